"""The memory plan of a run: bytes per device of every trainer group, from the checkpoints'
configs alone (each transformer is built on the meta device: no weights, no GPU).

Per rank, after sharding over ``S`` ranks (``fsdp_shard_size``, default the group):

- trainable weights, gradients, AdamW's two moments and the EMA: fp32, ``4 * P / S`` bytes each;
- the critic's frozen teacher: ``P_teacher * bytes(dtype) / S`` (its ``_keep_in_fp32_modules``, for
  the families that keep them, at 4 bytes);
- buffers (e.g. SD3's positional table): replicated, whole on every rank;
- the gather working set: two blocks unsharded in the compute dtype (the block running and the
  one FSDP prefetches) plus one block's fp32 gradients before their reduce-scatter, and the root's
  own parameters (embeddings, final layer), unsharded while it runs;
- activations: ``micro_batch_size`` samples through every block (or, with gradient
  checkpointing, every block's input plus one block recomputed), from the family's per-token
  estimate at the latent shape and the pipeline's text length.

A group that sleeps after its train holds nothing on the device while it sleeps, and the actor
is awake (after its rollout) while the critic trains; so with ``sleep_after_train`` and
colocated groups a device peaks at ``max(actor resident + critic peak, actor peak)``, without
sleeping at every group's resident state plus the largest transient. ``fsdp_cpu_offload`` moves
a group's shards (weights, gradients, optimizer state, EMA) to host memory. On CUDA a fixed
reserve covers the CUDA context and allocator fragmentation.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from dmd2_core import parallel, storage
from dmd2_core.args import Args, ArgsError
from dmd2_core.models import FAMILIES, describe_checkpoint

GIB = 1024 ** 3
CUDA_RESERVE = 2 * GIB


@dataclass
class ModelSize:
    params: int
    buffers_bytes: int
    largest_block: int
    root_params: int
    num_blocks: int
    config: dict = field(repr=False)
    fp32_params: int = 0  # kept in fp32 whatever the compute dtype (the family's keep_fp32_modules)


def model_size(url: str) -> ModelSize:
    """Parameter counts of a checkpoint's transformer, built from its config on the meta device."""
    info = describe_checkpoint(url)
    family = FAMILIES[info["family"]]
    config = json.loads(storage.read_text(storage.join(info["transformer_url"], "config.json")))
    with torch.device("meta"):
        model = family.model_class.from_config(config)
    blocks = parallel.blocks(model)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    fp32 = {id(p): p.numel() for m in (parallel.fp32_modules(model) if family.keep_fp32_modules else [])
            for p in m.parameters()}
    return ModelSize(
        fp32_params=sum(fp32.values()),
        params=sum(p.numel() for p in model.parameters()),
        buffers_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        largest_block=max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0),
        root_params=sum(p.numel() for p in model.parameters() if id(p) not in in_blocks),
        num_blocks=len(blocks),
        config=dict(model.config),
    )


@dataclass
class GroupPlan:
    role: str
    params: int
    grads: int
    optimizer: int
    ema: int
    teacher: int
    buffers: int
    gather: int
    activations: int
    activations_without_checkpointing: int
    activations_with_checkpointing: int
    offloaded: int  # bytes of this group's shards kept in host memory instead

    @property
    def resident(self) -> int:
        """On the device while awake and not training (gradients are freed after each step)."""
        return self.params + self.optimizer + self.ema + self.teacher + self.buffers

    @property
    def peak(self) -> int:
        return self.resident + self.grads + self.gather + self.activations


@dataclass
class MemoryPlan:
    groups: list[GroupPlan]
    num_devices: int
    shard_size: int
    device_peak: int
    device_limit: Optional[int]
    notes: list[str]
    peak_during: str = ""
    micro_batch_size: int = 1
    reserve: int = 0  # bytes the CUDA context and allocator take besides the plan's

    def as_dict(self) -> dict:
        out = asdict(self)
        for g, row in zip(self.groups, out["groups"]):
            row.update(resident=g.resident, peak=g.peak)
        return out

    @property
    def fits(self) -> bool:
        return self.device_limit is None or self.device_peak <= self.device_limit


