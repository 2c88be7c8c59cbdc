"""The DMD2 losses (Yin et al. 2024), as public functions."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dmd2_gradient(x0: torch.Tensor, x0_real: torch.Tensor, x0_fake: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The distribution-matching gradient g = (x0_fake - x0_real) / n with the per-sample
    normaliser n = mean over non-batch dims of |x0 - x0_real|. NaN/inf are NOT zeroed: zeroing
    would turn a broken score into a silent no-op; the trainer counts them and skips the step."""
    x0, x0_real, x0_fake = x0.float(), x0_real.float(), x0_fake.float()
    dims = tuple(range(1, x0.dim()))
    norm = (x0 - x0_real).abs().mean(dim=dims, keepdim=True) + eps
    return (x0_fake - x0_real) / norm


def dmd2_loss(x0: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """0.5 * mse(x0, sg(x0 - g)): its gradient w.r.t. x0 is exactly g / numel."""
    x0 = x0.float()
    target = (x0 - grad.float()).detach()
    return 0.5 * F.mse_loss(x0, target)


def flow_matching_loss(v_pred: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """mse(v, eps - sg(x0)): the critic's (and any flow-matching model's) loss."""
    return F.mse_loss(v_pred.float(), (noise.float() - x0.float()).detach())
