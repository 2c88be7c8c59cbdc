"""Eval task: student samples -> media files (+ digits metrics). The flow puts the result into the
run summary (flows/artifacts.py)."""

from __future__ import annotations

from prefect import task

from dmd2_core.media.eval_media import run_eval
from tasks.common import TASK_OPTIONS
from tasks.registry import get_run


@task(name="eval_media", task_run_name="eval-media-{iteration}", **TASK_OPTIONS)
def eval_media(run_id: str, iteration: int) -> dict:
    """Returns {iteration, metrics, media: [{url, browser_url, src, link, full, caption}]}; ``src``
    is a data URI (the whole medium when local and small, else a thumbnail). Not persisted."""
    return run_eval(get_run(run_id), iteration)
