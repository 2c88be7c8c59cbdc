"""A person is told (flows/alerts.py): the regression rule of a finished night, and, against the
session's real Prefect server (tests/conftest.py) with a local HTTP receiver as the webhook, the
regression and stale-deployment automations: what the server stores, a regressed night emitted by
record_night inside a run of a deployment reaching the receiver, and a proactive window without a
completed night reaching it."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from prefect import flow

from flows.alerts import REGRESSION_AUTOMATION, STALE_AUTOMATION, night_regression, stale_window

REPO = Path(__file__).resolve().parent.parent


def night(best_tkd, outcome: str = "completed", drift_out=None, run_id=None, criterion="teacher_kid") -> dict:
    return {"run_id": run_id or str(uuid.uuid4()), "outcome": outcome, "criterion": criterion, "best": best_tkd,
            "best_tkd": best_tkd, "drift_out": drift_out or []}


# ---- the rule ------------------------------------------------------------------------------------

def test_first_night_is_no_regression():
    assert night_regression([], night(0.9), 0.25) is None


def test_within_the_margin_is_no_regression():
    previous = [night(0.18), night(0.19), night(0.25)]
    assert night_regression(previous, night(0.2375), 0.25) is None  # 0.19 * 1.25 exactly
    assert night_regression(previous, night(0.10), 0.25) is None  # better


def test_above_the_margin_names_the_numbers():
    previous = [night(0.18), night(0.19), night(0.25)]
    assert night_regression(previous, night(0.41), 0.25) == \
        "best teacher KID 0.41 is 116% above the median 0.19 of 3 previous nights (margin 25%)"
    assert night_regression([night(0.2)], night(0.3), 0.25) == \
        "best teacher KID 0.3 is 50% above the median 0.2 of 1 previous night (margin 25%)"
    assert night_regression([night(0.2)], night(0.3), 0.6) is None  # the run's margin decides


def test_a_night_is_compared_with_the_nights_of_its_own_criterion():
    before_real_set = [night(0.01), night(0.012)]  # teacher KID, before the nights had a real set
    tonight = night(-0.05, criterion="real_kid")
    assert night_regression(before_real_set, tonight, 0.25) is None
    assert night_regression([night(0.2, criterion="real_kid")], night(0.3, criterion="real_kid"), 0.25) == \
        "best real-set KID 0.3 is 50% above the median 0.2 of 1 previous night (margin 25%)"
    assert night_regression([night(2.0, criterion="fd")], night(3.0, criterion="fd"), 0.25) == \
        "best FD 3 is 50% above the median 2 of 1 previous night (margin 25%)"


def test_drift_out_of_band_is_a_regression_whatever_the_kid():
    assert night_regression([], night(None, drift_out=["drift_saturation_video"]), 0.25) == \
        "drift out of band: drift_saturation_video"
    reason = night_regression([night(0.19)], night(0.41, drift_out=["drift_saturation_video", "av_align"]), 0.25)
    assert reason == ("best teacher KID 0.41 is 116% above the median 0.19 of 1 previous night (margin 25%); "
                      "drift out of band: drift_saturation_video, av_align")


def test_missing_numbers_are_no_regression():
    assert night_regression([night(0.1)], night(None), 0.25) is None
    assert night_regression([night(0.1)], {"run_id": "x"}, 0.25) is None  # a row without the new fields
    assert night_regression([night(None), night(float("nan")), night(True), night("0.1")], night(0.9), 0.25) is None
    assert night_regression([night(0.1)], night(float("nan")), 0.25) is None
    # only the nights with a number count (one here), and failed nights are left out
    assert night_regression([night(None), night(0.2), night(0.01, outcome="failed")], night(0.3), 0.25) == \
        "best teacher KID 0.3 is 50% above the median 0.2 of 1 previous night (margin 25%)"


def test_a_regression_alert_that_cannot_be_sent_is_one_warning_naming_it(monkeypatch, caplog):
    """The events API down (the webhook's automation never hears of the night): the night's
    regression is still reported in its log, the failure to send is one warning naming the alert,
    and nothing raises: the night keeps its outcome."""
    from flows import alerts
    from flows.nights import tell_if_regressed

    def server_down(*args):
        raise ConnectionError("events API unreachable\n(a second line of the error)")

    monkeypatch.setattr(alerts, "emit_night_regressed", server_down)
    reason = tell_if_regressed({}, [night(0.2)], night(0.3))
    assert reason and reason.startswith("best teacher KID 0.3")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [f"night regressed: {reason}",
                        "alert dmd2.night.regressed not sent: the webhook is not told of it "
                        "(ConnectionError: events API unreachable)"]


def test_median_at_or_below_zero_uses_the_spread():
    # the unbiased KID at its noise floor: the margin is a fraction of the previous nights' range
    previous = [night(-0.004), night(-0.001), night(0.002)]  # median -0.001, spread 0.006
    assert night_regression(previous, night(0.0004), 0.25) is None  # 0.0014 above: within 0.0015
    assert night_regression(previous, night(0.002), 0.25) == \
        "best teacher KID 0.002 is 0.003 above the median -0.001 of 3 previous nights, more than 25% of their spread 0.006"
    assert night_regression([night(0.0)], night(1e-6), 0.25) is not None  # one night at 0: anything above
    assert night_regression([night(0.0)], night(0.0), 0.25) is None


def test_stale_window_from_the_schedule():
    assert stale_window([("0 2 * * *", "UTC")]) == timedelta(hours=26)
    assert stale_window([("0 2 * * 1-5", "UTC")]) == timedelta(hours=74)  # Friday to Monday
    assert stale_window([("0 2 * * *", "Europe/Berlin")], slack=timedelta(0)) in (timedelta(hours=24),
                                                                                 timedelta(hours=25))
    assert stale_window([]) is None


# ---- against the real server ---------------------------------------------------------------------

@pytest.fixture
def server_api(prefect_server):
    """This process's Prefect client on the session's real server; the automations this file makes
    are removed afterwards (the server is shared with tests/test_served.py, which counts them)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.alerts import ensure_regression_alert, ensure_stale_alert

    api, env = prefect_server
    with temporary_settings(updates={PREFECT_API_URL: api}):
        try:
            yield api, env
        finally:
            ensure_regression_alert([], None)
            ensure_stale_alert([], None, None)


def _wait(predicate, timeout: float, what):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.5)
    return value


