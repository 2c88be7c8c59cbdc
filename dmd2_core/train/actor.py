"""The actor's training (loss type ``dmd2``): the student's graded forward at the rollout's stop
step, pulled towards x0 - g by the critic's DMD2 gradient g."""

from __future__ import annotations

from typing import Callable

import torch

from dmd2_core.train.dmd2_iteration import micro_batches
from dmd2_core.finite import is_finite, nonfinite_rows
from dmd2_core.losses import dmd2_loss
from dmd2_core.train.model_update import ModelUpdate


class Actor:
    def __init__(self, family, model: torch.nn.Module, update: ModelUpdate, cond: Callable[[torch.Tensor], dict],
                 local_batch: int, micro_batch_size: int):
        self.family, self.model, self.update, self.cond = family, model, update, cond
        self.local_batch, self.micro_batch_size = local_batch, micro_batch_size

    def train(self, iteration: int, pairs: dict) -> tuple[dict, dict]:
        """One step on loss 0.5 * mse(x0, sg(x0 - g)). Returns (no outputs, metrics)."""
        if "dmd2_grad" not in pairs:
            raise ValueError("loss_type dmd2 needs 'dmd2_grad' in the train pairs: the critic group's "
                             "scores, joined by the train-input hook")
        B = self.local_batch
        cond = self.cond(pairs["prompt_index"])
        total, drift = 0.0, 0.0
        for mb in micro_batches(B, self.micro_batch_size):
            mb_cond = {k: v[mb] for k, v in cond.items()}
            v = self.family.predict_velocity(self.model, pairs["x_t"][mb], pairs["sigma"][mb], mb_cond)
            x0 = self.family.velocity_to_x0(pairs["x_t"][mb], v, pairs["sigma"][mb])
            loss = dmd2_loss(x0, pairs["dmd2_grad"][mb]) * ((mb.stop - mb.start) / B)
            loss.backward()
            total += loss.item()
            drift = max(drift, (x0.detach() - pairs["x0"][mb]).abs().max().item())
        grad_norm, _ = self.update.step(iteration, is_finite(total))
        return {}, {"dmd2_loss": total, "actor_grad_norm": grad_norm, "actor_lr": self.update.lr,
                    "graded_x0_drift": drift, "actor_dmd2_grad_nonfinite": nonfinite_rows(pairs["dmd2_grad"])}
