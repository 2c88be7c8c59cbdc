"""The plain DMD2 reference loop: one process, no Ray, no Prefect, whole batches.

It runs the same iteration as the trainer groups with the same dmd2_core functions and the same
random streams, so it is both the cross-check of the distributed path (same weights after N
iterations) and the baseline of the orchestration-overhead benchmark.
"""

from __future__ import annotations

import copy
import time
from typing import Optional

import torch

from dmd2_core import size_schedule
from dmd2_core.train import dmd2_iteration
from dmd2_core.train import gan
from dmd2_core.models import lora, step_conditioning
from dmd2_core.args import Args
from dmd2_core.data import load_prompt_set, load_real_set
from dmd2_core.losses import dmd2_loss, weighted_modalities
from dmd2_core.models import load_model_dir, transformer_folder


def adamw(model, args: Args, lr: float):
    """AdamW over ``model``'s trained parameters, as the trainers build it (a fake score's step vectors
    in their own group)."""
    groups = step_conditioning.optimizer_groups(model, lora.trained_parameters(model), lr, args.dmd2_critic_step_lr_scale)
    return torch.optim.AdamW(groups, lr=lr, betas=(args.adam_beta1, args.adam_beta2),
                             weight_decay=args.weight_decay, foreach=True)  # as the trainers