@pytest.mark.server
def test_automations_as_the_server_stores_them(server_api, receiver):
    from prefect.client.orchestration import get_client
    from prefect.events.schemas.automations import Posture

    from flows.alerts import WEBHOOK_BLOCK, ensure_regression_alert, ensure_stale_alert

    deployment = uuid.uuid4()
    ensure_regression_alert([deployment], receiver[0])
    regression = ensure_regression_alert([deployment], receiver[0])  # replaced, not doubled
    stale = ensure_stale_alert([deployment], receiver[0], timedelta(hours=26))
    with get_client(sync_client=True) as client:
        assert [a.id for a in client.read_automations_by_name(REGRESSION_AUTOMATION)] == [uuid.UUID(regression)]
        block = client.read_block_document_by_name(WEBHOOK_BLOCK, "custom-webhook")
        got = {a.name: a for a in (client.read_automation(regression), client.read_automation(stale))}
    related = {"prefect.resource.role": "deployment", "prefect.resource.id": [f"prefect.deployment.{deployment}"]}
    specs = lambda t: [m.model_dump() for m in (t.match_related if isinstance(t.match_related, list)  # noqa: E731
                                                 else [t.match_related])]

    trigger = got[REGRESSION_AUTOMATION].trigger
    assert trigger.posture == Posture.Reactive and trigger.expect == {"dmd2.night.regressed"}
    assert trigger.threshold == 1 and trigger.within == timedelta(0)
    assert trigger.match.model_dump() == {"prefect.resource.id": "prefect.flow-run.*"}
    assert specs(trigger) == [related]
    (action,) = got[REGRESSION_AUTOMATION].actions
    assert action.type == "send-notification" and action.block_document_id == block.id
    assert "event.payload.reason" in action.body

    trigger = got[STALE_AUTOMATION].trigger
    assert trigger.posture == Posture.Proactive and trigger.expect == {"prefect.flow-run.Completed"}
    assert trigger.threshold == 1 and trigger.within == timedelta(hours=26) and not trigger.after
    assert specs(trigger) == [related]
    assert str(deployment) in got[STALE_AUTOMATION].actions[0].body  # no such deployment: named by its id

    # no URL: none left
    assert ensure_regression_alert([deployment], None) is None and ensure_stale_alert([deployment], None, None) is None
    with get_client(sync_client=True) as client:
        assert not client.read_automations_by_name(REGRESSION_AUTOMATION)
        assert not client.read_automations_by_name(STALE_AUTOMATION)


