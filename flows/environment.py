"""The process environment of the entry points (``python -m flows.dmd2``, ``flows.teacher``,
``flows.demo``, ``deployments.serve``, the benchmarks, the tests) and a local Prefect server.

Prefect and Ray read these settings when they are imported, so an entry point calls
``configure_environment()`` before it imports either. This module imports neither.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator, Optional

# A Prefect server on the trainers' own machine (the one a CLI run starts, or serve's
# --local-server) records task runs from their events in batches: one database write per event
# (Prefect's default) took ~60% of its CPU, ~70 ms per iteration taken from the trainers
# (bench/README.md, orchestration cost). Task states then reach the UI up to a second later.
#
# It also stays small: a minimax-h3 night adds ~480 MB to its database (docs/operations.md), and
# Prefect keeps flow runs forever unless its flow-run vacuum is on. Enabled here (events, flow runs
# and their orphaned logs and artifacts), runs ended more than RETENTION_DAYS ago are deleted hourly.
RETENTION_DAYS = 14
LOCAL_SERVER_ENV = {
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "100",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
    "PREFECT_SERVER_SERVICES_DB_VACUUM_ENABLED": "events,flow_runs",
    "PREFECT_SERVER_SERVICES_DB_VACUUM_RETENTION_PERIOD": str(RETENTION_DAYS * 24 * 3600),
}

ENVIRONMENT_DEFAULTS = {
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    **LOCAL_SERVER_ENV,
}


# Every new local Ray (ray.init without an address) turns on Ray's token authentication and says
# so on the console, with advice to opt out that a user has no reason to take. Dropped at its own
# logger; Ray's other notices there (token authentication disabled, a token generated) still show.
RAY_TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
RAY_TOKEN_AUTH_ENABLED_NOTICE = "Token authentication is enabled for this Ray cluster."


def _not_the_token_auth_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(RAY_TOKEN_AUTH_ENABLED_NOTICE)


def configure_environment() -> None:
    """Set the Prefect and Ray defaults above where the environment does not set them already,
    and drop Ray's token-authentication notice from this process's console."""
    for key, value in ENVIRONMENT_DEFAULTS.items():
        os.environ.setdefault(key, value)
    token_auth_logger = logging.getLogger(RAY_TOKEN_AUTH_LOGGER)
    if _not_the_token_auth_notice not in token_auth_logger.filters:
        token_auth_logger.addFilter(_not_the_token_auth_notice)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen, log: Optional[Path] = None) -> None:
    """Wait until ``url`` answers 200 while ``proc`` lives; RuntimeError (with the tail of ``log``)
    when it exits or the time is up."""
    tail = (lambda: "\n" + log.read_text()[-3000:]) if log is not None else (lambda: "")
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited ({proc.returncode}) before {url} answered{tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not up after {timeout_s:.0f}s{tail()}")
        time.sleep(0.5)


@contextlib.contextmanager
def local_prefect_server(port: Optional[int] = None, env: Optional[dict] = None, log: Optional[Path] = None,
                         timeout_s: float = 120.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """A `prefect server start` on 127.0.0.1:``port`` (default a free port) with ``env`` (default
    this process's), its output to ``log`` (default inherited), for as long as the block runs.
    Yields (API URL, the server process); stops it with SIGTERM (SIGKILL after 30 s)."""
    port = port or free_port()
    api = f"http://127.0.0.1:{port}/api"
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(log, "w")) if log is not None else None
        proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                 "--port", str(port)], env=env, stdout=out,
                                stderr=subprocess.STDOUT if out is not None else None, start_new_session=True)
        try:
            try:
                wait_http(f"{api}/health", timeout_s, proc, log)
            except RuntimeError as exc:
                raise RuntimeError(f"prefect server on 127.0.0.1:{port} (is the port taken?): {exc}") from None
            yield api, proc
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
