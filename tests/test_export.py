"""The student export (dmd2_core/export/pipeline.py): a diffusers directory that loads with diffusers alone
and reproduces the project's own samples."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch

from dmd2_core import storage
from dmd2_core.train import dmd2_iteration
from dmd2_core import flow_matching as fm
from dmd2_core.checkpoint import export_url, exports_root
from dmd2_core.export.retention import latest_exports, prune_exports
from dmd2_core.export.files import swap_record_url
from dmd2_core.export.pipeline import export_student
from dmd2_core.export.scheduler import scheduler_sigmas, student_scheduler_config
from dmd2_core.models import describe_model_dir, load_model_dir
from dmd2_core.errors import ModelDirError
from dmd2_core.toys.standins import build_standin, standin_prompt_set

WAN_SHIFT = 5.0  # the Wan stand-in's scheduler shift
WAN_LATENTS = (4, 3, 8, 8)  # [C, F, H, W]: 9 frames of 64x64 pixels for WanPipeline (VAE factors 4, 8)
PROMPTS = ["a red cat running", "a blue bird in the video"]


@pytest.fixture(scope="module")
def wan_teacher(tmp_path_factory) -> str:
    return build_standin(str(tmp_path_factory.mktemp("wan") / "teacher"), "wan", with_text_encoder=True)


def perturbed_student(teacher: str, seed: int = 1, scale: float = 0.05):
    """The teacher's transformer with every weight moved (a student that differs from it)."""
    loaded = load_model_dir(teacher)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in loaded.model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return loaded


def with_weights(model, tensors):
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p, t in zip(twin.parameters(), tensors):
            p.copy_(t)
    return twin


def assert_same_weights(model, reference):
    got, want = model.state_dict(), reference.state_dict()
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key].to(got[key].dtype)), key


def test_scheduler_config_gives_the_student_sigmas_through_set_timesteps():
    from diffusers import FlowMatchLCMScheduler

    for shift in (0.5, 1.0, 3.0, 5.0, 12.0):
        for k in (1, 2, 4, 8):
            config = student_scheduler_config(shift, k)
            torch.testing.assert_close(torch.tensor(scheduler_sigmas(config, k)),
                                       torch.tensor(fm.student_sigmas(k, shift)), atol=3e-7, rtol=0)
    # why a solved config: the training shift alone shifts the grid twice
    plain = FlowMatchLCMScheduler(shift=WAN_SHIFT)
    plain.set_timesteps(4)
    assert abs(float(plain.sigmas[3]) - fm.student_sigmas(4, WAN_SHIFT)[3]) > 0.5
    assert student_scheduler_config(WAN_SHIFT, 1) == {"num_train_timesteps": 1000, "shift": WAN_SHIFT}


def test_wan_export_is_a_wan_pipeline_that_reproduces_eval_samples(wan_teacher, tmp_path):
    from diffusers import DiffusionPipeline, WanPipeline, WanTransformer3DModel

    loaded = perturbed_student(wan_teacher)
    model = loaded.model
    ema = [p.detach() + 0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2))
           for p in model.parameters()]
    url = str(tmp_path / "export")
    out = export_student(url, model, teacher_url=wan_teacher, shift=WAN_SHIFT, num_steps=4,
                         export_dtype=torch.float32, ema=ema, iteration=12)
    assert out["url"] == url and out["pipeline"] is True and out["bytes"] > 0 and out["verify_s"] > 0

    # the layout: the teacher's other components are byte copies; the index is the teacher's
    root = Path(url)
    for component in ("vae", "text_encoder", "tokenizer"):
        for file in (Path(wan_teacher) / component).iterdir():
            assert (root / component / file.name).read_bytes() == file.read_bytes()
    index = json.loads((root / "model_index.json").read_text())
    teacher_index = json.loads((Path(wan_teacher) / "model_index.json").read_text())
    assert index == {**teacher_index, "scheduler": ["diffusers", "FlowMatchLCMScheduler"]}
    marker = json.loads((root / "export.json").read_text())
    assert marker["iteration"] == 12 and marker["num_steps"] == 4 and marker["shift"] == WAN_SHIFT
    assert marker["dtype"] == "float32" and marker["transformer"] == "ema"
    assert marker["transformer_online"] == "transformer_online"
    assert describe_model_dir(url)["shift"] == WAN_SHIFT  # the training shift, not the solved one

    # transformer/ is the EMA, transformer_online/ the trained weights
    ema_model = with_weights(model, ema)
    assert_same_weights(WanTransformer3DModel.from_pretrained(url, subfolder="transformer"), ema_model)
    assert_same_weights(WanTransformer3DModel.from_pretrained(url, subfolder="transformer_online"), model)

    # the whole pipeline, with the student inside, reproduces the project's sampler
    pipe = DiffusionPipeline.from_pretrained(url)
    assert isinstance(pipe, WanPipeline) and type(pipe.scheduler).__name__ == "FlowMatchLCMScheduler"
    embeds, _ = pipe.encode_prompt(prompt=PROMPTS, do_classifier_free_guidance=False, max_sequence_length=8,
                                   device="cpu")
    seed, shape = 11, (len(PROMPTS), *WAN_LATENTS)
    ours = dmd2_iteration.eval_samples(loaded.family, ema_model, {"prompt_embeds": embeds}, shape, seed, 4, WAN_SHIFT)
    call = dict(prompt=PROMPTS, num_inference_steps=4, guidance_scale=1.0, output_type="latent",
                height=64, width=64, num_frames=9, max_sequence_length=8)
    torch.manual_seed(seed)  # WanPipeline's steps draw from the global RNG (see export/pipeline.py)
    theirs = pipe(**call).frames
    assert theirs.shape == shape
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    # a generator alone seeds the initial latents only: the re-noising of steps 1..K-1 differs
    seeded = pipe(**call, generator=torch.Generator().manual_seed(seed)).frames
    assert (seeded - ours).abs().max() > 0.1, "WanPipeline now passes the generator to step(): update export/pipeline.py"


