"""Nights in a row against one real Prefect server (tests/conftest.py) and one serve process with
a failure webhook pointed at a local HTTP receiver: two nights of dmd2/tiny, the second killed
(kill -9 of its flow-run process) after its first checkpoint and rerun by the server's automation
to the weights of the uninterrupted first, then a night that fails. Each night its own name and artifacts, a rerun that reads as one run, the
nights view holding every night, one webhook message per failed or crashed night, no ERROR line
from the rerun machinery."""

from __future__ import annotations

import datetime
import http.server
import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from flows.environment import wait_http
from tests.test_flow import FAST, REPO, assert_same_saved_state
from tests.test_served import _api, _run_deployment, _stop, _wait_final

FINAL = ("COMPLETED", "FAILED", "CANCELLED")


@pytest.fixture
def receiver():
    """A local HTTP server that records the JSON bodies POSTed to it: (url, list of bodies)."""
    got: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", got
    server.shutdown()


def _kill_flow_process(serve: subprocess.Popen, run_id: str) -> None:
    import psutil

    def of_run(p) -> bool:
        try:
            return p.environ().get("PREFECT__FLOW_RUN_ID") == run_id
        except psutil.Error:
            return False

    victims = [p for p in psutil.Process(serve.pid).children(recursive=True) if of_run(p)]
    assert victims
    min(victims, key=lambda p: p.create_time()).send_signal(signal.SIGKILL)  # the flow-run process


def _artifacts(api: str, run_id: str) -> list[dict]:
    return _api(api, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run_id]}}})


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, what
        time.sleep(0.5)
    return value


