"""What does FSDP2 cost a group of one rank? The tiny recipe's iteration three ways in one process,
interleaved window by window: the plain reference loop, the trainers' phases called directly as
shipped (one fp32 rank: plain modules, ``parallel.needs_fsdp``), and the same trainers with FSDP2
forced onto their mesh of one. Prints one JSON line:

  {"plain_median_s", "trainers_median_s", "trainers_fsdp_median_s", "trainers_ratio",
   "trainers_fsdp_ratio", ...}

A ratio is the plain median over the path's median seconds per iteration (1.0: as fast as the
plain loop). No Ray, no Prefect: ``bench/overhead.py`` measures those. The process runs with the
allocator settings of the trainers' processes (``groups.CPU_ALLOCATOR_ENV``).

    python bench/one_rank.py [--batch 384] [--windows 6] [--window 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def main() -> None:
    from dmd2_core.run.groups import CPU_ALLOCATOR_ENV

    if any(os.environ.get(k) != v for k, v in CPU_ALLOCATOR_ENV.items()):
        # the allocator settings of the trainers' processes apply from a process's start
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **CPU_ALLOCATOR_ENV})
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=384)
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--window", type=int, default=4, help="iterations of each path per window")
    ns = parser.parse_args()
    torch.set_num_threads(1)

    from dmd2_core import parallel
    from dmd2_core.args import load_args
    from dmd2_core.run.distill_run import preflight
    from dmd2_core.train.reference import ReferenceLoop
    from dmd2_core.train.trainer import Trainer
    from bench.workload import random_digits_teacher, timed_tiny_overrides

    tmp, teacher = random_digits_teacher("dmd2-one-rank-")
    overrides = {**timed_tiny_overrides(teacher, ns.batch, 1000), "save": f"{tmp}/run"}
    roles = preflight(load_args("tiny", overrides))
    loop = ReferenceLoop(load_args("tiny", {**overrides, "save": f"{tmp}/plain"}))

    def trainers(force_fsdp: bool) -> dict:
        shipped = parallel.needs_fsdp
        if force_fsdp:
            parallel.needs_fsdp = lambda *a: True
        try:
            return {role: Trainer(a, role) for role, a in roles.items()}
        finally:
            parallel.needs_fsdp = shipped

    paths = {"plain": loop, "trainers": trainers(False), "trainers_fsdp": trainers(True)}
    assert not isinstance(paths["trainers"]["actor"].model, torch.distributed.fsdp.FSDPModule)
    assert isinstance(paths["trainers_fsdp"]["actor"].model, torch.distributed.fsdp.FSDPModule)

    def iterate(path, i: int) -> float:
        start = time.perf_counter()
        if isinstance(path, ReferenceLoop):
            path.iterate(i)
        else:
            pairs, _ = path["actor"].rollout(i)
            scores, _ = path["critic"].train(i, pairs)
            path["actor"].train(i, pairs, scores)
        return time.perf_counter() - start

    for path in paths.values():
        iterate(path, 0)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in paths}
    load_before = os.getloadavg()[0]
    for w in range(ns.windows):
        for name, path in paths.items():
            for k in range(ns.window):
                times[name].append(iterate(path, 1 + w * ns.window + k))
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(json.dumps({
        "global_batch_size": ns.batch, "iterations_per_path": ns.windows * ns.window,
        **{f"{name}_median_s": round(m, 4) for name, m in medians.items()},
        "trainers_ratio": round(medians["plain"] / medians["trainers"], 3),
        "trainers_fsdp_ratio": round(medians["plain"] / medians["trainers_fsdp"], 3),
        "load_average_1m": [round(load_before, 1), round(os.getloadavg()[0], 1)],
    }))


if __name__ == "__main__":
    main()
