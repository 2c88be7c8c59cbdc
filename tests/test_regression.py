"""DMD's regression loss made on the fly: its target is the teacher's own few-step sampler run on
from the student's x_t, the critic hands its pull over with the DMD gradient, the actor's x0
gradient is exactly that of dmd2_loss + weight * mse(x0, target), and the reference loop is the
trainers' oracle with it."""

from __future__ import annotations

import pytest
import torch

from dmd2_core.train import dmd2_iteration
from dmd2_core import flow_matching as fm
from dmd2_core.run.distill_run import preflight
from dmd2_core.losses import dmd2_loss
from dmd2_core.train.reference import ReferenceLoop
from dmd2_core.sampling import euler_sample
from dmd2_core.train.trainer import Trainer
from tests.helpers import in_process_trainers, iterate_in_process, tiny_args

WEIGHT = 0.3


def _critic(teacher, save, **kw) -> Trainer:
    return Trainer(preflight(tiny_args(teacher, save, micro_batch_size=3, **kw))["critic"], "critic")


def _teacher_sample(critic: Trainer, x, cond, sigmas):
    """The teacher's Euler ODE solve in velocity form (x += (s' - s) v, with the run's guidance),
    the sampler the digits teacher's quality table uses: an independent path to the target."""
    args = critic.args
    return euler_sample(critic.family, critic.learner.teacher, x, cond, sigmas, critic._uncond(x.shape[0]),
                        args.dmd2_guidance_scale)


def test_target_is_the_teachers_own_sampler_from_noise_and_from_a_stop_step(tiny_teacher, tmp_path):
    critic = _critic(tiny_teacher, str(tmp_path))
    args, family = critic.args, critic.family
    assert args.dmd2_guidance_scale != 1.0 and args.dmd2_shift == 3.0  # the guided branch, a shifted grid
    noise = torch.randn(5, *family.sample_shape(critic.model, None), generator=torch.Generator().manual_seed(0))
    cond = critic._cond(torch.arange(5))
    grid = fm.student_sigmas(4, args.dmd2_shift) + [0.0]
    four_steps = _teacher_sample(critic, noise, cond, grid)

    def target(x, sigma):
        return dmd2_iteration.regression_target(family, critic.learner.teacher, x, torch.full((5,), sigma), cond,
                                      critic._uncond(5), args.dmd2_guidance_scale, 4, args.dmd2_shift)

    torch.testing.assert_close(target(noise, 1.0), four_steps, atol=1e-5, rtol=1e-5)
    # from where a 4-step student stops at step 2, the teacher takes its own last two steps
    halfway = _teacher_sample(critic, noise, cond, grid[:3])
    torch.testing.assert_close(target(halfway, grid[2]), four_steps, atol=1e-5, rtol=1e-5)
    # from a sigma off its grid, one step to the grid's next sigma below it, then the grid
    off = (grid[1] + grid[2]) / 2
    torch.testing.assert_close(target(halfway, off), _teacher_sample(critic, halfway, cond, [off, *grid[2:]]),
                               atol=1e-5, rtol=1e-5)
    assert (four_steps - _teacher_sample(critic, noise, cond, fm.student_sigmas(8, args.dmd2_shift) + [0.0])).abs().max() > 1e-3


def test_rows_at_different_sigmas_are_refused(tiny_teacher, tmp_path):
    critic = _critic(tiny_teacher, str(tmp_path))
    x = torch.zeros(2, *critic.family.sample_shape(critic.model, None))
    with pytest.raises(ValueError, match="2 different sigmas"):
        dmd2_iteration.regression_target(critic.family, critic.learner.teacher, x, torch.tensor([1.0, 0.5]),
                               critic._cond(torch.arange(2)), None, 1.0, 4, 3.0)


