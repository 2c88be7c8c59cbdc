"""A person is told: server automations, created with the deployments (deployments/serve.py), that
post a Slack-compatible message (``{"text": ...}``) to one webhook when

- a run of those deployments fails or crashes (``ensure_failure_alert``);
- a night regresses (``ensure_regression_alert``): record_night (flows/nights.py) checks each
  completed night against the nights before it (``night_regression``) and emits the event
  ``dmd2.night.regressed`` when its best picture or sound figure is worse than theirs beyond its
  standard errors and the run's margin, or a drift statistic left its band;
- a deployment has no completed night within its expected window (``ensure_stale_alert``, a
  proactive automation: it fires on the *absence* of ``prefect.flow-run.Completed``).

The failure message names the run (and its deployment), its state, the iteration it reached and the
last line of its error (the flow run's labels ``dmd2_iteration`` / ``dmd2_error``, flows/runs.py;
the state's message when the run died without saying), and the link to the run. The webhook URL
lives in the block's secrets (a Slack incoming-webhook URL is a credential), the block is
``custom-webhook/dmd2-failures`` (one block for the three automations); a crash is followed by a
rerun (the rerun automation), so a crash message says so.

What the open-source server does with these (read in Prefect 3.9.1's sources):

- Both postures are evaluated by the server's ``triggers`` service
  (prefect/server/events/services/triggers.py, on unless PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED
  is false, and run by ephemeral servers too): reactive triggers per event as it arrives; proactive
  ones every ``PREFECT_SERVER_EVENTS_PROACTIVE_GRANULARITY`` (5 s) by
  ``evaluate_proactive_triggers`` (prefect/server/events/triggers.py). A proactive trigger without
  ``after`` keeps one window of ``within`` open from its first evaluation; a window that closes with
  fewer than ``threshold`` matching events fires, and the next window starts where it ended (so a
  stale deployment is reported once per window, until a night completes). The windows start again
  when the automation is replaced (each serve start).
- An automation created on a SQLite server is live at once (the server reloads it after the
  commit; every 5 s otherwise).
- A SendNotification's subject and body are Jinja (sandboxed, undefined names render empty) with
  ``automation``, ``event`` (the triggering event: ``event.payload``, ``event.resource``,
  ``event.resource_in_role``), ``labels``, ``firing``, ``firings``, ``events``, and, when the
  template names them, the objects ``flow_run``, ``deployment``, ``flow``, ... that the event's
  resources point at, read from the API (None when absent). A proactive firing over an empty window
  has no event, so the stale message names its deployments in plain text.
"""

from __future__ import annotations

import math
import statistics
from datetime import timedelta
from typing import Any, Optional

from dmd2_core.evaluation import criterion
from dmd2_core.evaluators import evaluator_for

ALERT_AUTOMATION = "dmd2: tell a person when a run fails"
REGRESSION_AUTOMATION = "dmd2: tell a person when a night regresses"
STALE_AUTOMATION = "dmd2: tell a person when a deployment has no completed night"
REGRESSION_EVENT = "dmd2.night.regressed"
REGRESSION_MARGIN = 0.25  # the default of Args.alert_regression_margin
WEBHOOK_BLOCK = "dmd2-failures"
WEBHOOK_ENV = "DMD2_ALERT_WEBHOOK_URL"

SUBJECT = "dmd2 {{ flow_run.state.name }}: {{ flow_run.name }}"
BODY = (
    "dmd2 run {{ flow_run.name }}{% if deployment %} (deployment {{ deployment.name }}){% endif %} "
    "is {{ flow_run.state.name }}"
    "{% if flow_run.labels.dmd2_iteration is defined %} at iteration {{ flow_run.labels.dmd2_iteration }}{% endif %}.\n"
    "Last error: {{ flow_run.labels.dmd2_error if flow_run.labels.dmd2_error is defined else flow_run.state.message }}\n"
    "{% if flow_run.state.type.value == 'CRASHED' %}It will be rerun from its checkpoint "
    "(max_crash_reruns bounds the reruns).\n{% endif %}"
    "{{ flow_run|ui_url or ('flow run ' ~ flow_run.id) }}"
)
# the event's own labels first (record_night names the run and its deployment), so the message
# reads the same when the API has no such run any more
REGRESSION_SUBJECT = "dmd2 night regressed: {{ event.resource.name }}"
REGRESSION_BODY = (
    "dmd2 run {{ event.resource.name }}"
    "{% if event.resource_in_role.deployment %} (deployment {{ event.resource_in_role.deployment.name }}){% endif %}"
    " regressed: {{ event.payload.reason }}\n"
    "{% if flow_run %}{{ flow_run|ui_url or ('flow run ' ~ flow_run.id) }}"
    "{% else %}flow run {{ event.payload.run_id }}{% endif %}"
)


