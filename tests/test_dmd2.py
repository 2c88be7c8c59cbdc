"""DMD2 itself: the gradient, the loss, CFG, scoring modes, the critic, and the two code paths."""

from __future__ import annotations

import pytest
import torch

from dmd2_core.train import dmd2_iteration
from dmd2_core import flow_matching as fm
from dmd2_core.run.distill_run import DistillRun, preflight
from dmd2_core.losses import dmd2_gradient, dmd2_loss, flow_matching_loss
from dmd2_core.train.reference import ReferenceLoop
from dmd2_core.train.trainer import Trainer
from tests.helpers import tiny_args


def test_dmd2_gradient_formula_with_a_per_sample_normaliser():
    x0 = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    real = torch.tensor([[0.0, 0.0], [1.0, -1.0]])
    fake = torch.tensor([[2.0, 1.0], [4.0, 1.0]])
    g = dmd2_gradient(x0, real, fake, eps=0.0)
    # sample 0: n = mean(|1|, |2|) = 1.5; sample 1: n = mean(|-1|, |1|) = 1
    torch.testing.assert_close(g, torch.tensor([[2 / 1.5, 1 / 1.5], [3.0, 2.0]]))
    # the normaliser is per sample: scaling one sample's error leaves the other's gradient alone
    g2 = dmd2_gradient(torch.stack([x0[0] * 10, x0[1]]), real, fake, eps=0.0)
    torch.testing.assert_close(g2[1], g[1])


def test_dmd2_gradient_keeps_nan_and_inf_where_they_are():
    """A broken score must not be zeroed into a silent no-op: it stays visible, per sample."""
    from dmd2_core.finite import nonfinite_rows

    x0 = torch.zeros(3, 3)
    fake = torch.tensor([[float("nan"), 1.0, 0.0], [float("inf"), 0, 0], [1.0, 0, 0]])
    g = dmd2_gradient(x0, torch.ones(3, 3), fake)
    assert g[0, 0].isnan() and g[1, 0].isinf() and torch.isfinite(g[2]).all()
    assert nonfinite_rows(g) == 2


def test_dmd2_loss_gradient_is_g_over_numel():
    x0 = torch.randn(3, 1, 4, 4, requires_grad=True)
    g = torch.randn(3, 1, 4, 4)
    dmd2_loss(x0, g).backward()
    torch.testing.assert_close(x0.grad, g / x0.numel())


def test_flow_matching_loss_target_is_noise_minus_x0():
    x0, eps = torch.randn(2, 4), torch.randn(2, 4)
    assert flow_matching_loss(eps - x0, eps, x0).item() == 0.0
    assert flow_matching_loss(torch.zeros(2, 4), eps, x0).item() == pytest.approx(((eps - x0) ** 2).mean().item())


