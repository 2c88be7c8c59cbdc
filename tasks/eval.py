"""Eval task: the student's samples -> media files and the run's evaluator's figures. The flow
puts the result into the run summary (flows/artifacts.py)."""

from __future__ import annotations

from prefect import task

from dmd2_core.evaluation.eval_step import run_eval
from tasks.common import TASK_OPTIONS
from tasks.registry import get_run


@task(name="evaluate", task_run_name="eval-{iteration}", **TASK_OPTIONS)
def evaluate(run_id: str, iteration: int) -> dict:
    """Returns {iteration, metrics, media: [{url, browser_url, src, link, full, caption}],
    reference}; ``src`` is a data URI (the whole medium when local and small, else a thumbnail).
    Not persisted."""
    return run_eval(get_run(run_id), iteration)
