"""How the ranks of a trainer group agree during a save or load: on their own gloo process
group, every rank succeeds or every rank raises, and storage outages are retried by all of them
together."""

from __future__ import annotations

import time

import torch.distributed as dist

from dmd2_core import storage
from dmd2_core.errors import CheckpointError, StorageUnavailableError, StoredFilesError, one_line


def checkpoint_group():
    """A gloo process group over the trainer group's ranks for checkpoint collectives (DCP's
    planning and the hash gather run in a background thread during asynchronous saves, and must
    never interleave with the training collectives). None without torch.distributed."""
    return dist.new_group(backend="gloo") if dist.is_initialized() else None


def all_or_none(fn, what: str, process_group, gather: bool = False):
    """``fn()`` on every rank of the group (a collective; ``fn`` itself must not be one). When
    any rank fails, every rank raises: the failing one its error, the others a StoredFilesError (a
    CheckpointError for a checkpoint that cannot be resumed from) naming that rank, so no
    rank is left waiting in a later collective for one that gave up. Returns this rank's result,
    or with ``gather`` every rank's (a list by rank)."""
    error, result = None, None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - shared with the group, then raised
        error = exc
    mine = (result if gather else None,
            None if error is None else (isinstance(error, CheckpointError), one_line(error)))
    if process_group is None:
        gathered = [mine]
    else:
        gathered = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(gathered, mine, group=process_group)
    if error is not None:
        raise error
    failed = next(((r, f) for r, (_, f) in enumerate(gathered) if f is not None), None)
    if failed is not None:
        rank, (load_error, line) = failed
        if load_error:
            raise CheckpointError(line.split(": ", 1)[-1])
        raise StoredFilesError(f"{what}: failed on rank {rank} of the group ({line})")
    return [r for r, _ in gathered] if gather else result


def collective_retrying(fn, what: str, process_group) -> None:
    """``fn()`` (a DCP save or load: every rank fails or succeeds together), retried like
    storage.retrying while it fails with transient errors; the ranks vote, so all of them retry
    or all of them raise."""
    deadline = time.monotonic() + storage.RETRY_S
    delay = storage.RETRY_FIRST_DELAY_S
    while True:
        error = None
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - classified below
            error = exc
        vote = (error is None, error is None or _transient(error))
        if process_group is not None:
            votes: list = [None] * dist.get_world_size(process_group)
            dist.all_gather_object(votes, vote, group=process_group)
        else:
            votes = [vote]
        if all(ok for ok, _ in votes):
            return
        if all(transient for _, transient in votes) and time.monotonic() + delay <= deadline:
            storage.log.warning(f"storage: {what}: {one_line(error) if error else 'another rank failed'}; "
                                f"retry in {delay:.1f} s")
            time.sleep(delay)
            delay = min(delay * 2, storage.RETRY_MAX_DELAY_S)
            continue
        if error is None:
            raise StoredFilesError(f"{what}: failed on another rank of the group")
        if all(transient for _, transient in votes):
            raise StorageUnavailableError(
                f"{what}: storage unavailable for {storage.RETRY_S:.0f} s ({one_line(error)})") from error
        raise error


def _transient(exc: BaseException) -> bool:
    """A storage outage, also when DCP wrapped it (CheckpointException: the failure of each rank)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return all(storage.is_transient(getattr(f, "exception", f)) for f in failures.values())
    return storage.is_transient(exc)
