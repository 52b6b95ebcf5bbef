"""What every part of the runtime shares, below all of them: what an algorithm supplies
(``algorithm.py``, ``data.py``), a segment's bytes (``segments.py``), the seeds a run derives
(``seeds.py``), where one rank's run stands (``state.py``), a stop asked from outside
(``stopping.py``) and the compiled update (``compiling.py``)."""
