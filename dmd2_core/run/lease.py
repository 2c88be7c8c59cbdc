"""One run per save URL: a lease file ``{save}/lease.json`` holding its owner and a renewal counter.

The owner is the run (the Prefect flow run's id) and, within it, one process: a ``holder`` token,
a random uuid fresh for every acquisition, written in the record and kept by the holder. Renewals,
takeovers and the release compare that token, never a hostname or a pid (containers sharing a
hostname reuse pids). Two processes of one flow run (Prefect marked a live run Crashed when its
API calls stopped and started the same flow run elsewhere) are two holders: only one writes.

- Created atomically: on local storage under an exclusive ``flock`` of ``{save}/.lease.lock``
  (read, decide, write through a temp name and a rename, all while holding the lock); on S3 with
  conditional writes (``If-None-Match: *`` to create, ``If-Match: <etag>`` to take over or renew),
  so two runs racing for one URL cannot both win. A store is probed once per process (per endpoint
  and bucket) that it honours them; one that does not is refused in one line.
- Held while the run lives: a daemon thread renews the lease every ``timeout_s / 4``, each renewal
  counting up. A renewal that finds another holder marks the lease lost; ``ensure()`` then raises
  before the run writes a checkpoint or moves the latest pointer. The lease also fences itself: once
  renewals lapsed (a storage outage), ``ensure()`` reads the lease before any write: still this
  holder's, it is renewed and the run goes on; another's, the run stops writing (LeaseLostError,
  retried: the retry acquires it again, refused while that run lives); unreadable past
  ``timeout_s``, the run writes nothing until it can. Writes after the check are bounded by
  ``expires()`` (the latest pointer's ``deadline``). The holder measures all of this on its own
  monotonic clock.
- Taken over only once stale, judged without comparing two hosts' clocks: a waiter watches the
  record (observe, wait, observe) and takes it over when its holder and renewal count did not
  change for the lease's timeout (the holder's own, in the record) measured on the waiter's
  monotonic clock; it refuses as soon as the record changes (that holder still renews). A holder
  whose process is provably gone (the same kernel and pid namespace, its pid dead or reused) is
  taken over at once. The holder that lost it finds another holder on its next renewal and stops
  writing.
- Released (deleted) when the run ends, only by its holder; a release that fails is a warning.
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
from dmd2_core.errors import ArgsError, LeaseHeldError, LeaseLostError, one_line

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


def _pid_space() -> Optional[str]:
    """This process's kernel boot and pid namespace: two processes with the same value see the same
    pids, so one may tell whether the other's pid is alive (None where /proc does not say)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def new_holder() -> str:
    """A token unique to one acquisition: a random uuid, kept by the holder."""
    return uuid.uuid4().hex


def _record(owner: str, holder: Optional[str] = None, renewals: int = 0, timeout_s: Optional[float] = None) -> dict:
    """A lease record. ``renewals`` changes with every renewal (what a waiter watches);
    ``heartbeat_utc`` is for people reading it (the holder's clock; no waiter compares it)."""
    return {"owner": owner, "holder": holder or new_holder(), "renewals": int(renewals), "timeout_s": timeout_s,
            "host": socket.gethostname(), "pid": os.getpid(), "pid_space": _pid_space(),
            "pid_start": _pid_start(os.getpid()), "heartbeat_utc": _utc(time.time())}


