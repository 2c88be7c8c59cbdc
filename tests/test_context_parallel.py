"""Context parallelism (cp_size): one sample's sequence split over ranks (Ulysses), composed with
FSDP2. N ranks with cp give the weights (and eval samples) of one rank after whole DMD2
iterations (rollout, critic training and scoring, student training), Wan and MiniMax-H3; bad
cp settings fail at preflight in one line naming the key."""

from __future__ import annotations

import pytest
import torch

from dmd2_core.args import load_args
from dmd2_core.errors import ArgsError
from dmd2_core.run.distill_run import preflight
from dmd2_core.toys.standins import H3_GEOMETRY, build_h3_standin, build_standin, standin_prompt_set
from dmd2_core.train.trainer import Trainer
from tests.helpers import h3_prompts, spawn_ranks

ITERATIONS = (1, 2, 3)
EVAL_PROMPTS, EVAL_SEED = [0, 1], 11
COMMON = dict(device="cpu", dtype="float32", torch_threads=1, global_batch_size=2, micro_batch_size=2,
              dmd2_update_ratio=2, dmd2_student_steps=2, seed=3, ema_decay=0.9, clip_grad=0.05,
              lr=2e-4, eval_interval=0, save_interval=0)


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    """With the GAN head (its features come from a split sequence; its generator gradient from
    each rank's part of it)."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("wan")
    prompts, real = str(root / "prompts.safetensors"), str(root / "real.safetensors")
    prompt_set = standin_prompt_set("wan")
    prompt_set.save(prompts)
    # [C, F, H, W] latents -> 2 x 2 x 2 = 8 video tokens (patch 1 x 2 x 2): splits over 2 and 4 ranks
    latent_shape = [4, 2, 4, 4]
    g = torch.Generator().manual_seed(5)
    save_file({"latents": torch.randn(4, *latent_shape, generator=g),
               "prompt_embeds": prompt_set.embeds["prompt_embeds"][:4].contiguous()}, real)
    return dict(hf_checkpoint=build_standin(str(root / "wan"), "wan"), prompts=prompts, latent_shape=latent_shape,
                dmd2_guidance_scale=2.0, real_data=real, gan_weight=0.5, gan_critic_weight=0.5)


@pytest.fixture(scope="module")
def h3(tmp_path_factory):
    root = tmp_path_factory.mktemp("h3")
    prompts = str(root / "prompts.safetensors")
    h3_prompts([5, 3, 5, 3]).save(prompts)
    return dict(hf_checkpoint=build_h3_standin(str(root / "h3")), prompts=prompts, **H3_GEOMETRY)


def _trainer_args(model: dict, save, **overrides):
    return preflight(load_args(None, {**COMMON, **model, "save": str(save), **overrides}))


def _iterate(trainers: dict, iteration: int) -> dict:
    pairs, _ = trainers["actor"].rollout(iteration)
    scores, _ = trainers["critic"].train(iteration, pairs)
    trainers["actor"].train(iteration, pairs, scores)
    return scores


def _run(trainers: dict) -> dict:
    scores = [_iterate(trainers, i)["dmd2_grad"] for i in ITERATIONS]
    out = {role: t.weights() for role, t in trainers.items()}
    out["scores"] = torch.stack(scores)  # [iteration, this rank's rows, ...]: what the actor is handed
    out["samples"] = trainers["actor"].sample(EVAL_PROMPTS, EVAL_SEED, decode=False)
    return out


def _one_rank(model: dict, save) -> dict:
    """The run on one rank, and the weights it started from."""
    trainers = {role: Trainer(a, role) for role, a in _trainer_args(model, save).items()}
    start = {role: t.weights() for role, t in trainers.items()}
    return {"start": start, **_run(trainers)}


@pytest.fixture(scope="module")
def wan_one(wan, tmp_path_factory):
    return _one_rank(wan, tmp_path_factory.mktemp("wan-one"))


def _rank(rank: int, world_size: int, trainer_args: dict, out_path: str, save: bool) -> None:
    trainers = {role: Trainer(a, role, rank, world_size) for role, a in trainer_args.items()}
    for trainer in trainers.values():
        trainer.init_process_group()  # in spawn_ranks' group
    out = _run(trainers)
    for trainer in trainers.values() if save else ():
        trainer.save(ITERATIONS[-1])
        trainer.save_status(wait=True)
    if rank == 0:
        torch.save(out, out_path)


def _ranks(trainer_args: dict, world_size: int, tmp_path, save: bool) -> dict:
    """The run on ``world_size`` trainer ranks, one process each (gloo); ``save``: each trainer
    then saves its checkpoint of the last iteration."""
    out = tmp_path / "ranks.pt"
    spawn_ranks(world_size, _rank, trainer_args, str(out), save)
    return torch.load(out, weights_only=False)


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _same_as_one_rank(model: dict, one: dict, tmp_path, world_size: int, save: bool = False, **parallel) -> dict:
    many = _ranks(_trainer_args(model, tmp_path / "many", num_devices=world_size, **parallel), world_size, tmp_path,
                  save)
    diffs = {role: _max_diff(one[role], many[role]) for role in ("actor", "critic")}
    diffs["samples"] = _max_diff({"x": one["samples"]}, {"x": many["samples"]})
    rows = many["scores"].shape[1]  # rank 0's: the first data-parallel rank's rows
    diffs["scores"] = _max_diff({"x": one["scores"][:, :rows]}, {"x": many["scores"]})
    moved = min(_max_diff(one["start"][role], one[role]) for role in ("actor", "critic"))
    print(f"max |N ranks - 1 rank|: {diffs}, moved {moved:.3g}")
    assert moved > 5e-4, moved  # training moved the weights well beyond the tolerance
    assert all(d < 1e-5 for d in diffs.values()), diffs
    return diffs


@pytest.mark.multi_rank
def test_wan_context_parallel_2_equals_1_rank(wan, wan_one, tmp_path):
    """And its checkpoint resumes on one rank without cp: FSDP shards over the same ranks whatever
    cp, so the saved state does not depend on it."""
    _same_as_one_rank(wan, wan_one, tmp_path, 2, save=True, cp_size=2)
    many = torch.load(tmp_path / "ranks.pt", weights_only=False)
    for role, args in _trainer_args(wan, tmp_path / "resumed").items():
        resumed = Trainer(args, role)
        assert resumed.load(ITERATIONS[-1], str(tmp_path / "many")) > 0
        assert _max_diff(many[role], resumed.weights()) == 0, role
        if role == "actor":
            samples = resumed.sample(EVAL_PROMPTS, EVAL_SEED, decode=False)  # the EMA came back too
            assert (samples - many["samples"]).abs().max() < 1e-6


@pytest.mark.multi_rank
def test_h3_context_parallel_2_equals_1_rank(h3, tmp_path):
    _same_as_one_rank(h3, _one_rank(h3, tmp_path / "one"), tmp_path, 2, cp_size=2)


@pytest.mark.multi_rank
def test_wan_shard_2_by_context_2_equals_1_rank(wan, wan_one, tmp_path):
    """4 ranks: two data-parallel shards, each a context group of 2; the batch of 2 splits by rows."""
    _same_as_one_rank(wan, wan_one, tmp_path, 4, cp_size=2)


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    root = tmp_path_factory.mktemp("sd3")
    prompts = str(root / "prompts.safetensors")
    standin_prompt_set("sd3").save(prompts)
    return dict(hf_checkpoint=build_standin(str(root / "sd3"), "sd3"), prompts=prompts, dmd2_guidance_scale=2.0)


@pytest.mark.parametrize("model, overrides, needle", [
    ("sd3", dict(num_devices=2, cp_size=2), "cp_size: SD3Transformer2DModel has no context-parallel plan"),
    ("wan", dict(num_devices=4, cp_size=4), "cp_size: WanTransformer3DModel has 2 attention heads"),
    ("wan", dict(num_devices=2, cp_size=2, latent_shape=[4, 1, 2, 6]), "cp_size: 2 ranks do not split the 3-token"),
    ("h3", dict(num_devices=2, cp_size=2, prompt_lengths=[5, 4]), "cp_size: 2 ranks do not split the 455-token"),
    ("wan", dict(num_devices=4, cp_size=2, global_batch_size=3), "global_batch_size: 3 is not divisible by the "
                                                                  "critic's data-parallel size 2"),
    ("wan", dict(num_devices=2, cp_size=2, critic_cp_size=1), "critic_cp_size: 1 differs from cp_size 2"),
], ids=["sd3-family", "heads", "wan-tokens", "h3-text", "batch", "critic-differs"])
def test_bad_cp_size_fails_at_preflight_in_one_line(request, tmp_path, model, overrides, needle):
    model = dict(request.getfixturevalue(model))
    if "prompt_lengths" in overrides:
        model["prompts"] = str(tmp_path / "prompts.safetensors")
        h3_prompts(overrides.pop("prompt_lengths")).save(model["prompts"])
    with pytest.raises(ArgsError) as info:
        _trainer_args(model, tmp_path / "run", **overrides)
    assert str(info.value).startswith(needle) and "\n" not in str(info.value), str(info.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.multi_rank
def test_h3_ref2va_context_parallel_2_equals_1_rank(h3, tmp_path):
    """ref2va on transformer_ref/: a picture's and a sound's reference blocks lengthen the packed
    sequence that Ulysses splits; 2 ranks at cp 2 train to the weights, scores and eval samples of 1."""
    from dmd2_core.data import load_prompt_set
    from dmd2_core.models.minimax_h3 import REFERENCE_AUDIO

    prompts, even = str(tmp_path / "ref2va.safetensors"), str(tmp_path / "even.safetensors")
    h3_prompts([4, 6, 4, 6]).save(even)  # with the references' 1 + 202 rows, every sequence splits over 2
    base = load_prompt_set(even)
    g = torch.Generator().manual_seed(9)
    n, tokens = len(base), base.embeds["prompt_embeds"].shape[1]
    tags = torch.ones(n, tokens, dtype=torch.long)
    tags[:, :2] = 0  # a vision block's rows, tagged video
    type(base)(base.prompts, {**base.embeds, "text_token_tags": tags,
                              "reference_latents": torch.randn(n, 1, 24, 1, 2, 2, generator=g),
                              "reference_kinds": torch.tensor([[0, 1]] * n),
                              REFERENCE_AUDIO: torch.randn(n, 1, 2 * 101, 32, generator=g)}, {}).save(prompts)
    model = dict(h3, prompts=prompts, workflow="ref2va")
    _same_as_one_rank(model, _one_rank(model, tmp_path / "one"), tmp_path, 2, cp_size=2)
