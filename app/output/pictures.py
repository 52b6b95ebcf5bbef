"""The launcher's picture service: ``layout.png``, and rank 0's ``learning_curve.png``, drawn in
``python -m app`` itself, so that neither the ranks' forkserver nor any rank imports matplotlib.

matplotlib takes about half a second to import. Preloaded in the forkserver it delayed every
rank's start by that much; imported by rank 0 at its stop decision it delayed ``result.json``.
The launcher has a core to spare from the moment its plan is valid (its forkserver is still
importing torch on the other), and once the ranks run it only watches them. So
:class:`PictureService` imports matplotlib on a thread of the launcher then, draws the layout,
then draws what a rank of this run hands it (:func:`draw`, over a local socket) until the
launcher closes it. A rank with no service to ask (torchrun, SLURM) draws in line.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import secrets
import threading
from collections.abc import Callable
from multiprocessing import AuthenticationError
from pathlib import Path
from typing import Any

# "<authkey in hex>@<socket path>" of the service that draws for this run's ranks, in their
# environment (the launcher's, adopted at launch: app/launch/forkserver.py).
ENV = "RLCOMM_PICTURES"
# What the pictures are drawn with: imported by the service before it draws anything (and by the
# forkserver of ``plan_only=true``: app/launch/forkserver.py).
MODULES = (
    "matplotlib",
    "matplotlib.figure",
    "matplotlib.backends.backend_agg",
    "app.output.layout_picture",
    "app.output.learning_curve",
)

_Outcome = tuple[str, Any]  # ("ok", value) or ("error", exception)


class PictureService:
    """Draws ``draw_layout()`` on a thread of this process, then serves :func:`draw` for the
    ranks named in :meth:`environ`; :meth:`wait` ends it and returns the layout's result (its
    error is raised there)."""

    def __init__(self, draw_layout: Callable[[], Path]) -> None:
        from multiprocessing.connection import Listener

        self._key = secrets.token_bytes(16)
        self._listener = Listener(family="AF_UNIX", authkey=self._key)
        self._layout: _Outcome | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, args=(draw_layout,), daemon=True,
                                        name="rlcomm-pictures")
        self._thread.start()

    def environ(self) -> dict[str, str]:
        """What a rank needs in its environment to have :func:`draw` draw here."""
        return {ENV: f"{self._key.hex()}@{self._listener.address}"}

    def wait(self, timeout_s: float | None = None) -> Path:
        """Ends the service once the layout and any drawing asked for are done; returns what
        ``draw_layout`` returned, or raises its error. TimeoutError when that takes longer than
        ``timeout_s``."""
        self._stop()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"layout picture: not done after {timeout_s:g} s")
        assert self._layout is not None
        kind, value = self._layout
        if kind == "error":
            raise value
        return value

    def cancel(self) -> None:
        """Ends the service without waiting (the run failed or was stopped: nobody will look at
        the pictures). A drawing under way finishes on its daemon thread."""
        self._stop()

    def _stop(self) -> None:
        # The thread stops at the sentinel, taken after whatever it draws now: sent from a thread
        # of its own, so that a drawing that hangs holds up no caller past its timeout.
        if not self._stopping:
            self._stopping = True
            threading.Thread(target=self._send, args=(None,), daemon=True,
                             name="rlcomm-pictures-stop").start()

    def _send(self, request: Any) -> None:
        from multiprocessing.connection import Client

        try:
            with Client(self._listener.address, family="AF_UNIX", authkey=self._key) as conn:
                conn.send(request)
        except OSError:  # the service has ended already
            pass

    def _serve(self, draw_layout: Callable[[], Path]) -> None:
        for name in MODULES:  # one that fails fails again, with its own error, in the drawing
            with contextlib.suppress(Exception):
                importlib.import_module(name)
        self._layout = _outcome(draw_layout)
        try:
            while True:
                try:
                    conn = self._listener.accept()
                except (OSError, EOFError, AuthenticationError):  # a client gone mid-handshake
                    continue
                with conn:
                    try:
                        request = conn.recv()
                    except (OSError, EOFError):
                        continue
                    except Exception as err:  # what this process cannot unpickle
                        _reply(conn, ("error", err))
                        continue
                    if request is None:
                        return
                    fn, args = request
                    _reply(conn, _outcome(fn, *args))
        finally:
            self._listener.close()


def draw(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` drawn by the picture service of the ``python -m app`` that launched this
    rank, which has matplotlib imported already; here where there is none. ``fn`` and ``args``
    travel pickled (a module-level function, paths). Its error is raised here."""
    found = os.environ.get(ENV)
    if found:
        from multiprocessing.connection import Client

        key, _, address = found.partition("@")
        try:
            conn = Client(address, family="AF_UNIX", authkey=bytes.fromhex(key))
        except OSError:  # its launcher is gone (this rank is about to be stopped): draw here
            conn = None
        if conn is not None:
            with conn:
                conn.send((fn, args))
                kind, value = conn.recv()
            if kind == "error":
                raise value
            return value
    return fn(*args)


def _outcome(fn: Callable[..., Any], *args: Any) -> _Outcome:
    try:
        return "ok", fn(*args)
    except Exception as err:
        return "error", err


def _reply(conn: Any, outcome: _Outcome) -> None:
    try:
        conn.send(outcome)
    except OSError:  # the rank is gone
        pass
    except Exception as err:  # an unpicklable result or error: its text
        conn.send(("error", RuntimeError(f"{outcome[1]!r} ({err})")))