@pytest.mark.server
def test_nights_in_a_row(prefect_server, receiver, tiny_teacher, tmp_path):
    api, env = prefect_server
    hook_url, messages = receiver
    env = {**env, "PREFECT_RUNNER_POLL_FREQUENCY": "2", "DMD2_ALERT_WEBHOOK_URL": hook_url}
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        serve = subprocess.Popen([sys.executable, "-m", "deployments.serve", "--only", "tiny"], env=env, cwd=REPO,
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"{api}/deployments/name/dmd2/tiny", 90, serve, log)
        automations = [a["name"] for a in _api(api, "/automations/filter", {})]
        _wait(lambda: "dmd2: tell a person when a run fails" in [a["name"] for a in _api(api, "/automations/filter", {})],
              60, f"no failure automation: {automations}\n{log.read_text()[-3000:]}")
        overrides = {**FAST, "eval_interval": 2, "save_interval": 2, "iterations_per_window": 2,
                     "sleep_after_train": False, "summary_interval": 1}
        params = {"recipe": "tiny", "overrides": overrides, "hf_checkpoint": tiny_teacher}

        # night 1: a plain run, the uninterrupted reference of night 2
        one = _wait_final(api, _run_deployment(api, env, {**params, "num_iterations": 4, "save": str(tmp_path / "n1")})["id"],
                          240, log, until=lambda r: r["state"]["type"] in FINAL)
        assert one["state"]["type"] == "COMPLETED", one["state"]

        # night 2: killed after its checkpoint at iteration 2, rerun by the automation, completes with
        # the weights of the uninterrupted night 1
        save = tmp_path / "n2"
        two = _run_deployment(api, env, {**params, "num_iterations": 4, "save": str(save)})
        tracker = save / "latest_checkpointed_iteration.txt"
        _wait(lambda: tracker.exists() and tracker.read_text().strip() == "2", 180, log.read_text()[-3000:])
        _kill_flow_process(serve, two["id"])
        two = _wait_final(api, two["id"], 300, log, until=lambda r: r["state"]["type"] in FINAL and r["run_count"] > 1)
        assert two["state"]["type"] == "COMPLETED" and two["run_count"] == 2, two["state"]
        rerun_log = log.read_text()
        assert_same_saved_state(save, tmp_path / "n1", 4)

        # night 3: fails at iteration 1 (a NaN gradient every step, one allowed)
        bad = {**overrides, "train_input_hook_path": "tests.hooks_fixture.nan_dmd2_gradient_always",
               "max_nonfinite_steps": 1}
        three = _run_deployment(api, env, {**params, "overrides": bad, "num_iterations": 2, "save": str(tmp_path / "n3")})
        three = _wait_final(api, three["id"], 240, log, until=lambda r: r["state"]["type"] in FINAL)
        assert three["state"]["type"] == "FAILED", three["state"]

        # distinct names and keys; one set of artifacts per run (the rerun updated night 2's)
        today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
        names = [r["name"] for r in (one, two, three)]
        assert len(set(names)) == 3 and all(n.startswith(f"dmd2-tiny-{today}-") for n in names), names
        assert two["name"].endswith(two["id"].replace("-", "")[:8])
        for run in (one, two):
            keys = sorted(a["key"] for a in _artifacts(api, run["id"]))
            assert keys == sorted([f"{run['name']}-metrics", f"{run['name']}-progress", f"{run['name']}-summary",
                                   "dmd2-nights-tiny"]), keys
        summary = next(a["data"] for a in _artifacts(api, two["id"]) if a["key"] == f"{two['name']}-summary")
        assert "**completed**: iteration 4 of 4 (resumed after 2)." in summary and "Updated " in summary
        # before -> after: the summary's and the log line's are the same (iteration 0 -> 4)
        logs = _api(api, "/logs/filter", {"logs": {"flow_run_id": {"any_": [two["id"]]}}, "limit": 200})
        (line,) = [entry["message"] for entry in logs if entry["message"].startswith("quality before -> after")]
        before = line.split(": ", 1)[1].split(", ")[0]  # "fd 0.9 -> 0.4"
        fd_before, fd_after = before.split(" ")[1], before.split(" ")[3]
        assert f"fd {fd_before}" in summary.split("Quality before -> after: ")[1].split(" -> ")[0]
        assert "(iterations 0 -> 4)" in summary and fd_after

        # the windows: named by their night; the crashed one closed with its name, the rerun's new
        windows = _api(api, "/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [two["id"]]}}})
        by_name = {w["name"]: w["state"]["type"] for w in windows}
        assert by_name == {f"{two['name']} iterations-0001-0002": "CRASHED",
                           f"{two['name']} iterations-0003-0004 (rerun 1)": "COMPLETED"}, by_name
        for window in windows:
            labels = [n["label"] for _, n in _api(api, f"/flow_runs/{window['id']}/graph-v2")["nodes"]]
            assert len(labels) == len(set(labels)), labels

        # no ERROR from the crash hook or the rerun machinery, in the serve process or the run
        assert "unexpected keyword argument" not in rerun_log and " ERROR " not in rerun_log.replace("| ERROR", " ERROR "), \
            rerun_log[-4000:]
        errors = _api(api, "/logs/filter", {"logs": {"flow_run_id": {"any_": [two["id"], *[w["id"] for w in windows]]},
                                                     "level": {"ge_": 40}}})
        assert errors == [], errors

        # the nights view: every night a row, the latest version
        nights = _api(api, "/artifacts/latest/filter", {"artifacts": {"key": {"any_": ["dmd2-nights-tiny"]}}})
        from flows.nights import rows_of

        # the server is shared with other test files whose tiny runs are nights too: ours are the last three
        rows = rows_of(nights[0]["data"])[-3:]
        assert [r["run_id"] for r in rows] == [one["id"], two["id"], three["id"]]
        assert [r["outcome"] for r in rows] == ["completed", "completed (1 rerun)", "failed"]
        assert rows[1]["iteration"] == 4 and isinstance(rows[1]["fd"], float) and rows[1]["best_fd"] <= rows[1]["fd"]
        assert "![FD over nights](data:image/png;base64," in nights[0]["data"]

        # a person is told: one message for the crash of night 2, one for the failure of night 3
        _wait(lambda: len(messages) >= 2, 60, f"webhook got {messages}")
        time.sleep(3)  # nothing more arrives
        texts = [m["text"] for m in messages]
        about_three = [t for t in texts if three["name"] in t]
        about_two = [t for t in texts if two["name"] in t]
        assert len(about_three) == 1 and len(about_two) == 1 and len(texts) == 2, texts
        assert "Failed" in about_three[0] and "at iteration 1" in about_three[0] and "NonFiniteError" in about_three[0]
        assert "Crashed" in about_two[0] and "rerun" in about_two[0]
        assert three["id"] in about_three[0]  # the link (or the id when the server has no UI)

        # deployments run by a worker: the same automations, made without serving
        out = subprocess.run([sys.executable, "-m", "deployments.serve", "--automations-only", "--only", "tiny",
                              "--alert-webhook", hook_url], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "automations for 1 deployment(s)" in out.stderr, out.stderr[-3000:]
        names = sorted(a["name"] for a in _api(api, "/automations/filter", {}))
        assert names == ["dmd2: crash runs without heartbeat", "dmd2: rerun crashed runs",
                         "dmd2: tell a person when a run fails"], names
    finally:
        _stop(serve)


def test_local_server_vacuums_old_flow_runs(monkeypatch):
    """The settings the project's local server gets parse, in Prefect's own model, to the flow-run
    vacuum (with orphaned logs and artifacts) and the documented retention."""
    from prefect.settings.models.server.services import ServerServicesDBVacuumSettings

    from flows.environment import LOCAL_SERVER_ENV, RETENTION_DAYS

    for key, value in LOCAL_SERVER_ENV.items():
        monkeypatch.setenv(key, value)
    settings = ServerServicesDBVacuumSettings()
    assert settings.enabled_vacuum_types == {"events", "flow_runs", "orphans"}
    assert settings.retention_period == datetime.timedelta(days=RETENTION_DAYS)
