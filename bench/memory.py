"""The memory plan against the bytes the ranks really hold, and the plan of real-size models.

Prints one JSON line:

  {"standin": {"1": {role: {kind: {"planned", "measured", "ratio"}}}, "2": {...}},
   "real_size": {config: {"params_b", "device_peak_gib", "groups": {role: {...GiB per rank}}}}}

The stand-in is minimax-h3 on the MiniMax-H3 stand-in (CPU, bf16, gradient checkpointing) run for
one iteration at 1 and 2 ranks; "measured" is the storage bytes each rank's weights, optimizer
state, EMA and teacher hold (the mean over ranks). The real-size plans: wan-video on 8 devices
with the Wan and SD3.5 configs of deployments/model_configs (Wan at 81 frames of 480x832, SD3.5 at
1024x1024); minimax-h3 with the real MiniMax-H3 config at 124 and 345 frames of 768x1344 on
80 and 141 GiB devices: the fewest devices (of 8, 16, 32, 64) whose plan fits, and 8 devices with
fsdp_cpu_offload.

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
H3_FRAMES = (124, 345)  # 5.2 s and 14.4 s at 24 fps (17n + 5 frames), 768 x 1344
DEVICE_GIB = (80, 141)
DEVICE_COUNTS = (8, 16, 32, 64)
KINDS = ("params", "optimizer", "ema", "teacher")
GIB = 1024 ** 3


def standin(tmp: str) -> dict:
    import ray

    from dmd2_core import memory
    from dmd2_core.args import load_args
    from dmd2_core.distill import DistillRun, preflight
    from dmd2_core.models.standins import H3_GEOMETRY, build_h3_standin, h3_prompt_set

    url = build_h3_standin(f"{tmp}/h3")
    h3_prompt_set().save(f"{tmp}/prompts.safetensors")
    ray.init(resources={"dmd2_device": 2.0}, include_dashboard=False, log_to_driver=False)
    out = {}
    try:
        for n in (1, 2):
            args = load_args("minimax-h3", dict(
                hf_checkpoint=url, prompts=f"{tmp}/prompts.safetensors", save=f"{tmp}/run{n}", device="cpu",
                num_devices=n, global_batch_size=4, micro_batch_size=2, eval_interval=0, save_interval=0,
                run_name=f"bench-memory-{n}", **H3_GEOMETRY))
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


def _plan(recipe: str, overrides: dict):
    from dmd2_core import checks, memory
    from dmd2_core.args import load_args
    from dmd2_core.models import describe_checkpoint
    from dmd2_core.trainer_config import compute_trainer_args, compute_trainer_configs

    args = load_args(recipe, overrides)
    args = checks.check_family_args(args, describe_checkpoint(args.hf_checkpoint))
    return memory.plan({cfg.role: compute_trainer_args(args, cfg) for cfg in compute_trainer_configs(args)}), args


def _row(plan) -> dict:
    return {"device_peak_gib": round(plan.device_peak / GIB, 1),
            "groups": {g.role: {k: round(v / GIB, 2) for k, v in
                                dict(resident=g.resident, peak=g.peak, activations=g.activations,
                                     activations_without_checkpointing=g.activations_without_checkpointing).items()}
                       for g in plan.groups}}


def real_size() -> dict:
    from dmd2_core import memory

    out = {}
    for name, extra in REAL.items():
        plan, args = _plan("wan-video", dict(hf_checkpoint=os.path.join(CONFIGS, name), **extra))
        out[name] = {"params_b": round(memory.model_size(args.hf_checkpoint).params / 1e9, 3), **_row(plan)}
    h3 = os.path.join(CONFIGS, "minimax-h3")
    out["minimax-h3"] = {"params_b": round(memory.model_size(h3).params / 1e9, 3)}
    for frames in H3_FRAMES:
        for gib in DEVICE_GIB:
            key = f"{frames}f_{gib}gib"
            row = {"fewest_devices": None}
            for n in DEVICE_COUNTS:  # the fewest devices whose plan fits, GPU-resident
                plan, args = _plan("minimax-h3", dict(hf_checkpoint=h3, num_frames=frames, num_devices=n,
                                                      global_batch_size=max(16, n), device_memory_gib=gib))
                if plan.fits:
                    row.update(fewest_devices=n, **_row(plan))
                    break
            if row["fewest_devices"] is None:
                row.update(at_most_devices=DEVICE_COUNTS[-1], **_row(plan))
            plan, args = _plan("minimax-h3", dict(hf_checkpoint=h3, num_frames=frames, device_memory_gib=gib,
                                                  fsdp_cpu_offload=True))
            row["offload_8"] = {"fits": plan.fits, "device_peak_gib": round(plan.device_peak / GIB, 1)}
            row["latent_shape"], row["seconds"] = args.latent_shape, round(frames / 24, 2)
            out["minimax-h3"][key] = row
    return out


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="dmd2-memory-") as tmp:
        print(json.dumps({"standin": standin(tmp), "real_size": real_size()}))


if __name__ == "__main__":
    main()
