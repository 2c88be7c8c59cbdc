"""The optimizer step every trainer takes after its backward passes (actor and critic alike):
clip on the global gradient norm, step the fp32 master weights, update the EMA, and skip the
step on every rank when any rank saw a non-finite loss or norm."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from dmd2_core import parallel
from dmd2_core.finite import NonFiniteCounter, is_finite


class ModelUpdate:
    """The steps of one trained model: ``steps`` counts those taken (skipped ones are counted by
    ``nonfinite``)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ema: Optional[list[torch.Tensor]],
                 ema_decay: float, clip_grad: float, nonfinite: NonFiniteCounter, world_size: int,
                 device: torch.device):
        self.model, self.optimizer, self.ema = model, optimizer, ema
        self.ema_decay, self.clip_grad = ema_decay, clip_grad
        self.nonfinite, self.world_size, self.device = nonfinite, world_size, device
        self.steps = 0

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def step(self, iteration: Optional[int], loss_finite: bool = True) -> tuple[float, bool]:
        """Gradients are already reduced over the group's ranks (FSDP reduce-scatters them in
        fp32 during backward: a mean over data-parallel ranks, summed over a context group's parts
        of the sequence, see dmd2_core.context_parallel); clip on the global norm, step the fp32
        master weights, EMA.
        Returns (the gradient norm, whether the step was taken: every rank agrees)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.clip_grad if self.clip_grad > 0 else float("inf")
        grad_norm = parallel.clip_grad_norm(params, max_norm)  # the global norm: every rank agrees
        # A non-finite loss or gradient norm: skip the step (no optimizer, no EMA update), count it.
        if self.world_size > 1:  # every rank must skip the same steps
            flag = torch.tensor([float(loss_finite)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            loss_finite = bool(flag.item())
        finite = loss_finite and is_finite(grad_norm)
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite.record(finite, iteration, f"loss finite: {loss_finite}, grad norm {grad_norm}")
        if not finite:
            return grad_norm, False
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            with torch.no_grad():
                for e, p in zip(self.ema, (p for p in self.model.parameters() if p.requires_grad)):
                    parallel.local(e).lerp_(parallel.local(p), 1.0 - self.ema_decay)
        self.steps += 1
        return grad_norm, True
