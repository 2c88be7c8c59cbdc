"""`python -m dmd2_core export`: any checkpoint of a run, after the fact, in each format; each
loads in its consumer and computes what the student the checkpoint holds computes; s3; refusals
before any weight is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dmd2_core import checkpoint as ckpt
from dmd2_core import storage
from dmd2_core.args import load_args
from dmd2_core.cli import main
from dmd2_core.models import base_identity, load_model_dir, lora
from dmd2_core.toys.standins import build_h3_standin, build_standin, standin_prompt_set

WAN_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2", "proj_out"]
H3_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]


@pytest.fixture(scope="module")
def wan_teacher(tmp_path_factory) -> str:
    return build_standin(str(tmp_path_factory.mktemp("wan") / "teacher"), "wan", with_text_encoder=True)


def _moved(model: torch.nn.Module, names, seed: int, scale: float = 0.05) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    return [params[n].detach() + scale * torch.randn(params[n].shape, generator=g) for n in names]


def save_student(teacher: str, save: str, iteration: int, targets=None, ema: bool = True) -> torch.nn.Module:
    """A student checkpoint as a run writes it (the actor's model, EMA and run record), its
    weights moved off the teacher's; returns the student the export must reproduce (its EMA)."""
    model = load_model_dir(teacher).model
    record = {"load": None, "hf_checkpoint": teacher, "lora": None, "base": None,
              "student": {"num_steps": 4, "shift": 5.0, "export_dtype": "float32"}}
    if targets:
        args = load_args(None, dict(hf_checkpoint=teacher, prompts="digits", save=save, lora_rank=4, lora_alpha=8.0,
                                    lora_target_modules=targets))
        model = lora.attach(model, args)
        record.update(lora=lora.adapter_record(args), base=base_identity(teacher))
    names = [n for n, _ in lora.trained(model)]
    with torch.no_grad():
        for p, moved in zip([p for _, p in lora.trained(model)], _moved(model, names, seed=1)):
            p.copy_(moved)
    averaged = _moved(model, names, seed=2) if ema else None
    ckpt.save_trainer(save, "actor", iteration, model, None, ema=averaged, extra={"run": record}).result()
    if averaged is not None:
        with torch.no_grad():
            for (_, p), value in zip(lora.trained(model), averaged):
                p.copy_(value)
    return model.eval()


def export(*argv) -> dict:
    return json.loads(_run(*argv))


def _run(*argv) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["export", *argv]) == 0
    return out.getvalue()


def wan_forward(model, seed: int = 3) -> torch.Tensor:
    from dmd2_core.models import FAMILIES

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 3, 8, 8, generator=g)
    cond = standin_prompt_set("wan", num_prompts=2).cond(torch.tensor([0, 1]))
    with torch.no_grad():
        return FAMILIES["WanTransformer3DModel"].predict_velocity(model, x, torch.tensor([0.3, 0.8]), cond)


def assert_same_adapted_layers(student, loaded, prefix: str = "") -> None:
    """Every adapted layer of ``student`` and the same layer of ``loaded`` give the same output."""
    from peft.tuners.lora import LoraLayer

    modules = dict(loaded.named_modules())
    layers = [(n, m) for n, m in student.named_modules() if isinstance(m, LoraLayer)]
    assert layers
    for name, layer in layers:
        x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(modules[prefix + name](x), layer(x), atol=1e-5, rtol=1e-5, msg=name)


# ---- each format in its consumer ------------------------------------------------------------------

def test_pipeline_of_a_full_checkpoint_is_a_wan_pipeline_with_the_ema_student(wan_teacher, tmp_path, monkeypatch):
    from diffusers import DiffusionPipeline, WanPipeline

    from dmd2_core.checkpoint.tensors import CheckpointTensors

    save = str(tmp_path / "run")
    save_student(wan_teacher, save, 3)
    student = save_student(wan_teacher, save, 5)
    out = str(tmp_path / "export")
    reads, read = [], CheckpointTensors.__getitem__
    monkeypatch.setattr(CheckpointTensors, "__getitem__", lambda self, name: reads.append(name) or read(self, name))
    done = export("--load", save, "--out", out, "--format", "pipeline")
    # streamed: each tensor read once per file it goes to (transformer/: the EMA, transformer_online/)
    assert len(reads) == 2 * len(student.state_dict())
    assert done["iteration"] == 5 and done["format"] == "pipeline"  # the newest complete checkpoint
    pipe = DiffusionPipeline.from_pretrained(out)
    assert isinstance(pipe, WanPipeline) and type(pipe.scheduler).__name__ == "FlowMatchLCMScheduler"
    torch.testing.assert_close(wan_forward(pipe.transformer), wan_forward(student), atol=1e-5, rtol=0)
    assert (Path(out) / "transformer_online").is_dir()  # as the run writes it: the trained weights beside
    marker = json.loads((Path(out) / "export.json").read_text())
    assert marker["iteration"] == 5 and marker["num_steps"] == 4 and marker["shift"] == 5.0