def webhook_block(url: str):
    """The notification block: POST {"text": subject + body} to ``url`` (kept as a secret)."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    return CustomWebhookNotificationBlock(name="dmd2 failures", url="{{webhook_url}}", method="POST",
                                          json_data={"text": "{{subject}}\n{{body}}"},
                                          secrets={"webhook_url": url})


def _remove(name: str) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for old in client.read_automations_by_name(name):
            client.delete_automation(old.id)


def _related(deployment_ids: list) -> dict:
    return {"prefect.resource.role": "deployment",
            "prefect.resource.id": [f"prefect.deployment.{d}" for d in deployment_ids]}


def ensure_failure_alert(deployment_ids: list, webhook_url: Optional[str]) -> Optional[str]:
    """The block and the automation (both replaced if they exist); without a URL, none (and an
    older automation of this name is removed). Returns the automation's id."""
    from prefect.automations import Automation, EventTrigger, Posture, SendNotification

    _remove(ALERT_AUTOMATION)
    if not webhook_url:
        return None
    block_id = webhook_block(webhook_url).save(WEBHOOK_BLOCK, overwrite=True)
    automation = Automation(
        name=ALERT_AUTOMATION,
        description="A dmd2 deployment run that fails or crashes posts a message to the dmd2-failures webhook.",
        trigger=EventTrigger(expect={"prefect.flow-run.Failed", "prefect.flow-run.Crashed"},
                             match={"prefect.resource.id": "prefect.flow-run.*"}, match_related=_related(deployment_ids),
                             posture=Posture.Reactive, threshold=1, within=timedelta(0)),
        actions=[SendNotification(block_document_id=block_id, subject=SUBJECT, body=BODY)],
    )
    return str(automation.create().id)


# ---- a night that regresses --------------------------------------------------------------------

