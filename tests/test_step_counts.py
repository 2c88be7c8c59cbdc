"""One student, any step count (``dmd2_student_steps: [1, 2, 4, 8]``): what each iteration draws,
what an eval measures at every K, and what a user sees of it."""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from dmd2_core import evaluators as registry
from dmd2_core import flow_matching as fm
from dmd2_core import rng
from dmd2_core.args import load_args
from dmd2_core.errors import ArgsError
from dmd2_core.export.pipeline import export_student
from dmd2_core.export.scheduler import StudentSteps
from dmd2_core.evaluation.eval_step import run_eval
from dmd2_core.report.nights_view import night_row, nights_markdown
from dmd2_core.report import best_eval, summary_markdown
from dmd2_core.run.distill_run import preflight
from dmd2_core.train import dmd2_iteration
from dmd2_core.train.reference import ReferenceLoop
from tests.helpers import in_process_trainers, iterate_in_process, resume_in_process, tiny_args


def test_one_step_count_draws_exactly_what_it_always_drew(tiny_teacher, tmp_path):
    """A student of one K: the stop step is the first draw of its stream, the sigmas the K-step
    schedule and the noise the iteration's own: a set's extra draw of K never touches them."""
    args = tiny_args(tiny_teacher, str(tmp_path), dmd2_student_steps=4, dmd2_shift=3.0)
    shape, rows = (1, 8, 8), slice(0, 8)
    for i in range(1, 40):
        plan = dmd2_iteration.plan_rollout(args, i, 10, shape, rows)
        assert plan.stop_step == int(torch.randint(4, (1,), generator=rng.generator(args.seed, i, "stop_step")))
        assert plan.sigmas == fm.student_sigmas(4, 3.0)
        assert torch.equal(plan.noise, rng.randn_rows((8, *shape), rows, args.seed, i, "noise"))
    several = args.model_copy(update={"dmd2_student_steps": [1, 2, 4, 8]})
    same = [i for i in range(1, 40) if len(dmd2_iteration.plan_rollout(several, i, 10, shape, rows).sigmas) == 4]
    assert same and all(torch.equal(dmd2_iteration.plan_rollout(several, i, 10, shape, rows).noise,
                                    dmd2_iteration.plan_rollout(args, i, 10, shape, rows).noise) for i in same)


def test_a_set_draws_each_step_count_by_its_weight_and_stops_inside_its_schedule(tiny_teacher, tmp_path):
    args = tiny_args(tiny_teacher, str(tmp_path), dmd2_student_steps=[8, 1, 4, 2],
                     dmd2_student_steps_weights=[1, 1, 1, 5], dmd2_shift=3.0)
    assert args.dmd2_student_steps == [1, 2, 4, 8]
    drawn = Counter()
    for i in range(1, 801):
        k = dmd2_iteration.draw_student_steps(args, i)
        plan = dmd2_iteration.plan_rollout(args, i, 10, (1, 8, 8), slice(0, 4))
        assert plan.sigmas == fm.student_sigmas(k, 3.0)  # backward simulation over the drawn K's schedule
        assert 0 <= plan.stop_step < k
        assert dmd2_iteration.plan_rollout(args, i, 10, (1, 8, 8), slice(4, 8)).sigmas == plan.sigmas  # every rank's K
        drawn[k] += 1
    assert set(drawn) == {1, 2, 4, 8}
    assert 0.55 < drawn[8] / 800 < 0.70 and all(0.08 < drawn[k] / 800 < 0.17 for k in (1, 2, 4))


