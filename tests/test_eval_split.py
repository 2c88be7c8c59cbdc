"""An eval's model work split over the data-parallel ranks (``parallel.EvalShare``): each rank
samples, and the critic's ranks featurise, their own contiguous share of the rows, and the figures
are the same as one rank's; the media clips are the first quality samples, decoded from the
latents the figures use, not sampled again; the time plan prices the eval that way."""

from __future__ import annotations


import pytest
import torch

from dmd2_core.evaluation import teacher_evaluator
from dmd2_core.evaluation.eval_step import run_eval
from dmd2_core.media.images import image_grid, png_bytes
from dmd2_core.run.distill_run import preflight
from dmd2_core.train.trainer import Trainer
from bench.eval_split import RankRun
from tests.helpers import in_process_trainers, spawn_ranks, tiny_args

SAMPLES, STEPS = 9, 2  # 9 rows over 2 ranks: 5 and 4, the second share padded with one row


def _args(teacher: str, save: str, **overrides):
    values = dict(evaluator="teacher", eval_interval=1, eval_num_samples=SAMPLES, eval_reference_steps=3,
                  dmd2_student_steps=STEPS, eval_prompts=[0, 1, 2], eval_samples_per_prompt=2)
    return tiny_args(teacher, save, **{**values, **overrides})


def _count_student_rows(trainer: Trainer) -> list[int]:
    """The batch rows of every forward of the student from now on (appended to the list returned)."""
    rows: list[int] = []

    def hook(module, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        rows.append(int(x.shape[0]))
    trainer.model.register_forward_pre_hook(hook, with_kwargs=True)
    return rows


class _Run(RankRun):
    """What an eval asks of a DistillRun, answered by this process's trainers on every rank (the
    bench's RankRun), with the student sampling and decoding calls it made recorded."""

    def __init__(self, trainers: dict, args):
        super().__init__(trainers, args)
        self.calls: list = []

    def sample(self, order, seed, num_steps=None):
        self.calls.append("sample")
        return super().sample(order, seed, num_steps=num_steps)

    def eval_latents(self, order, seed, num_steps=None):
        self.calls.append("eval_latents")
        return super().eval_latents(order, seed, num_steps=num_steps)

    def decode(self, latents):
        self.calls.append(("decode", latents.clone()))
        return super().decode(latents)


def _figures(trainers: dict, args, rank: int = 0) -> dict:
    """The teacher evaluator's figures (a reference cache of this rank's own), the student's
    samples, and the student rows each rank ran while sampling."""
    rows = _count_student_rows(trainers["actor"])
    run = _Run(trainers, args.model_copy(update={"eval_reference_url": f"{args.save}/reference-{rank}"}))
    out = teacher_evaluator.evaluate(run, run.args)
    sampled = sum(rows)
    latents = run.eval_latents(list(range(SAMPLES)), args.eval_seed)
    return {"metrics": out["metrics"], "reference": out["reference"], "sampled_rows": sampled, "latents": latents}


def _on_rank(rank: int, world_size: int, trainer_args: dict) -> dict:
    trainers = {role: Trainer(a, role, rank, world_size) for role, a in trainer_args.items()}
    for trainer in trainers.values():
        trainer.init_process_group()  # in spawn_ranks' group
    return _figures(trainers, trainer_args["actor"], rank)


@pytest.mark.multi_rank
def test_eval_figures_are_the_same_at_1_and_2_ranks_each_sampling_half(tiny_teacher, tmp_path):
    one = _figures(in_process_trainers(_args(tiny_teacher, str(tmp_path / "one"))), _args(tiny_teacher, str(tmp_path / "one")))
    two = spawn_ranks(2, _on_rank, preflight(_args(tiny_teacher, str(tmp_path / "two"), num_devices=2)), timeout_s=300)
    # the student's forwards: 9 rows x 2 steps on one rank; 5 rows (4 and one of padding) x 2 steps on each of two
    assert one["sampled_rows"] == SAMPLES * STEPS
    assert [r["sampled_rows"] for r in two] == [5 * STEPS, 5 * STEPS]
    assert torch.equal(two[0]["latents"], one["latents"])  # rank 0 holds every sample, in order, bit for bit
    for rank in two:  # the teacher's features of a share of 5 rows round as 1 ulp apart from a micro-batch of 8
        assert rank["metrics"] == pytest.approx(one["metrics"], rel=1e-6, abs=1e-9)
        assert rank["reference"] == one["reference"]
    assert set(one["metrics"]) >= {"teacher_kid", "diversity_image", "drift_brightness_image"}


def test_the_media_are_the_first_quality_samples_decoded_not_sampled_again(tiny_teacher, tmp_path):
    args = _args(tiny_teacher, str(tmp_path / "run"))
    trainers = in_process_trainers(args)
    rows = _count_student_rows(trainers["actor"])
    run = _Run(trainers, args)
    out = run_eval(run, 0)
    assert out["metrics"]["teacher_kid"] == out["metrics"]["teacher_kid"]  # a figure, not NaN
    # the student sampled the quality samples once (9 x 2 forward rows), not the 6 media clips again
    assert sum(rows) == SAMPLES * STEPS and run.calls.count("eval_latents") == 1 and "sample" not in run.calls
    quality = trainers["actor"].sample(teacher_evaluator.eval_order(args, 10), args.eval_seed, decode=False)
    decoded = [c[1] for c in run.calls if isinstance(c, tuple) and c[0] == "decode"]
    assert len(decoded) == 1 and torch.equal(decoded[0], quality[:6])  # the clips: the first 3 prompts twice
    grid = png_bytes(image_grid(trainers["actor"].decode(quality[:6]), nrow=3))
    (medium,) = out["media"]
    with open(medium["url"], "rb") as f:
        assert f.read() == grid


def test_the_time_plan_splits_the_eval_over_the_data_parallel_ranks_without_the_media(tiny_teacher):
    from dmd2_core.train.trainer_config import compute_trainer_args, compute_trainer_configs
    from dmd2_core.memory import time_plan

    def eval_flops(**overrides) -> float:
        args = _args(tiny_teacher, "/tmp/unused", eval_num_samples=8, **overrides)
        trainers = {c.role: compute_trainer_args(args, c) for c in compute_trainer_configs(args)}
        return time_plan.eval_flops(trainers, "teacher")

    one, two = eval_flops(), eval_flops(num_devices=2)
    assert two["eval"] == pytest.approx(one["eval"] / 2) and two["reference"] == pytest.approx(one["reference"] / 2)
    assert eval_flops(eval_samples_per_prompt=1) == one  # the clips (6 or 3) are quality samples: not priced again
    # more clips than quality samples: those are sampled on their own
    assert eval_flops(eval_samples_per_prompt=4)["eval"] > one["eval"]
