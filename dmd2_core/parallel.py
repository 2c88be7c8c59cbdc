"""Parallelism and precision of one trainer rank, in one place.

Every model of a trainer is sharded with torch FSDP2 (``fully_shard`` on each transformer block
named by diffusers' ``_no_split_modules``, then on the root) over the group's ranks:

- a 1-D mesh when the shard group is the whole trainer group, a 2-D ``(replicate, shard)`` mesh
  (HSDP) when ``fsdp_shard_size`` is smaller, so a group spanning nodes shards inside a node and
  replicates across nodes (ranks are ordered by node, see ``bundles_in_node_order``);
- trainable models keep fp32 master weights (and so fp32 gradients, AdamW state and EMA); the
  forward and backward run in the compute ``dtype`` and gradients reduce in fp32;
- a frozen model (the critic's teacher) is stored and run in the compute dtype;
- activation checkpointing, per block, is diffusers' own (``enable_gradient_checkpointing``,
  non-reentrant ``torch.utils.checkpoint``), applied before sharding so parameter names stay the
  diffusers ones;
- ``fsdp_cpu_offload`` keeps the sharded parameters, gradients and optimizer state in host memory
  (FSDP2's ``CPUOffloadPolicy``; CUDA only).

A group of one rank whose models need neither a cast nor offloading (compute dtype fp32, the
frozen teacher at any dtype) keeps plain modules: FSDP would only copy each block's parameters
into an all-gather buffer of one and back, and with its per-block hooks and DTensor dispatch that
cost 2-8% of the tiny recipe's iteration (``bench/one_rank.py``). Otherwise one rank runs the same
code on a mesh of one. Either way 1 rank and N ranks differ only by the order of floating-point
reductions. Within one process, every single-rank trainer shares one gloo process group of size
one (``ensure_process_group``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

MASTER_DTYPE = torch.float32


def ensure_process_group(rank: int, world_size: int, device: torch.device, master_addr: Optional[str] = None,
                         master_port: Optional[int] = None, timeout_s: float = 1800.0) -> None:
    """Join the trainer group's process group; one rank gets a private in-memory one."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError(f"this process is already in a group of {dist.get_world_size()} ranks, not {world_size}")
        return
    backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    if world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=timeout_s))
        return
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))


def check_shard_size(world_size: int, shard_size: Optional[int]) -> int:
    shard = shard_size or world_size
    if shard < 1 or world_size % shard:
        raise ValueError(f"fsdp_shard_size {shard} does not divide the group's {world_size} ranks")
    return shard


def build_mesh(device: torch.device, world_size: int, shard_size: Optional[int]) -> DeviceMesh:
    """The mesh FSDP shards over: ``(shard,)`` or ``(replicate, shard)``; context parallelism
    does not change it (see ``context_mesh``)."""
    shard = check_shard_size(world_size, shard_size)
    if shard == world_size:
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device.type, (world_size // shard, shard), mesh_dim_names=("replicate", "shard"))


def context_mesh(mesh: DeviceMesh, cp_size: int) -> DeviceMesh:
    """The same ranks seen as ``([replicate,] dp_shard, ring, ulysses)``: the shard dim split into
    data-parallel shards of ``cp_size`` consecutive ranks each (Ulysses only: ring attention needs
    a backend that returns the log-sum-exp, which native SDPA on CPU does not). FSDP keeps sharding
    over the whole shard dim, so the model's shards, and its checkpoints, do not depend on cp."""
    shard = mesh["shard"].size()
    if cp_size < 1 or shard % cp_size:
        raise ValueError(f"cp_size: {cp_size} does not divide the {shard} ranks a model is sharded over")
    return mesh._unflatten("shard", (shard // cp_size, 1, cp_size),
                           ("dp_shard", "ring", "ulysses"))


def data_parallel(rank: int, world_size: int, cp_size: int) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size): the ``cp_size`` consecutive ranks of a context
    group share one rank's rows of the batch."""
    return rank // cp_size, world_size // cp_size


class EvalShare:
    """One rank's share of an eval's ``n`` rows (samples, features): each data-parallel rank
    takes a contiguous ``per = ceil(n / dp_size)`` of them (the ranks of a context group the same
    ones), so an eval's model work divides by the data-parallel size instead of every rank doing
    all of it. Every rank runs ``per`` rows, the last share padded with copies of row ``n - 1``
    whose results are dropped: a sharded forward is a collective, and every rank must run as many.
    ``gather`` brings the shares to rank 0 in row order."""

    def __init__(self, n: int, rank: int, world_size: int, cp_size: int):
        self.n, self.rank, self.cp_size = n, rank, cp_size
        dp_rank, self.dp_size = data_parallel(rank, world_size, cp_size)
        self.per = -(-n // self.dp_size)
        self.start = dp_rank * self.per
        self.count = max(0, min(n, self.start + self.per) - self.start)  # this share's rows that are not padding

    @property
    def positions(self) -> list[int]:
        """The batch rows this rank runs, padding included (``per`` of them)."""
        return [min(i, self.n - 1) for i in range(self.start, self.start + self.per)]

    def pick(self, values: Sequence) -> list:
        """``values`` (one per row of the whole batch) at this rank's positions."""
        return [values[i] for i in self.positions]

    def gather(self, local):
        """Every rank's ``per`` rows (a tensor, or a dict of tensors) -> the ``n`` rows in order on
        rank 0 (on the CPU), None elsewhere. The padding is dropped; of a context group only its
        first rank's rows are kept (its peers hold the same). A collective over the default group."""
        if self.dp_size == 1:
            return local if self.rank == 0 else None
        if isinstance(local, dict):
            gathered = {k: self.gather(local[k]) if isinstance(local[k], torch.Tensor) else local[k] for k in sorted(local)}
            return gathered if self.rank == 0 else None
        local = local.detach().to("cpu").contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())] if self.rank == 0 else None
        dist.gather(local, parts, dst=0)
        if self.rank != 0:
            return None
        return torch.cat(parts[::self.cp_size])[:self.n]