def _utc(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


_UNREADABLE = {"owner": "?", "unreadable": True}  # torn or foreign content: no holder renews it


def gone_reason(record: dict) -> Optional[str]:
    """Why ``record``'s holder provably holds nothing any more, or None when that cannot be told
    without watching it: its record is unreadable, or its process, in this process's kernel and
    pid namespace, is gone. A pid of another namespace (a container sharing this hostname) says
    nothing here."""
    if record.get("unreadable"):
        return "its record is unreadable"
    space = _pid_space()
    if not space or record.get("pid_space") != space or not record.get("pid"):
        return None
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


def lease_ttl(record: dict, timeout_s: float) -> float:
    """The time a record's holder promised to renew within: its own ``timeout_s``, else the waiter's."""
    try:
        return float(record.get("timeout_s")) or float(timeout_s)
    except (TypeError, ValueError):
        return float(timeout_s)


def describe(record: dict) -> str:
    return (f"run {record.get('owner')!r} (host {record.get('host')}, pid {record.get('pid')}, holder "
            f"{str(record.get('holder'))[:8]}), renewal {record.get('renewals')} at {record.get('heartbeat_utc')} "
            "by its clock")


def _held_error(save_url: str, record: dict, ttl: float) -> LeaseHeldError:
    return LeaseHeldError(f"save: {save_url} is in use by {describe(record)}, which renewed its lease while this run "
                          f"watched it; one run per save URL (a crashed run's lease is taken over once it goes "
                          f"unrenewed for {ttl:.0f} s)")


def read(save_url: str) -> Optional[dict]:
    url = lease_url(save_url)
    if not storage.exists(url):
        return None
    try:
        record = json.loads(storage.read_text(url))
    except FileNotFoundError:
        return None
    except ValueError:
        return dict(_UNREADABLE)
    return record if isinstance(record, dict) else dict(_UNREADABLE)


def check_free(save_url: str, owner: Optional[str], timeout_s: float) -> None:
    """Preflight: raise LeaseHeldError when another run holds ``save_url`` and renews it (watched
    for up to half the lease's timeout: a live holder renews every quarter); ArgsError when its
    object store does not honour conditional writes. A lease of the same run (``owner``) passes
    here: acquiring it decides. A lease unrenewed so far passes too: acquiring it watches on from
    this look (``_watched``) until it is stale or renewed."""
    ensure_conditional_writes(save_url)
    record = read(save_url)
    if not record or record.get("owner") == owner or gone_reason(record):
        return
    watch = _Takeover(save_url, owner or "", "", timeout_s)
    until = time.monotonic() + lease_ttl(record, timeout_s) / 2
    while time.monotonic() < until:
        try:
            watch.watch(record)
            return  # stale already (watched since an earlier look of this process)
        except _KeepWatching:
            pass
        time.sleep(min(1.0, lease_ttl(record, timeout_s) / 8))
        record = read(save_url)
        if not record or gone_reason(record):
            return


# ---- conditional writes -----------------------------------------------------------------------

_honoured: set[tuple[str, str]] = set()  # (endpoint, bucket) whose conditional writes were probed


def _store(url: str) -> tuple[str, str]:
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "aws"
    return endpoint, storage.filesystem(url)[1].split("/")[0]


def _conditional_put(url: str, body: bytes, budget_s: Optional[float] = None, **condition) -> Optional[str]:
    """ETag of the object written at the s3:// ``url``, or None when the condition did not hold."""
    try:
        return storage.s3_call(url, "put_object", f"lease put_object {url}", budget_s=budget_s, Body=body,
                               **condition).get("ETag")
    except (FileExistsError, OSError) as exc:
        if isinstance(exc, FileExistsError) or storage.precondition_failed(exc):
            return None
        raise


def ensure_conditional_writes(save_url: str) -> None:
    """The lease's object store must honour ``If-None-Match: *`` and ``If-Match`` (a store that
    ignores them lets two runs both take a lease): probed once per endpoint and bucket in this
    process on a probe object beside the lease, removed after. ArgsError in one line otherwise."""
    if storage.is_local(save_url):
        return
    store = _store(save_url)
    if store in _honoured:
        return
    probe = storage.join(save_url, f".dmd2-lease-probe-{uuid.uuid4().hex[:8]}")
    try:
        created = _conditional_put(probe, b"created", IfNoneMatch="*")
        problem = None
        if created is None:
            problem = "an If-None-Match: * create of a new key was refused"
        elif _conditional_put(probe, b"created again", IfNoneMatch="*") is not None:
            problem = "a second If-None-Match: * create of one key succeeded"
        elif _conditional_put(probe, b"wrong etag", IfMatch='"' + "0" * 32 + '"') is not None:
            problem = "an If-Match write with a wrong ETag succeeded"
        elif _conditional_put(probe, b"its etag", IfMatch=created) is None:
            problem = "an If-Match write with the object's own ETag was refused"
    finally:
        try:
            storage.remove(probe)
        except Exception as exc:  # noqa: BLE001 - a leftover probe object harms nothing; say so
            log.warning(f"lease: probe object {probe} not removed ({one_line(exc)})")
    if problem:
        raise ArgsError(f"save: {save_url}: the object store at {store[0]} does not honour conditional writes "
                        f"({problem}), so two runs could both take the save URL's lease; use a store that does "
                        "(AWS S3, MinIO, Ceph RGW, Cloudflare R2)")
    _honoured.add(store)


# ---- who may take a lease over ------------------------------------------------------------------

class _KeepWatching(Exception):
    """The lease's holder may be alive and has not renewed yet while watched: look again shortly."""


_watched: dict[str, tuple[tuple, float]] = {}  # lease URL -> (the record watched, since when: monotonic)


class _Takeover:
    """Decides, for each record an acquisition finds, whether this holder may take it over."""

    def __init__(self, save_url: str, owner: str, holder: str, timeout_s: float):
        self.save_url, self.owner, self.holder, self.timeout_s = save_url, owner, holder, timeout_s

    def allow(self, current: dict) -> None:
        """Return when ``current`` may be replaced; raise LeaseHeldError or _KeepWatching."""
        if current.get("holder") == self.holder:
            return  # our own write, whose reply was lost
        reason = gone_reason(current) or self.watch(current)
        log.warning(f"lease: taking over {self.save_url} from {describe(current)}: {reason}")

    def watch(self, current: dict) -> str:
        """Observe, wait, observe: stale once the record stayed the same for the lease's timeout on
        this process's monotonic clock (why, returned); LeaseHeldError as soon as it changes;
        _KeepWatching meanwhile. A record seen longer ago than that timeout (an earlier run of this
        process) starts a new watch."""
        url, ttl = lease_url(self.save_url), lease_ttl(current, self.timeout_s)
        key, now = (current.get("owner"), current.get("holder"), current.get("renewals")), time.monotonic()
        seen = _watched.setdefault(url, (key, now))
        if key != seen[0] and now - seen[1] > ttl:
            seen = _watched[url] = (key, now)
        if key != seen[0]:
            _watched.pop(url, None)
            if current.get("owner") != self.owner:
                raise _held_error(self.save_url, current, ttl)
            raise LeaseHeldError(
                f"save: {self.save_url} is in use by another process of this flow run, {describe(current)}: it renewed "
                f"its lease while this one waited {now - seen[1]:.0f} s, so it still writes there (Prefect marks a "
                "live run Crashed when its API calls stop); this process stops: let that one finish, or stop it first")
        if now - seen[1] > ttl:
            return f"not renewed while watched for {now - seen[1]:.0f} s (timeout {ttl:.0f} s)"
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
            return record if isinstance(record, dict) else dict(_UNREADABLE)
        except FileNotFoundError:
            return None
        except ValueError:
            return dict(_UNREADABLE)

    def acquire(self, record: dict, takeover: _Takeover) -> dict:
        with self.locked():
            current = self._read()
            if current:
                takeover.allow(current)
            storage.write_text(str(self.path), json.dumps(record))
            return record

    def renew(self, record: dict, budget_s: Optional[float] = None) -> Optional[dict]:
        """``record`` written, or None when another holder holds the lease now."""
        with self.locked():
            current = self._read()
            if not current or current.get("holder") != record["holder"]:
                return None
            storage.write_text(str(self.path), json.dumps(record))
            return record

    def release(self, holder: str) -> None:
        with self.locked():
            current = self._read()
            if current and current.get("holder") == holder:
                self.path.unlink(missing_ok=True)


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
            record = dict(_UNREADABLE)
        return (record if isinstance(record, dict) else dict(_UNREADABLE)), etag

    def _put(self, record: dict, budget_s: Optional[float] = None, **condition) -> Optional[str]:
        """ETag of the written object, or None when the condition did not hold."""
        return _conditional_put(self.url, json.dumps(record).encode(), budget_s, **condition)

    def acquire(self, record: dict, takeover: _Takeover) -> dict:
        for _ in range(5):
            etag = self._put(record, IfNoneMatch="*")
            if etag:
                self.etag = etag
                return record
            current, current_etag = self._get()
            if current is None:
                continue  # released in between: create again
            takeover.allow(current)
            etag = self._put(record, IfMatch=current_etag)  # fails if its holder renewed meanwhile
            if etag:
                self.etag = etag
                return record
        raise LeaseHeldError(f"save: {takeover.save_url}: lease keeps changing under this run; another run is starting on it")

    def renew(self, record: dict, budget: Optional[float] = None) -> Optional[dict]:
        """As ``_Local.renew``; storage retried for ``budget`` seconds (default the storage budget)."""
        etag = self._put(record, budget, IfMatch=self.etag) if self.etag else None
        if etag is None:
            current, current_etag = self._get(budget)
            if not current or current.get("holder") != record["holder"]:
                return None
            etag = self._put(record, budget, IfMatch=current_etag)  # our own write whose reply was lost
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
        self.renewals = 0  # counts up with every write of the record: what a waiter watches
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def next_record(self) -> dict:
        """The record of this holder's next write (its renewal count one up)."""
        self.renewals += 1
        return _record(self.owner, self.holder, self.renewals, self.timeout_s)

    @classmethod
    def acquire(cls, save_url: str, owner: str, timeout_s: float) -> "Lease":
        ensure_conditional_writes(save_url)
        lease = cls(save_url, owner, timeout_s)
        takeover = _Takeover(save_url, owner, lease.holder, lease.timeout_s)
        while True:
            started = time.monotonic()
            try:
                lease.backend.acquire(lease.next_record(), takeover)
                break
            except _KeepWatching:
                time.sleep(min(1.0, lease.timeout_s / 8))
        _watched.pop(lease_url(save_url), None)
        lease.renewed = started
        lease._thread = threading.Thread(target=lease._beat, name="dmd2-lease", daemon=True)
        lease._thread.start()
        return lease

    def _beat(self) -> None:
        interval = max(0.5, self.timeout_s / 4)
        while not self._stop.wait(interval):
            try:
                started = time.monotonic()
                if self.backend.renew(self.next_record(), self.heartbeat_budget_s) is not None:
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
        before every write that matters (a checkpoint, the latest pointer)."""
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
            renewed = self.backend.renew(self.next_record())
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
            try:
                self.backend.release(self.holder)
            except Exception as exc:  # noqa: BLE001 - the run is over either way; the lease goes stale unrenewed
                log.warning(f"lease: {lease_url(self.save_url)} not released ({one_line(exc)}); another run takes it "
                            f"over once it stays unrenewed for {self.timeout_s:.0f} s")
