"""What a run records: one metrics row per update (``metrics.csv``, the trackers, the progress
line), one row per finished episode (``episodes.csv``), the figures that compare jobs
(``result["metrics"]``) and ``learning_curve.png``, drawn from ``metrics.csv``
(app/output/learning_curve.py). The :class:`Recorder` owns them."""

from app.runtime.records.history import HistoryFile, Offset
from app.runtime.records.recorder import Recorder, RecordsMark
from app.runtime.records.rows import COUNT_COLUMNS, Attempt, UpdateRecord

__all__ = ["COUNT_COLUMNS", "Attempt", "HistoryFile", "Offset", "Recorder", "RecordsMark",
           "UpdateRecord"]
