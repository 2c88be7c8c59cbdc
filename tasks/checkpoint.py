"""Checkpoint task: every trainer saves, then the tracker is written."""

from __future__ import annotations

from prefect import task

from tasks.common import TASK_OPTIONS
from tasks.registry import get_run


@task(name="checkpoint", task_run_name="checkpoint-{iteration}", **TASK_OPTIONS)
def checkpoint(run_id: str, iteration: int) -> dict:
    return get_run(run_id).checkpoint(iteration)