def test_bf16_export_without_ema_and_non_writer_ranks(wan_teacher, tmp_path):
    from diffusers import WanTransformer3DModel
    from safetensors import safe_open

    model = perturbed_student(wan_teacher).model
    url = str(tmp_path / "bf16")
    assert export_student(str(tmp_path / "other"), model, teacher_url=wan_teacher, shift=WAN_SHIFT, num_steps=2,
                          export_dtype=torch.bfloat16, writer=False) is None
    assert not (tmp_path / "other").exists()
    export_student(url, model, teacher_url=wan_teacher, shift=WAN_SHIFT, num_steps=2, export_dtype=torch.bfloat16)
    assert not (Path(url) / "transformer_online").exists()
    marker = json.loads((Path(url) / "export.json").read_text())
    assert marker["transformer"] == "online" and marker["dtype"] == "bfloat16" and marker["iteration"] is None
    files = list((Path(url) / "transformer").glob("*.safetensors"))
    with safe_open(str(files[0]), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
        assert "rope.freqs_cos" not in set(f.keys())  # non-persistent buffers stay out
    reloaded = WanTransformer3DModel.from_pretrained(url, subfolder="transformer", torch_dtype=torch.bfloat16)
    assert_same_weights(reloaded, copy.deepcopy(model).to(torch.bfloat16))
    (Path(url) / "export.json").write_text("{")  # a broken marker is one line naming it
    with pytest.raises(ModelDirError, match=re.escape(f"{url}/export.json: unreadable export marker")):
        describe_model_dir(url)


def test_sharded_student_exports_its_gathered_ema(wan_teacher, tmp_path):
    from diffusers import WanTransformer3DModel

    from dmd2_core import parallel

    plain = perturbed_student(wan_teacher, seed=3).model
    sharded = copy.deepcopy(plain)
    parallel.ensure_process_group(0, 1, torch.device("cpu"))
    parallel.shard_model(sharded, parallel.build_mesh(torch.device("cpu"), 1, None), torch.bfloat16,
                         trainable=True)  # bf16 compute: FSDP shards even one rank (fp32 would stay plain)
    ema = [p.detach().clone() * 0.5 for p in sharded.parameters()]
    assert type(ema[0]).__name__ == "DTensor"
    url = str(tmp_path / "sharded")
    export_student(url, sharded, teacher_url=wan_teacher, shift=WAN_SHIFT, num_steps=4,
                   export_dtype=torch.float32, ema=ema)
    halved = with_weights(plain, [p.detach() * 0.5 for p in plain.parameters()])
    assert_same_weights(WanTransformer3DModel.from_pretrained(url, subfolder="transformer"), halved)
    assert_same_weights(WanTransformer3DModel.from_pretrained(url, subfolder="transformer_online"), plain)


def test_bare_sd3_export_reproduces_eval_samples_with_the_manual_loop(tmp_path):
    from diffusers import FlowMatchLCMScheduler, SD3Transformer2DModel

    teacher = build_standin(str(tmp_path / "sd3"), "sd3")
    bare = storage.join(teacher, "transformer")  # a bare transformer directory as the teacher
    loaded = perturbed_student(teacher)
    url = str(tmp_path / "export")
    out = export_student(url, loaded.model, teacher_url=bare, shift=3.0, num_steps=4, export_dtype=torch.float32)
    assert out["pipeline"] is False
    assert sorted(p.name for p in Path(url).iterdir()) == ["export.json", "model_index.json", "scheduler", "transformer"]
    assert json.loads((Path(url) / "model_index.json").read_text())["_class_name"] == "StableDiffusion3Pipeline"

    transformer = SD3Transformer2DModel.from_pretrained(url, subfolder="transformer")
    scheduler = FlowMatchLCMScheduler.from_pretrained(url, subfolder="scheduler")
    prompts = standin_prompt_set("sd3", num_prompts=3)
    cond = prompts.cond(torch.tensor([0, 1, 2]))
    seed, shape = 5, (3, 4, 8, 8)
    # docs/scale.md's loop (Exported students), with set_timesteps(K) as a pipeline calls it
    scheduler.set_timesteps(4)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    with torch.no_grad():
        for t in scheduler.timesteps:
            v = transformer(x, encoder_hidden_states=cond["prompt_embeds"],
                            pooled_projections=cond["pooled_prompt_embeds"], timestep=t.expand(shape[0]),
                            return_dict=False)[0]
            x = scheduler.step(v, t, x, generator=generator, return_dict=False)[0]
    ours = dmd2_iteration.eval_samples(loaded.family, loaded.model, cond, shape, seed, 4, 3.0)
    torch.testing.assert_close(x, ours, atol=1e-5, rtol=0)


def test_verification_catches_a_corrupted_write(wan_teacher, tmp_path, monkeypatch):
    from dmd2_core.export import stream

    model = perturbed_student(wan_teacher).model
    real = stream.stream_tensors

    def corrupting(values, dtype, directory, *a, **kw):  # one byte of proj_out.bias changes on its way to the disk
        out = real(values, dtype, directory, *a, **kw)
        entry = next(e for e in out.entries if e.name == "proj_out.bias")
        with open(directory / entry.file, "r+b") as f:
            header = int.from_bytes(f.read(8), "little")
            f.seek(8 + header + entry.start)
            byte = f.read(1)
            f.seek(8 + header + entry.start)
            f.write(bytes([byte[0] ^ 0xFF]))
        return out

    monkeypatch.setattr(stream, "stream_tensors", corrupting)
    url = export_url(str(tmp_path / "run"), 3)
    with pytest.raises(ModelDirError) as failed:
        export_student(url, model, teacher_url=wan_teacher, shift=WAN_SHIFT, num_steps=4,
                       export_dtype=torch.float32)
    message = str(failed.value)
    assert "\n" not in message and message.startswith(f"{url}/transformer:") and "proj_out.bias" in message
    assert not (Path(url) / "export.json").exists()  # never marked complete
    assert latest_exports(str(tmp_path / "run")) == []


def test_prune_exports_keeps_the_newest_complete_ones(tmp_path):
    root = exports_root(str(tmp_path / "run"))

    def make(iteration, complete=True):
        d = Path(export_url(str(tmp_path / "run"), iteration))
        (d / "transformer").mkdir(parents=True)
        (d / "transformer" / "config.json").write_text("{}")
        if complete:
            (d / "export.json").write_text("{}")
        return str(d)

    def names():
        return sorted(p.name for p in Path(root).iterdir())

    assert prune_exports(root, keep=2) == []  # no exports yet
    urls = {i: make(i) for i in (100, 200, 300, 400, 500)}
    broken = make(250, complete=False)  # interrupted midway, older than the newest complete
    in_flight = make(600, complete=False)  # newer than every complete one: maybe being written
    (Path(root) / "notes").mkdir()  # not an export dir: never touched
    killed = Path(root) / "iter_0000150.staging-0badc0de"  # an export killed before its swap
    writing = Path(root) / "iter_0000600.staging-00c0ffee"  # the export under way
    for staging in (killed, writing):
        (staging / "transformer").mkdir(parents=True)
    assert latest_exports(str(tmp_path / "run"))[-1] == urls[100]  # staging is never an export
    assert prune_exports(root, keep=0) == [str(killed), broken]  # keep=0 keeps every complete export
    assert names() == ["iter_0000100", "iter_0000200", "iter_0000300", "iter_0000400", "iter_0000500",
                       "iter_0000600", writing.name, "notes"]
    assert latest_exports(str(tmp_path / "run")) == [urls[i] for i in (500, 400, 300, 200, 100)]
    removed = prune_exports(root, keep=2, protect=[urls[100], "iter_0000300"])
    assert removed == [urls[200]]
    assert names() == ["iter_0000100", "iter_0000300", "iter_0000400", "iter_0000500", "iter_0000600",
                       writing.name, "notes"]
    assert Path(in_flight).exists()
    assert prune_exports(root, keep=1) == [urls[100], urls[300], urls[400]]
    assert latest_exports(str(tmp_path / "run")) == [urls[500]]


def test_export_to_s3_from_an_s3_teacher_reloads(wan_teacher, s3_bucket, tmp_path):
    from diffusers import DiffusionPipeline, WanPipeline

    teacher = f"{s3_bucket}/teacher"
    storage.upload_dir(wan_teacher, teacher)
    model = perturbed_student(wan_teacher).model
    url = export_url(f"{s3_bucket}/run", 40)
    out = export_student(url, model, teacher_url=teacher, shift=WAN_SHIFT, num_steps=4,
                         export_dtype=torch.bfloat16, iteration=40)
    assert out["pipeline"] is True
    assert latest_exports(f"{s3_bucket}/run") == [url]
    with storage.local_copy(url) as local:
        pipe = DiffusionPipeline.from_pretrained(str(local))
        assert isinstance(pipe, WanPipeline)
        assert_same_weights(pipe.transformer, copy.deepcopy(model).to(torch.bfloat16))
        assert (local / "text_encoder" / "model.safetensors").read_bytes() == \
            (Path(wan_teacher) / "text_encoder" / "model.safetensors").read_bytes()
    assert prune_exports(exports_root(f"{s3_bucket}/run"), keep=1) == []


@pytest.mark.parametrize("async_save", [False, True])
def test_a_trainer_save_exports_its_ema_student(tiny_teacher, tmp_path, async_save):
    """What a run ships: Trainer.save(export=True) writes, through export_student, a pipeline whose
    transformer holds the EMA weights (and transformer_online the trained ones)."""
    from dmd2_core.run.distill_run import preflight
    from dmd2_core.train.trainer import Trainer
    from tests.helpers import tiny_args

    args = tiny_args(tiny_teacher, str(tmp_path), loss_type="flow_matching", ema_decay=0.5, async_save=async_save)
    actor = Trainer(preflight(args)["actor"], "actor")
    actor.train(1, actor.rollout(1)[0])
    actor.save(1, export=True)
    url = actor.save_status(wait=True)["export_url"]
    names = [n for n, _ in actor.model.named_parameters()]
    exported = load_model_dir(url).model.state_dict()
    assert all(torch.equal(exported[n], e) for n, e in zip(names, actor.ema))
    assert not all(torch.equal(exported[n], p) for n, p in actor.model.named_parameters())
    assert (Path(url) / "export.json").is_file() and (Path(url) / "transformer_online").is_dir()


def test_prune_exports_finishes_a_swap_a_kill_interrupted_before_it_judges(tmp_path):
    """A kill between the two renames of a swap leaves the export's URL empty, the old export set
    aside and the new one in its staging, both named like a killed export's leftovers: retention
    finishes the swap first, so the (protected) export is kept, the new one in place."""
    root = exports_root(str(tmp_path / "run"))
    url = export_url(str(tmp_path / "run"), 100)

    def complete(d: Path, text: str) -> str:
        (d / "transformer").mkdir(parents=True)
        (d / "transformer" / "config.json").write_text(text)
        (d / "export.json").write_text("{}")
        return str(d)

    complete(Path(export_url(str(tmp_path / "run"), 200)), "newest")
    staging = complete(Path(f"{url}.staging-0000beef"), "new")
    aside = complete(Path(f"{url}.staging-replaced-0000dead"), "old")
    Path(swap_record_url(url)).write_text(json.dumps({"staging": staging, "aside": aside}))
    assert latest_exports(str(tmp_path / "run")) == [export_url(str(tmp_path / "run"), 200)]

    assert prune_exports(root, keep=1, protect=[url]) == []
    assert sorted(p.name for p in Path(root).iterdir()) == ["iter_0000100", "iter_0000200"]
    assert (Path(url) / "transformer" / "config.json").read_text() == "new"
