"""The memory plan against the bytes the ranks really hold, and the plan of real-size models.

Prints one JSON line:

  {"standin": {"1": {role: {kind: {"planned", "measured", "ratio"}}}, "2": {...}},
   "standin_activations": {"checkpointing" | "no_checkpointing" | "no_grad": {"planned", "measured", "ratio"}},
   "real_size": {config: {"params_b", "device_peak_gib", "groups": {role: {...GiB per rank}}}},
   "grid": {"<model> <clip> cp<n> <gib>GiB": {"device_peak_gib", "usable_gib", "fits", "host_gib"}}}

The stand-in is minimax-h3 on the MiniMax-H3 stand-in (CPU, bf16, gradient checkpointing) run for
one iteration at 1 and 2 ranks; "measured" is the storage bytes each rank's weights, optimizer
state, EMA, teacher and sleep stash ("resident": the bytes a sleep moves to the host) hold (the
mean over ranks). "standin_activations" runs the whole stand-in (every block) forward once in bf16
on CPU and compares the bytes autograd saves (unique storages, parameters excluded; with and
without gradient checkpointing) and a no-grad forward's peak with the plan's figures for it (an
uncalibrated config: the family's ratio, bench/activations.py). "grid" is docs/scale.md's table: Wan
14B at 480p and 720p x 81 frames (micro batch 1) and MiniMax-H3 at 5 s and 15 s on 8 devices, cp
1 / 2 / 4 / 8, 80 and 141 GiB. The real-size plans: wan-video on 8 devices
with the Wan and SD3.5 configs of deployments/model_configs (Wan at 81 frames of 480x832, SD3.5 at
1024x1024); minimax-h3 with the real MiniMax-H3 config at 124 and 345 frames of 768x1344 on
80 and 141 GiB devices: the fewest devices (of 8, 16, 32, 64) whose plan fits, and 8 devices with
fsdp_cpu_offload.

"lora_grid" (and ``--lora``, its markdown table alone: docs/scale.md's LoRA section) plans a LoRA
student and fake score (rank 16 and 64, the default attention targets, one shared base in the
critic) for MiniMax-H3 at 5 s and Wan 14B at 480p / 720p x 81 frames on 8 x 80 GiB, cp 1 and 2,
beside the full-fine-tuning plan of the same run.

    python bench/memory.py
    python bench/memory.py --grid   # docs/scale.md's table only (no run)
    python bench/memory.py --lora   # the LoRA table only (no run)
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
KINDS = ("params", "optimizer", "ema", "teacher", "resident")
GRID = {"wan14b 480p": ("wan-video", {"hf_checkpoint": "wan2.1-t2v-14b", "latent_shape": [16, 21, 60, 104],
                                      "micro_batch_size": 1}),
        "wan14b 720p": ("wan-video", {"hf_checkpoint": "wan2.1-t2v-14b", "latent_shape": [16, 21, 90, 160],
                                      "micro_batch_size": 1}),
        "h3 5s": ("minimax-h3", {"hf_checkpoint": "minimax-h3", "num_frames": 124}),
        "h3 15s": ("minimax-h3", {"hf_checkpoint": "minimax-h3", "num_frames": 345})}
GRID_DEVICES = {"wan14b": (8,), "h3": (16, 32)}
LORA_RANKS = (16, 64)
LORA_MODELS = ("h3 5s", "wan14b 480p", "wan14b 720p")
LORA_CPS = (1, 2)
LORA_GIB = 80
GIB = 1024 ** 3


def standin(tmp: str) -> dict:
    import ray

    from dmd2_core.memory import planner
    from dmd2_core.args import load_args
    from dmd2_core.run.distill_run import DistillRun, preflight
    from dmd2_core.toys.standins import H3_GEOMETRY, build_h3_standin, h3_prompt_set

    url = build_h3_standin(f"{tmp}/h3")
    h3_prompt_set().save(f"{tmp}/prompts.safetensors")
    ray.init(resources={"dmd2_device": 2.0}, include_dashboard=False, log_to_driver=False)
    out = {}
    try:
        for n in (1, 2):
            args = load_args("minimax-h3", dict(
                hf_checkpoint=url, prompts=f"{tmp}/prompts.safetensors", save=f"{tmp}/run{n}", device="cpu",
                num_devices=n, cp_size=1, lora_rank=0, global_batch_size=4, micro_batch_size=2, eval_interval=0, save_interval=0,
                run_name=f"bench-memory-{n}", **H3_GEOMETRY))
            planned = {g.role: g for g in planner.plan(preflight(args)).groups}
            with DistillRun(args) as run:
                run.iterate(1)
                held = {role: run.group_call(role, "state_bytes") for role in run.groups}
            for role, ranks in held.items():  # what sleeping moves to the host: the device state
                for r in ranks:
                    r["resident"] = r["params"] + r["optimizer"] + r["ema"] + r["teacher"]
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


def standin_activations(tmp: str) -> dict:
    """The plan's activations of one stand-in clip against the bytes its forward really saves."""
    import torch

    from bench.activations import no_grad_peak
    from dmd2_core.run import preflight_checks
    from dmd2_core.memory import planner
    from dmd2_core.args import load_args
    from dmd2_core.models import describe_model_dir, load_model_dir
    from dmd2_core.toys.standins import H3_GEOMETRY, build_h3_standin

    url = build_h3_standin(f"{tmp}/h3-act")
    args = preflight_checks.check_family_args(load_args("minimax-h3", dict(hf_checkpoint=url, device="cpu", **H3_GEOMETRY)),
                                    describe_model_dir(url))
    loaded = load_model_dir(url, dtype=torch.bfloat16)
    model, family = loaded.model, loaded.family.bind(args.latent_shape, loaded.model)
    size = planner.model_size(url)
    act = planner.sample_activations(family, size.config, args, 2)
    x = torch.randn(1, *family.sample_shape(model, args.latent_shape))
    text = family.default_text_tokens
    cond = {"prompt_embeds": torch.randn(1, text, size.config["text_dim"]), "prompt_lengths": torch.tensor([text])}
    run = lambda: family.predict_velocity(model, x, torch.tensor([0.5]), cond)  # noqa: E731
    out = {}
    for name, ckpt in (("no_checkpointing", False), ("checkpointing", True)):
        if ckpt:
            model.enable_gradient_checkpointing()
        measured = _saved_bytes(model, run)
        planned = act.total(size.num_blocks, ckpt)
        out[name] = {"planned": planned, "measured": measured, "ratio": round(planned / measured, 3)}
    model.disable_gradient_checkpointing()
    measured = no_grad_peak(model, run)
    out["no_grad"] = {"planned": act.no_grad, "measured": measured, "ratio": round(act.no_grad / measured, 3)}
    out["source"] = act.source
    return out


