"""The nearest settings that fit, when a run's memory plan does not (``python -m dmd2_core plan``).

Each proposal changes the knobs the memory plan models -- ``cp_size``, LoRA (``lora_rank``, the
critic's following it), ``fsdp_cpu_offload`` (both groups, or ``critic_fsdp_cpu_offload`` alone),
``gradient_checkpointing``, ``micro_batch_size`` 1 and more devices (``num_devices`` x2, x4) --
and is planned again from scratch: memory (device and host) and time. Only plans that fit are
proposed, best first: on the devices the run names before more devices, fewer changed knobs before
more, then more iterations a night, then less memory. Of the settings that change the same knobs
only the best is proposed (``lora_rank=16`` stands for 64 too, when it is as fast), and one that
adds knobs to a proposal without more iterations a night is left out (it is not nearer, nor
better).

Time is the time plan's at the pace of the run being planned (its assumed MFU, or the MFU its
measured pace implies): the plan does not price context parallelism's all-to-all nor offload's
host traffic and host optimizer step, so those proposals say so.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

from dmd2_core.args import Args, replace_args
from dmd2_core.errors import ArgsError
from dmd2_core.memory import planner
from dmd2_core.memory.terms import GIB

LORA_RANKS = (16, 64)
DEVICE_FACTORS = (2, 4)
UNPRICED = {"cp_size": "cp's all-to-all", "fsdp_cpu_offload": "offload's host traffic",
            "critic_fsdp_cpu_offload": "offload's host traffic"}


@dataclass
class Proposal:
    overrides: dict
    memory_plan: planner.MemoryPlan
    time_plan: object  # time_plan.TimePlan

    @property
    def setting(self) -> str:
        return " ".join(f"{k}={_yaml(v)}" for k, v in self.overrides.items())

    @property
    def more_devices(self) -> bool:
        return "num_devices" in self.overrides

    def sort_key(self) -> tuple:
        return (self.more_devices, len(self.overrides), -self.time_plan.iterations_per_night,
                self.memory_plan.device_peak)

    def describe(self) -> str:
        tp = self.time_plan
        unpriced = sorted({UNPRICED[k] for k in self.overrides if k in UNPRICED})
        return (f"{self.setting}: {self.memory_plan.device_peak / GIB:.1f} GiB a device, "
                f"{tp.iteration_s:.1f} s an iteration, {tp.iterations_per_night} iterations a night"
                + (f" (not priced: {', '.join(unpriced)})" if unpriced else ""))

    def as_dict(self) -> dict:
        return {"overrides": self.overrides, "device_peak": self.memory_plan.device_peak,
                "host_peak": self.memory_plan.host.peak if self.memory_plan.host else None,
                "iteration_s": self.time_plan.iteration_s,
                "iterations_per_night": self.time_plan.iterations_per_night}


def _yaml(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def knob_options(args: Args, shard_size: int) -> list[list[dict]]:
    """Per knob, its alternatives to the run's own setting (``{}``: unchanged first)."""
    options = [[{}] + [{"cp_size": cp} for cp in (1, 2, 4, 8) if cp != args.cp_size and cp <= shard_size]]
    if not args.lora_rank:
        options.append([{}] + [{"lora_rank": rank} for rank in LORA_RANKS])
    offload = [{}]
    if not args.fsdp_cpu_offload:
        offload.append({"fsdp_cpu_offload": True})
        if not args.critic_fsdp_cpu_offload:
            offload.append({"critic_fsdp_cpu_offload": True})
    options.append(offload)
    if not args.gradient_checkpointing:
        options.append([{}, {"gradient_checkpointing": True}])
    if args.micro_batch_size > 1:
        options.append([{}, {"micro_batch_size": 1}])
    options.append([{}] + [{"num_devices": args.num_devices * f} for f in DEVICE_FACTORS])
    return options


def _valid(args: Args) -> bool:
    """What preflight would refuse in a setting, from the configs alone: the batch split over the
    data-parallel ranks, the family's context-parallel plan (heads over cp)."""
    import json

    from dmd2_core import storage
    from dmd2_core.models import FAMILIES, describe_model_dir

    if args.global_batch_size % max(1, args.num_devices // args.cp_size):
        return False
    if args.cp_size > 1:
        info = describe_model_dir(args.hf_checkpoint)
        config = json.loads(storage.read_text(storage.join(info["transformer_url"], "config.json")))
        if FAMILIES[info["family"]].context_parallel_problem(config, args.cp_size):
            return False
    return True


def propose(args: Args, plan_of: Callable[[Args], tuple], shard_size: int, limit: int = 5) -> list[Proposal]:
    """Up to ``limit`` settings near ``args`` that fit, best first. ``plan_of(args)`` is
    ``(memory_plan, time_plan)`` of a setting (the CLI's own planning, so a proposal is planned as
    the run would be)."""
    found: list[Proposal] = []
    for combo in itertools.product(*knob_options(args, shard_size)):
        overrides = {k: v for part in combo for k, v in part.items()}
        if not overrides:
            continue
        try:
            candidate = replace_args(args, overrides, "a proposed setting")
            if not _valid(candidate):
                continue
            memory_plan, timing = plan_of(candidate)
        except (ArgsError, ValueError):  # a setting the rules refuse is no proposal
            continue
        if memory_plan.fits:
            found.append(Proposal(overrides, memory_plan, timing))
    found.sort(key=Proposal.sort_key)
    kept: list[Proposal] = []
    for p in found:
        if any(set(q.overrides) == set(p.overrides) for q in kept):  # the best value of the same knobs only
            continue
        if any(set(q.overrides) < set(p.overrides)
               and q.time_plan.iterations_per_night >= p.time_plan.iterations_per_night for q in kept):
            continue
        kept.append(p)
    return kept[:limit]


def table(proposals: list[Proposal]) -> str:
    if not proposals:
        return "nearest settings that fit: none of cp_size, LoRA, offload, checkpointing, micro batch 1 or x4 devices"
    return "nearest settings that fit (best first):\n" + "\n".join(f"  {p.describe()}" for p in proposals)
