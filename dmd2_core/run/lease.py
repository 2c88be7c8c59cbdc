"""One run per save URL: a lease file ``{save}/lease.json`` holding its owner and a heartbeat.

The owner is the run (the Prefect flow run's id) and, within it, one process: a ``holder`` token
of host, pid and a nonce, fresh for every acquisition. Two processes of one flow run (Prefect
marked a live run Crashed when its API calls stopped and started the same flow run elsewhere)
are two holders: only one writes.

- Created atomically: on local storage under an exclusive ``flock`` of ``{save}/.lease.lock``
  (read, decide, write through a temp name and a rename, all while holding the lock); on S3 with
  conditional writes (``If-None-Match: *`` to create, ``If-Match: <etag>`` to take over or renew),
  so two runs racing for one URL cannot both win.
- Held while the run lives: a daemon thread renews the heartbeat every ``timeout_s / 4``. A renewal
  that finds another holder marks the lease lost; ``ensure()`` then raises before the run writes a
  checkpoint or moves the tracker. The lease also fences itself: once renewals lapsed (a storage
  outage), ``ensure()`` reads the lease before any write: still this holder's, it is renewed and the
  run goes on; another's, the run stops writing (LeaseLostError, retried: the retry acquires it
  again, refused while that run lives); unreadable past ``timeout_s``, the run writes nothing until
  it can. Writes after the check are bounded by ``expires()`` (the tracker's ``deadline``).
- Taken over only once stale: its heartbeat is older than ``timeout_s``, or its process is gone
  (same host, pid no longer alive or reused). Another run's live lease is refused at once; one of
  the same flow run (a rerun) is watched for up to ``timeout_s``: taken over if it never renews
  meanwhile, refused as soon as it does (that process still writes). The holder that lost it finds
  another holder on its next renewal and stops writing.
- Released (deleted) when the run ends, only by its holder.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from dmd2_core import storage
from dmd2_core.save_layout import LEASE_LOCK_NAME, LEASE_NAME, lease_url
from dmd2_core.errors import LeaseHeldError, LeaseLostError, one_line

log = logging.getLogger("dmd2")



def _pid_stat(pid: int) -> list[str]:
    """The fields of /proc/{pid}/stat after the command name ([] where unreadable)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _pid_start(pid: int) -> Optional[str]:
    """The process start time (clock ticks since boot) from /proc, to tell a reused pid apart."""
    fields = _pid_stat(pid)
    return fields[19] if len(fields) > 19 else None


