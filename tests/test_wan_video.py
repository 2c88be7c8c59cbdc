"""The 4-step video recipe (wan-video, minimax-h3's setup for CFG teachers) end to end on small
stand-ins of the real model classes (SD3 MMDiT image, Wan video), with VAE-decoded eval media, DMD2
metrics and a diffusers-loadable exported student."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from PIL import Image

from dmd2_core.args import load_args
from dmd2_core.errors import ArgsError
from dmd2_core.run.distill_run import DistillRun
from dmd2_core.models import describe_model_dir
from dmd2_core.toys.standins import build_standin, standin_prompt_set
from tests.helpers import CPU_OVERRIDES

SAMPLER_DOC = Path(__file__).resolve().parent.parent / "docs" / "scale.md"


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    root = tmp_path_factory.mktemp("standins")
    out = {}
    for kind in ("sd3", "wan"):
        url = build_standin(str(root / kind), kind)
        prompts = str(root / f"{kind}-prompts.safetensors")
        standin_prompt_set(kind).save(prompts)
        out[kind] = (url, prompts)
    return out


def test_the_family_comes_from_the_checkpoint(standins):
    assert describe_model_dir(standins["sd3"][0])["family"] == "SD3Transformer2DModel"
    wan = describe_model_dir(standins["wan"][0])
    assert wan["family"] == "WanTransformer3DModel" and wan["vae_url"].endswith("/vae") and wan["shift"] == 5.0


def test_recipe_requires_checkpoint_prompts_and_save(tmp_path):
    args = load_args("minimax-h3")
    assert (args.dmd2_student_steps, args.loss_type, args.colocate) == (4, "dmd2", True)
    with pytest.raises(ArgsError, match="hf_checkpoint is not set"):
        DistillRun(args)
    with pytest.raises(ArgsError, match="prompts is not set"):
        DistillRun(load_args("minimax-h3", {"hf_checkpoint": "x"}))


def test_a_video_model_needs_its_latent_shape_before_any_actor(standins, tmp_path):
    url, prompts = standins["wan"]
    with pytest.raises(ArgsError, match=r"latent_shape: .* is a video model \(WanTransformer3DModel\)"):
        DistillRun(load_args("wan-video", dict(CPU_OVERRIDES, hf_checkpoint=url, prompts=prompts, save=str(tmp_path))))


@pytest.mark.parametrize("kind", ["sd3", "wan"])
def test_wan_video_recipe_two_iterations_on_a_stand_in(prefect_harness, ray_session, standins, tmp_path, kind):
    from prefect.client.orchestration import get_client

    from flows.dmd2 import dmd2

    url, prompts = standins[kind]
    save = tmp_path / "run"
    overrides = dict(CPU_OVERRIDES, run_name=f"h3-{kind}")
    if kind == "wan":
        overrides["latent_shape"] = [4, 3, 8, 8]
    summary = dmd2(recipe="wan-video", overrides=overrides, hf_checkpoint=url, prompts=prompts, save=str(save))
    assert summary["final_iteration"] == 2

    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["iteration"] >= 1]
    for key in ("dmd2_loss", "dmd2_grad_norm", "dmd2_real_fake_gap", "stop_step", "rollout_sigma",
                "actor_grad_norm", "critic_grad_norm", "graded_x0_drift", "critic_train_s", "actor_train_s",
                "critic_sleep_s", "actor_sleep_s", "critic_device_bytes_awake", "actor_bytes_freed",
                "critic_sigma_mean", "rollout_s", "iteration_s"):
        assert all(key in r for r in trained), key
    # both groups slept after their train in iteration 1 (the actor again after its eval), so
    # iteration 2 woke them
    assert trained[-1]["critic_wake_s"] > 0 and trained[-1]["actor_wake_s"] > 0
    assert all(r["graded_x0_drift"] < 1e-4 for r in trained)
    # the teacher evaluator (the stand-ins' prompts name no toy world): every eval in the teacher's features
    modality = "image" if kind == "sd3" else "video"
    evals = [r for r in rows if "teacher_kid" in r]
    assert [r["iteration"] for r in evals] == [0, 1, 2]
    for key in (f"teacher_kid_{modality}", f"drift_brightness_{modality}", f"diversity_{modality}", "drift_out"):
        assert all(isinstance(r[key], float) for r in evals), key
    if kind == "wan":
        assert all(0 <= r["drift_flicker_video"] <= 1 for r in evals)

    media = sorted((save / "media").rglob("*.*"))
    assert media, "eval media were written"
    if kind == "sd3":
        grid = Image.open(media[-1])
        # 2 prompts x 2 samples of 16x16 decoded images, upscaled per cell
        assert grid.format == "PNG" and grid.size[0] >= 2 * 16 and grid.size[1] >= 2 * 16
    else:
        gifs = [m for m in media if m.suffix == ".gif"]
        assert len(gifs) >= 2  # one animation per eval prompt
        gif = Image.open(gifs[-1])
        assert gif.format == "GIF" and gif.n_frames == 5  # 3 latent frames -> 5 decoded by the Wan VAE

    import asyncio

    async def read_keys():
        async with get_client() as client:
            return [a.key for a in await client.read_artifacts()]

    keys = set(asyncio.run(read_keys()))
    # artifact keys derive from this run's own name (run name, date, run id): a history of its own
    own = summary["artifact_keys"]
    assert own["summary"].startswith(f"dmd2-h3-{kind}-") and {own["summary"], own["metrics"]} <= keys
    assert all(re.fullmatch(r"[a-z0-9-]+", k) for k in keys if k)


def _documented_sampler():
    blocks = [c for c in re.findall(r"```python\n(.*?)```", SAMPLER_DOC.read_text(), re.S) if "def sample" in c]
    assert len(blocks) == 1, f"{SAMPLER_DOC} should hold exactly one python block defining sample(), found {len(blocks)}"
    return blocks[0]


def test_exported_student_loads_with_diffusers_and_reproduces_the_sampler(ray_session, tiny_teacher, tmp_path):
    """The documented 4-step snippet (docs/scale.md), run on a saved student, gives the project's own samples."""
    from tests.helpers import tiny_args

    save = str(tmp_path / "run")
    with DistillRun(tiny_args(tiny_teacher, save, run_name="dmd2-export")) as run:
        run.iterate(1)
        run.checkpoint(1)
        ours = run.sample([0, 1, 2], seed=11)
    code = _documented_sampler().replace('"runs/tiny/exports/iter_0000200"', repr(f"{save}/exports/iter_0000001"))
    namespace: dict = {}
    exec(compile(code, str(SAMPLER_DOC), "exec"), namespace)
    from dmd2_core.toys.digits import digits_prompt_set

    cond = digits_prompt_set().cond(torch.tensor([0, 1, 2]))
    theirs = namespace["sample"](cond["prompt_embeds"], cond["pooled_prompt_embeds"], 11, (3, 1, 8, 8))
    torch.testing.assert_close(theirs.clamp(-1, 1), ours, atol=1e-5, rtol=0)
    assert type(namespace["scheduler"]).__name__ == "FlowMatchLCMScheduler"


