"""Samplers: the teacher's Euler ODE solve with classifier-free guidance, and the student's
few-step x0-prediction sampler (predict x0, re-noise to the next sigma with fresh noise)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from dmd2_core.models.base import ModelFamily


def guided_velocity(
    family: ModelFamily,
    model: torch.nn.Module,
    x_t: torch.Tensor,
    sigma: torch.Tensor,
    cond: dict,
    uncond: Optional[dict],
    guidance_scale: float,
) -> torch.Tensor:
    """Standard CFG: v_u + w (v_c - v_u); w = 1 (or no uncond) is the conditional branch alone.
    Both branches run in one batched forward, each on its side's conditions (``family.sample_cond``:
    a workflow's keyframes too); an entry the unconditional side has none of (keyframes given with
    a text-only negative, an eval's keyframe noise: the sample's own draw) is the sample's in both."""
    if uncond is None or guidance_scale == 1.0:
        return family.predict_velocity(model, x_t, sigma, cond)
    n = x_t.shape[0]
    negative = family.sample_cond(uncond)
    both = {k: torch.cat([negative.get(k, v), v]) for k, v in family.sample_cond(cond).items()}
    sig = torch.as_tensor(sigma, dtype=torch.float32).expand(n)
    v = family.predict_velocity(model, torch.cat([x_t, x_t]), torch.cat([sig, sig]), both)
    v_u, v_c = v[:n], v[n:]
    return v_u + guidance_scale * (v_c - v_u)


@torch.no_grad()
def euler_sample(
    family: ModelFamily,
    model: torch.nn.Module,
    noise: torch.Tensor,
    cond: dict,
    sigmas: Sequence[float],
    uncond: Optional[dict] = None,
    guidance_scale: float = 1.0,
) -> torch.Tensor:
    """Integrate dx/ds = v from sigmas[0] to sigmas[-1] (0) with Euler steps."""
    x = noise.float()
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        v = guided_velocity(family, model, x, torch.tensor(s), cond, uncond, guidance_scale)
        x = x + (s_next - s) * v
    return x


def student_step_x0(
    family: ModelFamily, model: torch.nn.Module, x_t: torch.Tensor, sigma: float, cond: dict
) -> torch.Tensor:
    v = family.predict_velocity(model, x_t, torch.tensor(sigma), cond)
    return family.velocity_to_x0(x_t, v, torch.tensor(sigma))


@torch.no_grad()
def student_sample(
    family: ModelFamily,
    model: torch.nn.Module,
    noise: torch.Tensor,
    cond: dict,
    sigmas: Sequence[float],
    renoise: Sequence[torch.Tensor],
    stop_step: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's few-step generation. ``sigmas`` are the K step sigmas (no terminal 0);
    ``renoise[j]`` is the fresh noise that re-noises step j's x0 to sigmas[j + 1] (a family with
    deterministic student steps moves x along its Euler line instead and takes no renoise).

    With ``stop_step=k`` (backward simulation) the steps < k run and the function returns
    (x at sigmas[k], the x0 predicted there); without, it returns (x at the last step, final x0)."""
    k = len(sigmas) - 1 if stop_step is None else stop_step
    x = noise.float()
    for j in range(k):
        x0 = student_step_x0(family, model, x, sigmas[j], cond)
        if family.deterministic_student:
            x = family.euler_step(x, x0, torch.tensor(sigmas[j]), torch.tensor(sigmas[j + 1]))
        else:
            x = family.add_noise(x0, renoise[j], torch.tensor(sigmas[j + 1]))
    x0 = student_step_x0(family, model, x, sigmas[k], cond)
    return x, x0