@pytest.fixture(scope="module")
def wan_lora_run(wan_teacher, tmp_path_factory):
    save = str(tmp_path_factory.mktemp("lora") / "run")
    return save, save_student(wan_teacher, save, 2, targets=WAN_TARGETS)


def test_merged_is_the_student_transformer(wan_teacher, wan_lora_run, tmp_path):
    from diffusers import WanTransformer3DModel

    save, student = wan_lora_run
    out = str(tmp_path / "merged")
    export("--load", save, "--out", out, "--format", "merged", "--dtype", "bfloat16")
    merged = WanTransformer3DModel.from_pretrained(out, torch_dtype=torch.float32)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    from safetensors import safe_open

    with safe_open(str(Path(out) / "diffusion_pytorch_model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    ours, theirs = wan_forward(student), wan_forward(merged)
    assert (ours - theirs).abs().max() < 2e-2 * ours.abs().max()  # bf16 weights
    assert (ours - wan_forward(load_model_dir(wan_teacher).model)).abs().max() > 0.1 * ours.abs().max()


@pytest.mark.parametrize("layout", ["lora-diffusers", "original"])
def test_diffusers_loader_takes_the_lora_layouts(wan_teacher, wan_lora_run, tmp_path, layout):
    from diffusers import WanPipeline

    save, student = wan_lora_run
    out = str(tmp_path / layout)
    export("--load", save, "--out", out, "--format", layout)
    # what pipe.load_lora_weights(out) reads (converted from the original layout) and loads
    state, metadata = WanPipeline.lora_state_dict(out, return_lora_metadata=True)
    keys = list(load_safetensors_keys(Path(out) / "pytorch_lora_weights.safetensors"))
    if layout == "original":
        assert all(k.startswith("diffusion_model.") for k in keys) and \
            "diffusion_model.blocks.0.self_attn.q.lora_A.weight" in keys
    else:
        assert all(k.startswith("transformer.") for k in keys)
    base = load_model_dir(wan_teacher).model
    WanPipeline.load_lora_into_transformer(state, transformer=base, metadata=metadata)
    assert_same_adapted_layers(student, base)
    torch.testing.assert_close(wan_forward(base), wan_forward(student), atol=1e-5, rtol=1e-5)


def load_safetensors_keys(path: Path):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def test_peft_adapter_directory_loads_with_peft(wan_teacher, wan_lora_run, tmp_path):
    from peft import PeftModel

    save, student = wan_lora_run
    out = str(tmp_path / "peft")
    export("--load", save, "--out", out, "--format", "peft")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in Path(out).iterdir()}
    wrapped = PeftModel.from_pretrained(load_model_dir(wan_teacher).model, out)
    assert_same_adapted_layers(student, wrapped, prefix="base_model.model.")
    torch.testing.assert_close(wan_forward(wrapped.base_model.model), wan_forward(student), atol=1e-5, rtol=1e-5)


def test_h3_original_layout_fuses_qkv_and_round_trips_through_its_loader(tmp_path):
    """MiniMax-H3's original attention is one fused qkv_proj: its three adapters become one that
    diffusers' own conversion splits back to the student's."""
    from diffusers.loaders import MiniMaxH3LoraLoaderMixin

    teacher = build_h3_standin(str(tmp_path / "h3"))
    save = str(tmp_path / "run")
    student = save_student(teacher, save, 1, targets=H3_TARGETS, ema=False)
    out = str(tmp_path / "original")
    export("--load", save, "--out", out, "--format", "original")
    keys = load_safetensors_keys(Path(out) / "pytorch_lora_weights.safetensors")
    assert "diffusion_model.blocks.0.attn.qkv_proj.lora_A.weight" in keys and not any("to_q" in k for k in keys)
    state = MiniMaxH3LoraLoaderMixin.lora_state_dict(out)
    base = load_model_dir(teacher).model
    MiniMaxH3LoraLoaderMixin.load_lora_into_transformer(state, transformer=base)
    assert_same_adapted_layers(student, base)

    from diffusers import MiniMaxH3Transformer3DModel

    repository = str(tmp_path / "repository")  # its modular repository, the student merged in
    export("--load", save, "--out", repository, "--format", "pipeline")
    assert (Path(repository) / "modular_model_index.json").is_file() and (Path(repository) / "audio_vae").is_dir()
    assert_same_adapted_layers(student, MiniMaxH3Transformer3DModel.from_pretrained(repository, subfolder="transformer"))


# ---- object storage, the run's own export ------------------------------------------------------------

def test_s3_checkpoint_to_an_s3_export_swapped_over_the_previous(wan_teacher, s3_bucket, tmp_path):
    from diffusers import WanTransformer3DModel

    save, out = f"{s3_bucket}/run", f"{s3_bucket}/exports/merged"
    student = save_student(wan_teacher, save, 4)
    export("--load", save, "--out", out, "--format", "merged")
    assert not [p for p in storage.list_names(f"{s3_bucket}/exports") if ".staging-" in p]
    with storage.local_copy(out) as local:
        torch.testing.assert_close(wan_forward(WanTransformer3DModel.from_pretrained(str(local))), wan_forward(student),
                                   atol=1e-5, rtol=0)
    export("--load", save, "--out", out, "--format", "merged", "--iteration", "4")  # over an export: swapped


def _same_tensors(ours: str, theirs: str) -> None:
    """The safetensors file, or transformer directory, at ``ours`` holds ``theirs``'s tensors exactly."""
    from dmd2_core.models.weight_files import WeightFiles, file_tensors

    def open_files(url: str) -> WeightFiles:
        return WeightFiles.of_file(url, file_tensors(url)[0]) if url.endswith(".safetensors") else WeightFiles(url)

    a, b = open_files(ours), open_files(theirs)
    assert set(a.tensors) == set(b.tensors)
    for name in a.tensors:
        rows = a.shape(name)[0] if a.shape(name) else 1
        assert torch.equal(next(a.read_rows([(name, 0, rows)]))[3], next(b.read_rows([(name, 0, rows)]))[3]), name


@pytest.mark.parametrize("student", ["full", "lora"])
def test_after_the_fact_equals_the_runs_own_export(tiny_teacher, tmp_path, student):
    """A trainer's save with export=True and a later export of the same checkpoint hold the same
    student, with the sampler (steps, shift) the checkpoint recorded."""
    from dmd2_core.run.distill_run import preflight
    from dmd2_core.train.trainer import Trainer
    from tests.helpers import tiny_args

    adapters = dict(lora_rank=4, lora_alpha=8.0) if student == "lora" else {}
    args = tiny_args(tiny_teacher, str(tmp_path / "run"), loss_type="flow_matching", ema_decay=0.5,
                     dmd2_student_steps=2, dmd2_shift=2.0, **adapters)
    actor = Trainer(preflight(args)["actor"], "actor")
    actor.train(1, actor.rollout(1)[0])
    run_export = actor.save(1, export=True)["export_url"]
    out = str(tmp_path / "later")
    export("--load", args.save, "--out", out, "--format", "lora-diffusers" if adapters else "pipeline")
    parts = (["pytorch_lora_weights.safetensors", "pytorch_lora_weights_online.safetensors"] if adapters
             else ["transformer", "transformer_online"])
    for part in parts:
        _same_tensors(f"{out}/{part}", f"{run_export}/{part}")
    for file in ("scheduler/scheduler_config.json",) + (() if adapters else ("model_index.json",)):
        assert (Path(out) / file).read_text() == (Path(run_export) / file).read_text()


# ---- refusals ---------------------------------------------------------------------------------------

@pytest.fixture
def no_weights_read(monkeypatch):
    """Any read of a checkpoint's or a model directory's tensors fails the test."""
    from dmd2_core.checkpoint.tensors import CheckpointTensors
    from dmd2_core.models.weight_files import WeightFiles

    def refuse(*a, **k):
        raise AssertionError("a weight was read before the refusal")

    monkeypatch.setattr(CheckpointTensors, "__getitem__", refuse)
    monkeypatch.setattr(WeightFiles, "read_rows", refuse)


def refusal(capsys, *argv) -> str:
    assert main(["export", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_refusals_are_one_line_before_any_weight(wan_teacher, wan_lora_run, tmp_path, capsys, no_weights_read):
    save, _ = wan_lora_run
    full = str(tmp_path / "full")
    for i in (10, 20, 40):
        save_student(wan_teacher, full, i, ema=False)
    out = str(tmp_path / "out")
    err = refusal(capsys, "--load", save, "--out", out, "--format", "lora-diffuser")
    assert "did you mean 'lora-diffusers'" in err
    err = refusal(capsys, "--load", full, "--out", out, "--format", "peft")
    assert "peft is a LoRA format" in err and "full weights" in err
    err = refusal(capsys, "--load", full, "--out", out, "--format", "pipeline", "--iteration", "30")
    assert err.startswith("error: iteration: ") and "no complete checkpoint at iteration 30" in err
    assert "nearest: 20, 40" in err
    err = refusal(capsys, "--load", str(tmp_path / "ful"), "--out", out, "--format", "pipeline")
    assert err == (f"error: load: no complete checkpoint of the student at {tmp_path / 'ful'} (no such path); "
                   f"did you mean '{full}'?\n")
    err = refusal(capsys, "--load", full, "--out", out, "--format", "pipeline", "--hf-checkpoint", wan_teacher + "x")
    assert err == f"error: hf_checkpoint: {wan_teacher}x: no such checkpoint; did you mean '{wan_teacher}'?\n"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    err = refusal(capsys, "--load", full, "--out", str(tmp_path / "mine"), "--format", "merged")
    assert "is not an export" in err and (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    err = refusal(capsys, "--load", save, "--out", out, "--set", "format=pipline")
    assert "did you mean 'pipeline'" in err
    err = refusal(capsys, "--load", save, "--out", out, "--format", "pipeline", "--num-steps", "0")
    assert "num_steps" in err
    assert not Path(out).exists()


def test_original_is_refused_for_a_family_without_a_documented_conversion(tmp_path, capsys, no_weights_read):
    teacher = build_standin(str(tmp_path / "sd3"), "sd3")
    save = str(tmp_path / "run")
    save_student(teacher, save, 1, targets=["to_q", "to_v"], ema=False)
    err = refusal(capsys, "--load", save, "--out", str(tmp_path / "out"), "--format", "original")
    assert "no original (non-diffusers) LoRA layout for SD3Transformer2DModel" in err and "use lora-diffusers or peft" in err


def test_an_out_in_the_saves_checkpoints_or_its_own_exports_is_refused(wan_teacher, tmp_path, capsys,
                                                                        no_weights_read):
    """Retention deletes and replaces what is in the save's checkpoints and its exports: an export
    written there would be lost, or would take a checkpoint's place; a symlink is judged by where
    it points."""
    save = str(tmp_path / "run")
    save_student(wan_teacher, save, 10, ema=False)
    before = sorted(str(p) for p in Path(save).rglob("*"))
    link = tmp_path / "link"
    link.symlink_to(ckpt.trainer_dir(save, "actor", 10), target_is_directory=True)
    for out in (f"{ckpt.trainer_dir(save, 'actor', 10)}/merged", ckpt.export_url(save, 10), f"{save}/exports/mine",
                str(link)):
        err = refusal(capsys, "--load", save, "--out", out, "--format", "merged")
        assert err.startswith(f"error: out: {out}") and "is inside" in err, err
        assert ("the save's checkpoints" if "trainers" in err else "the run's own exports") in err
    assert sorted(str(p) for p in Path(save).rglob("*")) == before  # nothing written


def test_a_symlinked_out_is_swapped_where_it_points(wan_teacher, tmp_path):
    save = str(tmp_path / "run")
    save_student(wan_teacher, save, 4, ema=False)
    real = tmp_path / "shared" / "merged"
    real.mkdir(parents=True)
    link = tmp_path / "merged"
    link.symlink_to(real, target_is_directory=True)
    export("--load", save, "--out", str(link), "--format", "merged")
    first = (real / "export.json").read_text()
    export("--load", save, "--out", str(link), "--format", "merged", "--dtype", "bfloat16")  # swapped where it points
    assert link.is_symlink() and link.resolve() == real
    assert json.loads((link / "export.json").read_text())["dtype"] == "bfloat16" != json.loads(first)["dtype"]
    assert sorted(p.name for p in real.parent.iterdir()) == ["merged"]  # no staging, nothing set aside
