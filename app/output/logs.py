"""One log file per rank in the run directory; the console gets rank 0's records and every
rank's warnings, each line prefixed with the rank.

Everything a rank prints to the console goes through ``write_console``, which prints above
rank 0's progress bar instead of through it.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

from app.errors import WRITE_ERRORS

FORMAT = "%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s"
# ``log.info(..., extra=FILE_ONLY)``: a record for the rank's log file, not the console.
FILE_ONLY = {"console": False}


_bar_on_screen = False  # set by this process's progress bar (app.output.progress) while it is shown


def bar_on_screen(shown: bool) -> None:
    """Called by the progress bar when it appears and when it is closed."""
    global _bar_on_screen
    _bar_on_screen = shown


def write_console(text: str, stream: TextIO | None = None) -> None:
    """Prints ``text`` as whole lines above any progress bar on ``stream`` (default stderr).

    While this process shows a bar, tqdm clears it, prints and redraws it. On a terminal the
    current line is cleared first too, so a bar drawn by another process (rank 0's, seen from
    the launcher or another rank) is not written through either.
    """
    stream = stream if stream is not None else sys.stderr
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):
        terminal = False
    if terminal:
        stream.write("\r\x1b[K")
    if _bar_on_screen:
        tqdm.write(text, file=stream)
    else:
        stream.write(text + "\n")
    stream.flush()


class _ConsoleHandler(logging.StreamHandler[TextIO]):
    """The console: one line per record, above the progress bar; tracebacks go to the rank's
    log file only, and so do records logged with ``extra=FILE_ONLY``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "console", True) and bool(super().filter(record))

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None
        try:  # multi-line messages (a stack dump) stay in the log file too
            return super().format(record).split("\n", 1)[0]
        finally:
            record.exc_info, record.exc_text = saved

    def emit(self, record: logging.LogRecord) -> None:
        try:
            write_console(self.format(record), self.stream)
        except Exception:
            self.handleError(record)


def console_handler(label: str, level: int = logging.INFO) -> logging.Handler:
    """A stderr handler that prints records as ``[label] message`` through ``write_console``."""
    handler = _ConsoleHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[{label}] %(message)s"))
    handler.setLevel(level)
    return handler


class RankFileHandler(logging.FileHandler):
    """A rank's log file. A write the disk refuses (WRITE_ERRORS: a full disk, a quota) is
    raised, naming the file, from the next log call on the main thread, once: the rank then
    fails with that error, named in the launcher's line. The file is written no more after it:
    the error paths that log must not fail again, and logging's own handling would print a
    traceback per record."""

    failed: OSError | None = None
    _raised = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.failed is None:
            super().emit(record)
        else:
            self._raise_once()

    def handleError(self, record: logging.LogRecord) -> None:
        err = sys.exc_info()[1]
        if not isinstance(err, OSError) or err.errno not in WRITE_ERRORS:
            super().handleError(record)
            return
        if self.failed is None:
            err.filename = err.filename or self.baseFilename
            self.failed = err
        self._raise_once()

    def _raise_once(self) -> None:
        if self.failed is not None and not self._raised \
                and threading.current_thread() is threading.main_thread():
            self._raised = True
            raise self.failed.with_traceback(None)


def quiet_file_errors(logger: logging.Logger | None = None) -> None:
    """The launcher's own log files (Hydra's ``<run dir>/__main__.log``): a write the disk
    refuses turns the file off with one console line instead of a traceback per record; the
    ranks, which write the run's data, name the failure that ends the run."""
    logger = logger or logging.getLogger()
    for handler in logger.handlers:
        if isinstance(handler, logging.FileHandler) and not isinstance(handler, RankFileHandler):
            handler.handleError = _file_off(logger, handler)  # type: ignore[method-assign,assignment]


def _file_off(
    logger: logging.Logger, handler: logging.FileHandler
) -> Callable[[logging.LogRecord], None]:
    original = handler.handleError

    def handle_error(record: logging.LogRecord) -> None:
        err = sys.exc_info()[1]
        if not isinstance(err, OSError) or err.errno not in WRITE_ERRORS:
            original(record)
            return
        logger.removeHandler(handler)
        write_console(f"[launcher] {WRITE_ERRORS[err.errno or 0]} writing "
                      f"{handler.baseFilename}: it is written no more")

    return handle_error


def setup_rank_logging(run_dir: Path, rank: int) -> Path:
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"rank{rank}.log"
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    formatter = logging.Formatter(FORMAT.format(rank=rank), datefmt="%H:%M:%S")
    file_handler = RankFileHandler(path)
    file_handler.setFormatter(formatter)
    # A rank the backend aborts (gloo on a size mismatch) leaves its Python stack here.
    if file_handler.stream is not None:
        faulthandler.enable(file_handler.stream, all_threads=True)
    root.addHandler(file_handler)
    # Python's warnings become log records, so they too reach the console above the bar.
    logging.captureWarnings(True)
    # Rank 0 tells what happens; the other ranks only warn.
    root.addHandler(console_handler(f"rank{rank}", logging.INFO if rank == 0 else logging.WARNING))
    root.setLevel(logging.INFO)
    return path
