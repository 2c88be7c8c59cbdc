"""The role-agnostic trainer: one rank of a trainer group.

It reads only the plain argument names of the args ``compute_trainer_args`` built for its trainer
(hf_checkpoint, lr, load, save, num_steps_per_rollout, loss_type, train_input_hook_path, ...), so
the actor (student) and the critic (fake score + frozen teacher) are the same class.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import socket
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from dmd2_core import checkpoint, dmd2, gan, parallel
from dmd2_core import export as exporting
from dmd2_core.args import Args
from dmd2_core.data import load_prompt_set, load_real_set
from dmd2_core.finite import NonFiniteCounter, is_finite, nonfinite_rows
from dmd2_core.hooks import batch_size, train_input_hook
from dmd2_core.losses import dmd2_loss
from dmd2_core.models import describe_checkpoint, load_checkpoint

SCORED = "dmd2_critic"  # the loss type whose train also scores the student's samples


def pick_device(args: Args) -> torch.device:
    # Ray exposes the actor's GPU share as cuda:0; num_gpus=0 actors see every GPU, so the args
    # decide, never CUDA_VISIBLE_DEVICES.
    return torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")


def micro_batches(n: int, micro: int):
    for start in range(0, n, micro):
        yield slice(start, min(start + micro, n))


class Trainer:
    """One rank. Models load in ``__init__`` (so colocated groups load at the same time); they are
    sharded, and the optimizer and EMA built on the shards, once the rank has joined its group
    (``init_process_group``; at once for a group of one rank)."""

    def __init__(self, args: Args, role: str, rank: int = 0, world_size: int = 1):
        torch.set_num_threads(args.torch_threads)
        if args.global_batch_size % world_size:
            raise ValueError(f"global_batch_size {args.global_batch_size} is not divisible by {world_size} ranks")
        parallel.check_shard_size(world_size, args.fsdp_shard_size)
        self.args, self.role, self.rank, self.world_size = args, role, rank, world_size
        self.device = pick_device(args)
        self.dtype = getattr(torch, args.dtype)  # the compute dtype; trained weights stay fp32
        self.hook = train_input_hook(args.train_input_hook_path)
        # models load on the host; sharding moves each rank's shards to the device
        loaded = load_checkpoint(args.hf_checkpoint, "cpu", parallel.MASTER_DTYPE)
        self.model = loaded.model
        self.family = loaded.family.bind(args.latent_shape, loaded.model, loaded.modality_shifts)
        self.shift = args.dmd2_shift or loaded.shift
        self.args = args.model_copy(update={"dmd2_shift": self.shift})
        self.teacher = None
        if args.loss_type == SCORED:
            self.teacher = load_checkpoint(args.teacher_checkpoint or args.hf_checkpoint, "cpu", self.dtype).model
        self.real = self.disc = self.disc_optimizer = None  # the GAN head: critic only, its own optimizer
        if args.loss_type == SCORED and args.gan_critic_weight:
            self.real = load_real_set(args.real_data)
            self.disc = gan.build_head(self.family.feature_dim(self.model), args.seed).to(self.device)
            self.disc_optimizer = torch.optim.AdamW(self.disc.parameters(), lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                                                    weight_decay=args.weight_decay)
        self.prompts = load_prompt_set(args.prompts)
        self.shape = self.family.sample_shape(self.model, args.latent_shape)
        self.modality_weights = args.dmd2_modality_weights
        self.local_batch = args.global_batch_size // world_size
        self.rows = slice(rank * self.local_batch, (rank + 1) * self.local_batch)
        self.step = 0
        self.nonfinite = NonFiniteCounter(role, args.max_nonfinite_steps)
        self.iteration: Optional[int] = None
        self.vae = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.ema: Optional[list[torch.Tensor]] = None
        self._stash: Optional[tuple[list, list]] = None
        self._pending: Optional[checkpoint.PendingSave] = None
        self._pending_export: Optional[concurrent.futures.Future] = None
        self.checkpoint_pg = None
        if world_size == 1:
            self.init_process_group()

    # ---- process group and sharding -----------------------------------------------------------
    def address(self) -> tuple[str, int]:
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def init_process_group(self, master_addr: Optional[str] = None, master_port: Optional[int] = None) -> None:
        """Join the group's process group, then shard the models and build the optimizer."""
        if self.optimizer is not None:
            return
        parallel.ensure_process_group(self.rank, self.world_size, self.device, master_addr, master_port,
                                      self.args.ray_timeout_s)
        args = self.args
        self.mesh = parallel.build_mesh(self.device, self.world_size, args.fsdp_shard_size)
        keep_fp32 = self.family.keep_fp32_modules
        parallel.shard_model(self.model, self.mesh, self.dtype, trainable=True, keep_fp32=keep_fp32,
                             gradient_checkpointing=args.gradient_checkpointing, cpu_offload=args.fsdp_cpu_offload)
        if self.teacher is not None:
            parallel.shard_model(self.teacher, self.mesh, self.dtype, trainable=False, keep_fp32=keep_fp32,
                                 cpu_offload=args.fsdp_cpu_offload)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
            weight_decay=args.weight_decay, foreach=True,  # one dispatch per op over all shards
        )
        if args.ema_decay:
            self.ema = [p.detach().clone() for p in self.model.parameters()]
        self.checkpoint_pg = checkpoint.checkpoint_group()

    def placement(self) -> dict:
        """Where Ray put this rank: its placement group and its share of the device resource."""
        import ray

        ctx = ray.get_runtime_context()
        name = self.args.resource_name
        return {"placement_group": ctx.get_placement_group_id(), "share": ctx.get_assigned_resources().get(name, 0.0)}

    # ---- conditions ---------------------------------------------------------------------------
    def _cond(self, prompt_index: torch.Tensor) -> dict:
        return {k: v.to(self.device) for k, v in self.prompts.cond(prompt_index.cpu()).items()}

    def _uncond(self, n: int) -> Optional[dict]:
        if self.args.dmd2_guidance_scale == 1.0:
            return None
        return {k: v.to(self.device) for k, v in self.prompts.uncond(n).items()}

    # ---- rollout ------------------------------------------------------------------------------
    def rollout(self, iteration: int):
        """Few-step generation with this rank's rows of the global batch, stopped at the step the
        DMD2 step strategy drew. Returns (train pairs, metrics)."""
        woke = self.wake_up()
        start = time.perf_counter()
        plan = dmd2.plan_rollout(self.args, iteration, len(self.prompts), self.shape, self.family.deterministic_student)
        pairs = dmd2.rollout_pairs(self.family, self.model, self._cond, _on(plan, self.device), self.rows)
        self._reshard()
        metrics = {"stop_step": plan.stop_step, "rollout_sigma": plan.sigmas[plan.stop_step],
                   "rollout_s": time.perf_counter() - start, **_wake_metric(self.role, woke)}
        return _cpu(pairs), metrics

    # ---- train --------------------------------------------------------------------------------
    def train(self, iteration: int, pairs: dict, external_data: Optional[dict] = None):
        """The train-input hook, then ``num_steps_per_rollout`` optimizer steps with micro-batching.
        Returns (outputs handed to later groups, metrics)."""
        woke = self.wake_up()
        start = time.perf_counter()
        self.iteration = iteration
        self.nonfinite.begin()
        pairs = self.hook(self.args, pairs, external_data)
        pairs = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in pairs.items()}
        if batch_size(pairs) != self.local_batch:
            raise ValueError(f"{self.role} rank {self.rank}: {batch_size(pairs)} train pairs, expected {self.local_batch}")
        if self.args.loss_type == "dmd2":
            outputs, metrics = self._train_dmd2(pairs)
        else:
            outputs, metrics = self._train_flow_matching(iteration, pairs)
        self._reshard()
        metrics[f"{self.role}_nonfinite_steps"] = self.nonfinite.this_call
        metrics[f"{self.role}_train_s"] = time.perf_counter() - start
        metrics.update(_wake_metric(self.role, woke))
        return _cpu(outputs), metrics

    def _train_flow_matching(self, iteration: int, pairs: dict):
        """Flow-matching steps on the pairs' (detached) x0; for the critic, also the scores."""
        args, B = self.args, self.local_batch
        x0 = pairs["x0"].detach()
        cond = self._cond(pairs["prompt_index"])
        global_shape = (args.global_batch_size, *x0.shape[1:])
        last = args.num_steps_per_rollout - 1
        scoring = args.loss_type == SCORED
        scores: list[dict] = []
        losses, grad_norms, sigmas, parts = [], [], [], []
        for step in range(args.num_steps_per_rollout):
            if scoring and step == last and args.dmd2_critic_scoring == "original":
                scores = self._score_separately(iteration, x0, cond, global_shape)
            sigma, noise = dmd2.noisy_inputs(args, iteration, dmd2.critic_stream(step), global_shape, self.rows)
            sigma, noise = sigma.to(self.device), noise.to(self.device)
            sigmas.append(sigma)
            fuse = scoring and step == last and args.dmd2_critic_scoring == "fused"
            real = self._real_batch(iteration, step, global_shape) if self.disc is not None else None
            total, modality_losses = 0.0, {}
            for mb in micro_batches(B, args.micro_batch_size):
                mb_cond = {k: v[mb] for k, v in cond.items()}
                out = gan.critic_forward(self.family, self.model, self.disc, args.gan_feature_block, x0[mb], noise[mb],
                                         sigma[mb], mb_cond, real and _rows(real, mb), args.gan_critic_weight,
                                         args.gan_weight if fuse and self.disc is not None and args.gan_weight else None,
                                         self.modality_weights)
                loss = out["loss"] * ((mb.stop - mb.start) / B)
                loss.backward()
                total += loss.item()
                parts += [{k: out[k] for k in ("logits_real", "logits_fake") if k in out}] if step == last else []
                for name, value in out.get("modality_loss", {}).items():
                    modality_losses[name] = modality_losses.get(name, 0.0) + value.item() * ((mb.stop - mb.start) / B)
                if fuse:
                    scores.append(self._score(x0[mb], out["x_t"], sigma[mb], mb_cond, v_fake=out["v"], gan_grad=out.get("gan_grad")))
            losses.append(total)
            grad_norm, stepped = self._optimizer_step(is_finite(total))
            grad_norms.append(grad_norm)
            if self.disc is not None:
                self._disc_step(stepped)
        metrics = {f"{self.role}_loss": sum(losses) / len(losses), f"{self.role}_loss_last": losses[-1],
                   f"{self.role}_grad_norm": grad_norms[-1], f"{self.role}_lr": self.optimizer.param_groups[0]["lr"],
                   f"{self.role}_sigma_mean": torch.cat(sigmas).mean().item(),
                   f"{self.role}_sigma_min": torch.cat(sigmas).min().item(),
                   f"{self.role}_sigma_max": torch.cat(sigmas).max().item(),
                   **{f"{self.role}_loss_{name}": value for name, value in modality_losses.items()}}
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
            gan_grad = torch.cat([s["gan_grad"] for s in scores])
            metrics["gan_grad_norm"] = gan_grad.flatten(1).norm(dim=1).mean().item()
            metrics["gan_dmd_grad_ratio"] = metrics["gan_grad_norm"] / max(metrics["dmd2_grad_norm"], 1e-12)
            grad = grad + gan_grad
        return {"dmd2_grad": grad}, metrics

    def _score(self, x0, x_t, sigma, cond, v_fake=None, gan_grad=None) -> dict:
        out = dmd2.score(self.family, self.teacher, self.model, x0, x_t, sigma, cond,
                         self._uncond(x0.shape[0]), self.args.dmd2_guidance_scale, v_fake=v_fake,
                         weights=self.modality_weights)
        return out if gan_grad is None else {**out, "gan_grad": gan_grad}

    def _score_separately(self, iteration, x0, cond, global_shape) -> list[dict]:
        """The reference's scoring: its own sigma and noise, before the critic's last step."""
        sigma, noise = dmd2.noisy_inputs(self.args, iteration, dmd2.SCORING_STREAM, global_shape, self.rows)
        sigma, noise = sigma.to(self.device), noise.to(self.device)
        scores = []
        for mb in micro_batches(self.local_batch, self.args.micro_batch_size):
            mb_cond = {k: v[mb] for k, v in cond.items()}
            if self.disc is not None and self.args.gan_weight:  # one critic forward for the score and g_gan
                out = gan.critic_forward(self.family, self.model, self.disc, self.args.gan_feature_block, x0[mb],
                                         noise[mb], sigma[mb], mb_cond, gen_weight=self.args.gan_weight,
                                         modality_weights=self.modality_weights)
                scores.append(self._score(x0[mb], out["x_t"], sigma[mb], mb_cond, v_fake=out["v"], gan_grad=out["gan_grad"]))
            else:
                scores.append(self._score(x0[mb], self.family.add_noise(x0[mb], noise[mb], sigma[mb]), sigma[mb], mb_cond))
        return scores

    def _real_batch(self, iteration: int, step: int, global_shape) -> tuple:
        """(real x0, its noise, its conditions) of critic step ``step`` for this rank's rows."""
        index, noise = gan.real_inputs(self.args, iteration, step, len(self.real), global_shape, self.rows)
        x, cond = self.real.batch(index)
        return x.to(self.device), noise.to(self.device), {k: v.to(self.device) for k, v in cond.items()}

    def _disc_step(self, critic_stepped: bool) -> float:
        """The GAN head's own step; replicated on every rank, so its gradient is all-reduced.
        Skipped with a skipped critic step (the ranks voted on that one) and on a non-finite
        gradient norm (the same on every rank once all-reduced)."""
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
        self.disc_optimizer.zero_grad(set_to_none=True)
        return norm

    def _train_dmd2(self, pairs: dict):
        """The student's graded forward at the stop step; loss 0.5 * mse(x0, sg(x0 - g))."""
        if "dmd2_grad" not in pairs:
            raise ValueError("loss_type dmd2 needs 'dmd2_grad' in the train pairs: the critic group's "
                             "scores, joined by the train-input hook")
        B = self.local_batch
        cond = self._cond(pairs["prompt_index"])
        total, drift = 0.0, 0.0
        for mb in micro_batches(B, self.args.micro_batch_size):
            mb_cond = {k: v[mb] for k, v in cond.items()}
            v = self.family.predict_velocity(self.model, pairs["x_t"][mb], pairs["sigma"][mb], mb_cond)
            x0 = self.family.velocity_to_x0(pairs["x_t"][mb], v, pairs["sigma"][mb])
            loss = dmd2_loss(x0, pairs["dmd2_grad"][mb]) * ((mb.stop - mb.start) / B)
            loss.backward()
            total += loss.item()
            drift = max(drift, (x0.detach() - pairs["x0"][mb]).abs().max().item())
        grad_norm, _ = self._optimizer_step(is_finite(total))
        return {}, {"dmd2_loss": total, "actor_grad_norm": grad_norm, "actor_lr": self.optimizer.param_groups[0]["lr"],
                    "graded_x0_drift": drift, "actor_dmd2_grad_nonfinite": nonfinite_rows(pairs["dmd2_grad"])}

    def _optimizer_step(self, loss_finite: bool = True) -> tuple[float, bool]:
        """Gradients are already averaged over the group's ranks (FSDP reduce-scatters them in
        fp32 during backward); clip on the global norm, step the fp32 master weights, EMA.
        Returns (the gradient norm, whether the step was taken: every rank agrees)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.args.clip_grad if self.args.clip_grad > 0 else float("inf")
        grad_norm = parallel.clip_grad_norm(params, max_norm)  # the global norm: every rank agrees
        # A non-finite loss or gradient norm: skip the step (no optimizer, no EMA update), count it.
        if self.world_size > 1:  # every rank must skip the same steps
            flag = torch.tensor([float(loss_finite)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            loss_finite = bool(flag.item())
        finite = loss_finite and is_finite(grad_norm)
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite.record(finite, self.iteration, f"loss finite: {loss_finite}, grad norm {grad_norm}")
        if not finite:
            return grad_norm, False
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            with torch.no_grad():
                for e, p in zip(self.ema, self.model.parameters()):
                    parallel.local(e).lerp_(parallel.local(p), 1.0 - self.args.ema_decay)
        self.step += 1
        return grad_norm, True

    @contextlib.contextmanager
    def _ema_weights(self):
        """The model's parameters hold the EMA inside the block (this rank's shards, exactly
        restored after); without an EMA, the model as it is. Parameters and EMA are swapped
        tensor by tensor, so the eval holds one tensor's copy at a time, not a second model."""
        if self.ema is None:
            yield
            return
        self._reshard()
        pairs = [(parallel.local(p), parallel.local(e)) for p, e in zip(self.model.parameters(), self.ema)]
        _swap(pairs)
        try:
            yield
        finally:
            _swap(pairs)

    # ---- eval ---------------------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, prompt_index: list[int], seed: int, decode: bool = True) -> Optional[torch.Tensor]:
        """Full K-step student samples (EMA weights when kept) for eval; same seed, same noise.
        Every rank of the group runs it (the sharded forward is a collective); rank 0 decodes
        and returns them. A sleeping trainer wakes for it and goes back to sleep."""
        was_asleep = self.asleep
        self.wake_up()
        with self._ema_weights():
            x0 = dmd2.eval_samples(self.family, self.model, self._cond(torch.tensor(prompt_index)),
                                   (len(prompt_index), *self.shape), seed, self.args.dmd2_student_steps,
                                   self.shift, self.device)
        self._reshard()
        if self.rank == 0 and decode:
            vae_url = describe_checkpoint(self.args.hf_checkpoint)["vae_url"]
            if self.vae is None and vae_url:
                self.vae = self.family.load_vae(vae_url, self.dtype)
            if self.vae is not None:
                self.vae.to(self.device)
            x0 = self.family.decode(self.vae, x0)
        if was_asleep:
            self.sleep()
        if self.rank != 0:
            return None
        if isinstance(x0, dict):  # a joint model: {'video', 'audio', 'sample_rate'}
            return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in x0.items()}
        return x0.cpu()

    # ---- sleep / wake -------------------------------------------------------------------------
    def _reshard(self) -> None:
        for module in (self.model, self.teacher):
            if module is not None:
                parallel.reshard(module)

    def _state_tensors(self):
        """This rank's tensors of the training state: weight shards, buffers, EMA, optimizer
        state, the teacher's shards and the GAN head with its optimizer state."""
        self._reshard()
        for module in (self.model, self.teacher, self.disc):
            if module is not None:
                yield from (parallel.local(t) for t in module.parameters())
                yield from (parallel.local(t) for t in module.buffers())
        yield from (parallel.local(e) for e in self.ema or ())
        for optimizer in (self.optimizer, self.disc_optimizer):
            for state in (optimizer.state.values() if optimizer is not None else ()):
                yield from (parallel.local(v) for v in state.values() if isinstance(v, torch.Tensor))

    def _device_storages(self) -> list[torch.UntypedStorage]:
        """The distinct storages behind the state on this rank's device (views share one; with
        fsdp_cpu_offload the shards already live on the host and are not counted; scalars such as
        AdamW's step counts stay where they are)."""
        seen: dict[int, torch.UntypedStorage] = {}
        for t in self._state_tensors():
            storage = t.untyped_storage()
            if t.device.type == self.device.type and t.dim() and storage.nbytes():
                seen.setdefault(storage.data_ptr(), storage)
        return list(seen.values())

    def _owned_slots(self) -> list[tuple]:
        """(holder, key) of the tensors this trainer alone refers to (EMA, optimizer moments):
        asleep, they are swapped out rather than resized (no other view of them exists). A
        distributed tensor's holder is itself (key ``_local_tensor``), a plain one's its state dict
        or the EMA list."""
        from torch.distributed.tensor import DTensor

        slots = [(e, "_local_tensor") if isinstance(e, DTensor) else (self.ema, i) for i, e in enumerate(self.ema or ())]
        for optimizer in (self.optimizer, self.disc_optimizer):
            for state in (optimizer.state.values() if optimizer is not None else ()):
                slots += [(v, "_local_tensor") if isinstance(v, DTensor) else (state, k)
                          for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim()]
        return [s for s in slots if _slot(*s).device.type == self.device.type]

    def sleep(self) -> dict:
        """Copy the state on the device to host memory and free it: the EMA's and optimizer's
        local tensors are swapped for empty ones, the model's and teacher's storages (which FSDP
        views) resized to zero bytes in place; idempotent."""
        if self._stash is not None:
            return {"asleep": True, "sleep_s": 0.0, "device_bytes_awake": 0, "bytes_freed": 0}
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        before = self.device_bytes()
        pin = self.device.type == "cuda"
        swapped = []
        for holder, key in self._owned_slots():
            value = _slot(holder, key)
            swapped.append((holder, key, _host_copy(value, pin)))
            _slot(holder, key, value.new_empty(0))
        resized = []
        for storage in self._device_storages():
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host.untyped_storage().copy_(storage)
            storage.resize_(0)
            resized.append((storage, host))
        self._stash = (swapped, resized)
        if self.vae is not None:  # the eval decoder (rank 0) goes to the host too; sample() brings it back
            self.vae.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return {"asleep": True, "sleep_s": time.perf_counter() - start, "device_bytes_awake": before,
                "bytes_freed": before - self.device_bytes()}

    def wake_up(self) -> dict:
        if self._stash is None:
            return {"asleep": False, "wake_s": 0.0}
        start = time.perf_counter()
        swapped, resized = self._stash
        for storage, host in resized:
            storage.resize_(host.numel())
            storage.copy_(host.untyped_storage())
        for holder, key, host in swapped:
            _slot(holder, key, host.to(self.device, copy=True))
        self._stash = None
        return {"asleep": False, "wake_s": time.perf_counter() - start}

    @property
    def asleep(self) -> bool:
        return self._stash is not None

    def device_bytes(self) -> int:
        """Bytes the training state holds on the device (allocator figure on CUDA)."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return sum(s.nbytes() for s in self._device_storages())

    def state_bytes(self) -> dict[str, int]:
        """Bytes of this rank's state by kind (storage sizes, any device, awake), to check the
        memory plan."""
        self.wake_up()
        def nbytes(tensors) -> int:
            return sum(parallel.local(t).untyped_storage().nbytes() for t in tensors)

        optimizer = [v for st in self.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        return {"params": nbytes(self.model.parameters()), "optimizer": nbytes(optimizer),
                "ema": nbytes(self.ema or ()), "teacher": nbytes(self.teacher.parameters()) if self.teacher else 0}

    def state_digest(self) -> str:
        """sha256 of this rank's state tensors (weights, EMA, optimizer), for bitwise comparisons."""
        self.wake_up()
        h = hashlib.sha256()
        for t in self._state_tensors():
            # a copy: a storage once shared with numpy can no longer be resized (slept)
            t = t.detach().to("cpu", copy=True).contiguous().reshape(-1)
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return h.hexdigest()

    def weights(self) -> dict[str, torch.Tensor]:
        """The whole trained weights on the host (a collective: every rank calls it)."""
        self.wake_up()
        self._reshard()
        return parallel.full_state_dict(self.model)

    # ---- checkpoints --------------------------------------------------------------------------
    def save(self, iteration: int, export: bool = False) -> dict:
        """Every rank writes its own shards (DCP); rank 0 the marker. With ``async_save`` the
        state is staged to host memory and the call returns while it is written; an earlier
        save still in flight is waited for first. ``export``: the student (and its EMA) is also
        gathered to rank 0 and written as a diffusers pipeline (dmd2_core.export), in the
        background too. Returns ``{'url', 'iteration', 'blocked_s'}`` plus, once durable,
        ``'save_s'``, ``'bytes'`` (this rank's) and the export's ``'export_url'``, ``'export_s'``."""
        start = time.perf_counter()
        self.save_status(wait=True)  # a later save waits for the earlier one (and raises if it failed)
        was_asleep = self.asleep
        self.wake_up()
        self._reshard()
        pending = checkpoint.save_trainer(
            self.args.save, self.role, iteration, self.model, self.optimizer, ema=self.ema,
            extra={"step": self.step, "iteration": iteration, **self.nonfinite.state(), **self._disc_state()},
            process_group=self.checkpoint_pg, asynchronous=self.args.async_save,
        )
        self._pending, self._pending_export = pending, None
        if export:
            run_write = functools.partial(_in_background, name=f"dmd2-export-{iteration}") if self.args.async_save else _done
            self._pending_export = exporting.export_student(
                checkpoint.export_url(self.args.save, iteration), self.model, teacher_url=self.args.hf_checkpoint,
                shift=self.shift, num_steps=self.args.dmd2_student_steps,
                export_dtype=getattr(torch, self.args.export_dtype or self.args.dtype), ema=self.ema,
                writer=self.rank == 0, iteration=iteration, run_write=run_write)
        if was_asleep:
            self.sleep()
        out = {"url": pending.url, "iteration": iteration, "blocked_s": time.perf_counter() - start}
        if pending.done() and (self._pending_export is None or self._pending_export.done()):
            out.update(self.save_status(wait=True))
        return out

    def save_status(self, wait: bool = False) -> Optional[dict]:
        """The latest save: None when there is none; ``{'pending': iteration}`` while it (or its
        export) is written (``wait``: block until it is durable); once durable, its result
        (``url``, ``save_s``, ``bytes``, ``export_url``, ``export_s``), every time it is asked. A
        save or export that failed raises its error."""
        pending, export = self._pending, self._pending_export
        if pending is None:
            return None
        if not wait and not (pending.done() and (export is None or export.done())):
            return {"pending": pending.iteration}
        out = dict(pending.result())
        if export is not None:
            done = export.result()
            out.update(export_url=done["url"], export_s=done["export_s"] + done["verify_s"], export_bytes=done["bytes"])
        return out

    def load(self, iteration: int, url: Optional[str] = None) -> int:
        """Load this trainer's checkpoint of ``iteration`` from ``url`` (default: its load URL);
        any number of ranks loads any checkpoint (each keeps its own shard)."""
        self.wake_up()
        extra = checkpoint.load_trainer(url or self.args.load_url, self.role, iteration, self.model,
                                        self.optimizer, ema=self.ema, process_group=self.checkpoint_pg)
        self.step = int(extra.get("step", 0))
        self.nonfinite.load(extra)
        if self.disc is not None and "disc" in extra:  # a checkpoint from before the head keeps the fresh head
            self.disc.load_state_dict(extra["disc"])
            self.disc_optimizer.load_state_dict(extra["disc_optimizer"])
        return self.step

    def _disc_state(self) -> dict:
        if self.disc is None:
            return {}
        return {"disc": self.disc.state_dict(), "disc_optimizer": self.disc_optimizer.state_dict()}


