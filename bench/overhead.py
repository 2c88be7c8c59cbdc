"""What does the orchestration cost? The same N DMD2 iterations of the same model, through the
Prefect flow (tasks -> Ray trainer groups, sleep after each train), through the same driver
without Prefect (the Ray groups alone) and through the plain single-process reference loop, in one
run. Prints one JSON line:

  {"iterations", "global_batch_size", "plain_median_s", "groups_median_s", "flow_median_s",
   "throughput_ratio", "groups_throughput_ratio", ...}

``throughput_ratio`` = plain median / flow median seconds per iteration (1.0: no overhead), the
flow's iteration measured end to end (from one iteration's end to the next: its tasks and all
the flow's per-iteration bookkeeping); ``phases_throughput_ratio`` counts its five tasks only. The
plain loop runs before and after the flow, to bracket the machine's drift; one-off costs (Prefect
server, Ray start, actors) are reported apart from the per-iteration figures.

    python bench/overhead.py [--iterations 20] [--batch 384]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--batch", type=int, default=384, help="global batch; 384 gives iterations over 1 s on 2 cores")
    ns = parser.parse_args()
    torch.set_num_threads(1)

    from flows.dmd2 import dmd2
    from dmd2_core.args import load_args
    from dmd2_core.models import save_checkpoint
    from dmd2_core.models.sd3 import SD3ImageFamily, tiny_digits_config
    from dmd2_core.reference import ReferenceLoop

    tmp = tempfile.mkdtemp(prefix="dmd2-overhead-")
    torch.manual_seed(0)
    teacher = f"{tmp}/teacher"
    save_checkpoint(SD3ImageFamily().build(tiny_digits_config()), teacher, shift=3.0)
    overrides = {"hf_checkpoint": teacher, "global_batch_size": ns.batch, "micro_batch_size": ns.batch,
                 "eval_interval": 0, "save_interval": 0, "num_iterations": ns.iterations}

    def plain() -> list[float]:
        loop = ReferenceLoop(load_args("tiny", {**overrides, "save": f"{tmp}/plain"}))
        loop.iterate(0)  # warm-up, as the flow's first iteration warms its actors
        return [loop.iterate(i)["iteration_s"] for i in range(1, ns.iterations + 1)]

    def groups() -> list[float]:
        """The same driver the flow uses, without Prefect: what the Ray groups cost alone."""
        from dmd2_core.distill import DistillRun

        times = []
        with DistillRun(load_args("tiny", {**overrides, "save": f"{tmp}/groups", "run_name": "overhead-groups"})) as run:
            run.iterate(1)  # warm-up (iteration 0 is the start point, nothing to run)
            for i in range(2, ns.iterations + 2):
                t = time.perf_counter()
                run.iterate(i)
                times.append(time.perf_counter() - t)
        return times

    plain_before = plain()
    groups_times = groups()
    start = time.perf_counter()
    summary = dmd2(recipe="tiny", overrides={**overrides, "save": f"{tmp}/flow"})
    flow_total = time.perf_counter() - start
    plain_after = plain()

    with open(f"{tmp}/flow/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    flow_times = [r["iteration_s"] for r in rows if r.get("iteration", 0) >= 1]
    flow_steady = flow_times[1:]  # the first iteration pays for the actors' first calls
    # Wall clock from one iteration's end to the next: the phases plus everything the flow does per
    # iteration (metrics log, progress, log line, window subflows); this is the throughput.
    ends = [r["wall_time"] for r in rows if r.get("iteration", 0) >= 1]
    flow_wall = [b - a for a, b in zip(ends, ends[1:])][1:]
    plain_times = plain_before + plain_after
    plain_median, flow_median = statistics.median(plain_times), statistics.median(flow_wall)
    print(json.dumps({
        "iterations": ns.iterations,
        "global_batch_size": ns.batch,
        "plain_median_s": round(plain_median, 4),
        "plain_median_before_after_s": [round(statistics.median(plain_before), 4), round(statistics.median(plain_after), 4)],
        "groups_median_s": round(statistics.median(groups_times), 4),
        "groups_throughput_ratio": round(plain_median / statistics.median(groups_times), 3),
        "flow_median_s": round(flow_median, 4),
        "throughput_ratio": round(plain_median / flow_median, 3),
        "flow_phases_median_s": round(statistics.median(flow_steady), 4),
        "phases_throughput_ratio": round(plain_median / statistics.median(flow_steady), 3),
        "plain_total_s": round(sum(plain_before), 2),
        "flow_iterations_total_s": round(sum(flow_times), 2),
        "flow_wall_s": round(flow_total, 2),
        "flow_one_off_s": round(flow_total - (ends[-1] - ends[0]) - flow_times[0], 2),
        "final_iteration": summary["final_iteration"],
    }))


if __name__ == "__main__":
    main()