def test_real_score_uses_standard_cfg_and_fake_score_the_conditional_branch(tiny_teacher, tmp_path):
    trainer = Trainer(preflight(tiny_args(tiny_teacher, str(tmp_path), dmd2_guidance_scale=3.0))["critic"], "critic")
    fam, n = trainer.family, 4
    cond, uncond = trainer._cond(torch.arange(n)), trainer._uncond(n)
    x0 = torch.randn(n, 1, 8, 8)
    sigma = torch.full((n,), 0.6)
    x_t = fm.add_noise(x0, torch.randn(n, 1, 8, 8), sigma)
    out = trainer.learner.score(x0, x_t, sigma, cond)
    with torch.no_grad():
        v_c = fam.predict_velocity(trainer.teacher, x_t, sigma, cond)
        v_u = fam.predict_velocity(trainer.teacher, x_t, sigma, uncond)
        v_fake = fam.predict_velocity(trainer.model, x_t, sigma, cond)
    guided = v_u + 3.0 * (v_c - v_u)  # standard CFG, written out
    torch.testing.assert_close(out["x0_real"], fm.velocity_to_x0(x_t, guided, sigma), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["x0_fake"], fm.velocity_to_x0(x_t, v_fake, sigma), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(v_c, v_u)  # the branches differ, so the check above has teeth


def _critic(teacher, save, scoring, steps):
    args = tiny_args(teacher, save, dmd2_critic_scoring=scoring, dmd2_update_ratio=steps)
    return Trainer(preflight(args)["critic"], "critic")


@pytest.mark.parametrize("scoring", ["fused", "original"])
def test_scoring_uses_the_critic_weights_and_noise_it_claims(tiny_teacher, tmp_path, scoring):
    actor = Trainer(preflight(tiny_args(tiny_teacher, str(tmp_path)))["actor"], "actor")
    pairs, _ = actor.rollout(1)
    two_steps = _critic(tiny_teacher, str(tmp_path), scoring, 2)
    outputs, _ = two_steps.train(1, pairs)
    # the critic weights of the last step = after one step with the same stream
    one_step = _critic(tiny_teacher, str(tmp_path), scoring, 1)
    one_step.train(1, pairs)
    stream = dmd2_iteration.critic_stream(1) if scoring == "fused" else dmd2_iteration.SCORING_STREAM
    x0 = pairs["x0"]
    sigma, noise = dmd2_iteration.noisy_inputs(two_steps.args, 1, stream, tuple(x0.shape), slice(None))
    expected = one_step.learner.score(x0, fm.add_noise(x0, noise, sigma), sigma, one_step._cond(pairs["prompt_index"]))
    torch.testing.assert_close(outputs["dmd2_grad"], expected["grad"], atol=1e-5, rtol=1e-4)
    # and not the other mode's noise
    other = dmd2_iteration.SCORING_STREAM if scoring == "fused" else dmd2_iteration.critic_stream(1)
    sigma_o, noise_o = dmd2_iteration.noisy_inputs(two_steps.args, 1, other, tuple(x0.shape), slice(None))
    wrong = one_step.learner.score(x0, fm.add_noise(x0, noise_o, sigma_o), sigma_o, one_step._cond(pairs["prompt_index"]))
    assert not torch.allclose(outputs["dmd2_grad"], wrong["grad"], atol=1e-3)


def test_critic_loss_falls_on_fixed_student_samples(tiny_teacher, tmp_path):
    args = tiny_args(tiny_teacher, str(tmp_path), lr=1e-3)
    roles = preflight(args)
    pairs, _ = Trainer(roles["actor"], "actor").rollout(1)
    critic = Trainer(roles["critic"].model_copy(update={"loss_type": "flow_matching"}), "critic")
    losses = [critic.train(1, pairs)[1]["critic_loss"] for _ in range(40)]
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5


@pytest.mark.parametrize("scoring", ["fused", "original"])
def test_reference_loop_and_ray_groups_give_the_same_weights(ray_session, tiny_teacher, tmp_path, scoring):
    args = tiny_args(tiny_teacher, str(tmp_path), dmd2_critic_scoring=scoring, ema_decay=0.5,
                     run_name=f"dmd2-ref-{scoring}")
    loop = ReferenceLoop(args)
    loop.run(3)
    with DistillRun(args) as run:
        run.rollout_ahead = lambda i: i < 3  # as the flow runs it: each iteration queued behind the last
        for i in (1, 2, 3):
            run.iterate(i)
        actor = run.group_call("actor", "weights")[0]
        critic = run.group_call("critic", "weights")[0]
        samples = run.sample([0, 1, 2], seed=5)
    student = loop.student.state_dict()
    assert max((actor[k] - student[k]).abs().max().item() for k in actor) < 1e-6
    fake = loop.critic.state_dict()
    assert max((critic[k] - fake[k]).abs().max().item() for k in critic) < 1e-6
    torch.testing.assert_close(samples, loop.sample([0, 1, 2], seed=5).clamp(-1, 1), atol=1e-5, rtol=0)
    initial = ReferenceLoop(args).student.state_dict()
    assert max((initial[k] - student[k]).abs().max().item() for k in initial) > 1e-6


@pytest.fixture(scope="module")
def teacher_target(short_teacher, tmp_path_factory):
    """The short teacher's 50-step samples of 500 balanced labels, in the digits classifier's
    feature space (what DMD2 matches), computed once for the module."""
    from dmd2_core.toys.digits_metrics import balanced_labels, eval_noise, features
    from dmd2_core.sampling import euler_sample

    loop = ReferenceLoop(tiny_args(short_teacher[0], str(tmp_path_factory.mktemp("target")), dmd2_guidance_scale=1.0))
    labels = balanced_labels(500)
    return labels, features(euler_sample(loop.family, loop.teacher, eval_noise(500, 1), loop.cond(labels),
                                         fm.euler_sigmas(50, loop.args.dmd2_shift)).clamp(-1, 1))


@pytest.mark.parametrize("gan", [False, True], ids=["dmd2", "dmd2+gan"])
def test_a_short_run_improves_the_student_over_its_initialisation(short_teacher, teacher_target, tmp_path, gan):
    """The student starts as the teacher's weights sampled in 4 steps; 60 DMD2 iterations must
    bring its samples clearly closer to the teacher's 50-step distribution, which DMD2 matches
    (the Fréchet distance in the digits classifier's feature space), also with the GAN head on
    (real data: the digits training split; the discriminator's weight in the critic's loss 0.1:
    at 1.0 it pulls the fake score's features away from denoising and the same run ends ~40%
    further from the teacher)."""
    from dmd2_core.toys.digits_metrics import features, frechet_distance

    heads = dict(real_data="digits", gan_weight=1.0, gan_critic_weight=0.1) if gan else {}
    args = tiny_args(short_teacher[0], str(tmp_path), global_batch_size=64, micro_batch_size=64,
                     dmd2_update_ratio=5, dmd2_guidance_scale=1.0, lr=2e-4, seed=0, **heads)
    loop = ReferenceLoop(args)
    labels, target = teacher_target

    def distance():
        return frechet_distance(features(loop.sample(labels.tolist(), seed=0).clamp(-1, 1)), target)

    before = distance()
    loop.run(60)
    after = distance()
    assert after < 0.7 * before, (before, after)


def test_each_rank_draws_only_its_rows_and_they_are_the_whole_batchs(tiny_teacher, tmp_path):
    """A rank's rollout noise, renoise and critic noise are its rows of the global draw, built
    without holding the other ranks' rows: 2 halves == the whole == today's global draw sliced."""
    from dmd2_core import rng

    args = tiny_args(tiny_teacher, str(tmp_path), global_batch_size=8, dmd2_shift=3.0)
    whole = dmd2_iteration.plan_rollout(args, 7, 10, (1, 8, 8), slice(None))
    halves = [dmd2_iteration.plan_rollout(args, 7, 10, (1, 8, 8), rows) for rows in (slice(0, 4), slice(4, 8))]
    assert whole.noise.shape == (8, 1, 8, 8) and halves[0].noise.shape == (4, 1, 8, 8)
    assert torch.equal(torch.cat([h.noise for h in halves]), whole.noise)
    assert torch.equal(whole.noise, rng.randn((8, 1, 8, 8), args.seed, 7, "noise"))  # the values of a global draw
    assert torch.equal(torch.cat([h.prompt_index for h in halves]), whole.prompt_index)
    assert all(torch.equal(torch.cat([h.renoise[j] for h in halves]), whole.renoise[j]) for j in range(whole.stop_step))
    sigma, noise = dmd2_iteration.noisy_inputs(args, 7, "critic/0", (8, 1, 8, 8), slice(None))
    parts = [dmd2_iteration.noisy_inputs(args, 7, "critic/0", (8, 1, 8, 8), rows) for rows in (slice(0, 4), slice(4, 8))]
    assert torch.equal(torch.cat([p[0] for p in parts]), sigma) and torch.equal(torch.cat([p[1] for p in parts]), noise)
    for shape in ((8, 3), (8, 4, 4), (5, 3, 7), (8, 2, 1)):  # rows of 3, 16, 21, 2 values: any alignment
        whole_draw = rng.randn(shape, 0, 7, "x")
        for rows in (slice(0, 1), slice(3, 6), slice(5, 8), slice(6, 6), slice(None)):
            assert torch.equal(rng.randn_rows(shape, rows, 0, 7, "x"), whole_draw[rows]), (shape, rows)
