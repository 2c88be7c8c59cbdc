"""The nights view: one markdown artifact per deployment, ``dmd2-nights-{deployment}``, that gains
a row per run (date, outcome, final and best quality by the run's criterion, per modality, drift out of
its band, iterations, wall time, the link to the run and its best student) under a plot of the criterion
over nights (dmd2_core/report/nights_view.py).

Each run (completed or failed) writes a new version of the key from the previous version's rows
plus its own (a crash rerun replaces its run's row: same flow run id); the UI shows the latest
version under Artifacts and in the run that wrote it. The read and the write happen under a global
concurrency limit of one slot named as the key (created on first use, its slot leased so a killed
writer frees it), so two nights ending together both keep their rows: the second reads the
first's version. The rows travel inside the markdown, in an
HTML comment (base64 JSON) the UI does not show, so the view needs nothing besides the server.
Runs outside a deployment (the CLI, tests calling the flow) have no nights view.

A completed night is also checked against the nights before it (flows/alerts.py,
``night_regression``, with the run's ``alert_regression_margin``); a regression emits the event
``dmd2.night.regressed`` that the server's automation turns into a message to a person.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import json
import logging
import re
from typing import Iterator, Optional

from dmd2_core.report import nights_view
from dmd2_core.errors import one_line
from flows.artifacts import slugify

MAX_NIGHTS = 60  # rows kept (the oldest drop off)
WRITER_WAIT_S = 120.0  # how long a night waits for another night's update of the view
WRITER_LEASE_S = 60.0  # a killed writer's slot is free again after this
_ROWS = re.compile(r"<!-- dmd2-nights-rows: ([A-Za-z0-9+/=]*) -->")
log = logging.getLogger("dmd2")


def nights_key(deployment: str) -> str:
    return f"dmd2-nights-{slugify(deployment)}"


def rows_of(markdown: Optional[str]) -> list[dict]:
    match = _ROWS.search(markdown or "")
    return json.loads(base64.b64decode(match.group(1))) if match else []


def with_rows(markdown: str, rows: list[dict]) -> str:
    blob = base64.b64encode(json.dumps(rows, default=str).encode()).decode()
    return f"{markdown}\n<!-- dmd2-nights-rows: {blob} -->\n"


def merge(rows: list[dict], row: dict) -> list[dict]:
    """``row`` replaces the row of the same run (a rerun) or joins at the end; MAX_NIGHTS at most."""
    kept = [r for r in rows if r.get("run_id") != row["run_id"]]
    return (kept + [row])[-MAX_NIGHTS:]


def latest_markdown(key: str) -> Optional[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
                                      sort=ArtifactSort.CREATED_DESC, limit=1)
    return found[0].data if found else None


@contextlib.contextmanager
def one_writer(key: str) -> Iterator[None]:
    """Hold the one slot of the global concurrency limit named ``key`` (made if missing): a nights
    view's read-modify-write is atomic among runs. TimeoutError after WRITER_WAIT_S."""
    from prefect.client.orchestration import get_client
    from prefect.concurrency.sync import concurrency

    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(key, 1)
    with concurrency(key, occupy=1, timeout_seconds=WRITER_WAIT_S, lease_duration=WRITER_LEASE_S, strict=True,
                     raise_on_lease_renewal_failure=False):
        yield


def add_row(key: str, name: str, row: dict, judge=None) -> tuple[list[dict], list[dict]]:
    """Write a new version of the nights view ``key`` of deployment ``name``: its latest rows with
    ``row`` merged in, read and written by one writer at a time. ``judge(previous rows)`` may mark
    ``row`` first (a regressed night). Returns (the rows before, after)."""
    from prefect.artifacts import create_markdown_artifact

    with one_writer(key):
        previous = rows_of(latest_markdown(key))
        if judge is not None:
            judge(previous)
        rows = merge(previous, row)
        markdown = nights_view.nights_markdown(name, rows, nights_view.nights_plot(rows, title=f"{name}: quality over nights"))
        create_markdown_artifact(markdown=with_rows(markdown, rows), key=key,
                                 description=f"dmd2/{name}: one row per run, newest first")
    return previous, rows


def record_night(view: dict, outcome: str, wall_s: float) -> Optional[str]:
    """Add this run's row to its deployment's nights view. A completed night that regressed
    against the nights before it is marked where a team looks (its row's outcome reads
    "..., regressed", the row keeps the reason) and told (``tell_if_regressed``); returns that
    reason, None otherwise (and outside a deployment). Best effort: a server hiccup here never
    fails the run."""
    from prefect.runtime import deployment, flow_run

    name = deployment.name
    if not name:
        return None
    key = nights_key(name)
    judged: dict = {}

    def judge(previous: list[dict]) -> None:
        if outcome.startswith("completed"):  # a failed night has its own message
            judged["previous"] = [r for r in previous if r.get("run_id") != row["run_id"]]
            judged["reason"] = regression_of(view, judged["previous"], row)
            if judged["reason"]:
                row["outcome"], row["regressed"] = f"{outcome}, regressed", judged["reason"]

    try:
        start = flow_run.scheduled_start_time or datetime.datetime.now(datetime.timezone.utc)
        start = start.astimezone(datetime.timezone.utc)
        row = nights_view.night_row(view, outcome, wall_s, str(flow_run.id), flow_run.ui_url, start.date().isoformat())
        row["time"] = start.strftime("%H:%M")  # tells two nights of one date apart on the plot
        add_row(key, name, row, judge)
    except Exception as exc:  # noqa: BLE001 - the view is for people; the run's outcome stands
        log.warning(f"nights view {key} not updated: {exc}")
        return None
    if judged.get("reason"):
        tell_if_regressed(view, judged["previous"], row, judged["reason"])
    return judged.get("reason")


def regression_of(view: dict, previous: list[dict], row: dict) -> Optional[str]:
    """Why ``row`` regressed against ``previous`` (the margin: the actor's
    ``alert_regression_margin``), None when it did not or cannot be judged. Never raises."""
    from flows import alerts

    try:
        margin = ((view.get("trainer_args") or {}).get("actor") or {}).get("alert_regression_margin")
        margin = alerts.REGRESSION_MARGIN if margin is None else float(margin)
        return alerts.night_regression(previous, row, margin)
    except Exception as exc:  # noqa: BLE001 - telling a person is best effort; the run's outcome stands
        log.warning(f"regression check not done ({one_line(exc)})")
        return None


def tell_if_regressed(view: dict, previous: list[dict], row: dict, reason: Optional[str] = None) -> Optional[str]:
    """Emit ``dmd2.night.regressed`` for this run when ``row`` regressed against ``previous``
    (``reason``: already judged); returns the reason. Never raises."""
    from prefect.runtime import deployment, flow_run

    from flows import alerts

    reason = reason or regression_of(view, previous, row)
    if reason:
        log.warning(f"night regressed: {reason}")
        try:
            alerts.emit_night_regressed(reason, row, str(flow_run.id), flow_run.name, deployment.id, deployment.name)
        except Exception as exc:  # noqa: BLE001 - as above
            log.warning(f"alert {alerts.REGRESSION_EVENT} not sent: the webhook is not told of it ({one_line(exc)})")
    return reason
