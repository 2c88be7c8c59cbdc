"""Prefect tasks: thin dispatchers from the flow to the live DistillRun of a run id.

Every task takes names and small values (a run id, an iteration) and returns small metrics; the
DistillRun itself sits in ``tasks.registry``.
"""

from tasks.checkpoint import checkpoint
from tasks.eval import evaluate
from tasks.phases import critic_train_and_score, rollout, sleep_groups, student_train
from tasks.registry import get_run, register, unregister

__all__ = [
    "rollout", "critic_train_and_score", "sleep_groups", "student_train", "evaluate", "checkpoint",
    "register", "unregister", "get_run",
]
