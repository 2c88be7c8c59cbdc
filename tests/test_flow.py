"""The dmd2 Prefect flow: end to end on the tiny recipe, bad parameters, an actor lost mid-run, and
a served deployment run against a real Prefect server.

A tiny untrained teacher stands in for the digits teacher (the flow does not care how good it is).
One Ray instance and one Prefect test harness serve the whole session (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dmd2_core.media import data_uri, image_grid, media_url, png_bytes, video_media

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

FAST = {
    "global_batch_size": 8,
    "micro_batch_size": 8,
    "eval_interval": 1,
    "eval_num_samples": 50,
    "eval_samples_per_prompt": 2,
    "save_interval": 1,
    "dmd2_guidance_scale": 1.5,
}


# ---- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def harness(prefect_harness, ray_session):
    """The session's Prefect test harness and Ray (started after the S3 endpoint is set, so the
    workers reach the moto server)."""
    return prefect_harness


@contextlib.contextmanager
def capture_digests():
    """Record every trainer's state_digest when a DistillRun shuts down (the final weights)."""
    from dmd2_core.distill import DistillRun

    digests: list[dict] = []
    original = DistillRun.shutdown

    def shutdown(self):
        if self.groups and not self.broken:
            digests.append({role: self.group_call(role, "state_digest")[0] for role in self.groups})
        original(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DistillRun, "shutdown", shutdown)
        yield digests


def run_flow(teacher: str, save: Path, **extra):
    from flows.dmd2 import dmd2

    state = dmd2(recipe="tiny", overrides=dict(FAST), num_iterations=2, hf_checkpoint=teacher,
                 save=str(save), return_state=True, **extra)
    return state


def read_artifacts(flow_run_id, key: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return sorted(found, key=lambda a: a.created)


def read_flow_run(flow_run_id):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id)


