"""LoRA students and fake scores (dmd2_core.models.lora): only the adapters train, over a frozen base in
the compute dtype; the critic group holds one base whose adapter-off forward is the teacher's,
bit for bit; sharded ranks equal one rank; checkpoints hold the adapters and resume bitwise; the
export is a diffusers LoRA that reproduces the eval samples, or merged, a full student."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dmd2_core import checkpoint as ckpt
from dmd2_core import parallel
from dmd2_core.train import dmd2_iteration
from dmd2_core.models import lora
from dmd2_core.errors import ArgsError
from dmd2_core.run.distill_run import DistillRun, preflight
from dmd2_core.train.trainer import Trainer
from tests.helpers import in_process_trainers, iterate_in_process, spawn_ranks, tiny_args

LORA = dict(lora_rank=4, lora_alpha=8.0, lr=1e-3, critic_lr=1e-3)


def test_only_the_adapters_move_the_base_is_bitwise_unchanged(tiny_teacher, tmp_path):
    trainers = in_process_trainers(tiny_args(tiny_teacher, str(tmp_path), **LORA))
    before = {role: t.weights() for role, t in trainers.items()}
    for i in (1, 2, 3):
        iterate_in_process(trainers, i)
    for role, t in trainers.items():
        after = t.weights()
        base = [k for k in after if not lora.is_adapter(k)]
        assert base and all(torch.equal(before[role][k], after[k]) for k in base), role
        moved = [k for k in after if not torch.equal(before[role][k], after[k])]
        assert moved and all(lora.is_adapter(k) for k in moved), role
        assert any(".lora_B." in k for k in moved)  # B starts at zero: the adapter really learned
        trained = lora.trained_parameters(t.model)
        assert {id(p) for p in trained} == {id(p) for g in t.optimizer.param_groups for p in g["params"]}
        assert {id(p) for p in t.optimizer.state} <= {id(p) for p in trained}
        assert len(trained) == 4 * 2 * 3  # to_q, to_k, to_v, to_out.0 x (A, B) x 3 blocks
    assert trainers["critic"].teacher is None  # one shared base: no second copy
    assert trainers["critic"].state_bytes()["teacher"] == 0


def test_real_score_under_the_shared_base_is_the_teachers_forward_bitwise(tiny_teacher, tmp_path):
    """bf16 compute (FSDP on a mesh of one, base in bf16, adapters fp32): after training has moved
    the fake score's adapter, the real score equals a separately loaded, sharded teacher exactly."""
    args = tiny_args(tiny_teacher, str(tmp_path / "lora"), dtype="bfloat16", **LORA)
    trainers = in_process_trainers(args)
    for i in (1, 2):
        iterate_in_process(trainers, i)
    critic = trainers["critic"]
    assert {p.dtype for n, p in critic.model.named_parameters() if lora.is_adapter(n)} == {torch.float32}
    assert {p.dtype for n, p in critic.model.named_parameters() if not lora.is_adapter(n)} == {torch.bfloat16}
    plain = Trainer(preflight(tiny_args(tiny_teacher, str(tmp_path / "full"), dtype="bfloat16"))["critic"], "critic")
    g = torch.Generator().manual_seed(0)
    x_t = torch.randn((4, *critic.shape), generator=g)
    sigma = torch.rand(4, generator=g) * 0.9 + 0.05
    cond = critic._cond(torch.arange(4))
    family = critic.family
    real = family.predict_velocity(critic.learner.teacher, x_t, sigma, cond)
    teacher = family.predict_velocity(plain.teacher, x_t, sigma, cond)
    critic._reshard()
    with torch.no_grad():
        fake = family.predict_velocity(critic.model, x_t, sigma, cond)
    critic._reshard()
    assert torch.equal(real, teacher)
    assert not torch.equal(fake, real)  # the adapter is on for the fake score
    # the adapters' flags are restored and nothing was left unsharded
    assert all(not m._disable_adapters for m in critic.model.modules() if hasattr(m, "_disable_adapters"))