def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def night_regression(previous_rows: list[dict], row: dict, margin: float) -> Optional[str]:
    """Why this night (a row of the nights view) regressed, in one line; None when it did not.

    - Per modality (``row["best_figures"]``: its best eval's figure and standard error for the
      picture and the sound, ``evaluation.criterion``), against the previous nights' of the same
      figure (failed nights left out): a regression when it is worse than their median by more
      than max(2 standard errors of the difference, ``margin`` of the median), so the KID's
      sampling noise alone does not call one (bench/joint_criterion.py: the margin alone fired on
      36% of simulated healthy nights, this rule on 0.7%) and a sound that degrades is one even
      while the picture improves.
    - Rows without per-modality figures (written before them), or with one figure and no standard
      error (a toy world's FD): its best figure by its criterion ``row["best"]`` (``row["criterion"]``: the real-set or
      teacher KID, else the toy worlds' FD; lower is better) against the median ``m`` of the
      previous nights' by the same criterion (rows with a finite number, failed nights left out: their
      best is an early one; at least one night): a regression when ``best > m + margin * s``. For
      ``m > 0``, ``s = m``: the relative rule ``best > m * (1 + margin)``. For ``m <= 0`` (the
      unbiased KID is at its noise floor: the student matches the teacher's features) a relative
      margin means nothing, so ``s`` is the larger of ``|m|`` and the previous nights' range (their
      spread at the noise floor); with one night at exactly 0 that is ``best > 0``.
    - Or ``row["drift_out"]``: the drift statistics that left their band, reported whatever the
      previous nights (the band is the statistic's own).

    Missing numbers (no best, no previous night with one) are no regression."""
    reasons = []
    key = row.get("criterion")
    evaluator = evaluator_for(row)
    name = evaluator.label(key)
    completed = [r for r in previous_rows if not str(r.get("outcome") or "").startswith("failed")]
    judged = {m: f for m, f in (row.get("best_figures") or {}).items()
              if any(((r.get("best_figures") or {}).get(m) or {}).get("key") == f.get("key") for r in completed)}
    # one figure without a standard error (a toy world's FD, older rows) reads as it always has: the scalar rule
    judged = judged if len(judged) > 1 or any(_number(f.get("se")) is not None for f in judged.values()) else {}
    if judged:
        reasons += criterion.regression([r.get("best_figures") or {} for r in completed], judged, margin,
                                        label=evaluator.label)
    best = _number(row.get("best"))
    values = [v for r in completed if r.get("criterion") == key and (v := _number(r.get("best"))) is not None]
    if best is not None and values and not judged:
        median = statistics.median(values)
        scale = median if median > 0 else max(abs(median), max(values) - min(values))
        if best > median + margin * scale:
            nights = _plural(len(values), "previous night")
            if median > 0:
                reasons.append(f"best {name} {best:.3g} is {100 * (best / median - 1):.0f}% above the median "
                               f"{median:.3g} of {nights} (margin {100 * margin:.0f}%)")
            else:
                reasons.append(f"best {name} {best:.3g} is {best - median:.3g} above the median {median:.3g} of "
                               f"{nights}, more than {100 * margin:.0f}% of their spread {scale:.3g}")
    drift = row.get("drift_out") or []
    drift = [drift] if isinstance(drift, str) else [str(d) for d in drift]
    if drift:
        reasons.append("drift out of band: " + ", ".join(drift))
    return "; ".join(reasons) or None


def night_regressed_event(reason: str, row: dict, flow_run_id: str, flow_run_name: Optional[str],
                          deployment_id: Optional[str], deployment_name: Optional[str]) -> dict:
    """The keyword arguments of ``emit_event`` for a regressed night: the flow run is the resource,
    its deployment a related resource (the automation matches on it), the payload the reason and the
    row's fields."""
    import json

    resource = {"prefect.resource.id": f"prefect.flow-run.{flow_run_id}"}
    if flow_run_name:
        resource["prefect.resource.name"] = flow_run_name
    related = []
    if deployment_id:
        related.append({"prefect.resource.id": f"prefect.deployment.{deployment_id}",
                        "prefect.resource.role": "deployment",
                        **({"prefect.resource.name": deployment_name} if deployment_name else {})})
    payload = {**json.loads(json.dumps(row, default=str)), "reason": reason}
    return dict(event=REGRESSION_EVENT, resource=resource, related=related, payload=payload)


def emit_night_regressed(reason: str, row: dict, flow_run_id: str, flow_run_name: Optional[str],
                         deployment_id: Optional[str], deployment_name: Optional[str]):
    """Emit ``dmd2.night.regressed`` (through this process's Prefect events worker); the event."""
    from prefect.events import emit_event

    return emit_event(**night_regressed_event(reason, row, flow_run_id, flow_run_name, deployment_id,
                                              deployment_name))


def ensure_regression_alert(deployment_ids: list, webhook_url: Optional[str]) -> Optional[str]:
    """On every ``dmd2.night.regressed`` of a run of these deployments, a message naming the run,
    its deployment and the reason (the automation replaced if it exists; none without a URL).
    Returns the automation's id."""
    from prefect.automations import Automation, EventTrigger, Posture, SendNotification

    _remove(REGRESSION_AUTOMATION)
    if not webhook_url or not deployment_ids:
        return None
    block_id = webhook_block(webhook_url).save(WEBHOOK_BLOCK, overwrite=True)
    automation = Automation(
        name=REGRESSION_AUTOMATION,
        description=f"A completed dmd2 night whose best picture or sound figure is worse than the median of the "
                    f"nights before it beyond its noise and its margin, or whose drift left its band, emits "
                    f"{REGRESSION_EVENT}; it posts "
                    f"a message to the dmd2-failures webhook.",
        trigger=EventTrigger(expect={REGRESSION_EVENT}, match={"prefect.resource.id": "prefect.flow-run.*"},
                             match_related=_related(deployment_ids), posture=Posture.Reactive, threshold=1,
                             within=timedelta(0)),
        actions=[SendNotification(block_document_id=block_id, subject=REGRESSION_SUBJECT, body=REGRESSION_BODY)],
    )
    return str(automation.create().id)