@pytest.mark.server
def test_serve_makes_the_alerts_for_its_scheduled_deployments(server_api, receiver):
    """deployments/serve.py: the three automations for its deployments; the stale one only for the
    deployment whose cron schedule is active, its window that schedule's day plus 2 h."""
    from prefect.client.orchestration import get_client
    from prefect.schedules import Cron
    from prefect.types.entrypoint import EntrypointType

    from deployments.serve import ensure_alerts
    from flows.alerts import ALERT_AUTOMATION

    tag = uuid.uuid4().hex[:6]
    nightly, paused, on_demand = (
        stand_in_night.to_deployment(name=f"alerts-{kind}-{tag}", schedules=schedules,
                                     entrypoint_type=EntrypointType.MODULE_PATH).apply()
        for kind, schedules in (("nightly", [Cron("0 2 * * *", timezone="UTC")]),
                                ("paused", [Cron("0 3 * * *", timezone="UTC", active=False)]), ("on-demand", None)))
    try:
        assert ensure_alerts([nightly, paused, on_demand], receiver[0]) is not None
        with get_client(sync_client=True) as client:
            got = {name: client.read_automations_by_name(name)
                   for name in (ALERT_AUTOMATION, REGRESSION_AUTOMATION, STALE_AUTOMATION)}
        assert all(len(found) == 1 for found in got.values()), got
        (stale,) = got[STALE_AUTOMATION]
        assert stale.trigger.within == timedelta(hours=26)
        assert stale.trigger.match_related.model_dump()["prefect.resource.id"] == [f"prefect.deployment.{nightly}"]
        assert f"alerts-nightly-{tag}" in stale.actions[0].body
        (regression,) = got[REGRESSION_AUTOMATION]
        assert len(regression.trigger.match_related.model_dump()["prefect.resource.id"]) == 3
    finally:
        ensure_alerts([], None)  # none left for the other tests of the server
        with get_client(sync_client=True) as client:
            for deployment in (nightly, paused, on_demand):
                client.delete_deployment(deployment)


@pytest.mark.server
def test_a_deployment_without_a_completed_night_tells_a_person(server_api, receiver):
    """The proactive automation at a 10 s window (the shortest Prefect takes) for a deployment with
    no runs: the server's proactive evaluation fires at the end of the window."""
    from flows.alerts import ensure_stale_alert

    url, messages = receiver
    deployment = uuid.uuid4()
    ensure_stale_alert([deployment], url, timedelta(seconds=10))
    ours = lambda: [m["text"] for m in messages if str(deployment) in m["text"]]  # noqa: E731
    (text, *_) = _wait(ours, 60, lambda: f"no stale message: {messages}")
    ensure_stale_alert([], None, None)
    assert text.startswith(f"dmd2 no completed night: {deployment}\n"), text
    assert f"No run of dmd2 deployment(s) {deployment} has completed in the last 10 s (checked 20" in text, text


@pytest.mark.server
def test_a_regressed_night_tells_a_person(server_api, receiver, tmp_path):
    """Two nights of a deployment (a stand-in flow that calls record_night, run by Prefect's flow
    engine in a child process as a runner would): the first is the baseline, the second's best
    teacher KID is 116% above it. One dmd2.night.regressed event, on the second run and its
    deployment, and one message naming the run, the deployment and the reason."""
    from prefect.types.entrypoint import EntrypointType

    from flows.alerts import ensure_regression_alert

    api, env = server_api
    url, messages = receiver
    name = f"alerts-{uuid.uuid4().hex[:6]}"
    deployment = stand_in_night.to_deployment(name=name, entrypoint_type=EntrypointType.MODULE_PATH).apply()
    ensure_regression_alert([deployment], url)
    seen = len(messages)

    out = subprocess.run([sys.executable, "-c", f"from tests.test_alerts import run_nights; "
                          f"run_nights({str(deployment)!r}, [0.19, 0.41])"],
                         env={**env, "PYTHONPATH": str(REPO)}, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    first, second = json.loads(out.stdout.strip().splitlines()[-1])

    reason = "best teacher KID 0.41 is 116% above the median 0.19 of 1 previous night (margin 25%)"
    ours = lambda: [m["text"] for m in messages[seen:] if name in m["text"]]  # noqa: E731
    text = _wait(ours, 60, lambda: f"no message: {messages}\n{out.stderr[-3000:]}")[0]
    assert text.startswith(f"dmd2 night regressed: {second['name']}\n"), text
    assert f"dmd2 run {second['name']} (deployment {name}) regressed: {reason}\n" in text, text
    assert second["id"] in text  # the link (or the id when the server has no UI)

    import urllib.request

    req = urllib.request.Request(f"{api}/events/filter", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"filter": {"event": {"name": ["dmd2.night.regressed"]},
                                                             "related": {"id": [f"prefect.deployment.{deployment}"]},
                                                             "occurred": {"since": "2000-01-01T00:00:00Z"}}}).encode())

    def events():
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())["events"]

    (event,) = _wait(events, 60, "no event stored")  # the server persists events in batches (every few s)
    assert event["resource"]["prefect.resource.id"] == f"prefect.flow-run.{second['id']}"
    assert event["resource"]["prefect.resource.name"] == second["name"]
    deployments = [r for r in event["related"] if r["prefect.resource.role"] == "deployment"]
    assert deployments == [{"prefect.resource.id": f"prefect.deployment.{deployment}",
                            "prefect.resource.role": "deployment", "prefect.resource.name": name}]
    assert event["payload"]["reason"] == reason and event["payload"]["best_tkd"] == 0.41
    assert event["payload"]["run_id"] == second["id"] and event["payload"]["outcome"] == "completed, regressed"
    # marked where a team looks: the night's row in the nights view, and what the run returns
    assert (first["outcome"], first["regressed"]) == ("completed", None)
    assert (second["outcome"], second["regressed"]) == ("completed, regressed", reason)
    time.sleep(2)
    assert len(ours()) == 1 and not any(first["name"] in t for t in ours())


