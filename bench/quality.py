"""Does DMD2 distill? On the digits teacher, distill a 4-step and a 1-step student with the plain
reference loop (the two in parallel, one core each) and print one JSON line:

  {"teacher": {"50": {"fd", "acc"}, "8": .., "4": .., "2": .., "1": ..},
   "student": {"4": {"fd", "acc", "diversity", "iteration"}, "1": {..}}, "iterations": {..}, "wall_s": ..}

Fréchet distance (lower is better) and class accuracy are measured against held-out digits, all
samplers from the same noise. Each student is evaluated along the way and the one kept is chosen
by its distance to the teacher's 50-step samples, a criterion that never sees the test split.

    python bench/quality.py [--minutes 5] [--teacher runs/teacher]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dmd2_core.args import load_args  # noqa: E402
from dmd2_core.evaluation import balanced_labels, evaluate_digits, features, frechet_distance, teacher_table  # noqa: E402
from dmd2_core.reference import ReferenceLoop  # noqa: E402
from dmd2_core.teacher import ensure_teacher  # noqa: E402

TEACHER_STEPS = (50, 8, 4, 2, 1)


def teacher_reference_features(teacher: str, num_samples: int, seed: int, guidance: float):
    """Features of the teacher's 50-step samples: the selection target (no test data)."""
    from dmd2_core import flow_matching as fm
    from dmd2_core.data import digits_prompt_set
    from dmd2_core.evaluation import eval_noise
    from dmd2_core.models import load_checkpoint
    from dmd2_core.sampling import euler_sample

    loaded = load_checkpoint(teacher)
    prompts = digits_prompt_set()
    labels = balanced_labels(num_samples)
    with torch.no_grad():
        x = euler_sample(loaded.family, loaded.model, eval_noise(num_samples, seed + 1), prompts.cond(labels),
                         fm.euler_sigmas(50, loaded.shift), prompts.uncond(num_samples), guidance)
    return features(x.clamp(-1, 1))


def distill(steps: int, teacher: str, minutes: float, eval_every: int, num_samples: int, seed: int,
            guidance: float, ema_decay, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    args = load_args("tiny", {
        "hf_checkpoint": teacher, "save": "runs/bench-quality", "dmd2_student_steps": steps,
        "dmd2_guidance_scale": guidance, "seed": seed, "ema_decay": ema_decay,
    })
    target = teacher_reference_features(teacher, num_samples, seed, guidance)
    loop = ReferenceLoop(args)
    labels = balanced_labels(num_samples)
    best, history, start, i = None, [], time.perf_counter(), 0

    def evaluate(iteration):
        nonlocal best
        images = loop.sample(labels.tolist(), seed).clamp(-1, 1)
        selection = frechet_distance(features(images), target)
        history.append((iteration, round(selection, 4)))
        if best is None or selection < best[0]:
            best = (selection, iteration, evaluate_digits(images, labels))

    evaluate(0)
    while time.perf_counter() - start < minutes * 60:
        i += 1
        loop.iterate(i)
        if i % eval_every == 0:
            evaluate(i)
    out.put((steps, {**best[2], "iteration": best[1], "selection_fd": best[0]}, i, history,
             time.perf_counter() - start))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--teacher", default="runs/teacher")
    parser.add_argument("--minutes", type=float, default=5.0, help="distillation budget per student")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--num-samples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--guidance", type=float, default=None, help="default: the tiny recipe's")
    parser.add_argument("--ema", type=float, default=0.99, help="EMA decay of the students (0: none)")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    teacher = ensure_teacher(ns.teacher, seed=0, log=lambda m: print(m, file=sys.stderr))
    guidance = ns.guidance if ns.guidance is not None else load_args("tiny").dmd2_guidance_scale
    queue: mp.Queue = mp.get_context("spawn").Queue()
    workers = [mp.get_context("spawn").Process(
        target=distill, args=(k, teacher, ns.minutes, ns.eval_every, ns.num_samples, ns.seed, guidance,
                              ns.ema or None, queue))
        for k in (4, 1)]
    table = teacher_table(teacher, TEACHER_STEPS, ns.num_samples, ns.seed, guidance_scale=guidance)
    for w in workers:  # one student per core, after the teacher's table so nothing shares a core
        w.start()
    results = [queue.get() for _ in workers]
    for w in workers:
        w.join()
    students = {str(k): r for k, r, *_ in sorted(results, reverse=True)}
    print(json.dumps({
        "teacher": {k: {m: round(v[m], 4) for m in ("fd", "acc", "diversity")} for k, v in table.items()},
        "student": {k: {m: (round(v, 4) if isinstance(v, float) else v) for m, v in r.items()} for k, r in students.items()},
        "iterations": {str(k): n for k, _, n, _, _ in results},
        "history": {str(k): h for k, _, _, h, _ in results},
        "guidance_scale": guidance,
        "ema_decay": ns.ema or None,
        "wall_s": round(time.perf_counter() - start, 1),
    }))


if __name__ == "__main__":
    main()