def _saved_bytes(model, run) -> int:
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    del out
    return sum(saved.values())


def grid() -> dict:
    out = {}
    for name, (recipe, extra) in GRID.items():
        for n in GRID_DEVICES[name.split()[0]]:
            for cp in (1, 2, 4, 8):
                for gib in DEVICE_GIB:
                    overrides = {**extra, "hf_checkpoint": os.path.join(CONFIGS, extra["hf_checkpoint"]), "cp_size": cp,
                                 "device_memory_gib": gib, "num_devices": n, "global_batch_size": 16}
                    plan, args = _plan(recipe, overrides)
                    out[f"{name} {n}x cp{cp} {gib}GiB"] = {
                        "device_peak_gib": round(plan.device_peak / GIB, 1), "usable_gib": round(plan.usable / GIB, 1),
                        "fits": plan.device_fits, "during": plan.peak_during,
                        "host_gib": round(plan.host.peak / GIB, 1),
                        "activations_gib": {g.role: round(g.activations / GIB, 2) for g in plan.groups}}
    return out


def lora_grid() -> dict:
    """The LoRA plans (and the full-fine-tuning plan of each cell) on one node of 8 x 80 GiB."""
    from dmd2_core.memory import lora_terms

    out = {}
    for name in LORA_MODELS:
        recipe, extra = GRID[name]
        for rank in (0, *LORA_RANKS):
            for cp in LORA_CPS:
                overrides = {**extra, "hf_checkpoint": os.path.join(CONFIGS, extra["hf_checkpoint"]), "cp_size": cp,
                             "device_memory_gib": LORA_GIB, "num_devices": 8, "global_batch_size": 16,
                             "lora_rank": rank}
                plan, args = _plan(recipe, overrides)
                groups = {g.role: g for g in plan.groups}
                out[f"{name} r{rank} cp{cp}"] = {
                    "device_peak_gib": round(plan.device_peak / GIB, 1), "usable_gib": round(plan.usable / GIB, 1),
                    "fits": plan.device_fits, "during": plan.peak_during, "host_gib": round(plan.host.peak / GIB, 1),
                    "adapters_m": round(lora_terms.size_of(args).adapters / 1e6, 1) if rank else None,
                    "base_gib": round(groups["critic"].base / GIB, 2),
                    "resident_gib": {r: round(g.resident / GIB, 2) for r, g in groups.items()},
                    "peak_gib": {r: round(g.peak / GIB, 2) for r, g in groups.items()}}
    return out


