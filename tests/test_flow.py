"""The dmd2 Prefect flow in Prefect's test harness: end to end on the tiny recipe, bad parameters,
an actor lost mid-run, media on S3. Against a real Prefect server: tests/test_served.py.

A tiny untrained teacher stands in for the digits teacher (the flow does not care how good it is).
One Ray instance and one Prefect test harness serve the whole session (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from dmd2_core.media.images import data_uri, image_grid, png_bytes, video_media
from dmd2_core.media.eval_files import media_url
from tests.helpers import FAST, assert_same_saved_state

BIN = Path(sys.executable).parent


# ---- fixtures ---------------------------------------------------------------------------------

@contextlib.contextmanager
def capture_digests():
    """Record every trainer's state_digest when a DistillRun shuts down (the final weights)."""
    from dmd2_core.run.distill_run import DistillRun

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


def read_task_runs(flow_run_id, settle_s: float = 1.5, timeout_s: float = 30.0) -> list:
    """The task runs of a flow run and of its window subflows, once the server has recorded them
    all: the server writes task runs from events in batches (flows.environment.LOCAL_SERVER_ENV), so read
    until every run is final and nothing changed for ``settle_s``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId

    def read(client) -> list:
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))
        ids = [flow_run_id] + [c.id for c in children]
        return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))

    def fingerprint(runs: list) -> set:
        return {(t.id, t.state_type, t.run_count) for t in runs}

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        runs = read(client)
        while True:
            time.sleep(settle_s)
            again = read(client)
            if fingerprint(again) == fingerprint(runs) and all(t.state and t.state.is_final() for t in again):
                return again
            if time.monotonic() > deadline:
                return again
            runs = again


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
    from dmd2_core.media.eval_files import save_png

    url = f"{s3_bucket}/media/iter_0000001.png"
    save_png(image_grid(torch.zeros(2, 1, 8, 8), nrow=2), url)
    link = media_url(url)
    assert link.startswith("http://") and "Signature" in link
    import urllib.request

    with urllib.request.urlopen(link, timeout=10) as resp:
        assert resp.read() == storage.read_bytes(url)


def test_retry_condition():
    from prefect.states import Failed

    from dmd2_core.errors import ArgsError
    from dmd2_core.errors import RayWorkError
    from dmd2_core.errors import ModelDirError
    from tasks.common import retry_runtime_failures

    assert retry_runtime_failures(None, None, Failed(data=RayWorkError("actor died")))
    assert retry_runtime_failures(None, None, Failed(data=RuntimeError("boom")))
    assert not retry_runtime_failures(None, None, Failed(data=ArgsError("unknown key 'lrr'")))
    assert not retry_runtime_failures(None, None, Failed(data=ModelDirError("/x: missing")))


# ---- the flow ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bad, expected", [
    ({"overrides": {**FAST, "lrr": 1e-3}}, ["'lrr'", "did you mean 'lr'"]),
    ({"hf_checkpoint": "/nonexistent/teacher"}, ["/nonexistent/teacher"]),
])
def test_bad_parameters_fail_before_any_actor(harness, tiny_teacher, tmp_path, monkeypatch, bad, expected):
    import ray

    from dmd2_core.run.distill_run import DistillRun
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
    # where the start's seconds went, in order (a slow start names its phase in the log line too)
    assert list(summary["startup_s"]) == ["ray", "lease", "placement group", "ranks up and models read", "resume"]
    assert all(s >= 0 for s in summary["startup_s"].values())
    assert set(summary["quality_before"]) == {"fd", "acc", "diversity"}
    assert set(summary["quality_after"]) == {"fd", "acc", "diversity"}

    lines = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in lines] == [0, 1, 2]
    assert "fd" in lines[0] and "dmd2_loss" not in lines[0]
    for row in lines[1:]:
        assert {"dmd2_loss", "critic_loss", "dmd2_grad_norm", "fd", "checkpoint_blocked_s", "checkpoint_save_s"} <= set(row)
    assert summary["final_metrics"]["dmd2_loss"] == lines[-1]["dmd2_loss"]
    for i in range(3):
        assert (save / "media" / f"iter_{i:07d}.png").is_file()

    keys = summary["artifact_keys"]
    name = f"dmd2-tiny-{datetime.datetime.now(datetime.timezone.utc).date()}-{str(run_id).replace('-', '')[:8]}"
    assert keys == {"summary": f"{name}-summary", "metrics": f"{name}-metrics", "progress": f"{name}-progress"}
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
    assert "iter_0000002.png" in text and "exports/iter_0000002" in text
    best = json.loads((save / "best_student.json").read_text())  # the best trained eval's student, exported, kept
    assert best["criterion"] == "fd" and best["iteration"] in (1, 2) and summary["best_student"] == best["export_url"]
    assert (Path(best["export_url"]) / "export.json").is_file()
    assert f"**the run's student** (the campaign's best eval, iteration {best['iteration']}; kept by retention)" in text
    assert "| dmd2_guidance_scale | 1.5 | 1.5 |" in text and "| loss_type | `dmd2_critic` | `dmd2` |" in text
    assert read_flow_run(run_id).name == name
    names = {t.name: t for t in read_task_runs(run_id)}
    for name in ("rollout-1", "critic-train-and-score-1", "sleep-critic-1", "student-train-1",
                 "sleep-actor-1", "eval-0", "eval-2", "checkpoint-2"):
        assert names[name].state.is_completed(), name


def test_actor_killed_mid_run_recovers_to_same_weights(reference, tiny_teacher, tmp_path, monkeypatch):
    """The critic's actor dies at iteration 2: the task fails with RayWorkError, its retry rebuilds
    the groups from checkpoint 1 and replays; the final weights equal the uninterrupted run's."""
    import ray

    from dmd2_core.run.distill_run import DistillRun

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
    assert_same_saved_state(save, ref_save, 2)
    assert summary["final_metrics"]["dmd2_loss"] == ref_summary["final_metrics"]["dmd2_loss"]
    retried = {t.name: t for t in read_task_runs(state.state_details.flow_run_id)}["critic-train-and-score-2"]
    assert retried.run_count == 2 and retried.state.is_completed()


