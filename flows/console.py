"""What a CLI run prints: log lines as Prefect formats them, and tracebacks in a log file instead
of on the terminal. A failure found once the run is going (a corrupt shard found by the ranks, a
storage outage past its budget) then ends as it would in preflight: one ``error:`` line naming
what is wrong, with the path of the file that holds the traceback. The Prefect UI keeps the
whole record: its API handler formats the record on its own.

The log files go to a directory of this user's own (``dmd2-logs-<uid>`` under the temporary
directory, mode 0700), never through a symlink: on a shared host another user's directory or a
planted link is refused. A traceback that cannot be written there is dropped with a note on its
line, never printed: logging would otherwise print the write error's own traceback."""

from __future__ import annotations

import datetime
import logging
import os
import stat
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
        try:
            _append(self.path, logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s").format(record) + "\n")
            self.used = True
            where = f"traceback in {self.path}"
        except OSError as exc:
            where = f"traceback not written: {exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None  # restored: other handlers see it whole
        try:
            return f"{self.inner.format(record)} ({where})"
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


def log_dir() -> Path:
    """This user's directory for the flow's log files."""
    return Path(tempfile.gettempdir()) / f"dmd2-logs-{os.getuid()}"


def _append(path: Path, text: str) -> None:
    """Append ``text`` to ``path`` in a private directory: the directory is created 0700 or must
    already be this user's own real directory (not a link), and the file is never a link."""
    directory = path.parent
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise OSError(0, f"{directory} is not a directory (a symlink?)")
    if info.st_uid != os.getuid():
        raise OSError(0, f"{directory} belongs to another user")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(directory, 0o700)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "a") as log:
        log.write(text)


def tracebacks_to_file(path: Optional[Path] = None) -> Optional[TracebacksToFile]:
    """Route the tracebacks of the console handlers on the root logger (Prefect's) to ``path``
    (default: a new file in this user's ``log_dir()``); returns the formatter, whose ``used``
    says whether a traceback went there, or None when there is no console handler."""
    path = path or log_dir() / (
        f"flow-{datetime.datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}.log")
    wrapper = None
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler.formatter, TracebacksToFile):
            wrapper = TracebacksToFile(handler.formatter or logging.Formatter(), path)
            handler.setFormatter(wrapper)
    return wrapper