@pytest.mark.filterwarnings("ignore:Artifact creation outside:FutureWarning")  # the flow writes it inside a run
def test_two_nights_ending_together_both_keep_their_rows(prefect_harness, monkeypatch):
    """Night A reads the view and is slow to write it; night B ends meanwhile. B waits for A's
    write, reads it and adds its row: the latest version holds both rows (without one writer at a
    time, B would write from the version A read, and A's write would drop B's row)."""
    import threading

    from flows import nights

    key = nights.nights_key(f"together-{uuid.uuid4().hex[:6]}")
    read_latest = nights.latest_markdown
    a_read, b_done = threading.Event(), threading.Event()

    def latest(k):
        markdown = read_latest(k)
        if threading.current_thread().name == "night-a":
            a_read.set()
            b_done.wait(3)  # B's whole update fits here unless it waits for A
        return markdown

    monkeypatch.setattr(nights, "latest_markdown", latest)
    nights.add_row(key, "together", {"run_id": "night-0", "name": "n0", "date": "2026-01-01"})

    def night_b():
        a_read.wait(30)
        nights.add_row(key, "together", {"run_id": "night-b", "name": "nb", "date": "2026-01-02"})
        b_done.set()

    a = threading.Thread(target=nights.add_row, name="night-a",
                         args=(key, "together", {"run_id": "night-a", "name": "na", "date": "2026-01-02"}))
    b = threading.Thread(target=night_b)
    a.start(), b.start()
    a.join(60), b.join(60)
    assert b_done.is_set()
    assert sorted(r["run_id"] for r in nights.rows_of(read_latest(key))) == ["night-0", "night-a", "night-b"]


# ---- the stand-in night (run in a child process) -------------------------------------------------

@flow(name="dmd2-alerts-stand-in")
def stand_in_night(view: dict):
    from flows.nights import record_night

    return record_night(view, "completed", 1.0)


def run_nights(deployment_id: str, best_tkds: list[float]) -> None:
    """One run of the deployment per value, each through Prefect's flow engine in this process, its
    one eval's teacher KID that value (the row: nights_view.night_row, as the flow's); prints the
    runs' ids and names as JSON."""
    from prefect.client.orchestration import get_client
    from prefect.events.worker import EventsWorker
    from prefect.flow_engine import run_flow

    runs = []
    for value in best_tkds:
        view = {"name": "stand-in", "iteration": 2, "final": 2, "evals": [{"iteration": 2, "teacher_kid": value}],
                "drift_flags": [], "trainer_args": {"actor": {"alert_regression_margin": 0.25}}}
        with get_client(sync_client=True) as client:
            flow_run = client.create_flow_run_from_deployment(uuid.UUID(deployment_id), parameters={"view": view})
        state = run_flow(stand_in_night, flow_run=flow_run, parameters={"view": view}, return_type="state")
        assert state.is_completed(), state
        runs.append({"id": str(flow_run.id), "name": flow_run.name, "regressed": state.result()})
    with contextlib.suppress(Exception):
        EventsWorker.drain_all(timeout=30)
    from flows import nights

    with get_client(sync_client=True) as client:
        name = client.read_deployment(uuid.UUID(deployment_id)).name
    outcomes = {r["run_id"]: r.get("outcome") for r in nights.rows_of(nights.latest_markdown(nights.nights_key(name)))}
    print(json.dumps([{**run, "outcome": outcomes.get(run["id"])} for run in runs]))
