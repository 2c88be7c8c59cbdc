"""Prefect flow: pretrain (or reuse) the digits teacher and publish its quality table.

    python -m flows.teacher [--save runs/teacher] [--seed 0] [--steps N] [--no-reuse]
"""

from __future__ import annotations

from flows.environment import configure_environment

if __name__ == "__main__":  # Prefect reads these settings when it is imported
    configure_environment()

import argparse  # noqa: E402

import torch  # noqa: E402
from prefect import flow, get_run_logger, task  # noqa: E402
from prefect.artifacts import create_table_artifact  # noqa: E402
from prefect.cache_policies import NO_CACHE  # noqa: E402

from dmd2_core.toys import digits_metrics  # noqa: E402
from dmd2_core.models import describe_model_dir  # noqa: E402
from dmd2_core.errors import ModelDirError
from dmd2_core.toys.digits_teacher import DEFAULT_STEPS, train_teacher  # noqa: E402

ARTIFACT_KEY = "teacher-quality"


@task(name="train-teacher", cache_policy=NO_CACHE)
def train_teacher_task(save: str, seed: int, num_steps: int, reuse: bool) -> dict:
    logger = get_run_logger()
    if reuse:
        try:
            describe_model_dir(save)
            logger.info("reusing teacher at %s", save)
            return {"url": save, "reused": True}
        except ModelDirError:
            pass
    info = train_teacher(save, seed=seed, num_steps=num_steps, log=logger.info)
    info.pop("model")
    return {**info, "reused": False}


@task(name="evaluate-teacher", cache_policy=NO_CACHE)
def evaluate_teacher_task(save: str, num_samples: int, eval_seed: int, guidance_scale: float) -> dict:
    return digits_metrics.teacher_table(save, num_samples=num_samples, seed=eval_seed, guidance_scale=guidance_scale)


@flow(name="teacher")
def teacher(
    save: str = "runs/teacher",
    seed: int = 0,
    num_steps: int = DEFAULT_STEPS,
    reuse: bool = True,
    num_samples: int = 2000,
    eval_seed: int = 0,
    guidance_scale: float = 1.0,
    torch_threads: int = 1,
) -> dict:
    """Train the teacher at ``save`` (or reuse the one there) and return its quality table
    {str(euler_steps): {fd, acc, diversity}}, also published as the 'teacher-quality' artifact."""
    torch.set_num_threads(torch_threads)
    info = train_teacher_task(save, seed, num_steps, reuse)
    table = evaluate_teacher_task(save, num_samples, eval_seed, guidance_scale)
    reference = digits_metrics.reference_stats()
    rows = [{"euler_steps": steps, **{k: round(v, 4) for k, v in vals.items()}} for steps, vals in table.items()]
    rows.append({"euler_steps": "real (train vs test)", **{k: round(v, 4) for k, v in reference.items()}})
    trained = "reused" if info["reused"] else f"trained {info['steps']} steps in {info['train_time_s']:.0f}s"
    create_table_artifact(
        rows,
        key=ARTIFACT_KEY,
        description=(f"Teacher {save} ({trained}): Fréchet distance to held-out digits, class accuracy and "
                     f"within-prompt diversity; Euler sampler, guidance {guidance_scale}, {num_samples} samples."),
    )
    get_run_logger().info("teacher quality:\n%s", digits_metrics.format_table(table, reference))
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flows.teacher", description=__doc__.splitlines()[0])
    parser.add_argument("--save", default="runs/teacher")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--no-reuse", dest="reuse", action="store_false", help="Train even if --save holds a checkpoint.")
    parser.add_argument("--num-samples", type=int, default=2000)
    parser.add_argument("--guidance-scale", type=float, default=1.0)
    ns = parser.parse_args(argv)
    teacher(save=ns.save, seed=ns.seed, num_steps=ns.steps, reuse=ns.reuse,
            num_samples=ns.num_samples, guidance_scale=ns.guidance_scale)


if __name__ == "__main__":
    main()
