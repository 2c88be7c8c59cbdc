"""The DMD2 losses (Yin et al. 2024), as public functions."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def dmd2_gradient(x0: torch.Tensor, x0_real: torch.Tensor, x0_fake: torch.Tensor,
                  segments: Optional[dict[str, slice]] = None, weights: Optional[dict[str, float]] = None,
                  eps: float = 1e-6) -> torch.Tensor:
    """The distribution-matching gradient g = (x0_fake - x0_real) / n with the per-sample
    normaliser n = mean over non-batch dims of |x0 - x0_real|. With ``segments`` (the modalities
    of a flat joint sample) each modality has its own normaliser and is scaled by its weight.
    NaN/inf are NOT zeroed: zeroing would turn a broken score into a silent no-op; the trainer
    counts them and skips the step."""
    x0, x0_real, x0_fake = x0.float(), x0_real.float(), x0_fake.float()
    if segments is None:
        dims = tuple(range(1, x0.dim()))
        norm = (x0 - x0_real).abs().mean(dim=dims, keepdim=True) + eps
        return (x0_fake - x0_real) / norm
    parts = []
    for name, seg in segments.items():
        diff = (x0[:, seg] - x0_real[:, seg]).abs().mean(dim=1, keepdim=True) + eps
        parts.append((weights or {}).get(name, 1.0) * (x0_fake[:, seg] - x0_real[:, seg]) / diff)
    return torch.cat(parts, dim=1)


def weighted_modalities(grad: torch.Tensor, segments: Optional[dict[str, slice]],
                        weights: Optional[dict[str, float]]) -> torch.Tensor:
    """A gradient of flat joint samples with each modality's part scaled by its weight (default 1);
    ``grad`` itself without segments or weights."""
    if segments is None or not weights:
        return grad
    return torch.cat([weights.get(name, 1.0) * grad[:, seg] for name, seg in segments.items()], dim=1)


def floored_modalities(grad: torch.Tensor, sigma, segments: Optional[dict[str, slice]],
                       floors: Optional[dict[str, float]]) -> torch.Tensor:
    """A gradient of flat joint samples drawn at ``sigma`` (per sample) with each modality's part
    zeroed for the samples below its floor (``floors``: modality -> the lowest sigma its part comes
    from); ``grad`` itself without segments or floors."""
    if segments is None or not floors:
        return grad
    sigma = torch.as_tensor(sigma, dtype=torch.float32, device=grad.device).reshape(-1, 1).expand(grad.shape[0], 1)
    return torch.cat([grad[:, seg] * (sigma >= floors[name]).to(grad.dtype) if name in floors else grad[:, seg]
                      for name, seg in segments.items()], dim=1)


def dmd2_loss(x0: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """0.5 * mse(x0, sg(x0 - g)): its gradient w.r.t. x0 is exactly g / numel."""
    x0 = x0.float()
    target = (x0 - grad.float()).detach()
    return 0.5 * F.mse_loss(x0, target)


def flow_matching_loss(v_pred: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor,
                       segments: Optional[dict[str, slice]] = None,
                       weights: Optional[dict[str, float]] = None) -> torch.Tensor:
    """mse(v, eps - sg(x0)): the critic's (and any flow-matching model's) loss. With ``segments``,
    the weighted mean of each modality's own mse (a modality's share does not follow its size)."""
    if segments is None:
        return F.mse_loss(v_pred.float(), (noise.float() - x0.float()).detach())
    per = modality_mse(v_pred, noise, x0, segments)
    w = {name: (weights or {}).get(name, 1.0) for name in segments}
    return sum(w[name] * per[name] for name in segments) / sum(w.values())


def modality_mse(v_pred: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor,
                 segments: dict[str, slice]) -> dict[str, torch.Tensor]:
    target = (noise.float() - x0.float()).detach()
    return {name: F.mse_loss(v_pred.float()[:, seg], target[:, seg]) for name, seg in segments.items()}