def test_a_sets_fake_score_learns_a_vector_per_step_count_that_the_real_score_never_sees(tiny_teacher, tmp_path):
    """A LoRA fake score over the teacher's base, of a student of [1, 2]: its step vectors start at
    zero (the fake score is the teacher), each K's is trained on that K's iterations alone, the
    fake score then differs by K, and the real score (the same base, adapters off) never sees them."""
    from dmd2_core.models import step_conditioning as sc

    args = tiny_args(tiny_teacher, str(tmp_path), dmd2_student_steps=[1, 2], dmd2_student_sampler="euler",
                     lora_rank=4)
    loop = ReferenceLoop(args)
    vectors = getattr(loop.critic, sc.ATTR).weight
    assert sc.is_conditioned(loop.critic) and not sc.is_conditioned(loop.student)
    assert torch.count_nonzero(vectors) == 0
    x = torch.randn(3, *loop.shape, generator=torch.Generator().manual_seed(0))
    sigma, cond = torch.full((3,), 0.6), loop.cond(torch.tensor([0, 1, 2]))

    def fake(k):
        with sc.at(loop.critic, k), torch.no_grad():
            return loop.family.predict_velocity(loop.critic, x, sigma, cond)

    def real(k):
        with sc.at(loop.critic, k):
            return loop.family.predict_velocity(loop.teacher, x, sigma, cond)

    real_before = real(1)
    drawn = [dmd2_iteration.draw_student_steps(loop.args, i) for i in (1, 2, 3, 4)]
    loop.run(4)
    assert set(drawn) == {1, 2}, drawn  # the seed draws both K in 4 iterations
    assert all(vectors[i].abs().sum() > 0 for i in range(2))
    assert (fake(1) - fake(2)).abs().max() > 1e-6
    torch.testing.assert_close(real(1), real(2), rtol=0, atol=0)
    torch.testing.assert_close(real(1), real_before, rtol=0, atol=0)  # the adapters and vectors are off
    with pytest.raises(ValueError, match="step count 4"):
        with sc.at(loop.critic, 4):
            pass
    one_k = ReferenceLoop(tiny_args(tiny_teacher, str(tmp_path / "one"), dmd2_student_steps=2))
    off = ReferenceLoop(args.model_copy(update={"dmd2_critic_step_conditioning": False}))
    assert not sc.is_conditioned(one_k.critic) and not sc.is_conditioned(off.critic)


def test_a_sets_critic_equals_the_reference_and_sleeps_saves_and_resumes_bitwise(tiny_teacher, tmp_path):
    """A set's critic with the GAN head: the fake score's step vectors (their own AdamW group, at
    dmd2_critic_step_lr_scale times the lr) and one head per K, only the drawn K's moving; the
    trainers equal the reference loop, and sleep, a checkpoint and a resume keep all of it."""
    from dmd2_core.models import step_conditioning as sc
    from dmd2_core.train import gan

    args = tiny_args(tiny_teacher, str(tmp_path), dmd2_student_steps=[1, 2], dmd2_student_sampler="euler",
                     real_data="digits", gan_weight=0.05, gan_critic_weight=0.1, micro_batch_size=3)
    trainers, loop = in_process_trainers(args), ReferenceLoop(args)
    critic = trainers["critic"]
    vectors = getattr(critic.model, sc.ATTR).weight
    assert [g["lr"] for g in critic.optimizer.param_groups] == [args.lr, args.lr * args.dmd2_critic_step_lr_scale]
    assert critic.optimizer.param_groups[1]["params"] == [vectors]
    assert isinstance(critic.disc, gan.StepHeads) and critic.disc.counts == (1, 2)
    start = {k: v.clone() for k, v in critic.disc.state_dict().items()}
    for i in (1, 2, 3):
        iterate_in_process(trainers, i)
        loop.iterate(i)
    for mine, theirs in ((trainers["actor"].weights(), loop.student.state_dict()),
                         (trainers["critic"].weights(), loop.critic.state_dict()),
                         (critic.disc.state_dict(), loop.heads.state_dict())):
        assert mine.keys() == theirs.keys()
        assert max((mine[k] - theirs[k]).abs().max().item() for k in mine) < 1e-5
    drawn = {dmd2_iteration.draw_student_steps(args, i) for i in (1, 2, 3)}
    moved = [any(not torch.equal(v, start[k]) for k, v in critic.disc.state_dict().items() if k.startswith(f"{i}."))
             for i in range(2)]
    assert moved == [k in drawn for k in (1, 2)]
    assert ((vectors.abs().sum(1) > 0).tolist()) == moved
    digest = critic.state_digest()
    critic.sleep()
    assert vectors.untyped_storage().nbytes() == 0
    assert critic.state_digest() == digest  # woken bit for bit
    resume_in_process(args, trainers, 3)
    from dmd2_core.errors import CheckpointError

    without = in_process_trainers(args.model_copy(update={"dmd2_critic_step_conditioning": False}))
    with pytest.raises(CheckpointError, match="resume with dmd2_critic_step_conditioning true, as it was saved"):
        without["critic"].load(3)