def _in_background(fn, name: str) -> concurrent.futures.Future:
    """``fn()`` on a daemon thread of its own (an actor killed meanwhile leaves nothing to join)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - raised by save_status
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def _done(fn) -> concurrent.futures.Future:
    """``fn()`` run now, as a finished future (its exception kept for whoever asks)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    try:
        future.set_result(fn())
    except Exception as exc:  # noqa: BLE001 - raised by save_status, like a background failure
        future.set_exception(exc)
    return future


def _wake_metric(role: str, woke: dict) -> dict:
    """The wake time, only from the call that actually woke the trainer."""
    return {f"{role}_wake_s": woke["wake_s"]} if woke["wake_s"] else {}


def _slot(holder, key, value: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Read (or, with ``value``, replace) a state tensor held as an attribute of a tensor or as
    an entry of a dict or list."""
    if value is None:
        return getattr(holder, key) if isinstance(holder, torch.Tensor) else holder[key]
    if isinstance(holder, torch.Tensor):
        setattr(holder, key, value)
    else:
        holder[key] = value
    return value


def _swap(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Exchange the values of each pair of same-shaped tensors in place."""
    with torch.no_grad():
        for a, b in pairs:
            held = a.clone()
            a.copy_(b)
            b.copy_(held)


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu", pin_memory=pin)
    host.copy_(t)
    return host


def _rows(real: tuple, mb: slice) -> tuple:
    x, noise, cond = real
    return x[mb], noise[mb], {k: v[mb] for k, v in cond.items()}


def _cpu(d: dict) -> dict:
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in d.items()}


def _on(plan: dmd2.RolloutPlan, device: torch.device) -> dmd2.RolloutPlan:
    return dmd2.RolloutPlan(plan.stop_step, plan.sigmas, plan.prompt_index, plan.noise.to(device),
                            [r.to(device) for r in plan.renoise])
