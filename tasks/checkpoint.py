"""Checkpoint task: every trainer saves its shards; the tracker moves once all of them are durable
(at once, or for asynchronous saves when a later iteration finds them written; ``wait`` at the
end of a run)."""

from __future__ import annotations

from typing import Optional

from prefect import task

from tasks.common import TASK_OPTIONS
from tasks.registry import get_run


@task(name="checkpoint", task_run_name="checkpoint-{iteration}", **TASK_OPTIONS)
def checkpoint(run_id: str, iteration: int, wait: bool = False, export: Optional[bool] = None) -> dict:
    return get_run(run_id).checkpoint(iteration, wait, export)
