"""The forkserver's preload: the module multiprocessing's forkserver imports before it forks
anything (``set_forkserver_preload``, app/launch/forkserver.py).

Importing it is the one hook multiprocessing gives a forkserver, so the import has an effect,
and this module exists for that alone: in the forkserver a launcher started it ties the
forkserver to the launcher and imports what the ranks need; imported anywhere else it does
nothing.
"""

from app.launch.forkserver import serve_if_forkserver

serve_if_forkserver()
