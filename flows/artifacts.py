"""The Prefect artifacts of a run: three, created once by the flow run and updated in place.

- ``{base}-summary`` (markdown): status, before -> after, the latest samples, the plot, one row
  per eval, checkpoint and exported student, the resolved per-trainer configuration;
- ``{base}-metrics`` (table): a handful of columns, 4 significant digits, newest first;
- ``{base}-progress`` (progress): iterations done.

``base`` derives from the flow run's name (``artifact_keys``), which carries the flow run's id
(flows/dmd2.py, ``run_display_name``), so every run has keys of its own and a crash rerun (the same
flow run) finds its artifacts again and updates them instead of starting a second set. Updating in
place (PATCH of the artifact) keeps one stored version per run instead of one per eval. What goes
into them is computed in ``dmd2_core.report``; the nights view across runs is flows/nights.py.
"""

from __future__ import annotations

import datetime
import json
import re
import time
from typing import Any, Optional

from prefect.artifacts import create_markdown_artifact, create_progress_artifact, create_table_artifact

from dmd2_core import report
from dmd2_core.evaluators import evaluator_for

KINDS = ("summary", "metrics", "progress")
PROGRESS_EVERY_S = 5.0  # the progress artifact moves at most this often (and at every eval)


def slugify(name: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", str(name).lower()).strip("-")
    return slug or "run"


def artifact_keys(run_name: str) -> dict[str, str]:
    """Keys from the run name: ``dmd2-{slug}-{kind}`` (no doubled prefix: run_name dmd2-tiny gives
    dmd2-tiny-summary)."""
    slug = slugify(run_name)
    base = slug if slug == "dmd2" or slug.startswith("dmd2-") else f"dmd2-{slug}"
    return {kind: f"{base}-{kind}" for kind in KINDS}


def existing_artifacts(flow_run_id: Optional[str], keys: dict[str, str]) -> dict[str, Any]:
    """kind -> id of the artifacts this flow run already made under these keys (a crash rerun)."""
    if not flow_run_id:
        return {}
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    by_key = {key: kind for kind, key in keys.items()}
    try:
        with get_client(sync_client=True) as client:
            found = client.read_artifacts(artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), key=ArtifactFilterKey(any_=list(by_key))))
    except ValueError:  # not a flow run id (a run outside Prefect's bookkeeping)
        return {}
    return {by_key[a.key]: a.id for a in found if a.key in by_key}


def _update(artifact_id, data: Any, description: Optional[str] = None) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactUpdate

    update = ArtifactUpdate(data=data) if description is None else ArtifactUpdate(data=data, description=description)
    with get_client(sync_client=True) as client:
        client.update_artifact(artifact_id, update)


SUMMARY_MAX_CHARS = 1_000_000  # Prefect refuses an artifact whose event passes 1.5 MB (EventTooLarge)


def summary_text(state: dict) -> str:
    """The run summary's markdown; without the clips played in place when it would be too large
    for Prefect (they stay named, and stored at their URL)."""
    text = report.summary_markdown(state)
    if len(text) > SUMMARY_MAX_CHARS:
        media = [{k: v for k, v in m.items() if k != "inline_video"} for m in state.get("media") or []]
        text = report.summary_markdown({**state, "media": media})
    return text


class RunArtifacts:
    """The run's artifacts. Create it inside the parent flow run (so they belong to it); update it
    from anywhere in the same process, subflows included."""

    def __init__(self, keys: dict[str, str], summary: dict, total: int, done: int = 0,
                 flow_run_id: Optional[str] = None):
        self.keys = keys
        self.state = summary
        self.total = max(1, int(total))
        self._progress_at = 0.0
        self.state["updated"] = _now()
        old = existing_artifacts(flow_run_id, keys)
        if len(old) == len(KINDS):  # a crash rerun of this flow run: the same artifacts, from where it resumed
            self.summary_id, self.metrics_id, self.progress_id = old["summary"], old["metrics"], old["progress"]
            _update(self.summary_id, summary_text(summary))
            self.progress(done, force=True)
            return
        # Created in reading order; the UI lists a run's artifacts by id, so they are kept few.
        self.summary_id = create_markdown_artifact(markdown=summary_text(summary), key=keys["summary"],
                                                   description=f"DMD2 run summary: {summary['name']}")
        self.metrics_id = create_table_artifact(table=[{"iteration": done}], key=keys["metrics"],
                                                description=self._metrics_description(0))
        self.progress_id = create_progress_artifact(progress=self._percent(done), key=keys["progress"],
                                                    description=f"DMD2 iterations done of {total}")

    def _metrics_description(self, n: int) -> str:
        url = self.state.get("metrics_url")
        return (f"DMD2 metrics, newest first ({n} iterations; a few columns, 4 significant digits). "
                + (f"Every key of every iteration: `{url}`." if url else ""))

    def _percent(self, done: int) -> float:
        return round(100.0 * min(max(done, 0), self.total) / self.total, 2)

    def progress(self, done: int, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._progress_at >= PROGRESS_EVERY_S:
            self._progress_at = now
            from prefect.artifacts import update_progress_artifact

            update_progress_artifact(self.progress_id, self._percent(done))

    def publish(self, rows: list[dict]) -> None:
        """Summary (with a fresh plot) and metrics table, in place. The plot and the table see at
        most report.PLOT_POINTS / TABLE_ROWS rows, so a publish costs the same late in a run as early."""
        self.state["updated"] = _now()
        evaluator = evaluator_for(self.state)
        self.state["plot"] = report.plot_png(report.thin(rows, report.PLOT_POINTS, evaluator.quality_keys),
                                             title=self.state["name"], panels=report.plot_panels(evaluator))
        _update(self.summary_id, summary_text(self.state))
        table = report.metrics_table(rows[-report.TABLE_ROWS:], report.table_columns(evaluator))
        _update(self.metrics_id, json.dumps(table), self._metrics_description(len(rows)))


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
