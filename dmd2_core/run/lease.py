"""One run per save URL: a lease file ``{save}/lease.json`` holding an owner id and a heartbeat.

- Created atomically: on local storage under an exclusive ``flock`` of ``{save}/.lease.lock``
  (read, decide, write through a temp name and a rename, all while holding the lock); on S3 with
  conditional writes (``If-None-Match: *`` to create, ``If-Match: <etag>`` to take over or renew),
  so two runs racing for one URL cannot both win.
- Held while the run lives: a daemon thread renews the heartbeat every ``timeout_s / 4``. A renewal
  that finds another owner marks the lease lost; ``ensure()`` then raises before the run writes a
  checkpoint or moves the tracker. The lease also fences itself: once its last successful renewal
  is older than ``timeout_s`` (renewals failing through a storage outage), another run may take it
  over, so ``ensure()`` raises as well until a renewal succeeds again.
- Taken over by the same owner (the same flow run's retries), or once stale: its heartbeat is older
  than ``timeout_s``, or its process is gone (same host, pid no longer alive or reused).
- Released (deleted) when the run ends, only by its owner.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from dmd2_core import storage
from dmd2_core.save_layout import LEASE_LOCK_NAME, LEASE_NAME, lease_url
from dmd2_core.errors import LeaseHeldError, LeaseLostError, one_line

log = logging.getLogger("dmd2")



def _pid_start(pid: int) -> Optional[str]:
    """The process start time (clock ticks since boot) from /proc, to tell a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _record(owner: str) -> dict:
    now = time.time()
    return {"owner": owner, "host": socket.gethostname(), "pid": os.getpid(), "pid_start": _pid_start(os.getpid()),
            "heartbeat": now, "heartbeat_utc": _utc(now)}


def _utc(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def stale_reason(record: dict, timeout_s: float, now: Optional[float] = None) -> Optional[str]:
    """Why ``record`` no longer holds its URL, or None while its owner is alive."""
    now = time.time() if now is None else now
    age = now - float(record.get("heartbeat", 0))
    if age > timeout_s:
        return f"no heartbeat for {age:.0f} s (timeout {timeout_s:.0f} s)"
    if record.get("host") == socket.gethostname() and record.get("pid"):
        pid = int(record["pid"])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"its process {pid} is gone"
        except PermissionError:
            pass
        start = _pid_start(pid)
        if record.get("pid_start") and start and start != record["pid_start"]:
            return f"its process {pid} is gone (pid reused)"
    return None


def describe(record: dict, now: Optional[float] = None) -> str:
    now = time.time() if now is None else now
    age = now - float(record.get("heartbeat", 0))
    return (f"run {record.get('owner')!r} (host {record.get('host')}, pid {record.get('pid')}), "
            f"last seen {age:.0f} s ago at {record.get('heartbeat_utc') or _utc(float(record.get('heartbeat', 0)))}")


def _held_error(save_url: str, record: dict, timeout_s: float) -> LeaseHeldError:
    return LeaseHeldError(f"save: {save_url} is in use by {describe(record)}; one run per save URL "
                          f"(a crashed run's lease is taken over once stale, after {timeout_s:.0f} s)")


def read(save_url: str) -> Optional[dict]:
    url = lease_url(save_url)
    if not storage.exists(url):
        return None
    try:
        record = json.loads(storage.read_text(url))
    except FileNotFoundError:
        return None
    except ValueError:
        return {"owner": "?", "heartbeat": 0}  # torn or foreign content: stale at once
    return record if isinstance(record, dict) else {"owner": "?", "heartbeat": 0}


def check(save_url: str, owner: Optional[str], timeout_s: float) -> None:
    """Preflight: raise LeaseHeldError when another live run holds ``save_url``."""
    record = read(save_url)
    if record and record.get("owner") != owner and stale_reason(record, timeout_s) is None:
        raise _held_error(save_url, record, timeout_s)


# ---- the backends -----------------------------------------------------------------------------

class _Local:
    def __init__(self, save_url: str):
        self.dir = Path(storage.filesystem(save_url)[1])
        self.path = self.dir / LEASE_NAME

    @contextlib.contextmanager
    def locked(self):
        import fcntl

        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / LEASE_LOCK_NAME, "a+") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def _read(self) -> Optional[dict]:
        try:
            record = json.loads(self.path.read_text())
            return record if isinstance(record, dict) else {"owner": "?", "heartbeat": 0}
        except FileNotFoundError:
            return None
        except ValueError:
            return {"owner": "?", "heartbeat": 0}

    def acquire(self, save_url, owner, timeout_s) -> dict:
        with self.locked():
            current = self._read()
            if current and current.get("owner") != owner:
                reason = stale_reason(current, timeout_s)
                if reason is None:
                    raise _held_error(save_url, current, timeout_s)
                log.warning(f"lease: taking over {save_url} from {describe(current)}: {reason}")
            record = _record(owner)
            storage.write_text(str(self.path), json.dumps(record))
            return record

    def renew(self, owner) -> Optional[dict]:
        """The renewed record, or None when another owner holds the lease now."""
        with self.locked():
            current = self._read()
            if not current or current.get("owner") != owner:
                return None
            record = _record(owner)
            storage.write_text(str(self.path), json.dumps(record))
            return record

    def release(self, owner) -> None:
        with self.locked():
            current = self._read()
            if current and current.get("owner") == owner:
                self.path.unlink(missing_ok=True)