def lora_table(rows: dict) -> str:
    """The LoRA grid as markdown: the device peak GiB per cp, bold where it fits in the usable 72 GiB."""
    cell = lambda c: f"**{c['device_peak_gib']}**" if c["fits"] else f"{c['device_peak_gib']}"  # noqa: E731
    cps = " | ".join(f"cp {cp}" for cp in LORA_CPS)
    lines = [f"| model, clip | LoRA rank | adapters per model (M) | base per rank (GiB) | {cps} | "
             "resident per rank: critic / actor (GiB) | peak during (cp 1) | host per node (GiB) |",
             "|---|---|---|---|" + "---|" * len(LORA_CPS) + "---|---|---|"]
    for name in LORA_MODELS:
        for rank in (0, *LORA_RANKS):
            cells = [rows[f"{name} r{rank} cp{cp}"] for cp in LORA_CPS]
            first = cells[0]
            during = first["during"].split(" (")[0].replace("the ", "")
            lines.append(f"| {name} | {rank or 'full FT'} | {first['adapters_m'] or '-'} | "
                         f"{first['base_gib'] or '-'} | " + " | ".join(cell(c) for c in cells)
                         + f" | {first['resident_gib']['critic']} / {first['resident_gib']['actor']} | {during} | "
                         f"{first['host_gib']} |")
    return "\n".join(lines)


def _plan(recipe: str, overrides: dict):
    from dmd2_core.run import preflight_checks
    from dmd2_core.memory import planner
    from dmd2_core.args import load_args
    from dmd2_core.models import describe_model_dir
    from dmd2_core.train.trainer_config import compute_trainer_args, compute_trainer_configs

    args = load_args(recipe, overrides)
    args = preflight_checks.check_family_args(args, describe_model_dir(args.hf_checkpoint))
    return planner.plan({cfg.role: compute_trainer_args(args, cfg) for cfg in compute_trainer_configs(args)}), args


def _row(plan) -> dict:
    return {"device_peak_gib": round(plan.device_peak / GIB, 1),
            "groups": {g.role: {k: round(v / GIB, 2) for k, v in
                                dict(resident=g.resident, peak=g.peak, activations=g.activations,
                                     activations_without_checkpointing=g.activations_without_checkpointing).items()}
                       for g in plan.groups}}


def real_size() -> dict:
    from dmd2_core.memory import planner

    out = {}
    for name, extra in REAL.items():
        plan, args = _plan("wan-video", dict(hf_checkpoint=os.path.join(CONFIGS, name), **extra))
        out[name] = {"params_b": round(planner.model_size(args.hf_checkpoint).params / 1e9, 3), **_row(plan)}
    h3 = os.path.join(CONFIGS, "minimax-h3")
    out["minimax-h3"] = {"params_b": round(planner.model_size(h3).params / 1e9, 3)}
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


def grid_table(rows: dict) -> str:
    """The grid as docs/scale.md's markdown: the device peak GiB per cell, bold where it fits."""
    lines = ["| model, clip | devices | device (usable) | cp 1 | cp 2 | cp 4 | cp 8 | host per node (cp 8) |",
             "|---|---|---|---|---|---|---|---|"]
    for name in GRID:
        for n in GRID_DEVICES[name.split()[0]]:
            for gib in DEVICE_GIB:
                cells = [rows[f"{name} {n}x cp{cp} {gib}GiB"] for cp in (1, 2, 4, 8)]
                text = [f"**{c['device_peak_gib']}**" if c["fits"] else f"{c['device_peak_gib']}" for c in cells]
                lines.append(f"| {name} | {n} | {gib} ({cells[0]['usable_gib']}) | " + " | ".join(text)
                             + f" | {cells[-1]['host_gib']} |")
    return "\n".join(lines)


def main() -> None:
    if "--grid" in sys.argv:  # docs/scale.md's table alone (configs only, seconds)
        print(grid_table(grid()))
        return
    if "--lora" in sys.argv:  # docs/scale.md's LoRA table alone (configs only, seconds)
        print(lora_table(lora_grid()))
        return
    with tempfile.TemporaryDirectory(prefix="dmd2-memory-") as tmp:
        print(json.dumps({"standin": standin(tmp), "standin_activations": standin_activations(tmp),
                          "real_size": real_size(), "grid": grid(), "lora_grid": lora_grid()}))


if __name__ == "__main__":
    main()