def test_prepare_prompts_uses_the_pipelines_own_text_encoder(tmp_path):
    import subprocess
    import sys

    from diffusers import WanPipeline

    from dmd2_core.data import load_prompt_set
    from dmd2_core.train.trainer import Trainer
    from dmd2_core.run.distill_run import preflight

    url = build_standin(str(tmp_path / "wan"), "wan", with_text_encoder=True)
    listing = tmp_path / "prompts.txt"
    listing.write_text("a red cat running\n\na dog on the moon\n")
    out = tmp_path / "prompts.safetensors"
    cmd = [sys.executable, "-m", "dmd2_core", "prepare-prompts", "--hf-checkpoint", url,
           "--prompts-file", str(listing), "--out", str(out), "--max-sequence-length", "8"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    prompts = load_prompt_set(str(out))
    assert prompts.prompts == ["a red cat running", "a dog on the moon"]
    pipe = WanPipeline.from_pretrained(url, transformer=None, vae=None)
    expected, negative = pipe.encode_prompt(prompt=prompts.prompts, negative_prompt="", max_sequence_length=8)
    torch.testing.assert_close(prompts.embeds["prompt_embeds"], expected)
    torch.testing.assert_close(prompts.negative["prompt_embeds"], negative[:1])
    # the set trains as it is: a rollout on the Wan stand-in with these conditions
    args = load_args("wan-video", dict(CPU_OVERRIDES, hf_checkpoint=url, prompts=str(out), save=str(tmp_path / "run"),
                                        latent_shape=[4, 3, 8, 8]))
    pairs, _ = Trainer(preflight(args)["actor"], "actor").rollout(1)
    assert pairs["x_t"].shape == (4, 4, 3, 8, 8)
    # a checkpoint without a text encoder is a clear error naming it
    bare = build_standin(str(tmp_path / "bare"), "wan")
    failed = subprocess.run([*cmd[:5], bare, *cmd[6:]], capture_output=True, text=True, timeout=180)
    assert failed.returncode == 2 and f"{bare}: the checkpoint has no text_encoder" in failed.stderr