def _precondition_failed(exc: BaseException) -> bool:
    while exc is not None:
        response = getattr(exc, "response", None)
        if isinstance(response, dict) and (response.get("Error") or {}).get("Code") == "PreconditionFailed":
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class _ObjectStore:
    """S3 (and any store s3fs speaks to) with conditional PutObject."""

    def __init__(self, save_url: str):
        self.url = lease_url(save_url)
        self.etag: Optional[str] = None

    def _call(self, method: str, **kw):
        return storage.s3_call(self.url, method, f"lease {method} {self.url}", **kw)

    def _get(self) -> tuple[Optional[dict], Optional[str]]:
        """The record and its ETag, from one GetObject (so the two always match)."""
        try:
            data, etag = storage.s3_get_object(self.url, f"lease read {self.url}")
        except FileNotFoundError:
            return None, None
        try:
            record = json.loads(data)
        except ValueError:
            record = {"owner": "?", "heartbeat": 0}
        return (record if isinstance(record, dict) else {"owner": "?", "heartbeat": 0}), etag

    def _put(self, record: dict, **condition) -> Optional[str]:
        """ETag of the written object, or None when the condition did not hold."""
        try:
            return self._call("put_object", Body=json.dumps(record).encode(), **condition).get("ETag")
        except (FileExistsError, OSError) as exc:
            if isinstance(exc, FileExistsError) or _precondition_failed(exc):
                return None
            raise

    def acquire(self, save_url, owner, timeout_s) -> dict:
        for _ in range(5):
            record = _record(owner)
            etag = self._put(record, IfNoneMatch="*")
            if etag:
                self.etag = etag
                return record
            current, current_etag = self._get()
            if current is None:
                continue  # released in between: create again
            if current.get("owner") != owner:
                reason = stale_reason(current, timeout_s)
                if reason is None:
                    raise _held_error(save_url, current, timeout_s)
                log.warning(f"lease: taking over {save_url} from {describe(current)}: {reason}")
            etag = self._put(record, IfMatch=current_etag)
            if etag:
                self.etag = etag
                return record
        raise LeaseHeldError(f"save: {save_url}: lease keeps changing under this run; another run is starting on it")

    def renew(self, owner) -> Optional[dict]:
        record = _record(owner)
        etag = self._put(record, IfMatch=self.etag) if self.etag else None
        if etag is None:
            current, current_etag = self._get()
            if not current or current.get("owner") != owner:
                return None
            etag = self._put(record, IfMatch=current_etag)  # our own write whose reply was lost
            if etag is None:
                return None
        self.etag = etag
        return record

    def release(self, owner) -> None:
        current, _ = self._get()
        if current and current.get("owner") == owner:
            self._call("delete_object")


# ---- the lease --------------------------------------------------------------------------------

class Lease:
    """The lease this process holds on a save URL, renewed by a daemon thread."""

    def __init__(self, save_url: str, owner: str, timeout_s: float):
        self.save_url, self.owner, self.timeout_s = save_url, owner, float(timeout_s)
        self.backend = _Local(save_url) if storage.is_local(save_url) else _ObjectStore(save_url)
        self.lost: Optional[str] = None
        self.renewed = time.monotonic()  # the last successful write of the heartbeat
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def acquire(cls, save_url: str, owner: str, timeout_s: float) -> "Lease":
        lease = cls(save_url, owner, timeout_s)
        started = time.monotonic()
        lease.backend.acquire(save_url, owner, lease.timeout_s)
        lease.renewed = started
        lease._thread = threading.Thread(target=lease._beat, name="dmd2-lease", daemon=True)
        lease._thread.start()
        return lease

    def _beat(self) -> None:
        interval = max(0.5, self.timeout_s / 4)
        while not self._stop.wait(interval):
            try:
                started = time.monotonic()
                if self.backend.renew(self.owner) is not None:
                    self.renewed = started
                else:
                    record = read(self.save_url) or {}
                    self.lost = f"save: {self.save_url}: this run's lease was taken over by {describe(record)}"
                    log.error(self.lost)
                    return
            except Exception as exc:  # noqa: BLE001 - an outage: keep trying, the timeout is generous
                log.warning(f"lease: heartbeat of {self.save_url} failed ({one_line(exc)})")

    def ensure(self) -> None:
        """Raise LeaseLostError when another run took the URL over, or may have: no renewal
        succeeded for ``timeout_s`` (checked before every write that matters: a checkpoint and the
        tracker)."""
        if self.lost:
            raise LeaseLostError(self.lost)
        age = time.monotonic() - self.renewed
        if age > self.timeout_s:
            raise LeaseLostError(f"save: {self.save_url}: this run's lease was last renewed {age:.0f} s ago (timeout "
                                 f"{self.timeout_s:.0f} s): another run may hold it now, so this run writes nothing more")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if not self.lost:
            with contextlib.suppress(Exception):
                self.backend.release(self.owner)
