"""The role-agnostic trainer: one rank of a trainer group.

It reads only the plain argument names of the args ``compute_trainer_args`` built for its trainer
(hf_checkpoint, lr, load, save, num_steps_per_rollout, loss_type, train_input_hook_path, ...), so
the actor (student) and the critic (fake score + frozen teacher) are the same class. It sequences;
the work is elsewhere: the actor's and the critic's training in ``actor`` and ``critic``, the
optimizer step in ``model_update``, sleep and wake in ``device_stash``, saves in ``saves``.
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
import time
from typing import Optional, Union

import torch

from dmd2_core import checkpoint, context_parallel, parallel, size_schedule
from dmd2_core.train import dmd2_iteration
from dmd2_core.train import gan
from dmd2_core.models import lora, step_conditioning
from dmd2_core.train.actor import Actor
from dmd2_core.args import Args
from dmd2_core.train.critic import SCORED, Critic
from dmd2_core.data import open_prompt_set, open_real_set
from dmd2_core.train.device_stash import DeviceStash, distinct_storages, slot
from dmd2_core.train.eval_sampling import EvalSampling
from dmd2_core.finite import NonFiniteCounter
from dmd2_core.train.input_hook import batch_size, train_input_hook
from dmd2_core.train.model_update import ModelUpdate
from dmd2_core.train.rank_outputs import RankOutputs
from dmd2_core.train.trainer_models import TrainerModels
from dmd2_core.train.trainer_config import optimizer_settings, run_origin


def pick_device(args: Args) -> torch.device:
    # Ray exposes the actor's GPU share as cuda:0; num_gpus=0 actors see every GPU, so the args
    # decide, never CUDA_VISIBLE_DEVICES.
    return torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")


class Trainer(EvalSampling):
    """One rank. Models are built on the meta device in ``__init__``; once the rank has joined its
    group (``init_process_group``; at once for a group of one rank) they are sharded, each rank
    reads its own shards (``dmd2_core.train.trainer_models``), and the optimizer and EMA are built on them."""

    def __init__(self, args: Args, role: str, rank: int = 0, world_size: int = 1):
        torch.set_num_threads(args.torch_threads)
        parallel.check_shard_size(world_size, args.fsdp_shard_size)
        self.dp_rank, self.dp_size = parallel.data_parallel(rank, world_size, args.cp_size)
        if args.global_batch_size % self.dp_size:
            raise ValueError(f"global_batch_size {args.global_batch_size} is not divisible by the data-parallel size "
                             f"{self.dp_size} ({world_size} ranks / cp_size {args.cp_size})")
        self.args, self.role, self.rank, self.world_size = args, role, rank, world_size
        self.device = pick_device(args)
        self.dtype = getattr(torch, args.dtype)  # the compute dtype; trained weights stay fp32
        self.hook = train_input_hook(args.train_input_hook_path)
        # built on the meta device; sharding fills each rank's shards (dmd2_core.train.trainer_models). A LoRA
        # critic whose fake score is the teacher's LoRA has no teacher: one base (dmd2_core.models.lora)
        teacher = args.teacher_checkpoint or args.hf_checkpoint
        self.models = TrainerModels(args, self.dtype, teacher if args.loss_type == SCORED and not lora.shares_base(args)
                                    else None)
        self.model, self.teacher = self.models.model, self.models.teacher
        self.family = dmd2_iteration.with_student_sampler(
            self.models.family.bind(args.latent_shape, self.model, self.models.modality_shifts), args)
        self.shift = args.dmd2_shift or self.models.shift
        self.args = args.model_copy(update={"dmd2_shift": self.shift})
        self.real = self.disc = self.disc_optimizer = None  # the GAN head: critic only, its own optimizer
        if args.loss_type == SCORED and args.gan_critic_weight:
            self.real = open_real_set(args.real_data)
            counts = args.student_step_counts if step_conditioning.is_conditioned(self.model) else None  # a head per K
            self.disc = gan.build_heads(self.family.feature_dim(self.model), args.seed, counts).to(self.device)
            self.disc_optimizer = torch.optim.AdamW(self.disc.parameters(), **optimizer_settings(args))
        self.prompts = open_prompt_set(args.prompts)
        self.shape = self.family.sample_shape(self.model, args.latent_shape)  # the full size: the eval's
        self._sizes: dict[tuple, tuple] = {}  # a size schedule's smaller stages: latents -> (family, sample shape)
        self.local_batch = args.global_batch_size // self.dp_size  # a context group shares its rows
        self.rows = slice(self.dp_rank * self.local_batch, (self.dp_rank + 1) * self.local_batch)
        self.nonfinite = NonFiniteCounter(role, args.max_nonfinite_steps)
        self.run_record = self._run_record()  # here, on every rank: a save never reads storage first
        self.vae = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.ema: Optional[list[torch.Tensor]] = None
        self.update: Optional[ModelUpdate] = None
        self.learner: Optional[Union[Actor, Critic]] = None  # what ``train`` runs: by loss type
        self._stash: Optional[DeviceStash] = None
        self.outputs = RankOutputs(self.args, role, rank, self.shift, self.family.deterministic_student)
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
        self.models.shard(self.mesh)
        for module, trainable in ((self.model, True), (self.teacher, False)):
            if module is not None:
                context_parallel.enable(module, self.mesh, args.cp_size, self.device, trainable, self.family)
        settings = optimizer_settings(args)
        groups = step_conditioning.optimizer_groups(self.model, lora.trained_parameters(self.model), settings["lr"],
                                                args.dmd2_critic_step_lr_scale)
        self.optimizer = torch.optim.AdamW(groups, **settings, foreach=True)  # one dispatch per op over all shards
        if args.ema_decay:
            self.ema = [p.detach().clone() for p in lora.trained_parameters(self.model)]
        self.checkpoint_pg = checkpoint.checkpoint_group()
        self.update = ModelUpdate(self.model, self.optimizer, self.ema, args.ema_decay, args.clip_grad, self.nonfinite,
                                  self.world_size, self.device)
        if args.loss_type == "dmd2":
            self.learner = Actor(self.family, self.model, self.update, self._cond, self.local_batch, args.micro_batch_size)
        else:
            self.learner = Critic(args, self.role, self.family, self.model, self.update, self._cond, self._uncond,
                                  self.rows, self.device, self.world_size, disc=self.disc,
                                  teacher=self.teacher if self.teacher is not None else lora.RealScore(self.model),
                                  disc_optimizer=self.disc_optimizer, real=self.real)

    def _reshard(self) -> None:
        for module in (self.model, self.teacher):
            if module is not None:
                parallel.reshard(module)

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
        if not self.args.uses_guidance:
            return None
        return {k: v.to(self.device) for k, v in self.prompts.uncond(n).items()}

    # ---- rollout ------------------------------------------------------------------------------
    def rollout(self, iteration: int):
        """Few-step generation with this rank's rows of the global batch, stopped at the step the
        DMD2 step strategy drew. Returns (train pairs, metrics)."""
        woke = self.wake_up()
        start = time.perf_counter()
        family, shape = self.at_size(iteration)
        plan = dmd2_iteration.plan_rollout(self.args, iteration, len(self.prompts), shape, self.rows,
                                 family.deterministic_student)
        pairs = dmd2_iteration.rollout_pairs(family, self.model, self._cond, _on(plan, self.device))
        self._reshard()
        stage = size_schedule.stage_index(self.args, iteration)
        metrics = {"stop_step": plan.stop_step, "rollout_sigma": plan.sigmas[plan.stop_step],
                   **({"student_steps": len(plan.sigmas)} if len(self.args.student_step_counts) > 1 else {}),
                   **({"size_stage": stage + 1} if stage is not None else {}),
                   "rollout_s": time.perf_counter() - start, **_wake_metric(self.role, woke)}
        return _cpu(pairs), metrics

    def at_size(self, iteration: int) -> tuple:
        """(the family bound to the sample geometry, the sample shape) ``iteration`` trains at: the
        full size, or a size schedule's smaller stage (``dmd2_core.size_schedule``)."""
        latent_shape = size_schedule.latent_shape_at(self.args, iteration)
        if latent_shape is None:
            return self.family, self.shape
        key = tuple(latent_shape)
        if key not in self._sizes:
            family = dmd2_iteration.with_student_sampler(
                self.models.family.bind(latent_shape, self.model, self.models.modality_shifts), self.args)
            self._sizes[key] = (family, family.sample_shape(self.model, latent_shape))
        return self._sizes[key]

    # ---- train --------------------------------------------------------------------------------
    def train(self, iteration: int, pairs: dict, external_data: Optional[dict] = None):
        """The train-input hook, then ``num_steps_per_rollout`` optimizer steps with micro-batching.
        Returns (outputs handed to later groups, metrics)."""
        woke = self.wake_up()
        start = time.perf_counter()
        self.nonfinite.begin()
        pairs = self.hook(self.args, pairs, external_data)
        pairs = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in pairs.items()}
        if batch_size(pairs) != self.local_batch:
            raise ValueError(f"{self.role} rank {self.rank}: {batch_size(pairs)} train pairs, expected {self.local_batch}")
        self.learner.family = self.at_size(iteration)[0]  # a joint model's layout is its sample's geometry
        outputs, metrics = self.learner.train(iteration, pairs)
        self._reshard()
        if context_parallel.peer_index(self.rank, self.args.cp_size):  # a context group's rows count once
            metrics.update({k: 0 for k in metrics if k.endswith("_nonfinite")})
        metrics[f"{self.role}_nonfinite_steps"] = self.nonfinite.this_call
        metrics[f"{self.role}_train_s"] = time.perf_counter() - start
        metrics.update(_wake_metric(self.role, woke))
        return _cpu(outputs), metrics

    @contextlib.contextmanager
    def _ema_weights(self):
        """The model's parameters hold the EMA inside the block (this rank's shards, exactly
        restored after); without an EMA, the model as it is. Parameters and EMA are swapped
        tensor by tensor, so the eval holds one tensor's copy at a time, not a second model."""
        if self.ema is None:
            yield
            return
        self._reshard()
        pairs = [(parallel.local(p), parallel.local(e)) for p, e in zip(lora.trained_parameters(self.model), self.ema)]
        _swap(pairs)
        try:
            yield
        finally:
            _swap(pairs)

    # ---- sleep / wake -------------------------------------------------------------------------
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
        return distinct_storages(self._state_tensors(), self.device.type)

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
        return [s for s in slots if slot(*s).device.type == self.device.type]

    def sleep(self) -> dict:
        """Copy the state on the device to host memory and free it: the EMA's and optimizer's
        local tensors are swapped for empty ones, the model's and teacher's storages (which FSDP
        views) resized to zero bytes in place; idempotent."""
        if self._stash is not None:
            return {"asleep": True, "sleep_s": 0.0, "device_bytes_awake": 0, "bytes_freed": 0}
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        before = self.device_bytes()
        stash = DeviceStash(pin=self.device.type == "cuda")
        stash.swap_out(self._owned_slots())
        stash.resize_out(self._device_storages())  # after the swap: the swapped tensors hold nothing now
        self._stash = stash
        if self.vae is not None:  # the eval decoder (rank 0) goes to the host too; sample() brings it back
            self.vae.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return {"asleep": True, "sleep_s": time.perf_counter() - start, "device_bytes_awake": before,
                "bytes_freed": before - self.device_bytes()}

    def wake_up(self) -> dict:
        self.models.check_filled()
        if self._stash is None:
            return {"asleep": False, "wake_s": 0.0}
        start = time.perf_counter()
        self._stash.restore()
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
        gathered to rank 0 and written as a diffusers pipeline (dmd2_core.export.pipeline), in the
        background too. Returns ``{'url', 'iteration', 'blocked_s'}`` plus, once durable,
        ``'save_s'``, ``'bytes'`` (this rank's) and the export's ``'export_url'``, ``'export_s'``."""
        start = time.perf_counter()
        self.save_status(wait=True)  # a later save waits for the earlier one (and raises if it failed)
        was_asleep = self.asleep
        self.wake_up()
        self._reshard()
        extra = {"step": self.update.steps, "iteration": iteration, "run": self.run_record, **self.nonfinite.state(),
                 **self._disc_state()}
        pending = self.outputs.start(iteration, self.model, self.optimizer, self.ema, extra, self.checkpoint_pg, export)
        if was_asleep:
            self.sleep()
        out = {"url": pending.url, "iteration": iteration, "blocked_s": time.perf_counter() - start}
        if self.outputs.durable():
            out.update(self.save_status(wait=True))
        return out

    def save_status(self, wait: bool = False) -> Optional[dict]:
        """The latest save: None when there is none; ``{'pending': iteration}`` while it (or its
        export) is written (``wait``: block until it is durable); once durable, its result
        (``url``, ``save_s``, ``bytes``, ``export_url``, ``export_s``), every time it is asked. A
        save or export that failed raises its error."""
        return self.outputs.status(wait)

    def load(self, iteration: int, url: Optional[str] = None) -> int:
        """Load this trainer's checkpoint of ``iteration`` from ``url`` (default: its load URL);
        any number of ranks loads any checkpoint (each keeps its own shard)."""
        self.models.resumed()
        self.wake_up()
        extra = checkpoint.load_trainer(url or self.args.load_url, self.role, iteration, self.model,
                                        self.optimizer, ema=self.ema, process_group=self.checkpoint_pg)
        self.update.steps = int(extra.get("step", 0))
        self.nonfinite.load(extra)
        if self.disc is not None and "disc" in extra:  # a checkpoint from before the head keeps the fresh head
            self.disc.load_state_dict(extra["disc"])
            self.disc_optimizer.load_state_dict(extra["disc_optimizer"])
            for group in self.disc_optimizer.param_groups:  # this run's settings, as the model's optimizer
                group.update(optimizer_settings(self.args))
            self.learner.disc_nonfinite.load(extra)
        return self.update.steps

    def _run_record(self) -> dict:
        """What each checkpoint records of the run that wrote it: where it started (``load``, the
        model directory), for a LoRA its adapters and an identity of the base weights, and the
        student's sampler, export dtype and workflow (what ``python -m dmd2_core export`` writes it with)."""
        from dmd2_core.models import base_identity, transformer_folder

        adapters = lora.adapter_record(self.args)
        student = {"num_steps": self.args.dmd2_student_steps, "shift": float(self.shift),
                   "euler": self.family.deterministic_student, "export_dtype": self.args.export_dtype or self.args.dtype,
                   "workflow": self.args.workflow, "modality_shifts": self.args.student_modality_shifts}
        return {**run_origin(self.args), "lora": adapters, "student": student,
                "base": base_identity(self.args.hf_checkpoint, transformer_folder(self.args.workflow)) if adapters else None}

    def _disc_state(self) -> dict:
        if self.disc is None:
            return {}
        return {"disc": self.disc.state_dict(), "disc_optimizer": self.disc_optimizer.state_dict(),
                **self.learner.disc_nonfinite.state()}


def _wake_metric(role: str, woke: dict) -> dict:
    """The wake time, only from the call that actually woke the trainer."""
    return {f"{role}_wake_s": woke["wake_s"]} if woke["wake_s"] else {}


def _swap(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Exchange the values of each pair of same-shaped tensors in place."""
    with torch.no_grad():
        for a, b in pairs:
            held = a.clone()
            a.copy_(b)
            b.copy_(held)


def _cpu(d: dict) -> dict:
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in d.items()}


def _on(plan: dmd2_iteration.RolloutPlan, device: torch.device) -> dmd2_iteration.RolloutPlan:
    return dmd2_iteration.RolloutPlan(plan.stop_step, plan.sigmas, plan.prompt_index, plan.noise.to(device),
                            [r.to(device) for r in plan.renoise])
