"""The memory plan against the bytes the ranks really hold, and the plan of real-size models.

Prints one JSON line:

  {"standin": {"1": {role: {kind: {"planned", "measured", "ratio"}}}, "2": {...}},
   "real_size": {config: {"params_b", "device_peak_gib", "groups": {role: {...GiB per rank}}}}}

The stand-in is minimax-h3 on the SD3 stand-in (CPU, bf16, gradient checkpointing) run for one
iteration at 1 and 2 ranks; "measured" is the storage bytes each rank's weights, optimizer state,
EMA and teacher hold (the mean over ranks). The real-size plans are minimax-h3 on 8 devices with
each config of deployments/model_configs (Wan at 81 frames of 480x832, SD3.5 at 1024x1024).

    python bench/memory.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from statistics import fmean

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deployments", "model_configs")
REAL = {
    "wan2.1-t2v-1.3b": {"latent_shape": [16, 21, 60, 104]},
    "wan2.1-t2v-14b": {"latent_shape": [16, 21, 60, 104]},
    "sd3.5-medium": {"latent_shape": [16, 128, 128]},
}
KINDS = ("params", "optimizer", "ema", "teacher")
GIB = 1024 ** 3


def standin(tmp: str) -> dict:
    import ray

    from dmd2_core import memory
    from dmd2_core.args import load_args
    from dmd2_core.distill import DistillRun, preflight
    from dmd2_core.models.standins import build_standin, standin_prompt_set

    url = build_standin(f"{tmp}/sd3", "sd3")
    standin_prompt_set("sd3").save(f"{tmp}/prompts.safetensors")
    ray.init(resources={"dmd2_device": 2.0}, include_dashboard=False, log_to_driver=False)
    out = {}
    try:
        for n in (1, 2):
            args = load_args("minimax-h3", dict(
                hf_checkpoint=url, prompts=f"{tmp}/prompts.safetensors", save=f"{tmp}/run{n}", device="cpu",
                num_devices=n, global_batch_size=4, micro_batch_size=2, eval_interval=0, save_interval=0,
                run_name=f"bench-memory-{n}"))
            planned = {g.role: g for g in memory.plan(preflight(args)).groups}
            with DistillRun(args) as run:
                run.iterate(1)
                held = {role: run.group_call(role, "state_bytes") for role in run.groups}
            out[str(n)] = {
                role: {kind: {"planned": getattr(planned[role], kind),
                              "measured": fmean(r[kind] for r in ranks),
                              "ratio": round(fmean(r[kind] for r in ranks) / getattr(planned[role], kind), 4)
                              if getattr(planned[role], kind) else None}
                       for kind in KINDS}
                for role, ranks in held.items()}
    finally:
        ray.shutdown()
    return out


def real_size() -> dict:
    from dmd2_core import memory
    from dmd2_core.args import load_args
    from dmd2_core.trainer_config import compute_trainer_args, compute_trainer_configs

    out = {}
    for name, extra in REAL.items():
        args = load_args("minimax-h3", dict(hf_checkpoint=os.path.join(CONFIGS, name), **extra))
        trainers = {cfg.role: compute_trainer_args(args, cfg) for cfg in compute_trainer_configs(args)}
        plan = memory.plan(trainers)
        out[name] = {
            "params_b": round(memory.model_size(args.hf_checkpoint).params / 1e9, 3),
            "device_peak_gib": round(plan.device_peak / GIB, 1),
            "groups": {g.role: {k: round(v / GIB, 2) for k, v in
                                dict(resident=g.resident, peak=g.peak, activations=g.activations,
                                     activations_without_checkpointing=g.activations_without_checkpointing).items()}
                       for g in plan.groups},
        }
    return out


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="dmd2-memory-") as tmp:
        print(json.dumps({"standin": standin(tmp), "real_size": real_size()}))


if __name__ == "__main__":
    main()
