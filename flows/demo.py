"""`make demo`: train (or reuse) the digits teacher, distill it into a 4-step student with the
dmd2 flow on the tiny recipe, and print the quality before and after and where everything went.

    python -m flows.demo [--iterations N]
"""

from __future__ import annotations

import argparse
import sys
import time

from flows.environment import configure_environment

if __name__ == "__main__":  # Prefect and Ray read these settings when they are imported
    configure_environment()

from flows.dmd2 import dmd2  # noqa: E402
from flows.teacher import teacher  # noqa: E402

from dmd2_core.args import load_args  # noqa: E402
from dmd2_core.toys.digits_metrics import format_table  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=None, help="default: the tiny recipe's")
    ns = parser.parse_args(argv)
    recipe = load_args("tiny")
    start = time.perf_counter()
    table = teacher(save=recipe.hf_checkpoint, reuse=True)
    save = f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}"
    summary = dmd2(recipe="tiny", save=save, num_iterations=ns.iterations)
    before, after = summary.get("quality_before") or {}, summary.get("quality_after") or {}
    ckpt = summary.get("checkpoint") or {}
    print("\n=== digits teacher (Euler steps, 2000 samples; FD against held-out digits) ===")
    print(format_table(table))
    print(f"\n=== {recipe.dmd2_student_steps}-step student, {summary['final_iteration']} DMD2 iterations "
          f"({recipe.eval_num_samples} samples) ===")
    print(format_table({"init": before, "final": after}))
    print(f"\nteacher:     {recipe.hf_checkpoint}")
    print(f"flow run:    {summary['name']}  (Prefect artifacts '{summary['artifact_keys']['summary']}', "
          f"'{summary['artifact_keys']['metrics']}')")
    print(f"metrics:     {summary['metrics_url']}")
    print(f"media:       {save}/media/")
    print(f"checkpoint:  {ckpt.get('trainers', {}).get('actor', ckpt.get('latest'))}  (sharded, DCP)")
    print(f"student:     {summary.get('student')}  (diffusers, loads with DiffusionPipeline.from_pretrained)")
    print(f"total:       {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
