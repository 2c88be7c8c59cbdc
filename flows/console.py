"""What a CLI run prints: log lines as Prefect formats them, and tracebacks in a log file instead
of on the terminal. A failure found once the run is going (a corrupt shard found by the ranks, a
storage outage past its budget) then ends as it would in preflight: one ``error:`` line naming
what is wrong, with the path of the file that holds the traceback. The Prefect UI keeps the
whole record: its API handler formats the record on its own."""

from __future__ import annotations

import datetime
import logging
import os
import tempfile
from pathlib import Path
from typing import Optional


class TracebacksToFile(logging.Formatter):
    """Wraps a console formatter: a record with a traceback is written whole to ``path`` and shown
    on the console as its one line, ending with where the traceback went."""

    def __init__(self, inner: logging.Formatter, path: Path):
        super().__init__()
        self.inner, self.path, self.used = inner, path, False

    def format(self, record: logging.LogRecord) -> str:
        if not (record.exc_info or record.exc_text or record.stack_info):
            return self.inner.format(record)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as log:
            log.write(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s").format(record) + "\n")
        self.used = True
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None  # restored: other handlers see it whole
        try:
            return f"{self.inner.format(record)} (traceback in {self.path})"
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


def tracebacks_to_file(path: Optional[Path] = None) -> Optional[TracebacksToFile]:
    """Route the tracebacks of the console handlers on the root logger (Prefect's) to ``path``
    (default: a new file under the temporary directory); returns the formatter, whose ``used``
    says whether a traceback went there, or None when there is no console handler."""
    path = path or Path(tempfile.gettempdir()) / "dmd2-logs" / (
        f"flow-{datetime.datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}.log")
    wrapper = None
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler.formatter, TracebacksToFile):
            wrapper = TracebacksToFile(handler.formatter or logging.Formatter(), path)
            handler.setFormatter(wrapper)
    return wrapper
