"""What every dispatcher task shares: no result cache (the checkpoint tracker is what a retry
resumes from), a few quick retries, and a retry condition that never retries a configuration error."""

from __future__ import annotations

from typing import Any

from prefect.cache_policies import NO_CACHE

from dmd2_core.errors import NEVER_RETRY


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