def read_task_runs(flow_run_id) -> list:
    """The task runs of a flow run and of its window subflows."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId

    with get_client(sync_client=True) as client:
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))
        ids = [flow_run_id] + [c.id for c in children]
        return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))


def weights_sha(save: Path, role: str, iteration: int) -> str:
    d = save / "trainers" / role / f"iter_{iteration:07d}" / "model" / "transformer"
    h = hashlib.sha256()
    for f in sorted(d.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def reference(harness, tiny_teacher, tmp_path_factory):
    """One uninterrupted 2-iteration run: (state, summary, digests, save dir)."""
    save = tmp_path_factory.mktemp("reference") / "run"
    with capture_digests() as digests:
        state = run_flow(tiny_teacher, save)
    assert state.is_completed(), state.message
    return state, state.result(), digests[-1], save


# ---- media (no Ray, no Prefect) ---------------------------------------------------------------

def test_media_helpers(tmp_path):
    images = torch.rand(6, 1, 8, 8) * 2 - 1
    grid = image_grid(images, nrow=3)
    assert grid.size == (3 * 64 + 4 * 2, 2 * 64 + 3 * 2)  # 8x8 upscaled to 64 px cells, 2 px padding
    data = png_bytes(grid)
    assert data_uri(data).startswith("data:image/png;base64,")
    gif = video_media(torch.rand(2, 3, 5, 8, 8) * 2 - 1, fps=4)
    assert gif[:6] == b"GIF89a" and data_uri(gif).startswith("data:image/gif;base64,")
    from PIL import Image
    import io

    assert Image.open(io.BytesIO(gif)).n_frames == 5
    assert media_url(str(tmp_path / "x.png")) is None
    assert media_url("https://example.com/x.png") == "https://example.com/x.png"


def test_media_url_presigns_s3(s3_bucket):
    from dmd2_core import storage
    from dmd2_core.media import save_png

    url = f"{s3_bucket}/media/iter_0000001.png"
    save_png(image_grid(torch.zeros(2, 1, 8, 8), nrow=2), url)
    link = media_url(url)
    assert link.startswith("http://") and "Signature" in link
    import urllib.request

    with urllib.request.urlopen(link, timeout=10) as resp:
        assert resp.read() == storage.read_bytes(url)


def test_retry_condition():
    from prefect.states import Failed

    from dmd2_core.args import ArgsError
    from dmd2_core.distill import RayWorkError
    from dmd2_core.models import CheckpointError
    from tasks.common import retry_runtime_failures

    assert retry_runtime_failures(None, None, Failed(data=RayWorkError("actor died")))
    assert retry_runtime_failures(None, None, Failed(data=RuntimeError("boom")))
    assert not retry_runtime_failures(None, None, Failed(data=ArgsError("unknown key 'lrr'")))
    assert not retry_runtime_failures(None, None, Failed(data=CheckpointError("/x: missing")))


# ---- the flow ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bad, expected", [
    ({"overrides": {**FAST, "lrr": 1e-3}}, ["'lrr'", "did you mean 'lr'"]),
    ({"hf_checkpoint": "/nonexistent/teacher"}, ["/nonexistent/teacher"]),
])
def test_bad_parameters_fail_before_any_actor(harness, tiny_teacher, tmp_path, monkeypatch, bad, expected):
    import ray

    from dmd2_core.distill import DistillRun
    from flows.dmd2 import dmd2

    ray_before = ray.is_initialized()
    started = []
    monkeypatch.setattr(DistillRun, "start", lambda self: started.append(1) or 0)
    params = {"recipe": "tiny", "overrides": dict(FAST), "num_iterations": 2,
              "hf_checkpoint": tiny_teacher, "save": str(tmp_path / "run"), **bad}
    state = dmd2(**params, return_state=True)
    assert state.is_failed()
    for text in expected:
        assert text in state.message, state.message
    assert not started and ray.is_initialized() == ray_before
    assert read_task_runs(state.state_details.flow_run_id) == []
    assert not (tmp_path / "run").exists()  # nothing written


def test_flow_end_to_end(reference):
    state, summary, digests, save = reference
    run_id = state.state_details.flow_run_id
    assert summary["final_iteration"] == 2 and summary["start_iteration"] == 0
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert summary["checkpoint"]["iteration"] == 2
    assert set(summary["checkpoint"]["trainers"]) == {"actor", "critic"}
    assert set(summary["quality_before"]) == {"fd", "acc", "diversity"}
    assert set(summary["quality_after"]) == {"fd", "acc", "diversity"}

    lines = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in lines] == [0, 1, 2]
    assert "fd" in lines[0] and "dmd2_loss" not in lines[0]
    for row in lines[1:]:
        assert {"dmd2_loss", "critic_loss", "dmd2_grad_norm", "fd", "checkpoint_s"} <= set(row)
    assert summary["final_metrics"]["dmd2_loss"] == lines[-1]["dmd2_loss"]
    for i in range(3):
        assert (save / "media" / f"iter_{i:07d}.png").is_file()

    keys = summary["artifact_keys"]
    assert keys == {"summary": "dmd2-tiny-summary", "metrics": "dmd2-tiny-metrics", "progress": "dmd2-tiny-progress"}
    for key in keys.values():  # created once, updated in place: one stored version each
        assert len(read_artifacts(run_id, key)) == 1
    table = json.loads(read_artifacts(run_id, keys["metrics"])[-1].data)
    assert [r["iteration"] for r in table] == [2, 1, 0]  # newest first
    assert table[0]["dmd2_loss"] == float(f"{lines[2]['dmd2_loss']:.4g}")
    assert "critic_sigma_mean" not in table[0] and table[2]["dmd2_loss"] is None
    progress = read_artifacts(run_id, keys["progress"])
    assert float(progress[0].data) == 100.0
    text = read_artifacts(run_id, keys["summary"])[0].data
    assert "**completed**: iteration 2 of 2" in text and "Quality before -> after: fd" in text
    assert text.count("data:image/png;base64,") == 2  # the latest grid and the plot
    assert "iter_0000002.png" in text and "trainers/actor/iter_0000002/model" in text
    assert "| dmd2_guidance_scale | 1.5 | 1.5 |" in text and "| loss_type | `dmd2_critic` | `dmd2` |" in text
    assert read_flow_run(run_id).name == f"dmd2-tiny-{datetime.datetime.now(datetime.timezone.utc).date()}"
    names = {t.name: t for t in read_task_runs(run_id)}
    for name in ("rollout-1", "critic-train-and-score-1", "sleep-critic-1", "student-train-1",
                 "sleep-actor-1", "eval-media-0", "eval-media-2", "checkpoint-2"):
        assert names[name].state.is_completed(), name


def test_actor_killed_mid_run_recovers_to_same_weights(reference, tiny_teacher, tmp_path, monkeypatch):
    """The critic's actor dies at iteration 2: the task fails with RayWorkError, its retry rebuilds
    the groups from checkpoint 1 and replays; the final weights equal the uninterrupted run's."""
    import ray

    from dmd2_core.distill import DistillRun

    _, ref_summary, ref_digests, ref_save = reference
    original = DistillRun.critic_train_and_score
    killed = []

    def critic_train_and_score(self, iteration):
        if iteration == 2 and not killed:
            victim = self.groups["critic"].ranks[0]
            ray.kill(victim, no_restart=True)
            with contextlib.suppress(ray.exceptions.RayActorError):
                for _ in range(100):  # until the kill has landed
                    ray.get(victim.__ray_ready__.remote(), timeout=30)
                    time.sleep(0.1)
            killed.append(iteration)
        return original(self, iteration)

    monkeypatch.setattr(DistillRun, "critic_train_and_score", critic_train_and_score)
    save = tmp_path / "run"
    with capture_digests() as digests:
        state = run_flow(tiny_teacher, save)
    assert state.is_completed(), state.message
    assert killed == [2]
    summary = state.result()
    assert summary["final_iteration"] == 2
    assert digests[-1] == ref_digests
    for role in ("actor", "critic"):
        assert weights_sha(save, role, 2) == weights_sha(ref_save, role, 2)
    assert summary["final_metrics"]["dmd2_loss"] == ref_summary["final_metrics"]["dmd2_loss"]
    retried = {t.name: t for t in read_task_runs(state.state_details.flow_run_id)}["critic-train-and-score-2"]
    assert retried.run_count == 2 and retried.state.is_completed()