def test_flow_on_s3_shows_presigned_media(harness, tiny_teacher, s3_bucket):
    """With save on S3: checkpoints, metrics.jsonl and media land in the bucket, and the summary
    embeds a thumbnail linked to a presigned URL a browser (here urllib) can open. The student
    serves two step counts: each has its eval figures, media and summary rows, and the export's
    scheduler gives both."""
    import urllib.request

    from dmd2_core import storage
    from dmd2_core.export.scheduler import verify_written_scheduler

    save = f"{s3_bucket}/runs/tiny"
    from flows.dmd2 import dmd2

    state = dmd2(recipe="tiny", overrides=dict(FAST, dmd2_student_steps=[1, 2], dmd2_student_sampler="euler"),
                 num_iterations=1, hf_checkpoint=tiny_teacher, save=save, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    assert storage.read_text(f"{save}/latest_checkpointed_iteration.txt").strip() == "1"
    rows = [json.loads(line) for line in storage.read_text(f"{save}/metrics.jsonl").splitlines()]
    assert len(rows) == 2 and rows[1]["fd"] == pytest.approx((rows[1]["fd@1"] + rows[1]["fd@2"]) / 2)
    assert rows[1]["student_steps"] in (1, 2)
    assert summary["media_urls"][-2:] == [f"{save}/media/iter_0000001_k1.png", f"{save}/media/iter_0000001_k2.png"]
    verify_written_scheduler(f"{save}/exports/iter_0000001", [1, 2], json.loads(
        storage.read_text(f"{save}/exports/iter_0000001/export.json"))["shift"])
    text = read_artifacts(state.state_details.flow_run_id, summary["artifact_keys"]["summary"])[-1].data
    assert "Quality at 1 steps before -> after" in text and "Quality at 2 steps before -> after" in text
    # the picture survives the presigned link's expiry: a thumbnail data URI, and the full file's
    # link on its own line below it (an image inside a link shows as text in the default UI)
    match = re.search(r"\n!\[[^\]]*\]\((data:image/png;base64,[^)]+)\)\n(?:.*\n)*?\[full size\]\((http[^)]+)\)", text)
    assert match, text[:2000]
    linked = [url for url in summary["media_urls"][-2:] if url.rsplit("/", 1)[1] in match.group(2)]
    assert len(linked) == 1, match.group(2)  # the first grid shown: the 1-step student's
    with urllib.request.urlopen(match.group(2), timeout=10) as resp:
        assert resp.read() == storage.read_bytes(linked[0])
        assert resp.headers["Content-Type"] == "image/png"  # shown by a browser, not downloaded
