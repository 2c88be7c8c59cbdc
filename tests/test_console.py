"""The flow CLI's console (flows.console, flows.environment): tracebacks go to a log file in a
directory of this user's own, never through a planted link; a traceback that cannot be written
there never reaches the terminal (neither the record's nor logging's own error report); a local
run shows no Ray notice a user cannot act on."""

from __future__ import annotations

import io
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

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


def test_a_local_run_does_not_show_rays_token_auth_notice(tmp_path):
    """An entry point that starts a local Ray as a run does (flows.environment first, then
    ray.init with address "local", as the driver's init_ray) shows Ray's own start line but not
    its notice that token authentication is on; its notice that it is off still shows. The home
    directory is a fresh one, so Ray generates its token as on a new user's machine."""
    script = """
from flows.environment import configure_environment
configure_environment()
import ray
ray.init(address="local", include_dashboard=False, num_cpus=1)
ray.shutdown()
import logging
from flows.environment import RAY_TOKEN_AUTH_LOGGER
logging.getLogger(RAY_TOKEN_AUTH_LOGGER).warning("Token authentication is disabled for this Ray cluster.")
"""
    # a Ray started earlier in this process sets RAY_AUTH_MODE, which silences the notice itself
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ADDRESS")}
    env.update(HOME=str(tmp_path), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    console = done.stdout + done.stderr
    assert done.returncode == 0, console
    assert "Started a local Ray instance" in console
    assert "Token authentication is enabled" not in console, console
    assert "Token authentication is disabled" in console  # Ray's other notices there still show
