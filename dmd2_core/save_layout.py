"""Everything a run keeps under its ``save`` URL, and where (one module says the layout)::

    {save}/lease.json                          the run that writes here (run/lease.py)
    {save}/latest_checkpointed_iteration.txt   the latest pointer: the iteration every trainer saved
    {save}/trainers/{role}/iter_{i:07d}/       a trainer's checkpoint (drawn in dmd2_core/checkpoint)
    {save}/exports/iter_{i:07d}/               the student as a diffusers pipeline or LoRA (export/)
    {save}/exports/iter_{i:07d}.staging-{n}/   an export being written, swapped in once complete
    {save}/exports/iter_{i:07d}.swap.json      a swap into iter_{i:07d}/ under way (export/files.py)
    {save}/best_student.json                   the run's best eval and its export: retention keeps it
    {save}/metrics.jsonl, {save}/metrics/      the metrics log and its segments (report/metrics_log.py)
    {save}/trackers.json                       the latest pointer runs a rerun continues (trackers/sinks.py)
    {save}/tensorboard/, {save}/mlflow.db, {save}/mlflow-artifacts/, {save}/wandb/
                                               the trackers' own files by default (trackers/)
    {save}/media/iter_{i:07d}[_p{prompt}].*    eval media (media/eval_files.py)
    {save}/eval_reference/{key}/               the teacher's reference samples' features (evaluation/)
"""

from __future__ import annotations

from dmd2_core import storage

FORMAT = 3  # sharded (DCP); the only format this dmd2 reads
LATEST_NAME = "latest_checkpointed_iteration.txt"
COMPLETE_NAME = "complete.json"
STATE_NAME = "trainer_state.pt"
DCP_DIR = "dcp"
EXPORT_MARKER_NAME = "export.json"
EXPORT_STAGING_SEP = ".staging-"  # {save}/exports/iter_{i:07d}.staging-{nonce}/: an export being written
EXPORT_SWAP_SUFFIX = ".swap.json"  # {save}/exports/iter_{i:07d}.swap.json: the swap a kill may have interrupted
STATE_FILES = (STATE_NAME, f"{DCP_DIR}/.metadata")  # small: hashed on the driver before any actor starts


def trainer_dir(save_url: str, role: str, iteration: int) -> str:
    return storage.join(save_url, "trainers", role, f"iter_{int(iteration):07d}")


def latest_url(save_url: str) -> str:
    return storage.join(save_url, LATEST_NAME)


def complete_url(save_url: str, role: str, iteration: int) -> str:
    return storage.join(trainer_dir(save_url, role, iteration), COMPLETE_NAME)


def exports_root(save_url: str) -> str:
    return storage.join(save_url, "exports")


def export_url(save_url: str, iteration: int) -> str:
    return storage.join(exports_root(save_url), f"iter_{int(iteration):07d}")


LEASE_NAME = "lease.json"
LEASE_LOCK_NAME = ".lease.lock"  # a local save's lock file beside the lease
METRICS_NAME = "metrics.jsonl"
METRICS_SEGMENTS_DIR = "metrics"


def lease_url(save_url: str) -> str:
    return storage.join(save_url, LEASE_NAME)


def metrics_url(save_url: str) -> str:
    return storage.join(save_url, METRICS_NAME)


def metrics_segment_url(save_url: str, first_iteration: int) -> str:
    return storage.join(save_url, METRICS_SEGMENTS_DIR, f"iter_{int(first_iteration):07d}.jsonl")


def media_stem(save_url: str, iteration: int) -> str:
    return storage.join(save_url, "media", f"iter_{int(iteration):07d}")


def eval_reference_root(save_url: str) -> str:
    return storage.join(save_url, "eval_reference")


def drift_start_url(save_url: str, num_steps: int) -> str:
    """The run's first eval's per-clip drift statistics of ``num_steps`` steps (the clip-by-clip start
    of ``teacher_evaluator.drift_start``): the run's own, never a shared reference cache's."""
    return storage.join(save_url, "drift_start", f"{num_steps}_steps.json")


BEST_STUDENT_NAME = "best_student.json"


def best_student_url(save_url: str) -> str:
    return storage.join(save_url, BEST_STUDENT_NAME)


TRACKERS_NAME = "trackers.json"


def trackers_url(save_url: str) -> str:
    return storage.join(save_url, TRACKERS_NAME)
