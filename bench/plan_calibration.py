"""Does the time plan predict a run's eval, checkpoint and export from one measured iteration? The
minimax-h3 recipe on the MiniMax-H3 stand-in (CPU, fp32, one rank per group, through the Prefect
flow and its Ray groups), twice: a short calibrating run (3 iterations, an eval, checkpoint and
export each), as a team makes before booking a night, then the run to predict (4 iterations, the
same each), the times read back from each run's metrics log. The plan (``python -m dmd2_core
plan``'s, from the configs alone) calibrated from the short run as ``plan --calibrate-from`` does
(``time_plan.calibrate``: its FIRST iteration's FLOP/s, its first eval's decoder and host pace, its
saves after the first for their fixed parts) predicts each cost of the second run, next to what it
measured. Prints one JSON line:

  {"settings": {...}, "calibration": {"iteration_s", "flops_per_s", ...},
   "costs": {cost: {"predicted_s", "measured_s", "ratio", "measured": [...]}}, "within_30pct": [...],
   "run_s", "total_s"}

``ratio`` is predicted over measured (the median of the second run's measurements of that cost).
What carries over to a GPU and what does not: docs/scale.md, "Calibrating the time plan".

    python bench/plan_calibration.py [--iterations 4] [--calibrate-iterations 3] [--keep DIR] [--from-save DIR]
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


def run_standin(root: str, name: str, iterations: int) -> tuple[str, dict]:
    """The minimax-h3 recipe on the stand-in through the flow: an eval at the start and after every
    iteration, a checkpoint at each (written synchronously, so that its seconds are the save's own),
    the student exported at each. Returns (the save, the overrides)."""
    from flows.environment import configure_environment

    configure_environment()  # before Prefect and Ray are imported
    from dmd2_core.toys.standins import H3_GEOMETRY, build_h3_standin, h3_prompt_set
    from flows.dmd2 import dmd2

    if not os.path.exists(f"{root}/h3"):
        build_h3_standin(f"{root}/h3")
        h3_prompt_set().save(f"{root}/prompts.safetensors")
    overrides = dict(hf_checkpoint=f"{root}/h3", prompts=f"{root}/prompts.safetensors", save=f"{root}/{name}",
                     device="cpu", num_devices=1, cp_size=1, dtype="float32", torch_threads=1,
                     run_name=f"bench-plan-calibration-{name}", num_iterations=iterations, eval_interval=1,
                     save_interval=1, export_interval=1, async_save=False, **H3_GEOMETRY)
    summary = dmd2(recipe="minimax-h3", overrides=overrides)
    if summary["final_iteration"] != iterations:
        raise RuntimeError(f"the stand-in run stopped at {summary['final_iteration']} of {iterations}")
    return overrides["save"], overrides


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def compare(calibrating: str, save: str, overrides: dict) -> dict:
    """The plan of the run's own settings (as ``python -m dmd2_core plan`` makes it), calibrated
    from the short run's metrics log at ``calibrating``, against what the run at ``save`` measured."""
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
    # the peak only names the scale of the MFU; the calibrated rate does not depend on it
    plan = time_plan.calibrate(time_plan.time_plan(trainers, planner.plan(trainers), evaluator_name(args),
                                                   peak_flops=1e12), trainers, read_metrics(calibrating),
                               metrics_url(calibrating))
    cal = plan.calibrated
    rate = cal["flops_per_s"] * plan.num_devices
    rows = read_metrics(save)
    trained = [r for r in rows if isinstance(r.get("iteration_s"), (int, float))]
    plain_evals = [r["eval_s"] for r in rows if "eval_s" in r and "eval_reference_s" not in r]
    first_eval = [r["eval_s"] for r in rows if "eval_reference_s" in r]

    def timed(key: str) -> list[float]:
        return [r[key] for r in rows if isinstance(r.get(key), (int, float))]

    def at_own_stop_step(row: dict) -> float:
        return sum(time_plan.iteration_flops(trainers, int(row["stop_step"])).values()) / rate

    costs = {
        "iterations_at_their_stop_step": (_median([at_own_stop_step(r) for r in trained]),
                                          [r["iteration_s"] for r in trained]),
        "iteration_expected": (plan.iteration_s, [r["iteration_s"] for r in trained]),
        "eval": (plan.eval_s, plain_evals),
        "eval_with_reference": (plan.eval_s + plan.reference_s, first_eval),
        # a trainer process's first save runs cold (time_plan._save_fixed); the night's many are after it
        "checkpoint_after_the_first": (plan.checkpoint_s, timed("checkpoint_save_s")[1:]),
        "export_after_the_first": (plan.export_s, timed("export_s")[1:]),
        "first_checkpoint_cold": (plan.checkpoint_s, timed("checkpoint_save_s")[:1]),
        "first_export_cold": (plan.export_s, timed("export_s")[:1]),
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
    parser.add_argument("--iterations", type=int, default=4, help="of the run predicted")
    parser.add_argument("--calibrate-iterations", type=int, default=3, help="of the short run calibrated from")
    parser.add_argument("--keep", default=None, help="run in this directory and keep it (else a temporary one)")
    parser.add_argument("--from-save", default=None, help="read an earlier bench run's directory (--keep) instead of running")
    ns = parser.parse_args()
    start = time.perf_counter()
    root = ns.from_save or ns.keep or tempfile.mkdtemp(prefix="dmd2-plan-calibration-")
    try:
        if ns.from_save:
            run_s = None
            overrides = json.loads(open(os.path.join(root, "overrides.json")).read())
        else:
            run_standin(root, "calibrating", ns.calibrate_iterations)
            _, overrides = run_standin(root, "predicted", ns.iterations)
            run_s = round(time.perf_counter() - start, 1)
            with open(os.path.join(root, "overrides.json"), "w") as f:
                json.dump(overrides, f)
        result = compare(os.path.join(root, "calibrating"), overrides["save"], overrides)
        print(json.dumps({**result, "run_s": run_s, "total_s": round(time.perf_counter() - start, 1)}))
    finally:
        if not (ns.keep or ns.from_save):
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