def test_a_separate_teacher_when_the_fake_score_starts_elsewhere(tiny_teacher, tmp_path):
    args = tiny_args(tiny_teacher, str(tmp_path), critic_lora_rank=0, **{k: v for k, v in LORA.items()})
    trainers = in_process_trainers(args)
    assert trainers["critic"].teacher is not None and not lora.has_adapters(trainers["critic"].model)
    assert lora.has_adapters(trainers["actor"].model)


@pytest.mark.parametrize("overrides, needle", [
    (dict(export_merged=True), "export_merged"),
    (dict(lora_rank=2, lora_target_modules=["no_such_module"]), "lora_target_modules"),
    (dict(lora_rank=-1), "lora_rank"),
])
def test_bad_lora_settings_fail_in_one_line(tiny_teacher, tmp_path, overrides, needle):
    with pytest.raises((ArgsError, ValueError)) as err:
        in_process_trainers(tiny_args(tiny_teacher, str(tmp_path), **overrides))
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("key", ["lora_dropout", "critic_lora_dropout"])
def test_lora_dropout_is_refused_before_any_actor(tiny_teacher, tmp_path, capsys, monkeypatch, key):
    """peft's adapter dropout draws unseeded masks: replay and N ranks == 1 rank would not hold.
    A value above 0 is refused in one line naming the key, exit 2, before Ray starts."""
    from tests.helpers import flow_cli_refusal

    save = tmp_path / "run"
    err = flow_cli_refusal(capsys, monkeypatch, "--recipe", "tiny", "--hf-checkpoint", tiny_teacher, "--save", str(save),
                           "--set", "lora_rank=2", "--set", f"{key}=0.1")
    assert f"'{key}'" in err and "set it to 0" in err, err
    assert not save.exists()


# ---- sharded ranks, checkpoints (Ray, gloo) -------------------------------------------------------

@pytest.mark.multi_rank
def test_save_kill_resume_is_bitwise_and_elastic(ray_session, tiny_teacher, tmp_path):
    """2 ranks with an EMA: the checkpoint holds the adapters (and their EMA and AdamW state)
    only; a new group resumes bitwise and continues as the uninterrupted run; 1 rank loads it and
    its next iteration gives the 2 sharded ranks' weights (a gradient summed instead of averaged
    over ranks would not)."""
    save = str(tmp_path / "run")
    args = tiny_args(tiny_teacher, save, num_devices=2, ema_decay=0.9, run_name="lora-resume", **LORA)
    with DistillRun(args) as run:
        for i in (1, 2):
            run.iterate(i)
        run.checkpoint(2)
        digests = {role: run.group_call(role, "state_digest") for role in run.groups}
        at_two = {role: run.group_call(role, "weights")[0] for role in run.groups}
        run.iterate(3)
        straight = {role: run.group_call(role, "state_digest") for role in run.groups}
        weights = {role: run.group_call(role, "weights")[0] for role in run.groups}
    for role in ("actor", "critic"):
        for section in ("model", "optim") + (("ema",) if role == "actor" else ()):
            saved = ckpt.read_weights(save, role, 2, section)
            assert saved and all(lora.is_adapter(k.rsplit(".", 1)[0] if section == "optim" else k) for k in saved), \
                (role, section)
    with DistillRun(args) as again:  # new actors (the old ones are gone), loaded from the tracker
        assert again.start_iteration == 2
        assert {role: again.group_call(role, "state_digest") for role in again.groups} == digests
        again.iterate(3)
        assert {role: again.group_call(role, "state_digest") for role in again.groups} == straight
    one = args.model_copy(update={"num_devices": 1, "run_name": "lora-resume-1"})
    with DistillRun(one) as elastic:
        assert elastic.start_iteration == 2
        elastic.iterate(3)
        got = {role: elastic.group_call(role, "weights")[0] for role in elastic.groups}
    for role in got:
        assert max((got[role][k] - weights[role][k]).abs().max().item() for k in got[role]) < 2e-6
        assert max((at_two[role][k] - weights[role][k]).abs().max().item() for k in got[role]) > 1e-4  # it trained


# ---- export ------------------------------------------------------------------------------------

