"""The flow CLI's console (flows.console): tracebacks go to a log file in a directory of this
user's own, never through a planted link; a traceback that cannot be written there never reaches
the terminal (neither the record's nor logging's own error report)."""

from __future__ import annotations

import io
import logging
import os
import stat

from flows.console import TracebacksToFile, log_dir


def _log_a_failure(path) -> str:
    """Log an exception through a console handler wrapped like the CLI's; what the console shows."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(TracebacksToFile(logging.Formatter("%(message)s"), path))
    logger = logging.getLogger("dmd2-console-test")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        try:
            raise RuntimeError("storage gone")
        except RuntimeError:
            logger.exception("the run failed")
    finally:
        logger.removeHandler(handler)
    return stream.getvalue()


def test_the_log_directory_is_this_users_own(tmp_path):
    path = tmp_path / "logs" / "flow.log"
    shown = _log_a_failure(path)
    assert shown == f"the run failed (traceback in {path})\n"
    assert "RuntimeError: storage gone" in path.read_text()
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert str(os.getuid()) in log_dir().name


def test_a_planted_link_or_an_unwritable_directory_never_reaches_the_terminal(tmp_path, capsys):
    elsewhere = tmp_path / "someone-elses"
    elsewhere.mkdir()
    (tmp_path / "logs").symlink_to(elsewhere)
    shown = _log_a_failure(tmp_path / "logs" / "flow.log")
    assert shown.startswith("the run failed (traceback not written: ") and "symlink" in shown
    assert list(elsewhere.iterdir()) == []  # nothing written through the link

    (tmp_path / "a-file").write_text("")
    shown = _log_a_failure(tmp_path / "a-file" / "flow.log")  # the directory cannot be made
    assert shown.startswith("the run failed (traceback not written: ") and shown.count("\n") == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Logging error" not in err