def test_a_sets_real_score_is_guided_at_each_step_counts_own_scale(tiny_teacher, tmp_path):
    """dmd2_student_steps_guidance: an iteration that draws K trains the student exactly as a run
    guided at K's scale everywhere would, and the trainers agree with the reference loop."""
    args = tiny_args(tiny_teacher, str(tmp_path), dmd2_student_steps=[1, 2], dmd2_student_sampler="euler",
                     dmd2_guidance_scale=1.0, dmd2_student_steps_guidance=[1.0, 3.0])
    drawn = {dmd2_iteration.draw_student_steps(args, i): i for i in range(1, 9)}
    assert set(drawn) == {1, 2}

    def student_after(update: dict, iteration: int) -> dict:
        loop = ReferenceLoop(args.model_copy(update=update))
        loop.iterate(iteration)
        return loop.student.state_dict()

    for k, scale in ((1, 1.0), (2, 3.0)):
        per_k = student_after({}, drawn[k])
        same = student_after({"dmd2_student_steps_guidance": None, "dmd2_guidance_scale": scale}, drawn[k])
        other = student_after({"dmd2_student_steps_guidance": None, "dmd2_guidance_scale": 4.0 - scale}, drawn[k])
        assert all(torch.equal(per_k[n], same[n]) for n in per_k), k
        assert any(not torch.equal(per_k[n], other[n]) for n in per_k), k
    trainers, loop = in_process_trainers(args), ReferenceLoop(args)
    for i in sorted(drawn.values()):
        iterate_in_process(trainers, i)
        loop.iterate(i)
    mine, theirs = trainers["actor"].weights(), loop.student.state_dict()
    assert max((mine[n] - theirs[n]).abs().max().item() for n in mine) < 1e-5


@pytest.mark.parametrize("override, message", [
    (dict(dmd2_student_steps=[4, 0]), r"'dmd2_student_steps'.*every K must be >= 1 \(got 0\)"),
    (dict(dmd2_student_steps=[1, 2], dmd2_student_steps_weights=[1.0]),
     r"'dmd2_student_steps_weights'.*one positive weight per K of \[1, 2\]"),
    (dict(dmd2_student_steps=4, dmd2_student_steps_weights=[1.0, 2.0]),
     r"'dmd2_student_steps_weights'.*only a set of step counts"),
    (dict(dmd2_student_steps=[1, 2], dmd2_student_steps_guidance=[1.0, -1.0]),
     r"'dmd2_student_steps_guidance'.*one guidance scale \(>= 0\) per K of \[1, 2\]"),
    (dict(dmd2_student_steps=4, dmd2_student_steps_guidance=[1.0]),
     r"'dmd2_student_steps_guidance'.*only a set of step counts"),
])
def test_bad_step_counts_are_one_line_naming_the_key(tiny_teacher, tmp_path, override, message):
    with pytest.raises(ArgsError, match=message) as err:
        tiny_args(tiny_teacher, str(tmp_path / "run"), **override)
    assert "\n" not in str(err.value)


def test_a_re_noising_student_of_several_step_counts_is_refused_before_any_actor(tiny_teacher, tmp_path):
    """Its export could serve only one of them: the refusal names the flag that makes it work."""
    args = tiny_args(tiny_teacher, str(tmp_path / "run"), dmd2_student_steps=[1, 4])
    with pytest.raises(ArgsError, match=r"dmd2_student_sampler: a set of step counts \[1, 4\] needs "
                                        r"dmd2_student_sampler=euler for SD3Transformer2DModel") as err:
        preflight(args)
    assert "\n" not in str(err.value) and not (tmp_path / "run").exists()
    preflight(args.model_copy(update={"dmd2_student_sampler": "euler"}))  # what the message says works


