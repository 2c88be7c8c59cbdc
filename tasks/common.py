"""What every dispatcher task shares: no result cache (the checkpoint tracker is what a retry
resumes from), a few quick retries, and a retry condition that never retries a configuration error."""

from __future__ import annotations

from typing import Any

from prefect.cache_policies import NO_CACHE

from dmd2_core.args import ArgsError
from dmd2_core.finite import NonFiniteError
from dmd2_core.run.lease import LeaseLostError
from dmd2_core.models import CheckpointError

# Configuration errors fail the same way every time: ArgsError and CheckpointError are ValueErrors,
# and so is a ValueError raised inside a trainer (Ray re-raises it as an instance of its cause).
# NonFiniteError: a replay from the checkpoint would hit the same non-finite values again;
# LeaseLostError: another run owns the save URL now.
NEVER_RETRY = (ArgsError, CheckpointError, ValueError, NonFiniteError, LeaseLostError)


def failure_of(state: Any) -> BaseException | None:
    data = getattr(state, "data", None)
    if isinstance(data, BaseException):
        return data
    try:
        result = state.result(raise_on_failure=False)
    except Exception as exc:  # noqa: BLE001 - an unreadable result is still a failure to judge
        return exc
    return result if isinstance(result, BaseException) else None


def retry_runtime_failures(task, task_run, state) -> bool:
    """Retry RayWorkError (a lost actor, a timed-out call) and other runtime failures; never a
    configuration error. The retried phase rebuilds the groups from the latest checkpoint."""
    return not isinstance(failure_of(state), NEVER_RETRY)


TASK_OPTIONS: dict[str, Any] = dict(
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=retry_runtime_failures,
    persist_result=False,
)
