"""How the ranks of a trainer group agree during a save or load: on their own gloo process
group, every rank succeeds or every rank raises, and storage outages are retried by all of them
together."""

from __future__ import annotations

import time

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from dmd2_core import storage
from dmd2_core.errors import (
    CheckpointError, LeaseLostError, NonFiniteError, StorageUnavailableError, StoredFilesError, TransientError, one_line,
)

# what a rank's failure is, as the other ranks of its group re-raise it (first match wins): every
# rank then fails with the same class, so Prefect retries it or not whichever rank it began on
_KINDS = (("checkpoint", CheckpointError), ("unavailable", StorageUnavailableError), ("nonfinite", NonFiniteError),
          ("lease", LeaseLostError), ("input", ValueError))
_RAISED_AS = {"checkpoint": CheckpointError, "unavailable": StorageUnavailableError, "nonfinite": NonFiniteError,
              "lease": LeaseLostError, "input": StoredFilesError, "transient": TransientError}


def failure_kind(exc: BaseException) -> str:
    """The kind of ``exc`` among _RAISED_AS: a checkpoint that cannot be resumed from, storage
    unavailable past the retry budget, non-finite state, a lost lease, bad input (any other
    ValueError), else a transient runtime failure."""
    return next((kind for kind, cls in _KINDS if isinstance(exc, cls)), "transient")


def peer_failure(kind: str, what: str, rank: int, line: str) -> Exception:
    """The error a rank raises for the failure of ``rank`` (``line``: its one-line form), of the
    same class. A checkpoint error keeps its own message (it names the file)."""
    if kind == "checkpoint":
        return CheckpointError(line.split(": ", 1)[-1])
    return _RAISED_AS[kind](f"{what}: failed on rank {rank} of the group ({line})")


def checkpoint_group():
    """A gloo process group over the trainer group's ranks for checkpoint collectives (DCP's
    planning and the hash gather run in a background thread during asynchronous saves, and must
    never interleave with the training collectives). None without torch.distributed."""
    return dist.new_group(backend="gloo") if dist.is_initialized() else None


def all_or_none(fn, what: str, process_group, gather: bool = False):
    """``fn()`` on every rank of the group (a collective; ``fn`` itself must not be one). When
    any rank fails, every rank raises: the failing one its error, the others one of the same kind
    (``peer_failure``) naming that rank, so no rank is left waiting in a later collective for one
    that gave up, and the group's failure is retried or not whichever rank hit it. Returns this rank's result,
    or with ``gather`` every rank's (a list by rank)."""
    error, result = None, None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - shared with the group, then raised
        error = exc
    mine = (result if gather else None,
            None if error is None else (failure_kind(error), one_line(error)))
    if process_group is None:
        gathered = [mine]
    else:
        gathered = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(gathered, mine, group=process_group)
    if error is not None:
        raise error
    failed = next(((r, f) for r, (_, f) in enumerate(gathered) if f is not None), None)
    if failed is not None:
        rank, (kind, line) = failed
        raise peer_failure(kind, what, rank, line)
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
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - classified below
            error = exc  # DCP's CheckpointException, a BaseException, carries every rank's failure
        vote = (error is None, error is None or _transient(error),
                None if error is None else (failure_kind(_first_cause(error)), one_line(_first_cause(error))))
        if process_group is not None:
            votes: list = [None] * dist.get_world_size(process_group)
            dist.all_gather_object(votes, vote, group=process_group)
        else:
            votes = [vote]
        if all(ok for ok, _, _ in votes):
            return
        all_transient = all(transient for _, transient, _ in votes)
        if all_transient and time.monotonic() + delay <= deadline:
            storage.log.warning(f"storage: {what}: {one_line(_first_cause(error)) if error else 'another rank failed'}; "
                                f"retry in {delay:.1f} s")
            time.sleep(delay)
            delay = min(delay * 2, storage.RETRY_MAX_DELAY_S)
            continue
        if all_transient:
            if error is None:
                rank, _, line = next((r, *f) for r, (_, _, f) in enumerate(votes) if f is not None)
                raise peer_failure("unavailable", what, rank, line)
            raise StorageUnavailableError(
                f"{what}: storage unavailable for {storage.RETRY_S:.0f} s ({one_line(_first_cause(error))})") from None
        if error is None or vote[1]:  # this rank is fine or only saw a blip: the failure is another's
            rank, kind, line = next((r, *f) for r, (_, transient, f) in enumerate(votes) if not transient)
            raise peer_failure(kind, what, rank, line)
        cause = _first_cause(error)
        if cause is error:
            raise error
        raise cause from None


def _causes(exc: BaseException) -> list[BaseException]:
    """The failures DCP wrapped in a CheckpointException (by rank), else ``exc`` itself."""
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and isinstance(failures, dict) and failures:
        return [f[0] if isinstance(f, tuple) else f for _, f in sorted(failures.items())]
    return [exc]


def _first_cause(exc: BaseException) -> BaseException:
    """The first failure in ``exc`` that is not a storage blip (else its first failure)."""
    causes = _causes(exc)
    return next((c for c in causes if not storage.is_transient(c)), causes[0])


def _transient(exc: BaseException) -> bool:
    """A storage outage, also when DCP wrapped it (CheckpointException: the failure of each rank)."""
    return all(storage.is_transient(c) for c in _causes(exc))