def test_an_euler_export_serves_every_step_count_with_num_inference_steps_alone(tmp_path):
    """One exported student, diffusers' own scheduler from its directory, K = 1 and 2 by
    set_timesteps(K) alone: each reproduces the project's K-step eval samples."""
    from diffusers import FlowMapEulerDiscreteScheduler, SD3Transformer2DModel

    from dmd2_core.models import load_model_dir
    from dmd2_core.storage import join
    from dmd2_core.toys.standins import build_standin, standin_prompt_set

    teacher = build_standin(str(tmp_path / "sd3"), "sd3")
    loaded = load_model_dir(teacher)
    with torch.no_grad():
        for p in loaded.model.parameters():
            p.mul_(0.9)
    url = str(tmp_path / "export")
    export_student(url, loaded.model, teacher_url=join(teacher, "transformer"), shift=3.0,
                   num_steps=StudentSteps((1, 2), euler=True), export_dtype=torch.float32)
    marker = json.loads((Path(url) / "export.json").read_text())
    assert marker["num_steps"] == [1, 2] and marker["scheduler"]["class"] == "FlowMapEulerDiscreteScheduler"
    transformer = SD3Transformer2DModel.from_pretrained(url, subfolder="transformer")
    scheduler = FlowMapEulerDiscreteScheduler.from_pretrained(url, subfolder="scheduler")
    cond = standin_prompt_set("sd3", num_prompts=3).cond(torch.tensor([0, 1, 2]))
    family = copy.copy(loaded.family)  # the family is a shared instance: setting it there leaks into every later test
    family.deterministic_student = True
    seed, shape = 5, (3, 4, 8, 8)
    for k in (1, 2):
        scheduler.set_timesteps(k)
        x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            for t in scheduler.timesteps:
                v = transformer(x, encoder_hidden_states=cond["prompt_embeds"],
                                pooled_projections=cond["pooled_prompt_embeds"], timestep=t.float().expand(shape[0]),
                                return_dict=False)[0]
                x = scheduler.step(v, t, x, return_dict=False)[0]
        ours = dmd2_iteration.eval_samples(family, loaded.model, cond, shape, seed, k, 3.0)
        torch.testing.assert_close(x.float(), ours, atol=1e-5, rtol=0)
    assert not torch.allclose(x.float(), dmd2_iteration.eval_samples(family, loaded.model, cond, shape, seed, 1, 3.0))


def test_an_eval_measures_every_step_count_and_ranks_by_their_mean(tiny_teacher, tmp_path):
    """The metrics carry each K's figures and the mean of the criterion; the media each K's
    grid; the summary and the nights view a row per K."""
    args = tiny_args(tiny_teacher, str(tmp_path / "run"), dmd2_student_steps=[1, 2], dmd2_student_sampler="euler",
                     eval_num_samples=40, eval_prompts=[0, 1], eval_samples_per_prompt=2)
    loop = ReferenceLoop(args)
    out = run_eval(loop, 0)
    metrics = out["metrics"]
    assert {"fd@1", "fd@2", "acc@1", "acc@2", "fd"} <= set(metrics)
    assert metrics["fd"] == pytest.approx((metrics["fd@1"] + metrics["fd@2"]) / 2) and metrics["fd@1"] != metrics["fd@2"]
    assert [Path(m["url"]).name for m in out["media"]] == ["iter_0000000_k1.png", "iter_0000000_k2.png"]
    assert all(Path(m["url"]).exists() for m in out["media"])
    later = {**{k: v * 0.5 for k, v in metrics.items() if k.startswith("fd")}, "iteration": 10}
    evals = [{"iteration": 0, **metrics}, later]
    assert best_eval(evals, registry.get("digits").criteria)["iteration"] == 10
    summary = summary_markdown({"name": "n", "iteration": 10, "final": 10, "start": 0, "evals": evals})
    assert "Quality at 1 steps before -> after" in summary and "Quality at 2 steps before -> after" in summary
    table = [line for line in summary.splitlines() if line.startswith("| 10 |") or line.startswith("| 0 |")]
    assert len(table) == 6  # per eval: the mean, then each K
    row = night_row({"evals": evals, "start": 0, "iteration": 10, "final": 10}, "Completed", 1.0, "id", None, "d")
    assert row["steps"]["1"]["final"] == later["fd@1"] and row["steps"]["2"]["best"] == later["fd@2"]
    view = nights_markdown("dmd2/x", [row], None)
    assert "| at 1 steps |" in view and "| at 2 steps |" in view


def test_the_recipe_cli_takes_a_set_as_flags_or_yaml():
    from dmd2_core.cli import arg_overrides, build_parser

    ns = build_parser().parse_args(["check", "--recipe", "tiny", "--dmd2-student-steps", "8", "2", "4"])
    assert load_args("tiny", arg_overrides(ns)).dmd2_student_steps == [2, 4, 8]
    ns = build_parser().parse_args(["check", "--recipe", "tiny", "--set", "dmd2_student_steps=[1, 2]"])
    assert load_args("tiny", arg_overrides(ns)).student_step_counts == (1, 2)
