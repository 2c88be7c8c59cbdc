"""The latest pointer (the latest iteration every role finished saving) and the pre-flight check of
the checkpoint it names."""

from __future__ import annotations

import time
from typing import Iterable, Optional

from dmd2_core import storage
from dmd2_core.checkpoint.integrity import check_files, read_current_marker
from dmd2_core.errors import CheckpointError, StorageUnavailableError, one_line
from dmd2_core.save_layout import STATE_FILES, complete_url, latest_url, trainer_dir


def write_latest(save_url: str, iteration: int, roles: Optional[Iterable[str]] = None,
                  deadline: Optional[float] = None) -> None:
    """Record ``iteration`` as the run's latest checkpoint (atomic). Call it from the driver after
    every trainer's save_trainer returned; with ``roles`` it first checks each one's marker. With
    a ``deadline`` (``time.monotonic``: when the run's lease may go to another run) the write is
    never attempted or retried past it (StorageUnavailableError, retried)."""
    if roles is not None:
        for role in roles:
            url = complete_url(save_url, role, iteration)
            if not storage.exists(url):
                raise CheckpointError(f"{url}: missing; not recording iteration {iteration} as checkpointed")
    if deadline is None:
        storage.write_text(latest_url(save_url), f"{int(iteration)}\n")
        return
    budget = deadline - time.monotonic()
    if budget <= 0:
        raise StorageUnavailableError(f"{latest_url(save_url)}: not written: this run's lease may have expired meanwhile")
    storage.write_text(latest_url(save_url), f"{int(iteration)}\n", budget_s=budget)


def read_latest(load_url: str) -> Optional[int]:
    """The latest checkpointed iteration, or None for a fresh start (no save dir or no latest pointer)."""
    url = latest_url(load_url)
    try:
        if not storage.exists(url):
            return None
        text = storage.read_text(url).strip()
    except StorageUnavailableError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"{url}: cannot read the latest pointer ({one_line(exc)})") from None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise CheckpointError(f"{url}: the latest pointer must hold a non-negative integer (got {text[:40]!r})")
    return value


def validate_resume(load_url: str, roles: Iterable[str]) -> Optional[int]:
    """Cheap pre-flight check before any actor starts: the latest pointer's iteration (None: fresh start)
    after checking that every role has a complete checkpoint there in this dmd2's format, its
    listing and sizes, and the hashes of its small state files (the trainer state, the DCP
    metadata); the shards' hashes are checked by the trainer's ranks at load, in parallel."""
    iteration = read_latest(load_url)
    if iteration is None:
        return None
    for role in roles:
        d = trainer_dir(load_url, role, iteration)
        check_files(d, read_current_marker(d), hashes=STATE_FILES)
    return iteration


def resume_url(args) -> str:
    """Where a (re)start resumes from: the run's own save once it has a checkpoint there (a retry
    or a rerun continues the run), else ``load`` (a fine-tune from another run)."""
    if args.save and read_latest(args.save) is not None:
        return args.save
    return args.load_url