def average_over_data_parallel(model: torch.nn.Module, dp_size: int) -> None:
    """Reduce a sharded model's gradients as a sum over all ranks divided by ``dp_size``: under
    context parallelism each rank of a context group holds the gradient of its part of the
    sequence, so those parts add up while data-parallel ranks average. Sum-only collectives,
    because gloo has no PREMUL_SUM."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(dp_size))
            module.set_force_sum_reduction_for_comms(True)


def block_classes(model: torch.nn.Module) -> tuple[str, ...]:
    """The model's transformer block classes: the units that are sharded and checkpointed."""
    names = tuple(getattr(model, "_no_split_modules", None) or ())
    if not names:
        raise ValueError(f"{type(model).__name__} names no transformer block classes (_no_split_modules)")
    return names


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    names = set(block_classes(model))  # through the MRO: sharded blocks are FSDP<class> subclasses
    return [m for m in model.modules() if names & {c.__name__ for c in type(m).__mro__}]


def needs_fsdp(mesh: DeviceMesh, compute_dtype: torch.dtype, trainable: bool, cpu_offload: bool) -> bool:
    """Whether FSDP has anything to do: shard over more than one rank, offload to the host, or
    cast trainable fp32 master weights to a lower compute dtype."""
    return mesh.size() > 1 or cpu_offload or (trainable and compute_dtype != MASTER_DTYPE)


