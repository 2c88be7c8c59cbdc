"""Does the time plan predict a run's eval, checkpoint and export from one measured iteration? The
minimax-h3 recipe on the MiniMax-H3 stand-in (CPU, fp32, one rank per group, through the Prefect
flow and its Ray groups): a few iterations with evals, checkpoints and an export, the times read
back from the run's metrics log; the plan (``python -m dmd2_core plan``'s, from the configs alone)
calibrated from the run's FIRST iteration only (``time_plan.calibrate``: the effective FLOP/s it
implies, and the storage bandwidth of the first checkpoint), then its predictions of every other
cost next to what the run measured. Prints one JSON line:

  {"settings": {...}, "calibration": {"iteration_s", "flops_per_s", "storage_bytes_per_s", ...},
   "costs": {cost: {"predicted_s", "measured_s", "ratio", "measured": [...]}}, "within_30pct": [...],
   "run_s", "total_s"}

``ratio`` is predicted over measured (the median of the run's measurements of that cost). What
carries over to a GPU and what does not: docs/scale.md, "Calibrating the time plan".

    python bench/plan_calibration.py [--iterations 4] [--interval 2] [--keep DIR] [--from-save DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_standin(root: str, iterations: int, interval: int) -> tuple[str, dict]:
    """The minimax-h3 recipe on the stand-in through the flow: evals at the start and every
    ``interval``, a checkpoint every ``interval`` (written synchronously, so that its seconds are
    the save's own), the student exported at each. Returns (the save, the overrides)."""
    from flows.environment import configure_environment

    configure_environment()  # before Prefect and Ray are imported
    from dmd2_core.toys.standins import H3_GEOMETRY, build_h3_standin, h3_prompt_set
    from flows.dmd2 import dmd2

    url = build_h3_standin(f"{root}/h3")
    h3_prompt_set().save(f"{root}/prompts.safetensors")
    overrides = dict(hf_checkpoint=url, prompts=f"{root}/prompts.safetensors", save=f"{root}/run", device="cpu",
                     num_devices=1, cp_size=1, dtype="float32", torch_threads=1, run_name="bench-plan-calibration",
                     num_iterations=iterations, eval_interval=interval, save_interval=interval,
                     export_interval=interval, async_save=False, **H3_GEOMETRY)
    summary = dmd2(recipe="minimax-h3", overrides=overrides)
    if summary["final_iteration"] != iterations:
        raise RuntimeError(f"the stand-in run stopped at {summary['final_iteration']} of {iterations}")
    return overrides["save"], overrides


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def compare(save: str, overrides: dict) -> dict:
    """The plan of the run's own settings (as ``python -m dmd2_core plan`` makes it), calibrated
    from the run's metrics log, against what the run measured."""
    from dmd2_core.args import load_args
    from dmd2_core.evaluation.evaluator import evaluator_name
    from dmd2_core.memory import planner, time_plan
    from dmd2_core.models import describe_model_dir
    from dmd2_core.report.metrics_log import read_metrics
    from dmd2_core.run import preflight_checks
    from dmd2_core.save_layout import metrics_url
    from dmd2_core.train.trainer_config import compute_trainer_args, compute_trainer_configs

    args = load_args("minimax-h3", overrides)
    args = preflight_checks.check_family_args(args, describe_model_dir(args.hf_checkpoint, "hf_checkpoint"))
    trainers = {cfg.role: compute_trainer_args(args, cfg) for cfg in compute_trainer_configs(args)}
    rows = read_metrics(save)
    # the peak only names the scale of the MFU; the calibrated rate does not depend on it
    plan = time_plan.calibrate(time_plan.time_plan(trainers, planner.plan(trainers), evaluator_name(args),
                                                   peak_flops=1e12), trainers, rows, metrics_url(save))
    cal = plan.calibrated
    rate = cal["flops_per_s"] * plan.num_devices
    trained = [r for r in rows if isinstance(r.get("iteration_s"), (int, float))]
    later = [r for r in trained if r["iteration"] != cal["iteration"]]
    plain_evals = [r["eval_s"] for r in rows if "eval_s" in r and "eval_reference_s" not in r]
    first_eval = [r["eval_s"] for r in rows if "eval_reference_s" in r]
    saves = [r for r in rows if isinstance(r.get("checkpoint_save_s"), (int, float))]

    def at_own_stop_step(row: dict) -> float:
        return sum(time_plan.iteration_flops(trainers, int(row["stop_step"])).values()) / rate

    costs = {
        # the calibrating iteration itself: exact by construction
        "calibrating_iteration": (at_own_stop_step(next(r for r in trained if r["iteration"] == cal["iteration"])),
                                  [cal["iteration_s"]]),
        "other_iterations_at_their_stop_step": (_median([at_own_stop_step(r) for r in later]),
                                                [r["iteration_s"] for r in later]),
        "iteration_expected": (plan.iteration_s, [r["iteration_s"] for r in later]),
        "eval": (plan.eval_s, plain_evals),
        "eval_with_reference": (plan.eval_s + plan.reference_s, first_eval),
        "checkpoint_after_the_first": (plan.checkpoint_s, [r["checkpoint_save_s"] for r in saves
                                                           if r["iteration"] != cal.get("checkpoint_iteration")]),
        "export_after_the_first": (plan.export_s, [r["export_s"] for r in rows if isinstance(r.get("export_s"), (int, float))
                                                   and r["iteration"] != cal.get("export_iteration")]),
    }
    out = {}
    for name, (predicted, measured) in costs.items():
        median = _median(measured)
        out[name] = {"predicted_s": round(predicted, 3), "measured_s": round(median, 3),
                     "ratio": round(predicted / median, 3) if measured else None,
                     "measured": [round(m, 3) for m in measured]}
    # where the eval's seconds went, as the run measured them (eval_media_s: the media clips sampled,
    # decoded and encoded; eval_quality_s: the quality samples, their features, decodes and drift)
    eval_rows = [r for r in rows if "eval_s" in r]
    parts = {k: [round(r[k], 3) for r in eval_rows if k in r]
             for k in ("eval_media_s", "eval_quality_s", "eval_reference_s", "eval_decode_s", "eval_decoded_clips",
                       "eval_drift_s", "eval_encode_s")}
    return {
        "settings": {k: overrides[k] for k in ("num_iterations", "eval_interval", "save_interval", "export_interval",
                                               "num_devices", "dtype", "torch_threads", "num_frames", "height", "width")}
        | {"global_batch_size": args.global_batch_size, "eval_num_samples": args.eval_num_samples,
           "eval_reference_steps": args.eval_reference_steps, "student_steps": args.dmd2_student_steps},
        "calibration": {**{k: v for k, v in cal.items() if k != "url"}, "implied_mfu_of_1_tflops": plan.mfu},
        "plan": {"iteration_flops": sum(plan.iteration_flops.values()), "eval_flops": plan.eval_flops,
"reference_flops": plan.reference_flops,
                 "decode_flops": plan.decode_flops, "decodes": plan.decodes, "pixel_frames": plan.pixel_frames,
                 "checkpoint_bytes": plan.checkpoint_bytes, "export_bytes": plan.export_bytes},
        "eval_parts_s": parts,
        "costs": out,
        "within_30pct": sorted(k for k, v in out.items() if v["ratio"] is not None and 1 / 1.3 <= v["ratio"] <= 1.3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--interval", type=int, default=2, help="eval, save and export interval")
    parser.add_argument("--keep", default=None, help="run in this directory and keep it (else a temporary one)")
    parser.add_argument("--from-save", default=None, help="read an earlier bench run's save instead of running")
    ns = parser.parse_args()
    start = time.perf_counter()
    root = ns.keep or tempfile.mkdtemp(prefix="dmd2-plan-calibration-")
    try:
        if ns.from_save:
            save, run_s = ns.from_save, None
            overrides = json.loads(open(os.path.join(save, "..", "overrides.json")).read())
        else:
            save, overrides = run_standin(root, ns.iterations, ns.interval)
            run_s = round(time.perf_counter() - start, 1)
            with open(os.path.join(root, "overrides.json"), "w") as f:
                json.dump(overrides, f)
        result = compare(save, overrides)
        print(json.dumps({**result, "run_s": run_s, "total_s": round(time.perf_counter() - start, 1)}))
    finally:
        if not ns.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
