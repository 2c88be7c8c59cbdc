"""What does the orchestration cost? The same N DMD2 iterations of the same model, through the
Prefect flow (tasks -> Ray trainer groups), through the same driver without Prefect (the Ray groups
alone) and through the plain single-process reference loop, in one run. Prints one JSON line:

  {"iterations", "global_batch_size", "plain_median_s", "groups_median_s", "flow_median_s",
   "throughput_ratio", "groups_throughput_ratio", ...}

``throughput_ratio`` = plain median / flow median seconds per iteration (1.0: no overhead), the
flow's iteration measured end to end (from one iteration's end to the next: its tasks and all
the flow's per-iteration bookkeeping). The three run in blocks interleaved window by window, so
all see the same machine; the start of a window subflow (once per 100 iterations in a real run) is
reported apart, as ``window_start_median_s``.

    python bench/overhead.py [--iterations 40] [--batch 384] [--window 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def plain_loop(args, conn) -> None:
    """The plain reference loop, in its own process: run as many iterations as asked, reply with
    their times; 0 ends it."""
    from dmd2_core.train.reference import ReferenceLoop

    loop = ReferenceLoop(args)
    done = 0
    while n := conn.recv():
        times = []
        for _ in range(n):
            times.append(loop.iterate(done)["iteration_s"])
            done += 1
        conn.send(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--batch", type=int, default=384, help="global batch; 384 gives iterations over 1 s on 2 cores")
    parser.add_argument("--window", type=int, default=5, help="flow iterations per window, each after as many plain ones")
    ns = parser.parse_args()
    torch.set_num_threads(1)

    from flows.environment import configure_environment

    configure_environment()  # before Prefect and Ray are imported
    from flows.dmd2 import dmd2
    from dmd2_core.args import load_args
    from dmd2_core.run.distill_run import DistillRun
    from dmd2_core.run.groups import CPU_ALLOCATOR_ENV
    from bench.workload import random_digits_teacher, timed_tiny_overrides

    tmp, teacher = random_digits_teacher("dmd2-overhead-")
    overrides = timed_tiny_overrides(teacher, ns.batch, ns.iterations)
    args = load_args("tiny", overrides)
    # room for two runs' groups at once: the Ray groups alone and the flow's
    import ray

    ray.init(namespace="overhead", resources={args.resource_name: 2.0 * args.num_devices}, include_dashboard=False)

    # The three paths run in blocks interleaved window by window (`window` plain iterations, as
    # many of the Ray groups alone, then a window of the flow), driven from this process, so that all
    # three see the same machine: on a shared 2-core machine the load drifts within minutes.
    # Between blocks nothing runs ahead: a window's last iteration does not start the next one.
    # The plain loop runs in a process of its own, as the trainers do in their actors (in this one
    # it would share the interpreter lock with the Prefect engine's and Ray driver's threads), with
    # the allocator settings the trainers' processes get.
    plain = mp.get_context("spawn")
    to_plain, plain_end = plain.Pipe()
    plain_process = plain.Process(target=plain_loop, args=(load_args("tiny", {**overrides, "save": f"{tmp}/plain"}), plain_end),
                                  daemon=True)
    saved_env = dict(os.environ)
    os.environ.update(CPU_ALLOCATOR_ENV)  # the trainers' allocator settings, read at the process's start
    try:
        plain_process.start()
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
    to_plain.send(1)
    to_plain.recv()  # warm-up, as the first iteration of the groups warms their actors
    groups_run = DistillRun(load_args("tiny", {**overrides, "save": f"{tmp}/groups", "run_name": "overhead-groups"}))
    groups_run.start()
    groups_run.rollout_ahead = lambda i: i % ns.window != 0
    groups_run.iterate(1)
    groups_done = [1]
    plain_times: list[float] = []
    groups_times: list[float] = []
    window_starts: list[float] = []

    def blocks(n: int) -> None:
        to_plain.send(n)
        plain_times.extend(to_plain.recv())
        t = time.perf_counter()
        for k in range(n):
            groups_done[0] += 1
            groups_run.iterate(groups_done[0])
            now = time.perf_counter()
            if k:  # the block's first iteration starts from idle actors, as a window's does
                groups_times.append(now - t)
            t = now

    import flows.dmd2 as flow_module

    real_iterations, real_follows = flow_module.iterations, flow_module.Driver.follows_directly

    class Interleaved:
        def with_options(self, **options):
            subflow = real_iterations.with_options(**options)

            def call(run_id, first, last):
                blocks(last - first + 1)
                window_starts.append(time.time())
                return subflow(run_id, first, last)
            return call

    load_before = os.getloadavg()[0]
    flow_module.iterations = Interleaved()
    flow_module.Driver.follows_directly = lambda driver, i: real_follows(driver, i) and i % ns.window != 0
    start = time.perf_counter()
    try:
        summary = dmd2(recipe="tiny", overrides={**overrides, "save": f"{tmp}/flow", "iterations_per_window": ns.window})
    finally:
        flow_module.iterations, flow_module.Driver.follows_directly = real_iterations, real_follows
        groups_run.shutdown()
        to_plain.send(0)
        plain_process.join(timeout=30)
    flow_total = time.perf_counter() - start

    with open(f"{tmp}/flow/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    # Wall clock from one iteration's end to the next: the phases plus everything the flow does per
    # iteration (metrics log, progress, log line); the first iteration of a window also holds the
    # blocks before it and the window's start, so it is left out (the window start is reported
    # apart: once per `iterations_per_window` iterations in a real run).
    trained = [r for r in rows if r.get("iteration", 0) >= 1]
    flow_wall = [b["wall_time"] - a["wall_time"] for a, b in zip(trained, trained[1:])
                 if (b["iteration"] - 1) % ns.window != 0][1:]
    window_start_s = [r["wall_time"] - t0 - r["iteration_s"] for r, t0 in
                      zip([r for r in trained if (r["iteration"] - 1) % ns.window == 0], window_starts)]
    plain_median, flow_median = statistics.median(plain_times), statistics.median(flow_wall)
    print(json.dumps({
        "iterations": ns.iterations,
        "global_batch_size": ns.batch,
        "window": ns.window,
        "plain_median_s": round(plain_median, 4),
        "groups_median_s": round(statistics.median(groups_times), 4),
        "groups_throughput_ratio": round(plain_median / statistics.median(groups_times), 3),
        "flow_median_s": round(flow_median, 4),
        "throughput_ratio": round(plain_median / flow_median, 3),
        "window_start_median_s": round(statistics.median(window_start_s), 3),
        "flow_wall_s": round(flow_total, 2),
        "final_iteration": summary["final_iteration"],
        "load_average_1m": [round(load_before, 1), round(os.getloadavg()[0], 1)],  # above ~2 on 2 cores: noise
    }))


if __name__ == "__main__":
    main()
