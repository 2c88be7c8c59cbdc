"""No orphans: a watchdog process that outlives the flow process by a few seconds at most.

``watch()`` (called by a CLI entry point) starts ``python -m dmd2_core.run.reaper <pid>`` in a session
of its own (so Ctrl-C to the terminal's process group does not reach it). While the watched
process lives, the reaper records its descendants every ``POLL_S`` (pid and start time, from
/proc); once it is gone -- SIGKILL, SIGTERM, SIGINT or a normal exit -- every recorded process still
alive (same pid, same start time) and its children get SIGTERM, then SIGKILL after ``GRACE_S``.
That covers what the flow process starts itself: a local Ray (gcs_server, raylet, its workers and
helper processes) and Prefect's temporary server.

Linux only (it reads /proc); elsewhere ``watch()`` does nothing. Standard library only, so the
watchdog starts in a fraction of a second.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

POLL_S = 0.5
GRACE_S = 3.0


def _stat(pid: int) -> Optional[tuple[int, str]]:
    """(parent pid, start time) of ``pid``, or None when it is gone (or a zombie)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    if fields[0] == "Z":
        return None
    return int(fields[1]), fields[19]


def _all() -> dict[int, tuple[int, str]]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                out[int(entry)] = st
    return out


def descendants(roots: set[int]) -> dict[int, str]:
    """pid -> start time of every live process below ``roots``."""
    table = _all()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: dict[int, str] = {}
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found and child != os.getpid():
                found[child] = table[child][1]
                stack.append(child)
    return found


def _alive(pid: int, start: str) -> bool:
    st = _stat(pid)
    return st is not None and st[1] == start


def reap(known: dict[int, str]) -> int:
    """SIGTERM every recorded process that still lives (and whatever it started since), then
    SIGKILL the ones left after GRACE_S. Returns how many were signalled."""
    targets = {p: s for p, s in known.items() if _alive(p, s)}
    targets.update(descendants(set(targets)))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, start in targets.items():
            if _alive(pid, start):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
        deadline = time.monotonic() + (GRACE_S if sig == signal.SIGTERM else 1.0)
        while time.monotonic() < deadline and any(_alive(p, s) for p, s in targets.items()):
            time.sleep(0.1)
    return len(targets)


def run(parent: int) -> None:
    parent_stat = _stat(parent)
    if parent_stat is None:
        return
    known: dict[int, str] = {}
    while _alive(parent, parent_stat[1]):
        known.update(descendants({parent}))
        known = {p: s for p, s in known.items() if _alive(p, s)}
        time.sleep(POLL_S)
    reap(known)


def watch() -> Optional[subprocess.Popen]:
    """Start the reaper for this process; None where /proc is not there."""
    if not Path("/proc/self/stat").exists():
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "dmd2_core.run.reaper", str(os.getpid())],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True,
    )


class Interrupted(BaseException):
    """SIGTERM (or SIGINT) of a CLI entry point, raised in its main thread so that cleanup runs."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_on_signals() -> None:
    """SIGTERM raises Interrupted and SIGINT KeyboardInterrupt in the main thread (instead of
    killing the process outright), so that cleanup runs and the CLI exits with one line."""
    def handler(signum, frame):
        raise Interrupted(signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt, which Prefect knows


def interruption(exc: BaseException) -> Optional[int]:
    """The signal number when ``exc`` (or what it wraps) is an interruption by a signal: ours,
    KeyboardInterrupt, or an orchestrator's termination signal carrying ``signal``."""
    seen = 0
    while exc is not None and seen < 8:
        seen += 1
        if isinstance(exc, Interrupted):
            return exc.signum
        if isinstance(exc, KeyboardInterrupt):
            return signal.SIGINT
        signum = getattr(exc, "signal", None)
        if type(exc).__name__ == "TerminationSignal" and isinstance(signum, int):
            return signum
        exc = exc.__cause__ or exc.__context__
    return None


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run(int(sys.argv[1]))
