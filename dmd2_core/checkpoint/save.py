"""Saving one trainer's checkpoint: every rank writes its own shards (DCP), hashed as they are
written; rank 0 then writes the marker. Asynchronous saves stage the state to host memory and
write it in a background thread (``PendingSave``)."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dmd2_core import storage
from dmd2_core.checkpoint.collective import all_or_none, collective_retrying
from dmd2_core.checkpoint.integrity import check_finite, hashing_writer, listing, nested_tensors, read_marker
from dmd2_core.errors import CheckpointError, StoredFilesError, one_line
from dmd2_core.save_layout import COMPLETE_NAME, DCP_DIR, FORMAT, STATE_NAME, trainer_dir
from dmd2_core.checkpoint.state import param_group_record, sharded_state, torch_bytes, torch_load
from dmd2_core.checkpoint.latest import read_latest


class PendingSave:
    """One trainer rank's save in flight. ``result()`` waits for it and returns
    ``{'url', 'iteration', 'save_s', 'bytes'}`` (this rank's bytes), or raises what the write hit."""

    def __init__(self, url: str, iteration: int, future, blocked_s: float):
        self.url, self.iteration, self.future, self.blocked_s = url, int(iteration), future, blocked_s

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: Optional[float] = None) -> dict:
        return self.future.result(timeout)


def save_trainer(
    save_url: str,
    role: str,
    iteration: int,
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    ema: Optional[Sequence[torch.Tensor]] = None,
    extra: Optional[dict] = None,
    process_group=None,
    asynchronous: bool = False,
) -> PendingSave:
    """Save one trainer's state for ``iteration``: a collective, every rank of the group calls it
    with its own shards (``process_group``: the group's ``checkpoint_group()``; None for a single
    process without torch.distributed). Synchronous saves return a finished PendingSave; with
    ``asynchronous`` the state is staged to host memory and written in the background. The
    tracked iteration, complete, is never rewritten: its save is a no-op (a replay reaches the
    same bytes, and deleting it first would leave the latest pointer naming nothing durable while the
    new copy is written). Any other directory already there for this iteration is replaced (its
    marker goes first, so no reader ever takes a half-replaced directory for a complete one)."""
    start = time.perf_counter()
    distributed = process_group is not None
    rank = dist.get_rank(process_group) if distributed else 0
    extra = dict(extra or {})
    try:  # fail now, not at resume time, on anything weights_only loading would refuse
        torch_load(torch_bytes(extra))
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"save_trainer({role!r}): extra must hold plain values and tensors ({one_line(exc)})") from None
    state = sharded_state(model, optimizer, ema)
    check_finite(role, iteration, {**state, **dict(nested_tensors(extra, "extra"))}, process_group)
    d = trainer_dir(save_url, role, iteration)
    meta = torch_bytes({"format": FORMAT, "param_groups": param_group_record(model, optimizer), "extra": extra})
    digests: dict[str, str] = {}
    marker_info = {"has_ema": ema is not None}

    def write(staged: dict) -> dict:
        # read here, not before staging: an asynchronous save never waits on storage in the caller
        tracked = all_or_none(lambda: _tracked_and_complete(save_url, role, iteration) if rank == 0 else None,
                              f"save {d}", process_group, gather=True)[0]
        if tracked is not None:
            return {"url": d, "iteration": int(iteration), "save_s": time.perf_counter() - start,
                    "bytes": _rank_bytes(tracked, rank), "kept": True}

        def replace_directory():
            if rank == 0:
                storage.remove(storage.join(d, COMPLETE_NAME))
                storage.remove(d)
                storage.write_bytes(storage.join(d, STATE_NAME), meta)
        # nobody writes before the old directory is gone; a failure there reaches every rank
        all_or_none(replace_directory, f"save {d}", process_group)

        def attempt():
            digests.clear()
            dcp.save(staged, storage_writer=hashing_writer(storage.join(d, DCP_DIR), digests),
                     process_group=process_group, no_dist=not distributed)
        collective_retrying(attempt, f"save {storage.join(d, DCP_DIR)}", process_group)
        return _finish_save(d, role, iteration, digests, marker_info, process_group, rank, start)

    future: concurrent.futures.Future = concurrent.futures.Future()
    if not asynchronous:
        future.set_result(write(state))
        return PendingSave(d, iteration, future, time.perf_counter() - start)

    staged = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}  # training may go on now

    def background():
        try:
            future.set_result(write(staged))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the save
            future.set_exception(exc)

    threading.Thread(target=background, name=f"dmd2-save-{role}-{iteration}", daemon=True).start()
    return PendingSave(d, iteration, future, time.perf_counter() - start)


def _tracked_and_complete(save_url: str, role: str, iteration: int) -> Optional[dict]:
    """The marker of ``iteration`` when the run's latest pointer names it and it is complete."""
    if read_latest(save_url) != int(iteration):
        return None
    try:
        return read_marker(trainer_dir(save_url, role, iteration))
    except CheckpointError:
        return None


def _rank_bytes(marker: dict, rank: int) -> int:
    """The bytes of a complete checkpoint that ``rank`` wrote (rank 0 also the shared files)."""
    own = f"{DCP_DIR}/__{rank}_"
    return sum(int(size) for rel, size in marker["files"].items()
               if rel.startswith(own) or (rank == 0 and not rel.startswith(f"{DCP_DIR}/__")))


def _finish_save(d: str, role: str, iteration: int, digests: dict, info: dict, process_group, rank: int,
                 start: float) -> dict:
    """After DCP wrote every rank's files: gather their hashes; rank 0 writes the marker."""
    mine = {f"{DCP_DIR}/{name}": digest for name, digest in digests.items()}
    if process_group is not None:
        gathered: list = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(gathered, mine, group=process_group)
        world = len(gathered)
    else:
        gathered, world = [mine], 1

    def write_marker() -> int:
        if rank != 0:
            return sum(listing(storage.join(d, DCP_DIR)).get(name, 0) for name in digests)
        hashes = {k: v for part in gathered for k, v in part.items()}
        files = listing(d)
        files.pop(COMPLETE_NAME, None)
        for rel in files:
            if rel not in hashes:  # .metadata (renamed from its temp name), trainer_state.pt
                hashes[rel] = storage.sha256(storage.join(d, rel))
        missing = sorted(set(hashes) - set(files))
        if missing:
            raise StoredFilesError(f"{storage.join(d, missing[0])}: written but not found in storage after the save")
        marker = {"format": FORMAT, "role": role, "iteration": int(iteration), "world_size": world,
                  "has_ema": info["has_ema"], "files": dict(sorted(files.items())),
                  "sha256": dict(sorted(hashes.items()))}
        storage.write_text(storage.join(d, COMPLETE_NAME), json.dumps(marker, indent=1))
        others = {rel for part in gathered[1:] for rel in part}
        return sum(size for rel, size in files.items() if rel not in others)  # and the shared files
    own_bytes = all_or_none(write_marker, f"save {d}", process_group)
    return {"url": d, "iteration": int(iteration), "save_s": time.perf_counter() - start, "bytes": own_bytes}
