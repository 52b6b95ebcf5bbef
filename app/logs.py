"""One log file per rank in the run directory; rank 0 also on the console, with a prefix."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

FORMAT = "%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s"


class _ConsoleFormatter(logging.Formatter):
    """Rank 0's console: one line per record; tracebacks go to the rank's log file only."""

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None
        try:
            return super().format(record)
        finally:
            record.exc_info, record.exc_text = saved


def setup_rank_logging(run_dir: Path, rank: int) -> Path:
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"rank{rank}.log"
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    formatter = logging.Formatter(FORMAT.format(rank=rank), datefmt="%H:%M:%S")
    file_handler = logging.FileHandler(path)
    file_handler.setFormatter(formatter)
    root.addHandler(file_handler)
    if rank == 0:
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(_ConsoleFormatter(f"[rank{rank}] %(message)s"))
        root.addHandler(console)
    root.setLevel(logging.INFO)
    return path