def fp32_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules diffusers keeps in fp32 whatever the model's dtype (``_keep_in_fp32_modules``:
    input and output projections, time embedder, rotary tables of mixed-precision checkpoints)."""
    names = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    return [m for name, m in model.named_modules() if name and name.split(".")[-1] in names]


def shard_model(model: torch.nn.Module, mesh: DeviceMesh, compute_dtype: torch.dtype, trainable: bool,
                gradient_checkpointing: bool = False, cpu_offload: bool = False,
                keep_fp32: bool = False) -> torch.nn.Module:
    """Cast, checkpoint and shard ``model`` in place (blocks first, then the root), or leave it a
    plain module where ``needs_fsdp`` finds nothing to do. ``keep_fp32``: the model's
    ``_keep_in_fp32_modules`` are stored and computed in fp32 (their own FSDP units), and the root
    leaves its inputs' dtypes alone (such a model casts them itself; position tables stay fp64).
    A trainable model with frozen parameters (a LoRA, see dmd2_core.models.lora) keeps its base as it was
    built (in the compute dtype, as the frozen teacher: buffers and ``keep_fp32`` modules alike),
    and its trained parameters (the adapters) in fp32, in the same FSDP units."""
    dtype = MASTER_DTYPE if trainable else compute_dtype
    fp32 = fp32_modules(model) if keep_fp32 else []
    if trainable and any(not p.requires_grad for p in model.parameters()):  # a LoRA: its base stays as built
        with torch.no_grad():
            for param in model.parameters():
                if param.requires_grad and param.dtype != MASTER_DTYPE:
                    param.data = param.data.to(MASTER_DTYPE)
    elif any(p.dtype != dtype for p in model.parameters()):
        _cast(model, dtype, fp32)
    for module in model.modules():  # own every buffer (loading may leave them on fixed-size mmaps)
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = buf.clone()
    if gradient_checkpointing and trainable:
        model.enable_gradient_checkpointing()
    if not needs_fsdp(mesh, compute_dtype, trainable, cpu_offload):
        device = _shard_device(mesh, cpu_offload)  # the rank's device, as FSDP would put its shards
        _materialise(model, device)
        model.to(device)  # a model built on the host goes to the device too
        with torch.no_grad():  # own every parameter too, as FSDP's shards do (sleep resizes them)
            for param in model.parameters():
                param.data = param.data.clone()
        if not trainable:
            model.requires_grad_(False).eval()
        return model
    policy = dict(
        mp_policy=MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=MASTER_DTYPE),
        offload_policy=CPUOffloadPolicy(pin_memory=True) if cpu_offload else None,
    )
    policy = {k: v for k, v in policy.items() if v is not None}
    for block in blocks(model):
        fully_shard(block, mesh=mesh, **policy)
    for module in fp32:
        fully_shard(module, mesh=mesh, **{**policy, "mp_policy": MixedPrecisionPolicy(
            param_dtype=MASTER_DTYPE, reduce_dtype=MASTER_DTYPE)})
    root = policy
    if fp32:
        root = {**policy, "mp_policy": MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=MASTER_DTYPE,
                                                            cast_forward_inputs=False)}
    fully_shard(model, mesh=mesh, **root)
    _materialise(model, _shard_device(mesh, cpu_offload))
    if not trainable:
        model.requires_grad_(False).eval()
    return model


def _cast(model: torch.nn.Module, dtype: torch.dtype, fp32: list[torch.nn.Module]) -> None:
    """Every floating parameter and buffer to ``dtype``, those of the ``fp32`` modules to fp32, each
    cast once from its loaded value (never through ``dtype`` and back)."""
    kept = {id(m) for module in fp32 for m in module.modules()}
    for module in model.modules():
        target = MASTER_DTYPE if id(module) in kept else dtype
        module._apply(lambda t: t.to(target) if t.is_floating_point() else t, recurse=False)


def _shard_device(mesh: DeviceMesh, cpu_offload: bool) -> torch.device:
    if cpu_offload or mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())


def _materialise(model: torch.nn.Module, device: torch.device) -> None:
    """Uninitialised storage for the parameters of a model built on the meta device: after
    sharding, only this rank's shards (``dmd2_core.models.loading`` fills them). Buffers, computed
    on the host when the model was built, keep their values."""
    if not any(p.is_meta for p in model.parameters()):
        return
    buffers = [(m, n, b) for m in model.modules() for n, b in m._buffers.items() if b is not None]
    model.to_empty(device=device)
    for module, name, buf in buffers:
        module._buffers[name] = buf.to(device)


def reshard(model: torch.nn.Module) -> None:
    """Register the sharded parameters again (freeing unsharded ones). FSDP2 keeps the root's
    parameters unsharded after a forward (expecting a backward next); after a forward-only pass
    (rollout, eval, the teacher's scoring) they would otherwise stay gathered, and the module
    would expose plain unsharded tensors instead of its shards."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly distributed) tensor."""
    return t._local_tensor if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor: every rank must call it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state_dict(model: torch.nn.Module, shards: Optional[Iterable[torch.Tensor]] = None,
                    keep: bool = True, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """The model's (or, with ``shards``, a same-layout copy's) whole state on the host: a
    collective, tensor by tensor; a rank with ``keep=False`` takes part and keeps nothing, so it
    never holds more than one whole tensor. ``dtype`` casts floating tensors as they arrive (the
    host never holds the whole state in the master dtype)."""
    params = dict(model.named_parameters())
    values = dict(zip(params, shards)) if shards is not None else params
    values.update(model.named_buffers())
    out = {}
    for name, value in values.items():
        whole = full(value).detach()
        if keep:
            cast = dtype if dtype is not None and whole.is_floating_point() else whole.dtype
            out[name] = whole.to("cpu", dtype=cast, copy=True)
    return out


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """The global gradient norm (across shards); gradients are scaled down in place when it is
    above ``max_norm`` (torch's clip_grad_norm_ rule)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = full(torch.nn.utils.get_total_norm(grads, norm_type=2.0)).item()
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        with torch.no_grad():
            torch._foreach_mul_([local(g) for g in grads], coef)
    return norm


def bundles_in_node_order(bundle_nodes: Sequence[str]) -> list[int]:
    """Bundle index of each rank: ranks ordered by (node, device), nodes in the order their first
    bundle appears, so consecutive ranks (a shard group) share a node whenever they can."""
    first: dict[str, int] = {}
    for index, node in enumerate(bundle_nodes):
        first.setdefault(node, index)
    return sorted(range(len(bundle_nodes)), key=lambda i: (first[bundle_nodes[i]], i))


def shard_rows(name: str, value: torch.Tensor) -> tuple[int, int]:
    """The rows (first dimension) of the whole tensor that this rank holds of ``value``."""
    if not value.dim():
        return 0, 1
    if isinstance(value, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        if tuple(shape[1:]) != tuple(value.shape[1:]):
            raise NotImplementedError(f"{name}: sharded along a dimension other than the first")
        return offset[0], offset[0] + shape[0]
    return 0, value.shape[0]