def new_holder() -> str:
    """A token unique to one acquisition by this process: host, pid and a nonce."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


def _record(owner: str, holder: Optional[str] = None) -> dict:
    now = time.time()
    return {"owner": owner, "holder": holder or new_holder(), "host": socket.gethostname(), "pid": os.getpid(),
            "pid_start": _pid_start(os.getpid()), "heartbeat": now, "heartbeat_utc": _utc(now)}


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
        if _pid_stat(pid)[:1] == ["Z"]:  # killed, not yet reaped by its parent
            return f"its process {pid} is gone (exited)"
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
    """Preflight: raise LeaseHeldError when another live run holds ``save_url``. A lease of the
    same run (``owner``) passes here: acquiring it decides whether its process is gone."""
    record = read(save_url)
    if record and record.get("owner") != owner and stale_reason(record, timeout_s) is None:
        raise _held_error(save_url, record, timeout_s)


# ---- who may take a lease over ------------------------------------------------------------------

class _KeepWatching(Exception):
    """Another process of this flow run holds the lease, alive so far: look again shortly."""


class _Takeover:
    """Decides, for each record an acquisition finds, whether this holder may take it over."""

    def __init__(self, save_url: str, owner: str, holder: str, timeout_s: float):
        self.save_url, self.owner, self.holder, self.timeout_s = save_url, owner, holder, timeout_s
        self.seen: Optional[tuple[tuple, float]] = None  # (holder, heartbeat) of the watched record, since when

    def check(self, current: dict) -> None:
        """Return when ``current`` may be replaced; raise LeaseHeldError or _KeepWatching."""
        if current.get("holder") == self.holder:
            return  # our own write, whose reply was lost
        reason = stale_reason(current, self.timeout_s)
        if reason is None and current.get("owner") == self.owner:
            reason = self._watch(current)  # another process of this flow run
        if reason is None:
            raise _held_error(self.save_url, current, self.timeout_s)
        log.warning(f"lease: taking over {self.save_url} from {describe(current)}: {reason}")

    def _watch(self, current: dict) -> Optional[str]:
        key, now = (current.get("holder"), current.get("heartbeat")), time.monotonic()
        if self.seen is None:
            self.seen = (key, now)
        if key != self.seen[0]:
            raise LeaseHeldError(
                f"save: {self.save_url} is in use by another process of this flow run, {describe(current)}: it renewed "
                f"its lease while this one waited {now - self.seen[1]:.0f} s, so it still writes there (Prefect marks a "
                "live run Crashed when its API calls stop); this process stops: let that one finish, or stop it first")
        if now - self.seen[1] > self.timeout_s:
            return f"no heartbeat while watched for {now - self.seen[1]:.0f} s (timeout {self.timeout_s:.0f} s)"
        raise _KeepWatching()


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

    def acquire(self, owner: str, holder: str, takeover: _Takeover) -> dict:
        with self.locked():
            current = self._read()
            if current:
                takeover.check(current)
            record = _record(owner, holder)
            storage.write_text(str(self.path), json.dumps(record))
            return record

    def renew(self, owner: str, holder: str, budget_s: Optional[float] = None) -> Optional[dict]:
        """The renewed record, or None when another holder holds the lease now."""
        with self.locked():
            current = self._read()
            if not current or current.get("holder") != holder:
                return None
            record = _record(owner, holder)
            storage.write_text(str(self.path), json.dumps(record))
            return record

    def release(self, holder: str) -> None:
        with self.locked():
            current = self._read()
            if current and current.get("holder") == holder:
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

    def _call(self, method: str, budget_s: Optional[float] = None, **kw):
        return storage.s3_call(self.url, method, f"lease {method} {self.url}", budget_s=budget_s, **kw)

    def _get(self, budget_s: Optional[float] = None) -> tuple[Optional[dict], Optional[str]]:
        """The record and its ETag, from one GetObject (so the two always match)."""
        try:
            data, etag = storage.s3_get_object(self.url, f"lease read {self.url}", budget_s)
        except FileNotFoundError:
            return None, None
        try:
            record = json.loads(data)
        except ValueError:
            record = {"owner": "?", "heartbeat": 0}
        return (record if isinstance(record, dict) else {"owner": "?", "heartbeat": 0}), etag

    def _put(self, record: dict, budget_s: Optional[float] = None, **condition) -> Optional[str]:
        """ETag of the written object, or None when the condition did not hold."""
        try:
            return self._call("put_object", budget_s, Body=json.dumps(record).encode(), **condition).get("ETag")
        except (FileExistsError, OSError) as exc:
            if isinstance(exc, FileExistsError) or _precondition_failed(exc):
                return None
            raise

    def acquire(self, owner: str, holder: str, takeover: _Takeover) -> dict:
        for _ in range(5):
            record = _record(owner, holder)
            etag = self._put(record, IfNoneMatch="*")
            if etag:
                self.etag = etag
                return record
            current, current_etag = self._get()
            if current is None:
                continue  # released in between: create again
            takeover.check(current)
            etag = self._put(record, IfMatch=current_etag)  # fails if its holder renewed meanwhile
            if etag:
                self.etag = etag
                return record
        raise LeaseHeldError(f"save: {takeover.save_url}: lease keeps changing under this run; another run is starting on it")

    def renew(self, owner: str, holder: str, budget: Optional[float] = None) -> Optional[dict]:
        """As ``_Local.renew``; storage retried for ``budget`` seconds (default the storage budget)."""
        record = _record(owner, holder)
        etag = self._put(record, budget, IfMatch=self.etag) if self.etag else None
        if etag is None:
            current, current_etag = self._get(budget)
            if not current or current.get("holder") != holder:
                return None
            etag = self._put(_record(owner, holder), budget, IfMatch=current_etag)  # our own write whose reply was lost
            if etag is None:
                return None
        self.etag = etag
        return record

    def release(self, holder: str) -> None:
        current, _ = self._get()
        if current and current.get("holder") == holder:
            self._call("delete_object")


# ---- the lease --------------------------------------------------------------------------------

class Lease:
    """The lease this process holds on a save URL for run ``owner``, renewed by a daemon thread."""

    def __init__(self, save_url: str, owner: str, timeout_s: float):
        self.save_url, self.owner, self.timeout_s = save_url, owner, float(timeout_s)
        self.holder = new_holder()
        self.backend = _Local(save_url) if storage.is_local(save_url) else _ObjectStore(save_url)
        self.heartbeat_budget_s = max(1.0, self.timeout_s / 4)  # a heartbeat retried longer would land stale
        self.lost: Optional[str] = None
        self.renewed = time.monotonic()  # the last successful write of the heartbeat
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def acquire(cls, save_url: str, owner: str, timeout_s: float) -> "Lease":
        lease = cls(save_url, owner, timeout_s)
        takeover = _Takeover(save_url, owner, lease.holder, lease.timeout_s)
        while True:
            started = time.monotonic()
            try:
                lease.backend.acquire(owner, lease.holder, takeover)
                break
            except _KeepWatching:
                time.sleep(min(1.0, lease.timeout_s / 8))
        lease.renewed = started
        lease._thread = threading.Thread(target=lease._beat, name="dmd2-lease", daemon=True)
        lease._thread.start()
        return lease

    def _beat(self) -> None:
        interval = max(0.5, self.timeout_s / 4)
        while not self._stop.wait(interval):
            try:
                started = time.monotonic()
                if self.backend.renew(self.owner, self.holder, self.heartbeat_budget_s) is not None:
                    self.renewed = max(self.renewed, started)
                else:
                    self._taken()
                    return
            except Exception as exc:  # noqa: BLE001 - an outage: keep trying, the timeout is generous
                log.warning(f"lease: heartbeat of {self.save_url} failed ({one_line(exc)})")

    def _taken(self) -> None:
        record = read(self.save_url)
        by = f"taken over by {describe(record)}" if record else "taken over (and released) by another run"
        self.lost = (f"save: {self.save_url}: this run's lease was {by}; this process writes nothing more there "
                     "(a retry takes the lease back only once that run is gone)")
        log.error(self.lost)

    def expires(self) -> float:
        """When (``time.monotonic``) another run may take the lease over unless it is renewed
        first; at once when it was lost. The bound of every write after ``ensure()``."""
        return float("-inf") if self.lost else self.renewed + self.timeout_s

    def ensure(self) -> None:
        """Raise LeaseLostError (retried: the retry acquires the lease again) when this process may
        not write to the save URL: another holder took it over, or renewals lapsed past
        ``timeout_s`` and the lease cannot be read now. Renewals that lapsed (a storage outage)
        are verified here first: the lease still ours is renewed and the run goes on. Checked
        before every write that matters (a checkpoint, the tracker)."""
        if self.lost:
            raise LeaseLostError(self.lost)
        while time.monotonic() - self.renewed > self.timeout_s / 2:  # renewals lapsed: verify
            if not self._verify():  # a slow success (storage just back) carries an old heartbeat: again
                return

    def _verify(self) -> bool:
        """One renewal, its storage retried for the full budget as any other write's; False when
        storage is still out but the lease not stale yet (the writes after are bounded by expires())."""
        started = time.monotonic()
        try:
            renewed = self.backend.renew(self.owner, self.holder)
        except Exception as exc:  # noqa: BLE001 - storage still out: ours only while not stale
            age = time.monotonic() - self.renewed
            if age <= self.timeout_s:
                return False
            raise LeaseLostError(f"save: {self.save_url}: this run's lease was last renewed {age:.0f} s ago (timeout "
                                 f"{self.timeout_s:.0f} s) and cannot be read now ({one_line(exc)}): another run may "
                                 "hold it, so this run writes nothing until it can") from exc
        if renewed is None:
            self._taken()
            raise LeaseLostError(self.lost)
        self.renewed = max(self.renewed, started)
        return True

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if not self.lost:
            with contextlib.suppress(Exception):
                self.backend.release(self.holder)