@pytest.mark.parametrize("scoring", ["fused", "original"])
def test_critic_hands_over_g_dmd_plus_g_reg_and_the_actor_x0_gradient_is_the_summed_loss(
        tiny_teacher, tmp_path, scoring, monkeypatch):
    kw = dict(dmd2_critic_scoring=scoring, dmd2_student_steps=4)
    plain_args = tiny_args(tiny_teacher, str(tmp_path), **kw)
    iteration = next(i for i in range(1, 100) if dmd2_iteration.draw_stop_step(plain_args, i, 4) > 0)  # mid-rollout
    actor = Trainer(preflight(tiny_args(tiny_teacher, str(tmp_path), dmd2_regression_weight=WEIGHT, **kw))["actor"], "actor")
    pairs, _ = actor.rollout(iteration)
    assert pairs["sigma"][0].item() < 1.0
    plain, _ = _critic(tiny_teacher, str(tmp_path), **kw).train(iteration, pairs)
    pulled, metrics = _critic(tiny_teacher, str(tmp_path), dmd2_regression_weight=WEIGHT, **kw).train(iteration, pairs)
    assert metrics["regression_grad_norm"] > 0 and metrics["regression_dmd_grad_ratio"] > 0

    critic = _critic(tiny_teacher, str(tmp_path), **kw)
    x0, cond = pairs["x0"], critic._cond(pairs["prompt_index"])
    # the student stopped on its own 4-step grid, the teacher's: the teacher takes that grid's remaining steps
    grid = fm.student_sigmas(4, critic.args.dmd2_shift) + [0.0]
    target = _teacher_sample(critic, pairs["x_t"], cond, grid[int(pairs["stop_step"][0]):])
    torch.testing.assert_close(pulled["dmd2_grad"], plain["dmd2_grad"] + 2 * WEIGHT * (x0 - target), atol=1e-5, rtol=1e-4)
    assert (pulled["dmd2_grad"] - plain["dmd2_grad"]).abs().max() > 1e-3

    # the actor's gradient w.r.t. its graded x0 is that of 0.5 mse(x0, sg(x0 - g_dmd)) + w mse(x0, target)
    import dmd2_core.train.actor as actor_module

    grads, graded = [], []
    real_loss = actor_module.dmd2_loss

    def spy(x0_graded, grad):
        graded.append(x0_graded.detach().clone())
        x0_graded.register_hook(lambda g: grads.append(g.detach().clone()))
        return real_loss(x0_graded, grad)

    monkeypatch.setattr(actor_module, "dmd2_loss", spy)
    actor.train(iteration, pairs, pulled)
    leaf = graded[0].clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(dmd2_loss(leaf, plain["dmd2_grad"]) + WEIGHT * torch.nn.functional.mse_loss(leaf, target), leaf)
    torch.testing.assert_close(grads[0], expected, atol=1e-9, rtol=1e-4)


def test_reference_loop_is_the_oracle_of_the_trainers_with_the_regression(tiny_teacher, tmp_path):
    args = tiny_args(tiny_teacher, str(tmp_path), micro_batch_size=3, dmd2_regression_weight=WEIGHT)
    trainers, loop = in_process_trainers(args), ReferenceLoop(args)
    plain = ReferenceLoop(tiny_args(tiny_teacher, str(tmp_path), micro_batch_size=3))
    for i in (1, 2):
        iterate_in_process(trainers, i)
        loop.iterate(i)
        plain.iterate(i)
    for role, theirs in (("actor", loop.student), ("critic", loop.critic)):
        a, b = trainers[role].weights(), theirs.state_dict()
        assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5, role
    a, b = loop.student.state_dict(), plain.student.state_dict()
    assert max((a[k] - b[k]).abs().max().item() for k in a) > 1e-5  # the pull changed the student


def test_on_the_joint_model_the_target_from_noise_is_the_clip_the_bench_calls_the_teachers_4_steps():
    """MiniMax-H3 (velocity sign reversed, video and audio each at its own sigma of one u): from the
    eval noise at u = 1 the target is the sounding-digits bench's "teacher at 4 steps" clip."""
    from dmd2_core.toys import sounding_digits_teacher
    from dmd2_core.toys import sounding_digits as sd

    torch.manual_seed(0)
    model = sounding_digits_teacher.new_av_teacher_model(seed=0).eval()
    family = sounding_digits_teacher.bound_family(model)
    labels = torch.arange(6) % 10
    bench_clips = sounding_digits_teacher.sample_clips(family, model, labels, 4, seed=5)
    noise = family.eval_noise(len(labels), 5)
    target = dmd2_iteration.regression_target(family, model, noise, torch.ones(len(labels)), sd.prompt_set().cond(labels), None,
                                    1.0, 4, 1.0)
    torch.testing.assert_close(target, bench_clips, atol=1e-5, rtol=1e-5)
    assert (target - sounding_digits_teacher.sample_clips(family, model, labels, 1, seed=5)).abs().max() > 1e-3
