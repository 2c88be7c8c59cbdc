"""The memory plan as text: GiB per rank per group, the activation sources, the device and host
lines (``python -m dmd2_core plan``)."""

from __future__ import annotations

from dmd2_core.memory.terms import GIB


def _gib(n) -> str:
    return "?" if n is None else f"{n / GIB:.1f} GiB"


ROWS = ("params", "grads", "optimizer", "ema", "teacher", "buffers", "gather", "activations",
        "activations_without_checkpointing", "activations_with_checkpointing", "cp_buffers", "guidance", "rollout",
        "offloaded", "resident", "peak")


def table(memory_plan) -> str:
    """The plan as a text table, GiB per rank, then the device and host lines."""
    roles = [g.role for g in memory_plan.groups]
    width = max(len(r) for r in ROWS) + 2
    lines = [f"{'GiB per rank':<{width}}" + "".join(f"{r:>12}" for r in roles)]
    lines.append(f"{'cp_size':<{width}}" + "".join(f"{g.cp_size:>12}" for g in memory_plan.groups))
    for row in ROWS:
        if row == "teacher" and any(g.base for g in memory_plan.groups):  # LoRA: the frozen base (memory_lora)
            lines.append(f"{'base':<{width}}" + "".join(f"{g.base / GIB:>12.2f}" for g in memory_plan.groups))
        values = [getattr(g, row) for g in memory_plan.groups]
        lines.append(f"{row:<{width}}" + "".join(f"{v / GIB:>12.2f}" for v in values))
    for g in memory_plan.groups:
        lines.append(f"{g.role} activations: {g.activation_source}")
    if memory_plan.eval_decoder:
        lines.append(f"eval decoder (actor rank 0, estimated): {_gib(memory_plan.eval_decoder)}")
    limit = "unchecked" if memory_plan.device_limit is None else (
        f"{_gib(memory_plan.usable)} usable ({_gib(memory_plan.device_limit)} less {memory_plan.headroom:.0%})")
    lines.append(f"device peak: {_gib(memory_plan.device_peak)} of {limit}, during {memory_plan.peak_during} "
                 f"({memory_plan.num_devices} devices, shard size {memory_plan.shard_size}; "
                 + "; ".join(memory_plan.notes) + ")")
    for stage in memory_plan.stages:
        lines.append(f"  size stage {stage['stage']} (iterations {stage['first']}-{stage['last']}, latents "
                     f"{stage['latent_shape']}): device peak {_gib(stage['device_peak'])}, during {stage['peak_during']}")
    host = memory_plan.host
    if host is not None:
        of = "unchecked" if host.limit is None else f"{_gib(host.usable)} usable ({_gib(host.limit)} less {memory_plan.headroom:.0%})"
        parts = ", ".join(f"{k.replace('_', ' ')} {_gib(v)}" for k, v in host.parts.items())
        lines.append(f"host peak per node: {_gib(host.peak)} of {of}, while {host.phase} "
                     f"({host.ranks_per_node} ranks; per rank: {parts})")
    return "\n".join(lines)