# ---- a deployment without a completed night ----------------------------------------------------

def schedule_gap(cron: str, timezone: Optional[str] = None, horizon: timedelta = timedelta(days=400)) -> timedelta:
    """The longest time between two consecutive times of ``cron`` (in ``timezone``, default UTC)
    over the coming ``horizon``: a day for a daily cron (25 h across a daylight-saving change in
    a zone that has one), 3 days for a weekdays-only cron."""
    import datetime
    import zoneinfo

    from cronsim import CronSim

    start = datetime.datetime.now(zoneinfo.ZoneInfo(timezone or "UTC"))
    times = CronSim(cron, start)
    previous, longest = next(times), timedelta(0)
    for _ in range(5000):
        at = next(times)
        longest = max(longest, at - previous)
        if at - start > horizon:
            break
        previous = at
    return longest


def stale_window(schedules: list[tuple[str, Optional[str]]], slack: timedelta = timedelta(hours=2)) -> Optional[timedelta]:
    """How long the deployments of these (cron, timezone) schedules may go without a completed
    night: the longest gap between scheduled times, plus ``slack`` for a night that ends later than
    the one before it (26 h for a nightly cron). Completions recur at the schedule's period, so a
    window this long holds one unless a night is missing or ends over ``slack`` later than usual.
    None without a schedule."""
    gaps = [schedule_gap(cron, tz) for cron, tz in schedules]
    return max(gaps) + slack if gaps else None


def _deployment_names(deployment_ids: list) -> list[str]:
    from prefect.client.orchestration import get_client

    names = []
    with get_client(sync_client=True) as client:
        for d in deployment_ids:
            try:
                names.append(client.read_deployment(d).name)
            except Exception:  # noqa: BLE001 - the id names it well enough
                names.append(str(d))
    return names


def ensure_stale_alert(deployment_ids: list, webhook_url: Optional[str], within: Optional[timedelta]) -> Optional[str]:
    """A proactive automation: when no run of these deployments reaches Completed in a window of
    ``within`` (``stale_window`` of their schedules), a message naming them. The windows are
    tumbling, from the automation's creation: a deployment that stays stale is reported once per
    window. One trigger for all of them (a completed night of any resets it), so serve gives it the
    scheduled deployments only. Replaced if it exists; none without a URL, a deployment or a window.
    Returns the automation's id."""
    from prefect.automations import Automation, EventTrigger, Posture, SendNotification

    _remove(STALE_AUTOMATION)
    if not webhook_url or not deployment_ids or not within:
        return None
    block_id = webhook_block(webhook_url).save(WEBHOOK_BLOCK, overwrite=True)
    names = ", ".join(_deployment_names(deployment_ids))
    hours = within.total_seconds() / 3600
    span = f"{hours:.0f} h" if hours >= 1 else f"{within.total_seconds():.0f} s"
    automation = Automation(
        name=STALE_AUTOMATION,
        description=f"No run of the scheduled dmd2 deployment(s) {names} completed within {span}: a message to the "
                    f"dmd2-failures webhook.",
        trigger=EventTrigger(expect={"prefect.flow-run.Completed"}, match={"prefect.resource.id": "prefect.flow-run.*"},
                             match_related=_related(deployment_ids), posture=Posture.Proactive, threshold=1,
                             within=within),
        actions=[SendNotification(
            block_document_id=block_id, subject=f"dmd2 no completed night: {names}",
            body=f"No run of dmd2 deployment(s) {names} has completed in the last {span} (checked "
                 "{{ firing.triggered.strftime('%Y-%m-%d %H:%M UTC') }}): the night is late, failed, or was "
                 "never scheduled (serve stopped, schedule paused). See the deployment's runs in the Prefect UI.")],
    )
    return str(automation.create().id)
