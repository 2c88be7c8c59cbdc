"""The dmd2 deployments against one real Prefect server (tests/conftest.py) and one serve process
whose failure webhook points at a local HTTP receiver: a deployment missing its inputs (paused),
the nightly MiniMax-H3 deployment on its stand-in, nights in a row of dmd2/tiny (a run's name,
windows, edges and summary; the second night killed with kill -9 and rerun by the server's
automation to the weights of the uninterrupted first; a night that fails: one record per night,
the nights view, one webhook message per failed or crashed night, no ERROR line from the rerun
machinery), the run graphs' sizes over tens of iterations and the local server's vacuum."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.environment import wait_http
from tests.helpers import FAST, REPO, assert_same_saved_state

FINAL = ("COMPLETED", "FAILED", "CANCELLED")

def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to a process this test started; if it lingers, SIGKILL its own session (it was
    started in a new one, so that holds only it and its children)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _api(api: str, path: str, body: dict | None = None):
    import urllib.request

    import urllib.error

    req = urllib.request.Request(f"{api}{path}", data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="GET" if body is None else "POST")
    for attempt in range(10):  # 503: the server asks to retry (its database was busy), as Prefect's client does
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or attempt == 9:
                raise
            time.sleep(1)


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


# how long a served run may take to end: a night's groups took 189 s to come up in a full run of
# the suite on 2 cores beside the multi-rank tests (~5 s alone); a wait, not a figure
RUN_WAIT_S = 600


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, what
        time.sleep(0.5)
    return value


@pytest.fixture(scope="module")
def shared_ray(ray_session) -> str:
    """The address of the session's Ray, which the served runs join (ray_address) instead of each
    starting a Ray of its own: ~10 s saved per run on a loaded machine. A run killed with kill -9
    leaves nothing there: Ray ends the actors and placement group of a driver that died."""
    return ray_session.get_runtime_context().gcs_address


@pytest.fixture(scope="module")
def served(prefect_server, receiver, tmp_path_factory):
    """`python -m deployments.serve` (both deployments; minimax-h3 without its inputs; failures
    posted to the receiver) against the session's real server. Yields (api, env, serve process,
    serve log)."""
    api, env = prefect_server
    env = {k: v for k, v in env.items() if not k.startswith("DMD2_MINIMAX_H3_")}
    env["PREFECT_RUNNER_POLL_FREQUENCY"] = "2"  # a rescheduled run is picked up within 2 s
    env["DMD2_ALERT_WEBHOOK_URL"] = receiver[0]
    # the runs join the session's Ray (shared_ray): a local Ray has token auth unless RAY_AUTH_MODE
    # says otherwise, and Ray turns it on only for a cluster found automatically, not an address
    env["RAY_AUTH_MODE"] = os.environ.get("RAY_AUTH_MODE", "token")
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "deployments.serve"], env=env, cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # ~15 s on a quiet machine; a readiness wait, generous for a loaded one (it imports torch and the flow)
        wait_http(f"{api}/deployments/name/dmd2/tiny", 240, proc, log)
        wait_http(f"{api}/deployments/name/dmd2/minimax-h3", 30, proc, log)
        yield api, env, proc, log
    finally:
        _stop(proc)


def _run_deployment(api: str, env: dict, params: dict, deployment: str = "tiny") -> dict:
    """Create a run of dmd2/{deployment}; returns the flow run."""
    dep = _api(api, f"/deployments/name/dmd2/{deployment}")
    run = _api(api, f"/deployments/{dep['id']}/create_flow_run", {"parameters": params})
    return run


def _wait_final(api: str, run_id: str, timeout: float, log: Path, until=None) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = _api(api, f"/flow_runs/{run_id}")
        if (until or (lambda r: r["state"]["type"] in ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")))(run):
            return run
        time.sleep(1)
    raise AssertionError(f"flow run {run_id} not done after {timeout}s: {run['state']}\n{log.read_text()[-4000:]}")


@pytest.mark.server
def test_deployment_missing_inputs_is_served_paused(served):
    """minimax-h3 without hf_checkpoint, prompts and save: schedule paused (UTC cron), a description
    saying what to set, one warning line naming the keys, and no scheduled run at all."""
    api, _, _, log = served
    dep = _api(api, "/deployments/name/dmd2/minimax-h3")
    (schedule,) = dep["schedules"]
    assert schedule["active"] is False
    assert schedule["schedule"]["cron"] == "0 2 * * *" and schedule["schedule"]["timezone"] == "UTC"
    assert "Schedule paused" in dep["description"] and "DMD2_MINIMAX_H3_HF_CHECKPOINT" in dep["description"]
    assert {"hf_checkpoint", "prompts", "save", "recipe"} <= set(dep["parameter_openapi_schema"]["required"])
    warnings = [line for line in log.read_text().splitlines() if "minimax-h3" in line and "warning" in line]
    assert warnings == ["warning: deployment 'minimax-h3': schedule paused, missing hf_checkpoint, prompts, save "
                        "(set DMD2_MINIMAX_H3_HF_CHECKPOINT, DMD2_MINIMAX_H3_PROMPTS, DMD2_MINIMAX_H3_SAVE and restart serve)"]
    runs = _api(api, "/flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [dep["id"]]}}})
    assert runs == []


@pytest.mark.server
def test_served_minimax_h3_run_on_the_stand_in(served, receiver, shared_ray, tmp_path):
    """A run of the nightly dmd2/minimax-h3 deployment, its inputs given as parameters, on the
    MiniMax-H3 stand-in: it completes; both modalities' metrics every iteration; per eval prompt an
    MP4 that plays with stereo sound, a frame strip and a spectrogram; a checkpoint and an export
    laid out as a MiniMax-H3 repository (that diffusers loads it: tests/test_minimax_h3.py)."""
    from dmd2_core import checkpoint
    from dmd2_core.media import av_clips
    from dmd2_core.toys.standins import H3_GEOMETRY, build_h3_standin, h3_prompt_set

    api, env, _, log = served
    seen = len(receiver[1])
    url = build_h3_standin(str(tmp_path / "h3"))
    h3_prompt_set().save(str(tmp_path / "prompts.safetensors"))
    save = tmp_path / "run"
    # one CPU rank trains the stand-in whole: the recipe's cp 2 needs two ranks, and its rank-64
    # LoRA would be wider than the stand-in's layers (the LoRA export: tests/test_lora.py)
    overrides = dict(device="cpu", num_devices=1, cp_size=1, lora_rank=0, dtype="float32", global_batch_size=4, micro_batch_size=2,
                     torch_threads=1, **H3_GEOMETRY, run_name="h3-standin", eval_interval=2, save_interval=2, export_interval=2,
                     eval_prompts=[0, 1], eval_samples_per_prompt=1, eval_num_samples=4, eval_reference_steps=2,
                     eval_reference_url=str(tmp_path / "reference"),  # shared by both nights
                     ema_decay=None,  # no EMA: two iterations of one would hide what they did
                     ray_address=shared_ray)
    params = {"recipe": "minimax-h3", "overrides": overrides, "num_iterations": 2, "hf_checkpoint": url,
              "prompts": str(tmp_path / "prompts.safetensors"), "save": str(save)}
    run = _wait_final(api, _run_deployment(api, env, params, "minimax-h3")["id"], RUN_WAIT_S, log)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["iteration"] >= 1]
    assert len(trained) == 2
    for key in ("dmd2_loss", "dmd2_grad_norm_video", "dmd2_grad_norm_audio", "critic_loss_video", "critic_loss_audio"):
        assert all(key in r for r in trained), key
    evals = [r for r in rows if "teacher_kid" in r]  # the teacher evaluator, at iterations 0 and 2
    assert [r["iteration"] for r in evals] == [0, 2]
    for key in ("teacher_kid_video", "teacher_kid_audio", "drift_brightness_video", "drift_loudness_audio", "drift_out",
                "sound_mel_kid", "sound_mel_kid_se"):  # the sound's weight-free distance beside its teacher-feature alarm
        assert all(isinstance(r[key], float) for r in evals), key
    clips = sorted((save / "media").glob("iter_0000002_*.mp4"))
    assert [c.name for c in clips] == ["iter_0000002_p0.mp4", "iter_0000002_p1.mp4"]  # one per eval prompt
    clip = av_clips.read_mp4(str(clips[0]))
    assert clip["audio_channels"] == 2 and clip["sample_rate"] == 32000
    assert abs(clip["duration_s"] - 124 / 24) < 0.15 and abs(clip["fps"] - 24) < 1e-6
    assert len(clip["frames"]) == 124 and clip["audio"].shape[1] > 5 * 32000
    assert (save / "media" / "iter_0000002_p0_spectrogram.png").stat().st_size > 0
    assert (save / "media" / "iter_0000002_p0_frames.png").stat().st_size > 0
    assert checkpoint.read_latest(str(save)) == 2
    export = save / "exports" / "iter_0000002"
    assert json.loads((export / "modular_model_index.json").read_text())["_class_name"] == "MiniMaxH3ModularPipeline"
    assert (export / "audio_vae" / "config.json").exists() and (export / "transformer" / "config.json").exists()

    # night 2, with a learning rate 50,000x the recipe's: the nights view's two rows carry the teacher
    # KID per modality and the drift; the second posts the regression message; the teacher's
    # reference was sampled once (the nights share eval_reference_url)
    bad = {**overrides, "lr": 0.1, "run_name": "h3-standin-bad"}
    run2 = _wait_final(api, _run_deployment(api, env, {**params, "overrides": bad, "save": str(tmp_path / "run2")},
                                            "minimax-h3")["id"], RUN_WAIT_S, log)
    assert run2["state"]["type"] == "COMPLETED", run2["state"]
    assert len(list((tmp_path / "reference").iterdir())) == 1
    from flows.nights import rows_of

    nights = _api(api, "/artifacts/latest/filter", {"artifacts": {"key": {"any_": ["dmd2-nights-minimax-h3"]}}})
    rows = rows_of(nights[0]["data"])[-2:]
    assert [r["run_id"] for r in rows] == [run["id"], run2["id"]]
    for row in rows:
        assert row["criterion"] == "teacher_kid" and isinstance(row["best_tkd"], float), row
        assert isinstance(row["teacher_kid_video"], float) and isinstance(row["teacher_kid_audio"], float), row
        assert isinstance(row["sound_mel_kid"], float), row
    assert "teacher_kid_video" in nights[0]["data"] and "drift out of band" in nights[0]["data"]
    assert "sound_mel_kid" in nights[0]["data"]
    texts = _wait(lambda: [m["text"] for m in receiver[1][seen:] if m["text"].startswith("dmd2 night regressed")],
                  60, f"no regression message: {receiver[1][seen:]}")
    assert len(texts) == 1 and run2["name"] in texts[0] and "minimax-h3" in texts[0], texts
    # and where a team looks: the runs list's state message, the night's row, the summary's first line
    message = run2["state"]["message"]  # each modality judged in its own noise (evaluation.criterion)
    assert message.startswith("regressed: picture: best teacher_kid_video ") and "standard errors" in message, message
    assert [r["outcome"] for r in rows] == ["completed", "completed, regressed"], rows
    artifacts2 = _api(api, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run2["id"]]}}})
    assert "**completed, regressed: picture: best teacher_kid_video " in next(
        a["data"] for a in artifacts2 if a["key"].endswith("-summary"))
    artifacts = _api(api, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run["id"]]}}})
    summary = next(a["data"] for a in artifacts if a["key"].endswith("-summary"))
    assert "dmd2-nights-minimax-h3" in {a["key"] for a in artifacts}
    # local: each clip plays in place (a data: video), named, never a dead link
    assert "MP4 with sound, played in place" in summary and "[MP4 with sound](" not in summary
    assert "| dmd2_shift | `video 8, audio 1 (the schedulers': video 12, audio 3)` |" in summary and "## Drift against the teacher" in summary
    assert any(line.startswith("| iteration |") and "sound_mel_kid" in line for line in summary.splitlines()), summary


@pytest.mark.server
def test_nights_in_a_row(served, receiver, shared_ray, tiny_teacher, tmp_path):
    api, env, serve, log = served
    hook_url, messages = receiver
    start, seen = len(log.read_text()), len(messages)  # this test's part of the serve log and of the messages
    automations = [a["name"] for a in _api(api, "/automations/filter", {})]
    _wait(lambda: "dmd2: tell a person when a run fails" in [a["name"] for a in _api(api, "/automations/filter", {})],
          60, f"no failure automation: {automations}\n{log.read_text()[-3000:]}")
    overrides = {**FAST, "eval_interval": 2, "save_interval": 2, "iterations_per_window": 2,
                 "sleep_after_train": False, "summary_interval": 1, "ray_address": shared_ray}
    params = {"recipe": "tiny", "overrides": overrides, "hf_checkpoint": tiny_teacher}
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()

    # night 1: a plain run (the uninterrupted reference of night 2): named {run_name}-{date}-{id},
    # a window subflow per 2 iterations (its phases chained, no sleep tasks when the groups do not
    # sleep), one run summary with the configuration, the plot, the latest grid and the export
    first = tmp_path / "n1"
    one = _wait_final(api, _run_deployment(api, env, {**params, "num_iterations": 4, "save": str(first)})["id"],
                      RUN_WAIT_S, log, until=lambda r: r["state"]["type"] in FINAL)
    assert one["state"]["type"] == "COMPLETED", one["state"]
    name = f"dmd2-tiny-{today}-{one['id'].replace('-', '')[:8]}"
    assert one["name"] == name
    assert (first / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert [json.loads(line)["iteration"] for line in (first / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3, 4]
    windows = _api(api, "/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [one["id"]]}}})
    assert sorted(w["name"] for w in windows) == [f"{name} iterations-0001-0002", f"{name} iterations-0003-0004"]
    assert all("dmd2-window" in w["tags"] for w in windows)
    for window in windows:  # every phase of an iteration is chained to the one before it
        graph = _api(api, f"/flow_runs/{window['id']}/graph-v2")
        labels = {n["id"]: n["label"] for _, n in graph["nodes"]}
        edges = {labels[n["id"]]: {labels[p["id"]] for p in n["parents"]} for _, n in graph["nodes"]}
        at = int(window["name"].rpartition(" iterations-")[2].split("-")[0])
        assert edges[f"critic-train-and-score-{at}"] == {f"rollout-{at}"}
        assert edges[f"student-train-{at}"] == {f"critic-train-and-score-{at}"}
        assert not any(label.startswith("sleep-") for label in edges)  # groups that do not sleep: no sleep tasks
    artifacts = _artifacts(api, one["id"])
    text = next(a["data"] for a in artifacts if a["key"] == f"{name}-summary")
    assert "## Configuration" in text and "| loss_type | `dmd2_critic` | `dmd2` |" in text
    assert "![metrics plot](data:image/png;base64," in text
    assert "## Samples, iteration 4" in text and "iter_0000004.png" in text
    assert f"`{first}/exports/iter_0000004`" in text
    table = json.loads(next(a["data"] for a in artifacts if a["key"] == f"{name}-metrics"))
    assert [r["iteration"] for r in table] == [4, 3, 2, 1, 0]

    # night 2: killed after its checkpoint at iteration 2, rerun by the automation, completes with
    # the weights of the uninterrupted night 1
    save = tmp_path / "n2"
    two = _run_deployment(api, env, {**params, "num_iterations": 4, "save": str(save)})
    tracker = save / "latest_checkpointed_iteration.txt"
    _wait(lambda: tracker.exists() and tracker.read_text().strip() == "2", RUN_WAIT_S, log.read_text()[-3000:])
    _kill_flow_process(serve, two["id"])
    two = _wait_final(api, two["id"], RUN_WAIT_S, log, until=lambda r: r["state"]["type"] in FINAL and r["run_count"] > 1)
    assert two["state"]["type"] == "COMPLETED" and two["run_count"] == 2, two["state"]
    rerun_log = log.read_text()[start:]
    assert_same_saved_state(save, first, 4)

    # night 3: fails at iteration 1 (a NaN gradient every step, one allowed)
    bad = {**overrides, "train_input_hook_path": "tests.hooks_fixture.nan_dmd2_gradient_always",
           "max_nonfinite_steps": 1}
    three = _run_deployment(api, env, {**params, "overrides": bad, "num_iterations": 2, "save": str(tmp_path / "n3")})
    three = _wait_final(api, three["id"], RUN_WAIT_S, log, until=lambda r: r["state"]["type"] in FINAL)
    assert three["state"]["type"] == "FAILED", three["state"]

    # distinct names and keys; one set of artifacts per run (the rerun updated night 2's)
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

    # the windows: named by their night; the one the kill hit (1-2, or 3-4 when the kill came
    # between the checkpoint at 2 and the end of that window) closed as crashed, none left
    # running; the rerun's new, from iteration 3
    windows = _api(api, "/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [two["id"]]}}})
    by_name = {w["name"]: w["state"]["type"] for w in windows}
    killed = {n: s for n, s in by_name.items() if "(rerun" not in n}
    assert by_name[f"{two['name']} iterations-0001-0002"] in ("CRASHED", "COMPLETED"), by_name
    assert set(killed) <= {f"{two['name']} iterations-0001-0002", f"{two['name']} iterations-0003-0004"}, by_name
    assert set(killed.values()) <= {"CRASHED", "COMPLETED"} and list(killed.values()).count("CRASHED") <= 1, by_name
    assert {n: s for n, s in by_name.items() if "(rerun" in n} == {
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
    _wait(lambda: len(messages) >= seen + 2, 60, f"webhook got {messages}")
    time.sleep(3)  # nothing more arrives
    texts = [m["text"] for m in messages[seen:] if not m["text"].startswith("dmd2 night regressed")]
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
                     "dmd2: tell a person when a night regresses", "dmd2: tell a person when a run fails"], names


@pytest.mark.server
def test_run_graphs_stay_small_at_hundreds_of_iterations(prefect_server):
    """bench/orchestration.py (a zero-cost stand-in on the minimax-h3 recipe) for 30 iterations in
    windows of 10 against the real server: the parent's graph holds a node per window (and the first
    eval), each window ~5 per iteration, and the flow logs about one line per iteration (the
    benchmark's 1000 iterations show the same shape at scale)."""
    api, env = prefect_server
    out = subprocess.run([sys.executable, "bench/orchestration.py", "--iterations", "30", "--window", "10",
                          "--api-url", api], env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["graphs"] == 4 and figures["parent_graph_nodes"] == 4  # eval-0 + 3 windows
    assert figures["task_runs"] >= 5 * 30
    assert 5 * 10 <= figures["largest_graph_nodes"] <= 5 * 10 + 3  # + its evals and checkpoints
    assert figures["log_lines_per_iteration"] * 30 <= 30 + 15  # a line per iteration, ~11 at start and end


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