def test_flow_on_s3_shows_presigned_media(harness, tiny_teacher, s3_bucket):
    """With save on S3: checkpoints, metrics.jsonl and media land in the bucket, and the summary
    embeds a thumbnail linked to a presigned URL a browser (here urllib) can open."""
    import urllib.request

    from dmd2_core import storage

    save = f"{s3_bucket}/runs/tiny"
    from flows.dmd2 import dmd2

    state = dmd2(recipe="tiny", overrides=dict(FAST), num_iterations=1, hf_checkpoint=tiny_teacher,
                 save=save, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    assert storage.read_text(f"{save}/latest_checkpointed_iteration.txt").strip() == "1"
    assert len(storage.read_text(f"{save}/metrics.jsonl").splitlines()) == 2
    assert summary["media_urls"][-1] == f"{save}/media/iter_0000001.png"
    text = read_artifacts(state.state_details.flow_run_id, summary["artifact_keys"]["summary"])[-1].data
    # the picture survives the presigned link's expiry: a thumbnail data URI, linked to the full file
    match = re.search(r"\[!\[[^\]]*\]\((data:image/png;base64,[^)]+)\)\]\((http[^)]+)\)", text)
    assert match, text[:2000]
    with urllib.request.urlopen(match.group(2), timeout=10) as resp:
        assert resp.read() == storage.read_bytes(summary["media_urls"][-1])


# ---- a served deployment against a real Prefect server -----------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, timeout: float, proc: subprocess.Popen, log: Path) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} not up after {timeout}s:\n{log.read_text()[-3000:]}")


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


@pytest.mark.server
def test_served_deployment_run(tiny_teacher, tmp_path):
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update({
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_API_URL": api,
        "PREFECT_UI_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_UI_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        "PYTHONUNBUFFERED": "1",
    })
    server_log, serve_log = tmp_path / "server.log", tmp_path / "serve.log"
    procs = []
    try:
        with open(server_log, "w") as out:
            procs.append(subprocess.Popen(
                [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        _wait_http(f"{api}/health", 90, procs[0], server_log)
        with open(serve_log, "w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "deployments.serve", "--only", "tiny"],
                env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        _wait_http(f"{api}/deployments/name/dmd2/tiny", 60, procs[1], serve_log)

        save = tmp_path / "run"
        params = {"overrides": {**FAST, "eval_interval": 2}, "num_iterations": 2,
                  "hf_checkpoint": tiny_teacher, "save": str(save)}
        result = subprocess.run(
            [str(BIN / "prefect"), "deployment", "run", "dmd2/tiny", "--watch", "--watch-timeout", "150",
             "--params", json.dumps(params)],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=180)
        output = result.stdout + result.stderr
        assert result.returncode == 0, output + serve_log.read_text()[-4000:]
        assert "Completed" in output, output
        assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
        lines = (save / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["iteration"] for line in lines] == [0, 1, 2]
    finally:
        for proc in reversed(procs):
            _stop(proc)
