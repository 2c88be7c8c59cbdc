"""One task per DMD2 phase; each dispatches to the live DistillRun of ``run_id``."""

from __future__ import annotations

from prefect import task

from tasks.common import TASK_OPTIONS
from tasks.registry import get_run


@task(name="rollout", task_run_name="rollout-{iteration}", **TASK_OPTIONS)
def rollout(run_id: str, iteration: int) -> dict:
    return get_run(run_id).rollout(iteration)


@task(name="critic_train_and_score", task_run_name="critic-train-and-score-{iteration}", **TASK_OPTIONS)
def critic_train_and_score(run_id: str, iteration: int) -> dict:
    return get_run(run_id).critic_train_and_score(iteration)


@task(name="student_train", task_run_name="student-train-{iteration}", **TASK_OPTIONS)
def student_train(run_id: str, iteration: int) -> dict:
    return get_run(run_id).student_train(iteration)


@task(name="sleep_groups", task_run_name="sleep-{group}-{iteration}", **TASK_OPTIONS)
def sleep_groups(run_id: str, iteration: int, group: str) -> dict:
    """Put ``group`` ('critic' or 'actor') to sleep right after its train."""
    run = get_run(run_id)
    if group == "critic":
        return run.sleep_critic(iteration)
    if group == "actor":
        return run.sleep_actor(iteration)
    raise ValueError(f"sleep_groups: unknown group '{group}' (known: critic, actor)")