def _dtype_bytes(name: str) -> int:
    return torch.empty(0, dtype=getattr(torch, name)).element_size()


def group_plan(role: str, args: Args, size: ModelSize, teacher: Optional[ModelSize], shard_size: int) -> GroupPlan:
    family = FAMILIES[describe_checkpoint(args.hf_checkpoint)["family"]].bind(args.latent_shape)
    compute = _dtype_bytes(args.dtype)
    fp32 = 4
    shard = lambda n: -(-n // shard_size)  # noqa: E731 - ceil division, as FSDP pads shards
    params = shard(size.params) * fp32
    grads = params
    optimizer = 2 * params
    ema = params if args.ema_decay else 0
    teacher_bytes = (shard(teacher.params) * compute + shard(teacher.fp32_params) * (fp32 - compute)) if teacher else 0
    buffers = size.buffers_bytes + (teacher.buffers_bytes * compute // fp32 if teacher else 0)
    largest = max(size.largest_block, teacher.largest_block if teacher else 0)
    root = max(size.root_params, teacher.root_params if teacher else 0)
    gather = (2 * largest + root) * compute + largest * fp32

    sample_shape = family_shape(family, size.config, args.latent_shape)
    image_tokens = family.tokens(size.config, sample_shape)
    text_tokens = family.default_text_tokens
    per_block = family.activation_elements(size.config, image_tokens, text_tokens) * compute
    block_inputs = (image_tokens + text_tokens) * hidden_size(size.config) * compute
    micro = args.micro_batch_size
    without = micro * per_block * size.num_blocks
    with_ckpt = micro * (block_inputs * size.num_blocks + per_block)
    activations = with_ckpt if args.gradient_checkpointing else without

    offloaded = 0
    if args.fsdp_cpu_offload:
        offloaded = params + grads + optimizer + ema + teacher_bytes
        params = grads = optimizer = ema = teacher_bytes = 0
    return GroupPlan(role, params, grads, optimizer, ema, teacher_bytes, buffers, gather, activations,
                     without, with_ckpt, offloaded)


def hidden_size(config: dict) -> int:
    """The residual stream's width (MiniMax-H3's 5376 is narrower than its 56 x 128 attention)."""
    return int(config.get("hidden_size") or int(config["num_attention_heads"]) * int(config["attention_head_dim"]))


def family_shape(family, config: dict, latent_shape: Optional[list[int]]) -> tuple[int, ...]:
    if latent_shape:
        return tuple(int(d) for d in latent_shape)
    if family.is_video:
        raise ArgsError("latent_shape: a video model's plan needs its latents' [C, F, H, W]")
    return (config["in_channels"], config["sample_size"], config["sample_size"])


def device_limit(args: Args) -> Optional[int]:
    """The bytes one device has: ``device_memory_gib``, else the device's own on cuda (when this
    process sees one), else unknown (no check)."""
    if args.device_memory_gib:
        return int(args.device_memory_gib * GIB)
    if args.device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return None


def plan(trainer_args: dict[str, Args]) -> MemoryPlan:
    """The plan of a run's trainers (``preflight``'s per-role args)."""
    args = trainer_args["actor"]
    shard_size = parallel.check_shard_size(args.num_devices, args.fsdp_shard_size)
    sizes: dict[str, ModelSize] = {}

    def size_of(url: str) -> ModelSize:
        if url not in sizes:
            sizes[url] = model_size(url)
        return sizes[url]

    groups = []
    for role, targs in trainer_args.items():
        teacher = size_of(targs.teacher_checkpoint or targs.hf_checkpoint) if targs.loss_type == "dmd2_critic" else None
        groups.append(group_plan(role, targs, size_of(targs.hf_checkpoint), teacher, shard_size))
    by_role = {g.role: g for g in groups}
    notes = []
    if not args.colocate:
        candidates = {f"the {g.role} group's train": g.peak for g in groups}
        notes.append("groups on separate devices: the largest group's peak")
    elif args.sleep_after_train and "critic" in by_role:
        actor, critic = by_role["actor"], by_role["critic"]
        candidates = {"the critic group's train (beside the awake actor)": actor.resident + critic.peak,
                      "the actor group's train": actor.peak}
        notes.append("colocated, sleeping after train: max(actor resident + critic peak, actor peak)")
    else:
        resident = sum(g.resident for g in groups)
        candidates = {f"the {g.role} group's train (every group resident)": resident + g.peak - g.resident
                      for g in groups}
        notes.append("colocated, awake: every group's resident state + the largest transient")
    when = max(candidates, key=candidates.get)
    peak = candidates[when]
    reserve = CUDA_RESERVE if args.device == "cuda" else 0
    if reserve:
        peak += reserve
        notes.append(f"+ {CUDA_RESERVE / GIB:.0f} GiB reserve for the CUDA context and allocator")
    return MemoryPlan(groups, args.num_devices, shard_size, peak, device_limit(args), notes, when, args.micro_batch_size, reserve)


def check(memory_plan: MemoryPlan) -> None:
    """One line naming the group, the figure and the knobs, when the plan does not fit."""
    if memory_plan.fits:
        return
    worst = next((g for g in memory_plan.groups if f"the {g.role} group" in memory_plan.peak_during),
                 max(memory_plan.groups, key=lambda g: g.peak))
    unsharded = worst.activations + worst.gather + worst.buffers + memory_plan.reserve  # no number of devices divides these
    knobs = []
    if unsharded <= memory_plan.device_limit:
        knobs.append("more devices (num_devices)")
        if not worst.offloaded:
            knobs.append("fsdp_cpu_offload")
    if worst.activations == worst.activations_without_checkpointing:
        knobs.append("gradient_checkpointing")
    if memory_plan.micro_batch_size > 1:
        knobs.append("a smaller micro_batch_size")
    if unsharded > memory_plan.device_limit:
        knobs.append(f"shorter or smaller samples (one sample's activations and gathered blocks alone take "
                     f"{_gib(unsharded)}, whatever the number of devices)")
    raise ArgsError(
        f"memory plan: {memory_plan.peak_during} needs {_gib(memory_plan.device_peak)} per device "
        f"(the {worst.role} group's largest part: {_largest_part(worst)}), more than the "
        f"{_gib(memory_plan.device_limit)} of one device (device_memory_gib); try {', '.join(knobs)} "
        f"(python -m dmd2_core plan shows the figures)"
    )


def _largest_part(g: GroupPlan) -> str:
    parts = {"weights": g.params, "gradients": g.grads, "optimizer": g.optimizer, "ema": g.ema,
             "teacher": g.teacher, "activations": g.activations, "gather": g.gather}
    name = max(parts, key=parts.get)
    return f"{name} {_gib(parts[name])}"


def _gib(n: Optional[int]) -> str:
    return "?" if n is None else f"{n / GIB:.1f} GiB"


ROWS = ("params", "grads", "optimizer", "ema", "teacher", "buffers", "gather", "activations",
        "activations_without_checkpointing", "activations_with_checkpointing", "offloaded", "resident", "peak")


def table(memory_plan: MemoryPlan) -> str:
    """The plan as a text table, GiB per rank."""
    roles = [g.role for g in memory_plan.groups]
    width = max(len(r) for r in ROWS) + 2
    lines = [f"{'GiB per rank':<{width}}" + "".join(f"{r:>12}" for r in roles)]
    for row in ROWS:
        values = [getattr(g, row) for g in memory_plan.groups]
        lines.append(f"{row:<{width}}" + "".join(f"{v / GIB:>12.2f}" for v in values))
    limit = "unchecked" if memory_plan.device_limit is None else _gib(memory_plan.device_limit)
    lines.append(f"device peak: {_gib(memory_plan.device_peak)} of {limit}, during {memory_plan.peak_during} "
                 f"({memory_plan.num_devices} devices, shard size {memory_plan.shard_size}; "
                 + "; ".join(memory_plan.notes) + ")")
    return "\n".join(lines)
