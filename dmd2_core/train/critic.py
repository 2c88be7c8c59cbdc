"""The critic's training (loss types ``flow_matching`` and ``dmd2_critic``): flow-matching steps
of the fake score on the student's samples, the scores (the DMD2 gradient, with the GAN head's
generator gradient) handed to the actor, and the GAN head's own steps."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from dmd2_core.train import dmd2_iteration
from dmd2_core.train import gan
from dmd2_core.args import Args
from dmd2_core.data import RealSet
from dmd2_core.train.dmd2_iteration import micro_batches
from dmd2_core.finite import NonFiniteCounter, is_finite, nonfinite_rows
from dmd2_core.losses import weighted_modalities
from dmd2_core.train.model_update import ModelUpdate
from dmd2_core.models import step_conditioning

SCORED = "dmd2_critic"  # the loss type whose train also scores the student's samples


class Critic:
    """The critic of one rank: ``teacher`` only when it scores, ``disc`` (the GAN head, replicated
    on every rank, with its own optimizer) and ``real`` (the real set) only with the head."""

    def __init__(self, args: Args, role: str, family, model: torch.nn.Module, update: ModelUpdate,
                 cond: Callable[[torch.Tensor], dict], uncond: Callable[[int], Optional[dict]], rows: slice,
                 device: torch.device, world_size: int, teacher: Optional[torch.nn.Module] = None,
                 disc: Optional[torch.nn.Module] = None, disc_optimizer: Optional[torch.optim.Optimizer] = None,
                 real: Optional[RealSet] = None):
        self.args, self.role, self.family, self.model, self.update = args, role, family, model, update
        self.cond, self.uncond, self.rows, self.device, self.world_size = cond, uncond, rows, device, world_size
        self.local_batch = rows.stop - rows.start
        self.teacher, self.disc, self.disc_optimizer, self.real = teacher, disc, disc_optimizer, real
        self.modality_weights = args.dmd2_modality_weights
        self.guidance = args.dmd2_guidance_scale  # the real score's scale; train sets the drawn K's
        # the head's skipped steps: limited like the critic's own, and saved with the head
        self.disc_nonfinite = NonFiniteCounter(f"{role} GAN head", args.max_nonfinite_steps, key="gan_nonfinite")

    def train(self, iteration: int, pairs: dict) -> tuple[dict, dict]:
        """Flow-matching steps on the pairs' (detached) x0; scoring (loss type dmd2_critic), also
        the scores. Returns (outputs handed to the actor, metrics). A fake score told the step
        count sees the pairs' one (``step_conditioning``), and the GAN head is that K's; the real
        score is guided at that K's scale (``Args.guidance_at``)."""
        counts = self.args.student_step_counts
        num_steps = step_conditioning.batch_steps(pairs) if len(counts) > 1 else counts[0]
        self.guidance = self.args.guidance_at(num_steps)
        if not step_conditioning.is_conditioned(self.model):
            return self._train(iteration, pairs)
        heads, self.disc = self.disc, gan.head_for(self.disc, num_steps)  # the GAN head of this K
        try:
            with step_conditioning.at(self.model, num_steps):
                return self._train(iteration, pairs)
        finally:
            self.disc = heads

    def _train(self, iteration: int, pairs: dict) -> tuple[dict, dict]:
        args, B = self.args, self.local_batch
        self.disc_nonfinite.begin()
        x0 = pairs["x0"].detach()
        cond = self.cond(pairs["prompt_index"])
        global_shape = (args.global_batch_size, *x0.shape[1:])
        last = args.num_steps_per_rollout - 1
        scoring = args.loss_type == SCORED
        scores: list[dict] = []
        losses, grad_norms, sigmas, parts = [], [], [], []
        for step in range(args.num_steps_per_rollout):
            if scoring and step == last and args.dmd2_critic_scoring == "original":
                scores = self._score_separately(iteration, x0, cond, global_shape)
            sigma, noise = dmd2_iteration.noisy_inputs(args, iteration, dmd2_iteration.critic_stream(step), global_shape, self.rows)
            sigma, noise = sigma.to(self.device), noise.to(self.device)
            sigmas.append(sigma)
            fuse = scoring and step == last and args.dmd2_critic_scoring == "fused"
            real = self._real_batch(iteration, step, global_shape) if self.disc is not None else None
            total, modality_losses = 0.0, {}
            for mb in micro_batches(B, args.micro_batch_size):
                mb_cond = {k: v[mb] for k, v in cond.items()}
                out = gan.critic_forward(self.draws, self.model, self.disc, args.gan_feature_block, x0[mb], noise[mb],
                                         sigma[mb], mb_cond, real and _rows(real, mb), args.gan_critic_weight,
                                         args.gan_weight if fuse and self.disc is not None and args.gan_weight else None,
                                         self.modality_weights, args.gan_judged_modalities)
                loss = out["loss"] * ((mb.stop - mb.start) / B)
                loss.backward()
                total += loss.item()
                parts += [{k: out[k] for k in ("logits_real", "logits_fake") if k in out}] if step == last else []
                for name, value in out.get("modality_loss", {}).items():
                    modality_losses[name] = modality_losses.get(name, 0.0) + value.item() * ((mb.stop - mb.start) / B)
                if fuse:
                    scores.append(self.score(x0[mb], out["x_t"], sigma[mb], mb_cond, v_fake=out["v"], gan_grad=out.get("gan_grad")))
            losses.append(total)
            grad_norm, stepped = self.update.step(iteration, is_finite(total))
            grad_norms.append(grad_norm)
            if self.disc is not None:
                self._disc_step(iteration, stepped)
        metrics = {f"{self.role}_loss": sum(losses) / len(losses), f"{self.role}_loss_last": losses[-1],
                   f"{self.role}_grad_norm": grad_norms[-1], f"{self.role}_lr": self.update.lr,
                   f"{self.role}_sigma_mean": torch.cat(sigmas).mean().item(),
                   f"{self.role}_sigma_min": torch.cat(sigmas).min().item(),
                   f"{self.role}_sigma_max": torch.cat(sigmas).max().item(),
                   **{f"{self.role}_loss_{name}": value for name, value in modality_losses.items()}}
        if self.disc is not None:  # the same skips on every rank: counted once, by the first rows' rank
            metrics["gan_nonfinite"] = self.disc_nonfinite.this_call if self.rows.start == 0 else 0
        if not scoring:
            return {}, metrics
        grad = torch.cat([s["grad"] for s in scores])
        gap = torch.cat([(s["x0_real"] - s["x0_fake"]).abs().flatten(1).mean(1) for s in scores])
        metrics.update({"dmd2_grad_nonfinite": nonfinite_rows(grad),  # counted, never zeroed
                        "dmd2_grad_norm": grad.flatten(1).norm(dim=1).mean().item(),
                        "dmd2_real_fake_gap": gap.mean().item(), **gan.gan_metrics(parts)})
        for name, seg in (self.family.segments or {}).items():  # per modality of a joint model
            real_fake = torch.cat([(s["x0_real"][:, seg] - s["x0_fake"][:, seg]).abs().mean(1) for s in scores])
            metrics[f"dmd2_grad_norm_{name}"] = grad[:, seg].norm(dim=1).mean().item()
            metrics[f"dmd2_real_fake_gap_{name}"] = real_fake.mean().item()
        if "gan_grad" in scores[0]:  # handed over summed: the actor's x0 gradient is (g_dmd + g_gan) / numel
            gan_grad = weighted_modalities(torch.cat([s["gan_grad"] for s in scores]), self.family.segments,
                                           args.gan_modality_weights)
            metrics.update(gan.gan_grad_norms(gan_grad, self.family.segments))
            metrics["gan_dmd_grad_ratio"] = metrics["gan_grad_norm"] / max(metrics["dmd2_grad_norm"], 1e-12)
            grad = grad + gan_grad
        if args.dmd2_regression_weight:  # handed over summed too: (g_dmd [+ g_gan] + g_reg) / numel
            reg_grad = self._regression_gradient(pairs, x0, cond)
            metrics["regression_grad_norm"] = reg_grad.flatten(1).norm(dim=1).mean().item()
            metrics["regression_dmd_grad_ratio"] = metrics["regression_grad_norm"] / max(metrics["dmd2_grad_norm"], 1e-12)
            grad = grad + reg_grad
        return {"dmd2_grad": grad}, metrics

    @property
    def draws(self):
        """The family the critic's steps and the DMD gradient draw their noise at (``dmd2_modality_shifts``;
        the regression target's teacher sampler steps on ``family``'s schedules, as the student)."""
        return self.family.drawing_at(self.args.dmd2_modality_shifts)

    def score(self, x0, x_t, sigma, cond, v_fake=None, gan_grad=None) -> dict:
        """The teacher's and the fake score's view of ``x0`` noised to ``x_t`` (``dmd2.score``),
        with the GAN head's generator gradient ``gan_grad`` alongside when there is one."""
        out = dmd2_iteration.score(self.draws, self.teacher, self.model, x0, x_t, sigma, cond,
                         self.uncond(x0.shape[0]), self.guidance, v_fake=v_fake,
                         weights=self.modality_weights, floors=self.args.dmd2_modality_min_sigma)
        return out if gan_grad is None else {**out, "gan_grad": gan_grad}

    def _regression_gradient(self, pairs: dict, x0: torch.Tensor, cond: dict) -> torch.Tensor:
        """The regression pull on the student's x0, one micro-batch of the teacher's sampler at a time
        (each step a no-grad teacher forward, under the critic's own peak)."""
        args, grads = self.args, []
        for mb in micro_batches(self.local_batch, args.micro_batch_size):
            target = dmd2_iteration.regression_target(
                self.family, self.teacher, pairs["x_t"][mb], pairs["sigma"][mb], {k: v[mb] for k, v in cond.items()},
                self.uncond(mb.stop - mb.start), self.guidance, args.dmd2_regression_steps, args.dmd2_shift)
            grads.append(dmd2_iteration.regression_gradient(x0[mb], target, args.dmd2_regression_weight,
                                                            self.family.segments, args.dmd2_regression_modality_weights))
        return torch.cat(grads)

    def _score_separately(self, iteration, x0, cond, global_shape) -> list[dict]:
        """The reference's scoring: its own sigma and noise, before the critic's last step."""
        sigma, noise = dmd2_iteration.noisy_inputs(self.args, iteration, dmd2_iteration.SCORING_STREAM, global_shape, self.rows)
        sigma, noise = sigma.to(self.device), noise.to(self.device)
        scores = []
        for mb in micro_batches(self.local_batch, self.args.micro_batch_size):
            mb_cond = {k: v[mb] for k, v in cond.items()}
            if self.disc is not None and self.args.gan_weight:  # one critic forward for the score and g_gan
                out = gan.critic_forward(self.draws, self.model, self.disc, self.args.gan_feature_block, x0[mb],
                                         noise[mb], sigma[mb], mb_cond, gen_weight=self.args.gan_weight,
                                         modality_weights=self.modality_weights, judged=self.args.gan_judged_modalities)
                scores.append(self.score(x0[mb], out["x_t"], sigma[mb], mb_cond, v_fake=out["v"], gan_grad=out["gan_grad"]))
            else:
                scores.append(self.score(x0[mb], self.draws.add_noise(x0[mb], noise[mb], sigma[mb]), sigma[mb], mb_cond))
        return scores

    def _real_batch(self, iteration: int, step: int, global_shape) -> tuple:
        """(real x0, its noise, its conditions) of critic step ``step`` for this rank's rows."""
        index, noise = gan.real_inputs(self.args, iteration, step, len(self.real), global_shape, self.rows)
        x, cond = self.real.batch(index)
        return x.to(self.device), noise.to(self.device), {k: v.to(self.device) for k, v in cond.items()}

    def _disc_step(self, iteration: int, critic_stepped: bool) -> float:
        """The GAN head's own step; replicated on every rank, so its gradient is all-reduced.
        Skipped with a skipped critic step (the ranks voted on that one, and counted it) and on a
        non-finite gradient norm (the same on every rank once all-reduced): counted, and
        ``max_nonfinite_steps`` such skips in a row fail the run."""
        params = [p for p in self.disc.parameters() if p.grad is not None]
        norm = float("nan")
        if critic_stepped:
            if self.world_size > 1:
                for p in params:
                    dist.all_reduce(p.grad)
                    p.grad /= self.world_size
            norm = torch.nn.utils.clip_grad_norm_(params, self.args.clip_grad or float("inf")).item()
            if is_finite(norm):
                self.disc_optimizer.step()
            self.disc_nonfinite.record(is_finite(norm), iteration, f"GAN head gradient norm {norm}")
        self.disc_optimizer.zero_grad(set_to_none=True)
        return norm


def _rows(real: tuple, mb: slice) -> tuple:
    x, noise, cond = real
    return x[mb], noise[mb], {k: v[mb] for k, v in cond.items()}