def _step(model, optimizer, clip: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf")).item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


class ReferenceLoop:
    def __init__(self, args: Args):
        torch.set_num_threads(args.torch_threads)
        folder = transformer_folder(args.workflow)  # the repository partition the run distills
        teacher = load_model_dir(args.hf_checkpoint, transformer=folder)
        self.args = args.model_copy(update={"dmd2_shift": args.dmd2_shift or teacher.shift})
        # a joint model (MiniMax-H3) needs its clip geometry and its two schedules bound
        self.family = dmd2_iteration.with_student_sampler(
            teacher.family.bind(args.latent_shape, teacher.model, teacher.modality_shifts), args)
        self.teacher_family, self.modality_shifts = teacher.family, teacher.modality_shifts
        self.student = lora.attach(load_model_dir(args.hf_checkpoint, transformer=folder).model, args)
        from dmd2_core.train.trainer_config import TrainerConfig, compute_trainer_args, critic_overrides

        critic_args = compute_trainer_args(args, TrainerConfig("critic", critic_overrides(args)))
        critic = load_model_dir(critic_args.hf_checkpoint, transformer=folder).model
        self.critic = step_conditioning.attach_for(lora.attach(critic, critic_args), self.family, critic_args)
        step_conditioning.init(self.critic)
        # a LoRA fake score of the teacher shares its base, as in the critic group
        self.teacher = lora.RealScore(self.critic) if lora.shares_base(critic_args) else \
            teacher.model.requires_grad_(False).eval()
        self.student_opt = adamw(self.student, args, args.lr)
        self.critic_opt = adamw(self.critic, args, args.critic_lr or args.lr)
        self.ema = copy.deepcopy(self.student).requires_grad_(False) if args.ema_decay else None
        self.heads = self.disc = self.real = None
        if args.gan_critic_weight:
            self.real = load_real_set(args.real_data)
            counts = args.student_step_counts if step_conditioning.is_conditioned(self.critic) else None
            self.heads = self.disc = gan.build_heads(self.family.feature_dim(self.critic), args.seed, counts)
            self.disc_opt = adamw(self.heads, args, args.critic_lr or args.lr)
        self.prompts = load_prompt_set(args.prompts)
        self.shape = self.family.sample_shape(self.student, args.latent_shape)

    def cond(self, prompt_index):
        return self.prompts.cond(prompt_index)

    def iterate(self, iteration: int) -> dict:
        args, everything = self.args, slice(None)
        start = time.perf_counter()
        family, shape = self.at_size(iteration)
        plan = dmd2_iteration.plan_rollout(args, iteration, len(self.prompts), shape, everything,
                                 family.deterministic_student)
        pairs = dmd2_iteration.rollout_pairs(family, self.student, self.cond, plan)
        self.disc = gan.head_for(self.heads, len(plan.sigmas))  # the GAN head of this K
        with step_conditioning.at(self.critic, len(plan.sigmas)):  # the fake score sees the iteration's K
            return self._train_critic_and_student(iteration, family, plan, pairs, start)

    def at_size(self, iteration: int) -> tuple:
        """(family, sample shape) of ``iteration``: the full size, or a size schedule's smaller
        stage (its latents resolved, as preflight resolves them), as the trainers."""
        latent_shape = size_schedule.latent_shape_at(self.args, iteration)
        if latent_shape is None:
            return self.family, self.shape
        family = dmd2_iteration.with_student_sampler(
            self.teacher_family.bind(latent_shape, self.student, self.modality_shifts), self.args)
        return family, family.sample_shape(self.student, latent_shape)

    def _train_critic_and_student(self, iteration: int, family, plan, pairs: dict, start: float) -> dict:
        args, everything = self.args, slice(None)
        x0, cond = pairs["x0"], self.cond(pairs["prompt_index"])
        guidance = args.guidance_at(len(plan.sigmas))  # the real score's at this K
        uncond = self.prompts.uncond(x0.shape[0]) if args.uses_guidance else None
        shape = tuple(x0.shape)

        gen_weight = args.gan_weight if self.disc is not None and args.gan_weight else None
        gan_grad = None
        draws = family.drawing_at(args.dmd2_modality_shifts)  # the critic's and the DMD gradient's noise, as the critic's

        def scores_at(stream, v_fake=None, noisy=None):
            sigma, noise = noisy or dmd2_iteration.noisy_inputs(args, iteration, stream, shape, everything)
            x_t = draws.add_noise(x0, noise, sigma)  # each modality at its own sigma, as the critic
            return dmd2_iteration.score(draws, self.teacher, self.critic, x0, x_t, sigma, cond, uncond,
                              guidance, v_fake=v_fake, weights=args.dmd2_modality_weights,
                              floors=args.dmd2_modality_min_sigma)

        scores = None
        last = args.dmd2_update_ratio - 1
        for step in range(args.dmd2_update_ratio):
            if step == last and args.dmd2_critic_scoring == "original":
                noisy = dmd2_iteration.noisy_inputs(args, iteration, dmd2_iteration.SCORING_STREAM, shape, everything)
                if gen_weight is not None:  # g_gan at the scoring pass's own sigma and noise
                    out = gan.critic_forward(draws, self.critic, self.disc, args.gan_feature_block, x0, noisy[1],
                                             noisy[0], cond, gen_weight=gen_weight,
                                             modality_weights=args.dmd2_modality_weights,
                                             judged=args.gan_judged_modalities)
                    scores, gan_grad = scores_at(None, v_fake=out["v"], noisy=noisy), out["gan_grad"]
                else:
                    scores = scores_at(None, noisy=noisy)
            sigma, noise = dmd2_iteration.noisy_inputs(args, iteration, dmd2_iteration.critic_stream(step), shape, everything)
            real = None
            if self.disc is not None:
                index, noise_real = gan.real_inputs(args, iteration, step, len(self.real), shape, everything)
                x_real, cond_real = self.real.batch(index)
                real = (x_real, noise_real, cond_real)
            fuse = step == last and args.dmd2_critic_scoring == "fused"
            out = gan.critic_forward(draws, self.critic, self.disc, args.gan_feature_block, x0, noise, sigma, cond,
                                     real, args.gan_critic_weight, gen_weight if fuse else None,
                                     args.dmd2_modality_weights, args.gan_judged_modalities)
            critic_loss = out["loss"]
            critic_loss.backward()
            if fuse:
                scores = scores_at(None, v_fake=out["v"], noisy=(sigma, noise))
                gan_grad = out.get("gan_grad")
            critic_norm = _step(self.critic, self.critic_opt, args.clip_grad)
            if self.disc is not None:
                _step(self.disc, self.disc_opt, args.clip_grad)

        v = family.predict_velocity(self.student, pairs["x_t"], pairs["sigma"], cond)
        x0_graded = family.velocity_to_x0(pairs["x_t"], v, pairs["sigma"])  # as the actor
        if gan_grad is not None:
            gan_grad = weighted_modalities(gan_grad, family.segments, args.gan_modality_weights)
        grad = scores["grad"] if gan_grad is None else scores["grad"] + gan_grad
        if args.dmd2_regression_weight:
            target = dmd2_iteration.regression_target(family, self.teacher, pairs["x_t"], pairs["sigma"], cond, uncond,
                                            guidance, args.dmd2_regression_steps, args.dmd2_shift)
            grad = grad + dmd2_iteration.regression_gradient(x0, target, args.dmd2_regression_weight, family.segments,
                                                             args.dmd2_regression_modality_weights)
        loss = dmd2_loss(x0_graded, grad)
        loss.backward()
        student_norm = _step(self.student, self.student_opt, args.clip_grad)
        if self.ema is not None:
            with torch.no_grad():
                for e, p in zip(self.ema.parameters(), self.student.parameters()):
                    e.lerp_(p, 1.0 - args.ema_decay)
        return {"iteration": iteration, "stop_step": plan.stop_step, "critic_loss": critic_loss.item(),
                **({"student_steps": len(plan.sigmas)} if len(args.student_step_counts) > 1 else {}),
                "critic_grad_norm": critic_norm, "dmd2_loss": loss.item(), "actor_grad_norm": student_norm,
                "dmd2_grad_norm": scores["grad"].flatten(1).norm(dim=1).mean().item(),
                **({} if gan_grad is None else gan.gan_grad_norms(gan_grad, family.segments)),
                "iteration_s": time.perf_counter() - start}

    def run(self, num_iterations: int, first: int = 1) -> list[dict]:
        return [self.iterate(i) for i in range(first, first + num_iterations)]

    def sample(self, prompt_index, seed: int, num_steps: Optional[int] = None,
               cond: Optional[dict] = None) -> torch.Tensor:
        """K-step samples (EMA weights when kept), the same noise as Trainer.sample; ``num_steps``
        one of the student's step counts (default its largest); ``cond`` conditions of the samples'
        own instead of the prompt set's rows (held-out keyframes)."""
        model = self.ema if self.ema is not None else self.student
        cond = self.cond(torch.as_tensor(prompt_index)) if cond is None else cond
        return dmd2_iteration.eval_samples(self.family, model, cond,
                                 (len(prompt_index), *self.shape), seed, num_steps or self.args.max_student_steps,
                                 self.args.dmd2_shift)
