"""The save URL's lease on its own (dmd2_core/run/lease.py): a holder is known by its token and its
renewals, never by hostname, pid or another host's clock; an object store that ignores
conditional writes is refused; a release that fails says so. Runs holding it: test_faults.py."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

import pytest

from dmd2_core import storage
from dmd2_core.errors import ArgsError, LeaseHeldError
from dmd2_core.run import lease


class ForeignHolder:
    """A holder in another container that shares this hostname: its record names this host and
    a pid that is dead here, with its own pid namespace and a wall clock ``skew_s`` off ours.
    While ``renewing`` it rewrites the record every 0.2 s (its renewal count one up)."""

    def __init__(self, root: str, skew_s: float, renewing: bool, timeout_s: float = 2.0):
        self.url = lease.lease_url(root)
        clock = time.time() + skew_s
        self.record = {"owner": "run-elsewhere", "holder": "f" * 32, "renewals": 1, "timeout_s": timeout_s,
                       "host": socket.gethostname(), "pid": _dead_pid(), "pid_space": "another-container",
                       "heartbeat": clock, "heartbeat_utc": lease._utc(clock)}
        storage.write_text(self.url, json.dumps(self.record))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._renew, daemon=True) if renewing else None
        if self.thread:
            self.thread.start()

    def _renew(self) -> None:
        while not self.stop.wait(0.2):
            self.record = {**self.record, "renewals": self.record["renewals"] + 1}
            storage.write_text(self.url, json.dumps(self.record))

    def close(self) -> None:
        self.stop.set()
        if self.thread:
            self.thread.join()


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_a_renewing_holder_in_a_container_sharing_this_hostname_is_never_taken_over(tmp_path):
    """Its pid is dead here and its wall clock an hour behind ours: neither says it is gone. It
    renews, so a waiter refuses (within a renewal) and leaves its record alone."""
    root = str(tmp_path / "store")
    other = ForeignHolder(root, skew_s=-3600, renewing=True)
    try:
        start = time.monotonic()
        with pytest.raises(LeaseHeldError, match=r"in use by run 'run-elsewhere' .* which renewed its lease"):
            lease.Lease.acquire(root, "run-here", timeout_s=2)
        assert time.monotonic() - start < 2  # refused at its first renewal seen, not after the timeout
        assert lease.read(root)["holder"] == "f" * 32
    finally:
        other.close()


def test_an_unrenewed_lease_goes_stale_on_the_waiters_clock_whatever_the_holders_clock_says(tmp_path):
    """A holder whose clock runs an hour ahead of ours stopped renewing: taken over once its record
    stayed the same for its timeout (2 s) measured here, not when its wall-clock time says."""
    root = str(tmp_path / "store")
    ForeignHolder(root, skew_s=3600, renewing=False)
    start = time.monotonic()
    held = lease.Lease.acquire(root, "run-here", timeout_s=2)
    try:
        assert 2 <= time.monotonic() - start < 10
        assert lease.read(root)["holder"] == held.holder
    finally:
        held.release()


def test_a_store_that_ignores_conditional_writes_is_refused_in_one_line(s3_bucket, monkeypatch):
    """moto honours If-None-Match and If-Match: probed once per bucket in this process. A store
    that drops the conditions (two runs could both create the lease) is refused before a lease
    is written, and the probe object is removed."""
    save = s3_bucket + "/run"
    calls = []
    call = storage.s3_call

    def counted(url, method, *a, **kw):
        calls.append((method, sorted(kw)))
        return call(url, method, *a, **kw)

    monkeypatch.setattr(storage, "s3_call", counted)
    held = lease.Lease.acquire(save, "run-a", timeout_s=60)
    held.release()
    probes = len(calls)
    lease.check_free(save, "run-b", 60)
    held = lease.Lease.acquire(save, "run-b", timeout_s=60)
    held.release()
    assert probes >= 4 and len(calls) - probes <= 3  # the second acquisition probes nothing

    def unconditional(url, method, *a, IfNoneMatch=None, IfMatch=None, **kw):
        return call(url, method, *a, **kw)

    monkeypatch.setattr(storage, "s3_call", unconditional)
    monkeypatch.setattr(lease, "_honoured", set())
    for attempt in (lambda: lease.check_free(save, "run-c", 60), lambda: lease.Lease.acquire(save, "run-c", timeout_s=60)):
        with pytest.raises(ArgsError) as info:
            attempt()
        msg = str(info.value)
        assert "\n" not in msg and msg.startswith(f"save: {save}: the object store at ") and \
            "does not honour conditional writes (a second If-None-Match: * create of one key succeeded)" in msg, msg
    assert storage.list_names(save) == []  # no lease, no probe object left


def test_a_release_that_fails_is_a_warning_naming_the_lease(tmp_path, caplog, monkeypatch):
    root = str(tmp_path / "store")
    held = lease.Lease.acquire(root, "run-a", timeout_s=60)

    def refused(holder):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(held.backend, "release", refused)
    with caplog.at_level(logging.WARNING, logger="dmd2"):
        held.release()
    (line,) = [r.getMessage() for r in caplog.records if "not released" in r.getMessage()]
    assert line.startswith(f"lease: {lease.lease_url(root)} not released (") and "read-only file system" in line, line
