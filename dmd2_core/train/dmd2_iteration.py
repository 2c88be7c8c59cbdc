"""The steps of one DMD2 iteration, shared by the Ray trainers and the plain reference loop.

Every draw covers the *global* batch and is sliced per rank, so 1 rank and N ranks see the same
numbers for the same sample.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch

from dmd2_core import flow_matching as fm
from dmd2_core import rng
from dmd2_core.args import Args
from dmd2_core.losses import dmd2_gradient, floored_modalities, weighted_modalities
from dmd2_core.models.base import ModelFamily
from dmd2_core.models.minimax_h3 import NOISED_CONDITIONS
from dmd2_core.sampling import guided_velocity, student_sample


def draw_student_steps(args: Args, iteration: int) -> int:
    """The step count K this iteration's rollout runs: the student's K, or with a set of them
    one drawn by ``dmd2_student_steps_weights`` from its own stream (so a set of one draws
    nothing and every other stream is today's), the same on every rank."""
    counts = args.student_step_counts
    if len(counts) == 1:
        return counts[0]
    weights = torch.tensor(args.dmd2_student_steps_weights or [1.0] * len(counts), dtype=torch.float64)
    g = rng.generator(args.seed, iteration, "student_steps")
    return counts[int(torch.multinomial(weights, 1, generator=g))]


def draw_stop_step(args: Args, iteration: int, num_steps: int) -> int:
    """The DMD2 step strategy: k ~ U{0..K-1} per iteration (backward simulation over the
    iteration's K-step schedule), the same on every rank; without backward simulation the
    student trains at its first step (pure noise)."""
    if not args.dmd2_backward_simulation:
        return 0
    g = rng.generator(args.seed, iteration, "stop_step")
    return int(torch.randint(num_steps, (1,), generator=g))


def student_is_euler(family: ModelFamily, args: Args) -> bool:
    """Whether the student steps along its velocity (no fresh noise): ``dmd2_student_sampler``,
    else the family's own."""
    if args.dmd2_student_sampler is None:
        return family.deterministic_student
    return args.dmd2_student_sampler == "euler"


def with_student_sampler(family: ModelFamily, args: Args) -> ModelFamily:
    """``family`` stepping the student as ``dmd2_student_sampler`` and ``student_modality_shifts``
    say (a copy when it differs)."""
    family = family.stepping_at(args.student_modality_shifts)
    euler = student_is_euler(family, args)
    if euler == family.deterministic_student:
        return family
    changed = copy.copy(family)
    changed.deterministic_student = euler
    return changed


@dataclass
class RolloutPlan:
    stop_step: int
    sigmas: list[float]
    prompt_index: torch.Tensor  # [rows] of this rank
    noise: torch.Tensor  # [rows, ...]
    renoise: list[torch.Tensor]  # stop_step tensors [rows, ...]


def plan_rollout(args: Args, iteration: int, num_prompts: int, shape: tuple[int, ...], rows: slice,
                 deterministic: bool = False) -> RolloutPlan:
    """The rollout of ``rows`` of the global batch: the stop step and the prompts are drawn for the
    whole batch (G numbers), the noise for these rows only."""
    G = args.global_batch_size
    num_steps = draw_student_steps(args, iteration)
    k = draw_stop_step(args, iteration, num_steps)
    prompt_index = torch.randint(num_prompts, (G,), generator=rng.generator(args.seed, iteration, "prompts"))[rows]
    noise = rng.randn_rows((G, *shape), rows, args.seed, iteration, "noise")
    renoise = [] if deterministic else [rng.randn_rows((G, *shape), rows, args.seed, iteration, f"renoise/{j}")
                                        for j in range(k)]
    return RolloutPlan(k, fm.student_sigmas(num_steps, args.dmd2_shift), prompt_index, noise, renoise)


@torch.no_grad()
def rollout_pairs(family: ModelFamily, student, cond_of, plan: RolloutPlan) -> dict:
    """Run the student's steps < k for the plan's rows and return their train pairs
    (x at sigma_k, sigma_k, prompt index, the no-grad x0 predicted there)."""
    prompt_index = plan.prompt_index
    x_t, x0 = student_sample(
        family, student, plan.noise, cond_of(prompt_index), plan.sigmas, plan.renoise, stop_step=plan.stop_step,
    )
    n = x_t.shape[0]
    return {
        "x_t": x_t,
        "sigma": torch.full((n,), plan.sigmas[plan.stop_step]),
        "prompt_index": prompt_index,
        "x0": x0,
        "stop_step": torch.full((n,), plan.stop_step, dtype=torch.long),
        "student_steps": torch.full((n,), len(plan.sigmas), dtype=torch.long),
    }


def noisy_inputs(args: Args, iteration: int, stream: str, x0_global_shape: tuple[int, ...], rows: slice):
    """Fresh (sigma, noise) of one critic step or scoring pass for this rank's rows:
    sigma = clamp(shift(u), min, max), u ~ U(0, 1) per sample."""
    G = x0_global_shape[0]
    sigma = fm.sample_sigmas(
        G, args.dmd2_shift, rng.generator(args.seed, iteration, f"{stream}/sigma"),
        args.dmd2_min_sigma, args.dmd2_max_sigma,
    )
    return sigma[rows], rng.randn_rows(x0_global_shape, rows, args.seed, iteration, f"{stream}/noise")


def critic_stream(step: int) -> str:
    return f"critic/{step}"


SCORING_STREAM = "scoring"


@torch.no_grad()
def micro_batches(n: int, micro: int):
    """Slices of ``micro`` rows (the last one may be shorter) covering a batch of ``n`` rows."""
    for start in range(0, n, micro):
        yield slice(start, min(start + micro, n))


def score(
    family: ModelFamily,
    teacher,
    critic,
    x0: torch.Tensor,
    x_t: torch.Tensor,
    sigma: torch.Tensor,
    cond: dict,
    uncond: Optional[dict],
    guidance_scale: float,
    v_fake: Optional[torch.Tensor] = None,
    weights: Optional[dict[str, float]] = None,
    floors: Optional[dict[str, float]] = None,
) -> dict:
    """Teacher (real score, CFG) and critic (fake score, conditional) x0 predictions at x_t, and
    the DMD gradient for the student's x0 (each modality's part weighted by ``weights`` and left
    out below its floor in ``floors``). ``v_fake`` reuses a critic forward already made."""
    if v_fake is None:
        v_fake = family.predict_velocity(critic, x_t, sigma, cond)
    v_real = guided_velocity(family, teacher, x_t, sigma, cond, uncond, guidance_scale)
    x0_fake = family.velocity_to_x0(x_t, v_fake.detach(), sigma)
    x0_real = family.velocity_to_x0(x_t, v_real, sigma)
    grad = floored_modalities(dmd2_gradient(x0, x0_real, x0_fake, family.segments, weights), sigma, family.segments, floors)
    return {"grad": grad, "x0_real": x0_real, "x0_fake": x0_fake}


def regression_sigmas(sigma: float, num_steps: int, shift: float) -> list[float]:
    """The teacher's own ``num_steps``-step grid (on the DMD schedule) continued from ``sigma``:
    ``sigma``, the grid's sigmas below it, then 0."""
    return [sigma, *(s for s in fm.student_sigmas(num_steps, shift) if s < sigma - 1e-6), 0.0]


@torch.no_grad()
def regression_target(family: ModelFamily, teacher, x_t: torch.Tensor, sigma: torch.Tensor, cond: dict,
                      uncond: Optional[dict], guidance_scale: float, num_steps: int, shift: float) -> torch.Tensor:
    """DMD's regression target, made on the fly instead of from stored pairs: the frozen teacher's
    own ``num_steps``-step Euler sampler (with the real score's guidance), run on from the
    student's ``x_t`` at ``sigma`` to 0. From pure noise it is the teacher's num_steps-step sample."""
    levels = sigma.unique()
    if levels.numel() != 1:  # the rollout stops every row of an iteration at one step
        raise ValueError(f"regression target: rows at {levels.numel()} different sigmas, expected one")
    x, n = x_t.float(), x_t.shape[0]
    sigmas = regression_sigmas(float(levels), num_steps, shift)
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        s_rows = x.new_full((n,), s)
        x0 = family.velocity_to_x0(x, guided_velocity(family, teacher, x, s_rows, cond, uncond, guidance_scale), s_rows)
        x = x0.float() if s_next == 0.0 else family.euler_step(x, x0, s_rows, x.new_full((n,), s_next))
    return x


def regression_gradient(x0: torch.Tensor, target: torch.Tensor, weight: float,
                        segments: Optional[dict[str, slice]] = None,
                        modality_weights: Optional[dict[str, float]] = None) -> torch.Tensor:
    """weight * mse(x0, target) as a gradient for the actor's x0 beside the DMD one: dmd2_loss turns
    g into g / numel, so this is 2 * weight * (x0 - target), each modality's part of a joint sample
    scaled by its ``modality_weights``."""
    return weighted_modalities(2.0 * weight * (x0.float() - target.float()), segments, modality_weights)


@torch.no_grad()
def eval_samples(family: ModelFamily, model, cond: dict, shape: tuple[int, ...], seed: int,
                 num_steps: int, shift: float, device=None, rows: Optional[list[int]] = None) -> torch.Tensor:
    """Full K-step student samples for eval. The noise is drawn as a diffusers pipeline with
    FlowMatchLCMScheduler and ``torch.Generator().manual_seed(seed)`` draws it (the latents, then
    one draw per step), so an exported student reproduces these samples with diffusers alone.

    ``rows`` (a data-parallel rank's share, ``parallel.EvalShare``): only those rows of the batch
    of ``shape``, ``cond`` holding theirs. Each draw is the whole batch's, then cut to the rows, so
    row i's noise is the same whichever rank samples it and however many ranks share the batch."""
    noise, g = eval_start_noise(family, shape, seed, cond)
    index = None if rows is None else torch.tensor(rows, dtype=torch.long)

    def cut(t: torch.Tensor) -> torch.Tensor:
        return (t if index is None else t.index_select(0, index)).to(device)
    renoise = [] if g is None or family.deterministic_student else \
        [cut(torch.randn(shape, generator=g)) for _ in range(num_steps)]
    cond = eval_cond(family, cond, shape[0], seed, rows)
    return student_sample(family, model, cut(noise), cond, fm.student_sigmas(num_steps, shift), renoise)[1]


def eval_start_noise(family: ModelFamily, shape: tuple[int, ...], seed: int, cond: Optional[dict] = None):
    """The noise an eval's samples start from, and the generator that drew it (None where the
    family's pipeline draws it per sample, sample j from seed + j, after the draws of its noised
    conditions, keyframes or image references, where ``cond`` holds them): the student's eval
    samples and the teacher's reference samples of the same prompts start from the same noise."""
    noise = family.eval_noise(shape[0], seed, _condition_shapes(cond)[1])
    if noise is not None:
        return noise, None
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), g


def eval_cond(family: ModelFamily, cond: dict, n: int, seed: int, rows: Optional[list[int]] = None) -> dict:
    """``cond`` of an eval batch of ``n`` samples (``rows`` of it: this rank's share), with each
    sample's condition noise as its request draws it where it holds noised conditions (MiniMax-H3's
    fl2va keyframes, ref2va image references: ``keyframe_noise`` / ``reference_noise``, sample j's
    from seed + j, before its clip's noise), so the sample is the one the exported student's
    pipeline gives from the same inputs; as it is otherwise."""
    key, shapes = _condition_shapes(cond)
    if not shapes:
        return cond
    noise = family.eval_condition_noise(n, seed, shapes)
    if rows is not None:
        noise = noise.index_select(0, torch.tensor(rows, dtype=torch.long))
    return dict(cond, **{NOISED_CONDITIONS[key]: noise.to(cond[key].device)})


def _condition_shapes(cond: Optional[dict]) -> tuple[Optional[str], tuple]:
    """The key of ``cond``'s noised conditions and each one's latent shape per sample (none: ())."""
    for key in NOISED_CONDITIONS:
        if cond and key in cond:
            return key, (tuple(cond[key].shape[2:]),) * int(cond[key].shape[1])
    return None, ()
