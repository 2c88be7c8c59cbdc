"""Eval task: student samples -> media files (+ digits metrics) -> a media artifact."""

from __future__ import annotations

from typing import Optional

from prefect import task

from dmd2_core.media import run_eval
from tasks.artifacts import publish_media
from tasks.common import TASK_OPTIONS
from tasks.registry import get_run


@task(name="eval_media", task_run_name="eval-media-{iteration}", **TASK_OPTIONS)
def eval_media(run_id: str, iteration: int, artifact_key: Optional[str] = None) -> dict:
    """Returns {iteration, metrics, media: [{url, browser_url, caption}]} (no image bytes)."""
    result = run_eval(get_run(run_id), iteration)
    if artifact_key:
        publish_media(artifact_key, result)
    for item in result["media"]:
        item.pop("data_uri", None)
    return result
