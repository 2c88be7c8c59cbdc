"""The dmd2 deployments against one real Prefect server (tests/conftest.py): a served deployment
run (name, windows, edges, summary), the nightly MiniMax-H3 deployment on its stand-in, a deployment
missing its inputs (paused), a kill -9 of a run's process (it reruns itself) and the run graphs'
sizes over tens of iterations."""

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
from tests.test_flow import FAST, REPO

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


@pytest.fixture(scope="module")
def served(prefect_server, tmp_path_factory):
    """`python -m deployments.serve` (both deployments; minimax-h3 without its inputs) against the
    session's real server. Yields (api, env, serve process, serve log)."""
    api, env = prefect_server
    env = {k: v for k, v in env.items() if not k.startswith("DMD2_MINIMAX_H3_")}
    env["PREFECT_RUNNER_POLL_FREQUENCY"] = "2"  # a rescheduled run is picked up within 2 s
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "deployments.serve"], env=env, cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"{api}/deployments/name/dmd2/tiny", 90, proc, log)
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
def test_served_deployment_run(served, tiny_teacher, tmp_path):
    """A run of dmd2/tiny: named {run_name}-{date}, a window subflow per 2 iterations (its phases
    chained, no sleep tasks when the groups do not sleep), and one run summary with the
    configuration, the plot, the latest grid and the checkpoint path."""
    api, env, _, log = served
    save = tmp_path / "run"
    params = {"recipe": "tiny", "overrides": {**FAST, "eval_interval": 2, "iterations_per_window": 2,
                                              "sleep_after_train": False},
              "num_iterations": 3, "hf_checkpoint": tiny_teacher, "save": str(save)}
    run = _run_deployment(api, env, params)
    run = _wait_final(api, run["id"], 240, log)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    name = f"dmd2-tiny-{today}-{run['id'].replace('-', '')[:8]}"
    assert run["name"] == name
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert [json.loads(line)["iteration"] for line in (save / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    windows = _api(api, "/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [run["id"]]}}})
    assert sorted(w["name"] for w in windows) == [f"{name} iterations-0001-0002", f"{name} iterations-0003-0003"]
    assert all("dmd2-window" in w["tags"] for w in windows)
    for window in windows:  # every phase of an iteration is chained to the one before it
        graph = _api(api, f"/flow_runs/{window['id']}/graph-v2")
        names = {n["id"]: n["label"] for _, n in graph["nodes"]}
        edges = {names[n["id"]]: {names[p["id"]] for p in n["parents"]} for _, n in graph["nodes"]}
        first = int(window["name"].rpartition(" iterations-")[2].split("-")[0])
        assert edges[f"critic-train-and-score-{first}"] == {f"rollout-{first}"}
        assert edges[f"student-train-{first}"] == {f"critic-train-and-score-{first}"}
        assert not any(label.startswith("sleep-") for label in edges)  # groups that do not sleep: no sleep tasks
    artifacts = _api(api, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run["id"]]}}})
    assert sorted(a["key"] for a in artifacts) == ["dmd2-nights-tiny", f"{name}-metrics", f"{name}-progress", f"{name}-summary"]
    text = next(a["data"] for a in artifacts if a["key"] == f"{name}-summary")
    assert "## Configuration" in text and "| loss_type | `dmd2_critic` | `dmd2` |" in text
    assert "![metrics plot](data:image/png;base64," in text
    assert "## Samples, iteration 3" in text and "iter_0000003.png" in text
    assert f"`{save}/exports/iter_0000003`" in text
    table = json.loads(next(a["data"] for a in artifacts if a["key"] == f"{name}-metrics"))
    assert [r["iteration"] for r in table] == [3, 2, 1, 0]


@pytest.mark.server
def test_served_minimax_h3_run_on_the_stand_in(served, tmp_path):
    """A run of the nightly dmd2/minimax-h3 deployment, its inputs given as parameters, on the
    MiniMax-H3 stand-in: it completes; both modalities' metrics every iteration; per eval prompt an
    MP4 that plays with stereo sound, a frame strip and a spectrogram; a checkpoint and an export
    laid out as a MiniMax-H3 repository (that diffusers loads it: tests/test_minimax_h3.py)."""
    from dmd2_core import av_media, checkpoint
    from dmd2_core.models.standins import H3_GEOMETRY, build_h3_standin, h3_prompt_set

    api, env, _, log = served
    url = build_h3_standin(str(tmp_path / "h3"))
    h3_prompt_set().save(str(tmp_path / "prompts.safetensors"))
    save = tmp_path / "run"
    overrides = dict(device="cpu", num_devices=1, dtype="float32", global_batch_size=4, micro_batch_size=2,
                     torch_threads=1, **H3_GEOMETRY, run_name="h3-standin", eval_interval=2, save_interval=2,
                     eval_prompts=[0, 1], eval_samples_per_prompt=1)
    params = {"recipe": "minimax-h3", "overrides": overrides, "num_iterations": 2, "hf_checkpoint": url,
              "prompts": str(tmp_path / "prompts.safetensors"), "save": str(save)}
    run = _wait_final(api, _run_deployment(api, env, params, "minimax-h3")["id"], 300, log)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["iteration"] >= 1]
    assert len(trained) == 2
    for key in ("dmd2_loss", "dmd2_grad_norm_video", "dmd2_grad_norm_audio", "critic_loss_video", "critic_loss_audio"):
        assert all(key in r for r in trained), key
    clips = sorted((save / "media").glob("iter_0000002_*.mp4"))
    assert [c.name for c in clips] == ["iter_0000002_p0.mp4", "iter_0000002_p1.mp4"]  # one per eval prompt
    clip = av_media.read_mp4(str(clips[0]))
    assert clip["audio_channels"] == 2 and clip["sample_rate"] == 32000
    assert abs(clip["duration_s"] - 124 / 24) < 0.15 and abs(clip["fps"] - 24) < 1e-6
    assert len(clip["frames"]) == 124 and clip["audio"].shape[1] > 5 * 32000
    assert (save / "media" / "iter_0000002_p0_spectrogram.png").stat().st_size > 0
    assert (save / "media" / "iter_0000002_p0_frames.png").stat().st_size > 0
    assert checkpoint.read_tracker(str(save)) == 2
    export = save / "exports" / "iter_0000002"
    assert json.loads((export / "modular_model_index.json").read_text())["_class_name"] == "MiniMaxH3ModularPipeline"
    assert (export / "audio_vae" / "config.json").exists() and (export / "transformer" / "config.json").exists()
    artifacts = _api(api, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run["id"]]}}})
    summary = next(a["data"] for a in artifacts if a["key"].endswith("-summary"))
    assert "dmd2-nights-minimax-h3" in {a["key"] for a in artifacts}
    assert "[MP4 with sound](" in summary


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
    assert figures["graphs"] == 4 and figures["parent_graph_nodes"] == 4  # eval-media-0 + 3 windows
    assert figures["task_runs"] >= 5 * 30
    assert 5 * 10 <= figures["largest_graph_nodes"] <= 5 * 10 + 3  # + its evals and checkpoints
    assert figures["log_lines_per_iteration"] < 1.2
