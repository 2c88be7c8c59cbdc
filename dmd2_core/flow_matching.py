"""Rectified-flow math: x_t = (1 - s) x0 + s eps, v = eps - x0, model timestep = 1000 s."""

from __future__ import annotations

import numpy as np
import torch

NUM_TRAIN_TIMESTEPS = 1000


def broadcast_sigma(sigma: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    sigma = torch.as_tensor(sigma, dtype=torch.float32, device=like.device)
    if sigma.dim() == like.dim():  # already per element (a family's sigma field)
        return sigma
    return sigma.reshape(-1, *([1] * (like.dim() - 1))) if sigma.dim() else sigma


def shift_sigma(u, shift: float):
    """s(u) = S u / (1 + (S - 1) u): the timestep shift of SD3-style schedulers."""
    return shift * u / (1 + (shift - 1) * u)


def add_noise(x0: torch.Tensor, noise: torch.Tensor, sigma) -> torch.Tensor:
    s = broadcast_sigma(sigma, x0)
    return ((1 - s) * x0.float() + s * noise.float()).to(x0.dtype)


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return noise.float() - x0.float()


def velocity_to_x0(x_t: torch.Tensor, v: torch.Tensor, sigma) -> torch.Tensor:
    """x0 = x_t - s v, computed in fp32."""
    return x_t.float() - broadcast_sigma(sigma, x_t) * v.float()


def x0_to_velocity(x_t: torch.Tensor, x0: torch.Tensor, sigma) -> torch.Tensor:
    s = broadcast_sigma(sigma, x_t).clamp_min(1e-8)
    return (x_t.float() - x0.float()) / s


def timestep(sigma: torch.Tensor) -> torch.Tensor:
    return sigma * NUM_TRAIN_TIMESTEPS


def sample_sigmas(
    n: int, shift: float, generator: torch.Generator, min_sigma: float = 0.0, max_sigma: float = 1.0
) -> torch.Tensor:
    """u ~ U(0, 1), shifted, clamped to [min_sigma, max_sigma]."""
    u = torch.rand(n, generator=generator)
    return shift_sigma(u, shift).clamp(min_sigma, max_sigma)


def student_sigmas(num_steps: int, shift: float) -> list[float]:
    """The K-step student schedule: base [1, (K-1)/K, ..., 1/K] warped by the shift."""
    base = np.linspace(1.0, 0.0, num_steps + 1)[:-1]
    return [float(s) for s in shift_sigma(base, shift)]


def euler_sigmas(num_steps: int, shift: float) -> list[float]:
    """The teacher's Euler grid, exactly as diffusers' FlowMatchEulerDiscreteScheduler(shift=S)
    .set_timesteps(N) builds it (the training sigma range is shifted first, then the grid again),
    followed by the terminal 0."""
    train_sigma_min = shift_sigma(1.0 / NUM_TRAIN_TIMESTEPS, shift)
    grid = np.linspace(1.0, train_sigma_min, num_steps)
    return [float(s) for s in shift_sigma(grid, shift)] + [0.0]