def _trained_student(tiny_teacher, tmp_path, **kw):
    trainers = in_process_trainers(tiny_args(tiny_teacher, str(tmp_path), **LORA, **kw))
    for i in (1, 2):
        iterate_in_process(trainers, i)
    return trainers["actor"]


def _teacher_transformer(tiny_teacher):
    from diffusers import SD3Transformer2DModel

    from dmd2_core.models import describe_model_dir

    return SD3Transformer2DModel.from_pretrained(describe_model_dir(tiny_teacher)["transformer_url"])


def test_exported_lora_loads_with_diffusers_and_reproduces_eval_samples(tiny_teacher, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    actor = _trained_student(tiny_teacher, tmp_path, ema_decay=0.9)
    done = actor.save(2, export=True)
    url = done["export_url"]
    marker = json.loads((Path(url) / "export.json").read_text())
    assert marker["lora"]["r"] == 4 and marker["lora"]["lora_alpha"] == 8.0 and marker["transformer"] == "ema"
    assert not (Path(url) / "transformer").exists()  # the base is the teacher's: never written again
    ours = actor.sample([0, 1, 2, 3], seed=7, decode=False)
    transformer = _teacher_transformer(tiny_teacher)
    state, metadata = StableDiffusion3Pipeline.lora_state_dict(url, return_lora_metadata=True)
    assert metadata["transformer.r"] == 4 and metadata["transformer.lora_alpha"] == 8.0
    # what pipe.load_lora_weights(url) runs on the pipeline's transformer
    StableDiffusion3Pipeline.load_lora_into_transformer(state, transformer=transformer, metadata=metadata)
    theirs = dmd2_iteration.eval_samples(actor.family, transformer, actor._cond(torch.tensor([0, 1, 2, 3])), tuple(ours.shape), 7,
                               actor.args.dmd2_student_steps, actor.shift)
    assert (theirs - ours).abs().max().item() < 1e-6
    plain = dmd2_iteration.eval_samples(actor.family, _teacher_transformer(tiny_teacher), actor._cond(torch.tensor([0, 1, 2, 3])),
                              tuple(ours.shape), 7, actor.args.dmd2_student_steps, actor.shift)
    assert (plain - ours).abs().max().item() > 1e-4  # the LoRA is what makes them match


def test_merged_export_is_a_full_student_that_reproduces_eval_samples(tiny_teacher, tmp_path):
    from diffusers import SD3Transformer2DModel

    actor = _trained_student(tiny_teacher, tmp_path, export_merged=True)
    url = actor.save(2, export=True)["export_url"]
    merged = SD3Transformer2DModel.from_pretrained(url, subfolder="transformer")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    ours = actor.sample([0, 1], seed=3, decode=False)
    theirs = dmd2_iteration.eval_samples(actor.family, merged, actor._cond(torch.tensor([0, 1])), tuple(ours.shape), 3,
                               actor.args.dmd2_student_steps, actor.shift)
    assert (theirs - ours).abs().max().item() < 1e-4
    assert parallel.full(next(iter(lora.trained_parameters(actor.model)))).abs().sum() > 0


# ---- MiniMax-H3 stand-in: fp32 modules, context parallelism, 2 sharded ranks ---------------------

def _h3_rank(rank: int, world_size: int, trainer_args: dict, out_path: str) -> None:
    shared = Trainer(trainer_args["lora"], "critic", rank, world_size)
    plain = Trainer(trainer_args["plain"], "critic", rank, world_size)
    for trainer in (shared, plain):
        trainer.init_process_group()  # in spawn_ranks' group
    with torch.no_grad():  # the fake score's adapter away from its zero start
        for name, param in shared.model.named_parameters():
            if ".lora_B." in name:
                parallel.local(param).normal_(0.0, 0.05, generator=torch.Generator().manual_seed(rank))
    g = torch.Generator().manual_seed(0)
    x_t = torch.randn((2, *shared.shape), generator=g)
    sigma, cond, family = torch.tensor([0.3, 0.8]), shared._cond(torch.arange(2)), shared.family
    real = family.predict_velocity(shared.learner.teacher, x_t, sigma, cond)
    shared._reshard()
    teacher = family.predict_velocity(plain.teacher, x_t, sigma, cond)
    plain._reshard()
    with torch.no_grad():
        fake = family.predict_velocity(shared.model, x_t, sigma, cond)
    shared._reshard()
    if rank == 0:
        torch.save({"real": real, "teacher": teacher, "fake": fake, "teacher_copy": plain.teacher is not None,
                    "shared_copy": shared.teacher is not None}, out_path)


@pytest.mark.multi_rank
@pytest.mark.parametrize("cp_size", [1, 2], ids=["fsdp", "fsdp-cp2"])
def test_h3_real_score_is_the_sharded_teachers_forward_bitwise(tmp_path, cp_size):
    """bf16 on 2 ranks (both models sharded, the fp32 modules in fp32), with and without Ulysses
    context parallelism: the shared base's real score is the separately loaded teacher's forward."""
    from dmd2_core.args import load_args
    from dmd2_core.toys.standins import H3_GEOMETRY, build_h3_standin
    from tests.helpers import h3_prompts

    prompts = str(tmp_path / "prompts.safetensors")
    h3_prompts([5, 3, 5, 3]).save(prompts)  # odd text lengths: the packed sequence splits over 2 ranks
    common = dict(device="cpu", dtype="bfloat16", torch_threads=1, global_batch_size=2, micro_batch_size=2,
                  dmd2_update_ratio=2, dmd2_student_steps=2, seed=3, num_devices=2, cp_size=cp_size,
                  hf_checkpoint=build_h3_standin(str(tmp_path / "h3")), prompts=prompts, **H3_GEOMETRY)
    trainer_args = {name: preflight(load_args(None, {**common, "save": str(tmp_path / name), **extra}))["critic"]
                    for name, extra in (("lora", {"lora_rank": 4}), ("plain", {}))}
    out = tmp_path / "out.pt"
    spawn_ranks(2, _h3_rank, trainer_args, str(out))
    got = torch.load(out, weights_only=False)
    assert not got["shared_copy"] and got["teacher_copy"]
    assert torch.equal(got["real"], got["teacher"])
    assert not torch.equal(got["fake"], got["real"])


@pytest.mark.parametrize("kind", ["sd3", "wan", "h3"])
def test_each_family_exports_a_lora_its_own_loader_takes(tmp_path, kind):
    """The stand-ins of every family: a LoRA student (its adapters moved off their zero start)
    exported and loaded by the family's loader (the pipeline's ``load_lora_into_transformer``,
    MiniMax-H3's ``MiniMaxH3LoraLoaderMixin``) onto the teacher's transformer computes what the
    student does."""
    from dmd2_core.args import load_args
    from dmd2_core.export.pipeline import export_student
    from dmd2_core.models import describe_model_dir, load_model_dir
    from dmd2_core.toys.standins import build_h3_standin, build_standin

    url = build_h3_standin(str(tmp_path / "t")) if kind == "h3" else build_standin(str(tmp_path / "t"), kind)
    args = load_args(None, dict(hf_checkpoint=url, prompts="digits", save=str(tmp_path), **LORA))
    student = lora.attach(load_model_dir(url).model, args)
    with torch.no_grad():
        for name, param in lora.trained(student):
            if ".lora_B." in name:
                param.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
    loader = lora.lora_loader(load_model_dir(url).family)
    done = export_student(str(tmp_path / "export"), student, teacher_url=url, shift=3.0, num_steps=4,
                          export_dtype=torch.float32, lora_metadata=lora.adapter_metadata(args))
    assert json.loads((Path(done["url"]) / "export.json").read_text())["lora"]["loader"] == loader.__name__
    state, metadata = loader.lora_state_dict(done["url"], return_lora_metadata=True)
    loaded = load_model_dir(url)
    loader.load_lora_into_transformer(state, transformer=loaded.model, metadata=metadata)
    ours = {n.replace(f".{lora.ADAPTER}.", "."): p for n, p in student.named_parameters()}
    theirs = {n.replace(".default_0.", "."): p for n, p in loaded.model.named_parameters()}
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert describe_model_dir(url)["family"] == type(student).__name__
