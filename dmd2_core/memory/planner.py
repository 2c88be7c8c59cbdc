"""The memory plan of a run: bytes per device of every trainer group, and host bytes per node,
from the checkpoints' configs alone (each transformer is built on the meta device: no weights, no GPU).

Per rank, after sharding over ``S`` ranks (``fsdp_shard_size``, default the group):

- trainable weights, gradients, AdamW's two moments and the EMA: fp32, ``4 * P / S`` bytes each;
- the critic's frozen teacher: ``P_teacher * bytes(dtype) / S`` (its ``_keep_in_fp32_modules``, for
  the families that keep them, at 4 bytes);
- a LoRA trainer (``lora_rank > 0``): its frozen base in ``dtype`` (``base``) and the fp32 state above
  for its adapters alone; a critic whose fake score is a LoRA of the teacher holds that one base and
  no teacher (``dmd2_core/memory/lora_terms.py``);
- buffers (e.g. SD3's positional table): replicated, whole on every rank;
- the gather working set: two blocks unsharded in the compute dtype (the block running and the
  one FSDP prefetches) plus one block's fp32 gradients before their reduce-scatter, and the root's
  own parameters (embeddings, final layer), unsharded while it runs;
- activations: ``micro_batch_size`` samples through every block (or, with gradient
  checkpointing, every block's carried input plus one block recomputed), from the calibration of
  the family's real blocks (``dmd2_core/memory/activations.py``) at the rank's ``tokens / cp_size``
  tokens (context parallelism splits the sequence), plus the all-to-all buffers of one block;
- the critic's guidance transient (the teacher's cond + uncond forward beside the fake score's
  activations) and every group's rollout buffers; the eval decoder on the actor's rank 0.

A group that sleeps after its train holds nothing on the device while it sleeps, and the actor
is awake (after its rollout) while the critic trains; so with ``sleep_after_train`` and
colocated groups a device peaks at ``max(actor resident + critic peak, actor peak)``, without
sleeping at every group's resident state plus the largest transient. ``fsdp_cpu_offload`` moves
a group's shards (weights, gradients, optimizer state, EMA) to host memory. On CUDA each process
on a device (one per colocated group) adds its reserve (``memory.terms.process_reserve``). A plan
above ``1 - memory_headroom`` of the device (or of ``host_memory_gib``) is refused.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Optional

import torch

from dmd2_core.memory import activations as acts
from dmd2_core.models import lora
from dmd2_core.memory import lora_terms
from dmd2_core.memory import terms as terms
from dmd2_core import parallel
from dmd2_core.args import Args
from dmd2_core.errors import ArgsError
from dmd2_core.memory.table import ROWS, table  # noqa: F401 - the plan's printout, memory.table
from dmd2_core.models import FAMILIES, describe_model_dir

GIB = 1024 ** 3
NODE_CP = terms.DEVICES_PER_NODE  # the largest cp_size a refusal suggests growing to: one node's all-to-all


@dataclass
class ModelSize:
    params: int
    buffers_bytes: int
    largest_block: int
    root_params: int
    num_blocks: int
    config: dict = field(repr=False)
    fp32_params: int = 0  # kept in fp32 whatever the compute dtype (the family's keep_fp32_modules)
    largest_tensor: int = 0  # elements of the largest parameter or buffer (what an export streams at once)


@lru_cache(maxsize=16)
def model_size(url: str) -> ModelSize:
    """Parameter counts of a checkpoint's transformer, built from its config on the meta device
    (cached per URL within a process: a checkpoint's config does not change under a plan)."""
    family = FAMILIES[describe_model_dir(url)["family"]]
    model = lora_terms.meta_model(url)
    blocks = parallel.blocks(model)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    fp32 = {id(p): p.numel() for m in (parallel.fp32_modules(model) if family.keep_fp32_modules else [])
            for p in m.parameters()}
    return ModelSize(
        fp32_params=sum(fp32.values()),
        largest_tensor=max((t.numel() for t in (*model.parameters(), *model.buffers())), default=0),
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
    cp_buffers: int = 0  # context parallelism's all-to-all buffers of one block
    guidance: int = 0  # the teacher's forward beside the fake score's activations (critic)
    rollout: int = 0  # the rank's rollout rows and conditions
    saved: int = 0  # the trainable state a checkpoint writes (weights, optimizer, EMA), wherever it lives
    loaded: int = 0  # the weight shards a rank loads (trainable fp32, a LoRA's base and the teacher)
    activation_source: str = ""
    cp_size: int = 1
    base: int = 0  # a LoRA's frozen base (dmd2_core.memory.lora_terms); ``params`` etc. are then its adapters'
    set_rows: int = 0  # on the host: the prompt (and real) set rows one step reads

    @property
    def resident(self) -> int:
        """On the device while awake and not training (gradients are freed after each step)."""
        return self.params + self.optimizer + self.ema + self.teacher + self.base + self.buffers

    @property
    def peak(self) -> int:
        """The teacher scores after the fake score's backward (its activations freed): the larger of
        the two transients, beside the gradients and the gathered blocks."""
        return (self.resident + self.grads + self.gather + max(self.activations + self.cp_buffers, self.guidance)
                + self.rollout)


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
    reserve: int = 0  # bytes the processes on a device take besides the plan's (CUDA contexts, NCCL)
    usable: Optional[int] = None  # device_limit less the headroom
    headroom: float = 0.0
    cp_size: int = 1
    eval_decoder: int = 0  # the VAE decode at eval, actor rank 0
    host: Optional[terms.HostPlan] = None
    stages: list[dict] = field(default_factory=list)  # a size schedule's stages: their sizes and peaks

    def as_dict(self) -> dict:
        out = asdict(self)
        for g, row in zip(self.groups, out["groups"]):
            row.update(resident=g.resident, peak=g.peak)
        if self.host is not None:
            out["host"].update(peak=self.host.peak, phase=self.host.phase, fits=self.host.fits)
        out["fits"] = self.fits
        return out

    @property
    def device_fits(self) -> bool:
        return self.usable is None or self.device_peak <= self.usable

    @property
    def fits(self) -> bool:
        return self.device_fits and (self.host is None or self.host.fits)


def _dtype_bytes(name: str) -> int:
    return torch.empty(0, dtype=getattr(torch, name)).element_size()


def group_plan(role: str, args: Args, size: ModelSize, teacher: Optional[ModelSize], shard_size: int,
               scored: Optional[bool] = None) -> GroupPlan:
    """``teacher``: the critic's separate frozen teacher; ``scored``: the group scores with a teacher
    (default: it has one; a LoRA critic over a shared base has none of its own)."""
    from dmd2_core.data import workflow_conditions

    # a workflow's keyframes' or references' condition rows lengthen every sequence
    family = FAMILIES[describe_model_dir(args.hf_checkpoint)["family"]].bind(
        args.latent_shape, **workflow_conditions(args.prompts, args.workflow))
    compute = _dtype_bytes(args.dtype)
    fp32 = 4
    shard = lambda n: -(-n // shard_size)  # noqa: E731 - ceil division, as FSDP pads shards
    own = lora_terms.state(args, size, shard_size, compute) if args.lora_rank else None
    params = own.params if own else shard(size.params) * fp32
    base = own.base if own else 0
    grads = params
    optimizer = 2 * params
    ema = params if args.ema_decay else 0
    teacher_bytes = (shard(teacher.params) * compute + shard(teacher.fp32_params) * (fp32 - compute)) if teacher else 0
    buffers = (own.buffers if own else size.buffers_bytes) + (teacher.buffers_bytes * compute // fp32 if teacher else 0)
    largest = max(own.largest_block if own else size.largest_block, teacher.largest_block if teacher else 0)
    root = max(own.root if own else size.root_params, teacher.root_params if teacher else 0)
    gather = (2 * largest + root) * compute + (own.block_grads if own else largest * fp32)

    act = sample_activations(family, size.config, args, compute)
    micro = args.micro_batch_size
    without = micro * act.total(size.num_blocks, False)
    with_ckpt = micro * act.total(size.num_blocks, True)
    activations = with_ckpt if args.gradient_checkpointing else without
    tokens = family.tokens(size.config, family_shape(family, size.config, args.latent_shape))
    inner = int(size.config["num_attention_heads"]) * int(size.config["attention_head_dim"])
    cp_buffers = micro * terms.cp_buffers(args, tokens, family.default_text_tokens, inner, compute)
    sample_elements = _sample_elements(family, size.config, args.latent_shape)
    guidance = 0
    if (teacher is not None) if scored is None else scored:
        guidance = terms.guidance_transient(args, family.guidance_distilled, act.no_grad, sample_elements * fp32)
    cond_bytes = family.default_text_tokens * int(size.config.get("text_dim") or size.config.get(
        "joint_attention_dim") or hidden_size(size.config)) * fp32
    rollout = terms.rollout_buffers(args, sample_elements, cond_bytes)
    loaded = params + base + teacher_bytes  # the weights a rank loads (load once, shard on arrival)

    saved = params + optimizer + ema  # a LoRA's checkpoint holds its adapters alone
    offloaded = 0
    if args.fsdp_cpu_offload:
        offloaded = params + grads + optimizer + ema + teacher_bytes + base
        params = grads = optimizer = ema = teacher_bytes = base = 0
    return GroupPlan(role, params, grads, optimizer, ema, teacher_bytes, buffers, gather, activations,
                     without, with_ckpt, offloaded, cp_buffers, guidance, rollout, saved, loaded,
                     act.source, args.cp_size or 1, base, terms.set_rows(args, cond_bytes, sample_elements * fp32))


def sample_activations(family, config: dict, args: Args, compute: int) -> acts.Activations:
    """One sample's activations on one rank: the calibration at the rank's share of the tokens."""
    tokens = family.tokens(config, family_shape(family, config, args.latent_shape))
    per_rank = -(-tokens // (args.cp_size or 1))
    return acts.estimate(family, config, per_rank, family.default_text_tokens, hidden_size(config), compute)


def _sample_elements(family, config: dict, latent_shape) -> int:
    return math.prod(family_shape(family, config, latent_shape))


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
    """The plan of a run's trainers (``preflight``'s per-role args). With a size schedule each
    stage's train is planned at its size and the device peak is the largest over the stages; the
    eval is the full size's whatever the stage. The full-size stage dominates (a stage is no larger
    in any dimension), so the peak is today's full-size one; the stages are listed beside it."""
    full = _plan(trainer_args)
    args = trainer_args["actor"]
    if not args.size_schedule:
        return full
    from dmd2_core.size_schedule import stage_spans

    spans = stage_spans(args)
    for index, (first, last, stage) in enumerate(spans):
        if index == len(spans) - 1:
            peak, during = full.device_peak, full.peak_during
        else:  # the train alone: the eval samples at the full size
            sized = {role: targs.model_copy(update={"latent_shape": list(stage["latent_shape"])})
                     for role, targs in trainer_args.items()}
            staged = _plan(sized, with_eval=False)
            peak, during = staged.device_peak, staged.peak_during
        full.stages.append({"stage": index + 1, "first": first, "last": last,
                            "latent_shape": list(stage["latent_shape"]), "device_peak": peak, "peak_during": during})
    worst = max(full.stages, key=lambda st: st["device_peak"])
    if worst["device_peak"] > full.device_peak:
        full.device_peak, full.peak_during = worst["device_peak"], f"stage {worst['stage']}'s {worst['peak_during']}"
    full.notes.append(f"size schedule: {len(spans)} stages, the peak the largest stage's")
    return full


def _plan(trainer_args: dict[str, Args], with_eval: bool = True) -> MemoryPlan:
    """The plan of the trainers at their ``latent_shape``; ``with_eval``: the eval's peak too."""
    args = trainer_args["actor"]
    shard_size = parallel.check_shard_size(args.num_devices, args.fsdp_shard_size)
    sizes: dict[str, ModelSize] = {}

    def size_of(url: str) -> ModelSize:
        if url not in sizes:
            sizes[url] = model_size(url)
        return sizes[url]

    groups = []
    for role, targs in trainer_args.items():
        scored = targs.loss_type == "dmd2_critic"  # a LoRA of the teacher: one shared base, no teacher copy
        teacher = size_of(targs.teacher_checkpoint or targs.hf_checkpoint) if scored and not lora.shares_base(
            targs) else None
        groups.append(group_plan(role, targs, size_of(targs.hf_checkpoint), teacher, shard_size, scored))
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
    reserves = [terms.process_reserve(targs, shard_size) for targs in trainer_args.values()]
    reserve = sum(reserves) if args.colocate else max(reserves)
    if reserve:
        notes.append(f"+ {_gib(reserve)} reserve: {len(reserves) if args.colocate else 1} process(es) per device, "
                     "each a CUDA context and its NCCL communicators")
    decoder = 0
    if "actor" in by_role and args.eval_interval and with_eval:  # eval: the student's K steps, then rank 0 decodes
        actor_args, actor = trainer_args["actor"], by_role["actor"]
        from dmd2_core.data import workflow_conditions

        family = FAMILIES[describe_model_dir(actor_args.hf_checkpoint)["family"]].bind(
            actor_args.latent_shape, **workflow_conditions(actor_args.prompts, actor_args.workflow))
        size = size_of(actor_args.hf_checkpoint)
        compute = _dtype_bytes(actor_args.dtype)
        shape = family_shape(family, size.config, actor_args.latent_shape)
        decoder = terms.eval_decoder(actor_args, family, shape, compute)
        sampling = actor.gather + terms.eval_clips(actor_args) * sample_activations(
            family, size.config, actor_args, compute).no_grad
        others = 0 if args.sleep_after_train or not args.colocate else sum(
            g.resident for g in groups if g.role != "actor")
        candidates["the eval (actor rank 0: sampling, then the decoder)"] = actor.resident + others + max(
            sampling, decoder)
    when = max(candidates, key=candidates.get)
    peak = candidates[when] + reserve
    limit = device_limit(args)
    usable = int(limit * (1 - args.memory_headroom)) if limit is not None else None
    largest_block = max(s.largest_block for s in sizes.values()) * 4
    host = terms.host_plan(args, groups, largest_block, terms.export_writer(
        trainer_args["actor"], size_of(trainer_args["actor"].hf_checkpoint)))
    return MemoryPlan(groups, args.num_devices, shard_size, peak, limit, notes, when, args.micro_batch_size,
                      reserve, usable, args.memory_headroom, args.cp_size or 1, decoder, host)


def check_fits(memory_plan: MemoryPlan) -> None:
    """One line naming the group, the figure and the knobs, when the plan does not fit."""
    if not memory_plan.device_fits:
        _refuse_device(memory_plan)
    if memory_plan.host is not None and not memory_plan.host.fits:
        _refuse_host(memory_plan)


def _headroom(memory_plan: MemoryPlan) -> str:
    return f" less the {memory_plan.headroom:.0%} headroom (memory_headroom)" if memory_plan.headroom else ""


def _refuse_device(memory_plan: MemoryPlan) -> None:
    usable = memory_plan.usable
    if "the eval" in memory_plan.peak_during:
        raise ArgsError(
            f"memory plan: {memory_plan.peak_during} needs {_gib(memory_plan.device_peak)} per device (the decoder "
            f"alone {_gib(memory_plan.eval_decoder)}), more than the {_gib(usable)} of one device (device_memory_gib"
            f"{_headroom(memory_plan)}); try fewer eval clips (eval_prompts, eval_samples_per_prompt), "
            "eval_interval=0, or more devices (num_devices)")
    worst = next((g for g in memory_plan.groups if f"the {g.role} group" in memory_plan.peak_during),
                 max(memory_plan.groups, key=lambda g: g.peak))
    # no number of devices divides these at this cp_size
    unsharded = (worst.activations + worst.cp_buffers + worst.guidance + worst.gather + worst.buffers
                 + memory_plan.reserve)
    knobs = []
    if unsharded <= usable:
        knobs.append("more devices (num_devices)")
        if not worst.offloaded:
            knobs.append("critic_fsdp_cpu_offload" if worst.role == "critic" else "fsdp_cpu_offload")
        if not worst.base:  # full fine-tuning: LoRA keeps fp32 state for the adapters alone
            knobs.append("LoRA (critic_lora_rank)" if worst.role == "critic" else "LoRA (lora_rank)")
    if worst.activations and memory_plan.shard_size >= 2 * worst.cp_size:
        knobs.append(f"a larger cp_size (now {worst.cp_size}; it divides the {memory_plan.shard_size}-rank shard group)")
    if worst.activations == worst.activations_without_checkpointing:
        knobs.append("gradient_checkpointing")
    if memory_plan.micro_batch_size > 1:
        knobs.append("a smaller micro_batch_size")
    if memory_plan.headroom and memory_plan.device_peak <= memory_plan.device_limit:  # inside the headroom only
        knobs.append(f"a smaller memory_headroom (at {memory_plan.headroom:g})")
    if unsharded > usable:
        whatever = ("more devices with a larger cp_size (num_devices, cp_size) split them" if worst.cp_size < NODE_CP
                    else "whatever the number of devices at this cp_size")
        knobs.append(f"shorter or smaller samples (one sample's activations, transients and gathered blocks alone "
                     f"take {_gib(unsharded)} at cp_size {worst.cp_size}; {whatever})")
    raise ArgsError(
        f"memory plan: {memory_plan.peak_during} needs {_gib(memory_plan.device_peak)} per device "
        f"(the {worst.role} group's largest part: {_largest_part(worst)}), more than the "
        f"{_gib(usable)} of one device (device_memory_gib{_headroom(memory_plan)}); try {', '.join(knobs)} "
        f"(python -m dmd2_core plan shows the figures)"
    )


def _refuse_host(memory_plan: MemoryPlan) -> None:
    host = memory_plan.host
    parts = {k: v for k, v in host.parts.items() if k != "load"} if host.phase == "training" else {"load": host.parts["load"]}
    name = max(parts, key=parts.get)
    knobs = {"sleep_stash": "sleep_after_train=false (if the device plan allows)", "async_save_staging": "async_save=false",
             "offloaded": "fsdp_cpu_offload=false (if the device plan allows)",
             "load": "more nodes (num_devices; the load peak per rank shrinks with the shard)"}
    advice = [knobs[name]] if name in knobs else []
    advice += ["more nodes (num_devices)"] if name != "load" else []
    if memory_plan.headroom and host.peak <= host.limit:
        advice.append(f"a smaller memory_headroom (at {memory_plan.headroom:g})")
    raise ArgsError(
        f"memory plan: host memory while {host.phase} needs {_gib(host.peak)} per node ({host.ranks_per_node} ranks; "
        f"per rank {name.replace('_', ' ')} {_gib(parts[name])}), more than the {_gib(host.usable)} of "
        f"host_memory_gib{_headroom(memory_plan)}; try {', '.join(advice)} (python -m dmd2_core plan shows the figures)")


def _largest_part(g: GroupPlan) -> str:
    parts = {"weights": g.params, "gradients": g.grads, "optimizer": g.optimizer, "ema": g.ema,
             "teacher": g.teacher, "frozen base": g.base, "activations": g.activations, "gather": g.gather,
             "cp buffers": g.cp_buffers, "guidance transient": g.guidance, "rollout": g.rollout}
    name = max(parts, key=parts.get)
    return f"{name} {_gib(parts[name])}"


def _gib(n: Optional[int]) -> str:
    return "?" if n is None else f"{n / GIB:.1f} GiB"
