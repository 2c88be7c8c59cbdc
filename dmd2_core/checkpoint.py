"""Checkpoints of one trainer and the run tracker, at any fsspec URL (path, file://, s3://).

Layout under the run's ``save`` URL (format 3)::

    {save}/latest_checkpointed_iteration.txt          the run tracker: one integer
    {save}/trainers/{role}/iter_{iteration:07d}/
        dcp/               torch.distributed.checkpoint: every rank writes its own shards
                           (__{rank}_{n}.distcp) of the model, the EMA and the AdamW moments and
                           step counts, keyed ``model.<name>``, ``ema.<name>``, ``optim.<name>.<key>``;
                           .metadata last (rank 0, after every rank's files are written)
        trainer_state.pt   {'format', 'param_groups' (settings keyed by parameter name), 'extra'}
        complete.json      written LAST by rank 0: every file with its size and its sha256
    {save}/exports/iter_{iteration:07d}/    the student as a diffusers pipeline (dmd2_core.export)

No rank ever holds the whole model: a 14B trainer on 8 ranks writes 1/8 of its state per rank.
DCP records the global shape and offsets of every shard, so a checkpoint loads on any number of
ranks (DCP reshards on load). Each file's sha256 is computed while it is written (by the rank that
writes it) and gathered into ``complete.json``; at load the ranks split the files between them and
check every hash before anything is loaded, so a flipped byte is one line naming the file. The
pre-flight check (``validate_resume``, before any actor) checks the listing and sizes only.

A trainer directory counts only once ``complete.json`` exists; a save interrupted midway leaves a
directory without it, which ``load_trainer`` and ``validate_resume`` refuse. The tracker is
written by the driver alone (``write_tracker``), after every trainer's save is durable (its marker
written), so it only ever names an iteration that every role finished saving. Retention
(``prune``) runs after the tracker moved and never touches the tracked checkpoint or a newer one.

Asynchronous saves (``save_trainer(..., asynchronous=True)``): the state is copied to host memory
before the call returns; the files are written and uploaded in a background thread, which then
writes the marker; ``PendingSave.result()`` waits for it. The checkpoint collectives (DCP's
planning, the hash gather) run on a separate gloo process group (``checkpoint_group``), never on
the training one. Storage outages are retried like every other write (``storage.RETRY_S``), the
ranks agreeing on each retry.

Exact resume: weights (fp32 masters), EMA and AdamW state are the bytes that were saved; every
param-group setting (``lr`` ...) is the saved one. Anything else a trainer needs (iteration, step
counters, the GAN head) goes in ``extra``, which must hold only what ``torch.load(weights_only=True)``
reads back; ``save_trainer`` checks that before it writes anything.

Older checkpoints (formats 1 and 2: whole diffusers weights under ``model/`` and ``ema/`` plus the
whole optimizer in ``trainer_state.pt``, written by rank 0) still load, on any number of ranks.
"""

from __future__ import annotations

import hashlib
import io
import json
import warnings
from typing import Any, Iterable, Optional, Sequence

import torch

from dmd2_core import parallel, storage

# a single process without torch.distributed (tests, tools) saves and loads with no_dist=True
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
from dmd2_core.finite import NonFiniteError, first_nonfinite
from dmd2_core.models import CheckpointError

TRACKER_NAME = "latest_checkpointed_iteration.txt"
COMPLETE_NAME = "complete.json"
STATE_NAME = "trainer_state.pt"
FORMAT = 3  # 3: sharded (DCP); 2: whole weights, optimizer keyed by name; 1: by position (both still read)
DCP_DIR = "dcp"


class CheckpointLoadError(CheckpointError):
    """A trainer checkpoint or tracker that cannot be resumed from (a ValueError); the message is
    one line naming the path."""


# ---- paths ------------------------------------------------------------------------------------

def trainer_dir(save_url: str, role: str, iteration: int) -> str:
    return storage.join(save_url, "trainers", role, f"iter_{int(iteration):07d}")


def tracker_url(save_url: str) -> str:
    return storage.join(save_url, TRACKER_NAME)


def _complete_url(save_url: str, role: str, iteration: int) -> str:
    return storage.join(trainer_dir(save_url, role, iteration), COMPLETE_NAME)


# ---- helpers ----------------------------------------------------------------------------------

def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _torch_load(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _listing(url: str) -> dict[str, int]:
    """Relative path -> size of every file under ``url``."""
    fs, root = storage.filesystem(url)
    root = root.rstrip("/")
    out = {}
    found = storage.retrying(lambda: storage.filesystem(url)[0].find(root, detail=True), f"list {url}")
    for path, info in found.items():
        if info.get("type", "file") != "directory":
            out[path[len(root):].lstrip("/")] = int(info["size"])
    return out


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


# ---- save (format 3: sharded, DCP) -------------------------------------------------------------

def checkpoint_group():
    """A gloo process group over the trainer group's ranks for checkpoint collectives (DCP's
    planning and the hash gather run in a background thread during asynchronous saves, and must
    never interleave with the training collectives). None without torch.distributed."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo") if dist.is_initialized() else None


class _HashingStream(io.RawIOBase):
    """A write-only stream that forwards to ``inner`` and hashes what passes through."""

    def __init__(self, inner, digest):
        super().__init__()
        self.inner, self.digest = inner, digest

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        written = self.inner.write(view)
        return len(view) if written is None else written

    def tell(self) -> int:
        return self.inner.tell()

    def flush(self) -> None:
        self.inner.flush()

    def fileno(self) -> int:
        return self.inner.fileno()


def _hashing_writer(url: str, digests: dict[str, str]):
    """DCP's fsspec writer, recording the sha256 of every file it writes (by file name)."""
    import contextlib

    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecWriter

    class HashingFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path, mode):
            with super().create_stream(path, mode) as stream:
                if "w" not in mode:
                    yield stream
                    return
                digest = hashlib.sha256()
                yield _HashingStream(stream, digest)
                name = str(path).rstrip("/").rsplit("/", 1)[-1]
                if not name.endswith(".tmp"):  # .metadata goes through a temp name: hashed once renamed
                    digests[name] = digest.hexdigest()

    writer = FsspecWriter(url, sync_files=storage.is_local(url))
    fs = HashingFileSystem()
    writer.path = fs.init_path(url)
    writer.fs = fs
    return writer


def _sharded_state(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
                   ema: Optional[Sequence[torch.Tensor]], init_optimizer: bool = False) -> dict[str, torch.Tensor]:
    """This rank's view of the trainer state as one flat dict of (distributed) tensors: DCP saves
    each rank's shards and loads into them in place. ``init_optimizer`` creates AdamW's state
    (zeros, step 0) where it does not exist yet, so a fresh trainer has tensors to load into."""
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    names = [n for n, _ in model.named_parameters()]
    if ema is not None:
        state.update({f"ema.{n}": e for n, e in zip(names, ema)})
    if optimizer is not None:
        by_id = {id(p): n for n, p in model.named_parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p not in optimizer.state and init_optimizer:
                    optimizer.state[p] = _fresh_adam_state(optimizer, p)
                for key, value in optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        state[f"optim.{by_id[id(p)]}.{key}"] = value
    return state


def _fresh_adam_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise TypeError(f"cannot create the state of {type(optimizer).__name__} to load into")
    state = {"step": torch.tensor(0.0, dtype=torch.float32),
             "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
             "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    if optimizer.defaults.get("amsgrad"):
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def _param_groups(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> list[dict]:
    if optimizer is None:
        return []
    names = {id(p): n for n, p in model.named_parameters()}
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
            for g in optimizer.param_groups]


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
    same bytes, and deleting it first would leave the tracker naming nothing durable while the
    new copy is written). Any other directory already there for this iteration is replaced (its
    marker goes first, so no reader ever takes a half-replaced directory for a complete one)."""
    import concurrent.futures
    import threading
    import time

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    start = time.perf_counter()
    distributed = process_group is not None
    rank = dist.get_rank(process_group) if distributed else 0
    extra = dict(extra or {})
    try:  # fail now, not at resume time, on anything weights_only loading would refuse
        _torch_load(_torch_bytes(extra))
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"save_trainer({role!r}): extra must hold plain values and tensors ({one_line(exc)})") from None
    state = _sharded_state(model, optimizer, ema)
    _check_finite_local(role, iteration, {**state, **dict(_nested_tensors(extra, "extra"))}, process_group)
    d = trainer_dir(save_url, role, iteration)
    meta = _torch_bytes({"format": FORMAT, "param_groups": _param_groups(model, optimizer), "extra": extra})
    digests: dict[str, str] = {}
    marker_info = {"has_ema": ema is not None}

    def write(staged: dict) -> dict:
        # read here, not before staging: an asynchronous save never waits on storage in the caller
        tracked = _all_or_none(lambda: _tracked_and_complete(save_url, role, iteration) if rank == 0 else None,
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
        _all_or_none(replace_directory, f"save {d}", process_group)

        def attempt():
            digests.clear()
            dcp.save(staged, storage_writer=_hashing_writer(storage.join(d, DCP_DIR), digests),
                     process_group=process_group, no_dist=not distributed)
        _collective_retrying(attempt, f"save {storage.join(d, DCP_DIR)}", process_group)
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


def _collective_retrying(fn, what: str, process_group) -> None:
    """``fn()`` (a DCP save or load: every rank fails or succeeds together), retried like
    storage.retrying while it fails with transient errors; the ranks vote, so all of them retry
    or all of them raise."""
    import time

    import torch.distributed as dist

    deadline = time.monotonic() + storage.RETRY_S
    delay = storage.RETRY_FIRST_DELAY_S
    while True:
        error = None
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - classified below
            error = exc
        vote = (error is None, error is None or _transient(error))
        if process_group is not None:
            votes: list = [None] * dist.get_world_size(process_group)
            dist.all_gather_object(votes, vote, group=process_group)
        else:
            votes = [vote]
        if all(ok for ok, _ in votes):
            return
        if all(transient for _, transient in votes) and time.monotonic() + delay <= deadline:
            storage.log.warning(f"storage: {what}: {one_line(error) if error else 'another rank failed'}; "
                                f"retry in {delay:.1f} s")
            time.sleep(delay)
            delay = min(delay * 2, storage.RETRY_MAX_DELAY_S)
            continue
        if error is None:
            raise CheckpointError(f"{what}: failed on another rank of the group")
        if all(transient for _, transient in votes):
            raise storage.StorageUnavailableError(
                f"{what}: storage unavailable for {storage.RETRY_S:.0f} s ({one_line(error)})") from error
        raise error


def _transient(exc: BaseException) -> bool:
    """A storage outage, also when DCP wrapped it (CheckpointException: the failure of each rank)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return all(storage.is_transient(getattr(f, "exception", f)) for f in failures.values())
    return storage.is_transient(exc)


def _all_or_none(fn, what: str, process_group, gather: bool = False):
    """``fn()`` on every rank of the group (a collective; ``fn`` itself must not be one). When
    any rank fails, every rank raises: the failing one its error, the others a CheckpointError (a
    CheckpointLoadError for a checkpoint that cannot be resumed from) naming that rank, so no
    rank is left waiting in a later collective for one that gave up. Returns this rank's result,
    or with ``gather`` every rank's (a list by rank)."""
    import torch.distributed as dist

    error, result = None, None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - shared with the group, then raised
        error = exc
    mine = (result if gather else None,
            None if error is None else (isinstance(error, CheckpointLoadError), one_line(error)))
    if process_group is None:
        gathered = [mine]
    else:
        gathered = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(gathered, mine, group=process_group)
    if error is not None:
        raise error
    failed = next(((r, f) for r, (_, f) in enumerate(gathered) if f is not None), None)
    if failed is not None:
        rank, (load_error, line) = failed
        if load_error:
            raise CheckpointLoadError(line.split(": ", 1)[-1])
        raise CheckpointError(f"{what}: failed on rank {rank} of the group ({line})")
    return [r for r, _ in gathered] if gather else result


def _tracked_and_complete(save_url: str, role: str, iteration: int) -> Optional[dict]:
    """The marker of ``iteration`` when the run's tracker names it and it is complete."""
    if read_tracker(save_url) != int(iteration):
        return None
    try:
        return _read_marker(trainer_dir(save_url, role, iteration))
    except CheckpointLoadError:
        return None


def _rank_bytes(marker: dict, rank: int) -> int:
    """The bytes of a complete checkpoint that ``rank`` wrote (rank 0 also the shared files)."""
    own = f"{DCP_DIR}/__{rank}_"
    return sum(int(size) for rel, size in marker["files"].items()
               if rel.startswith(own) or (rank == 0 and not rel.startswith(f"{DCP_DIR}/__")))


def _nested_tensors(obj, prefix: str):
    """(dotted key, tensor) of every tensor in nested dicts and lists."""
    if torch.is_tensor(obj):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _nested_tensors(v, f"{prefix}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _nested_tensors(v, f"{prefix}.{i}")


def _finish_save(d: str, role: str, iteration: int, digests: dict, info: dict, process_group, rank: int,
                 start: float) -> dict:
    """After DCP wrote every rank's files: gather their hashes; rank 0 writes the marker."""
    import time

    import torch.distributed as dist

    mine = {f"{DCP_DIR}/{name}": digest for name, digest in digests.items()}
    if process_group is not None:
        gathered: list = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(gathered, mine, group=process_group)
        world = len(gathered)
    else:
        gathered, world = [mine], 1

    def write_marker() -> int:
        if rank != 0:
            return sum(_listing(storage.join(d, DCP_DIR)).get(name, 0) for name in digests)
        hashes = {k: v for part in gathered for k, v in part.items()}
        files = _listing(d)
        files.pop(COMPLETE_NAME, None)
        for rel in files:
            if rel not in hashes:  # .metadata (renamed from its temp name), trainer_state.pt
                hashes[rel] = storage.sha256(storage.join(d, rel))
        missing = sorted(set(hashes) - set(files))
        if missing:
            raise CheckpointError(f"{storage.join(d, missing[0])}: written but not found in storage after the save")
        marker = {"format": FORMAT, "role": role, "iteration": int(iteration), "world_size": world,
                  "has_ema": info["has_ema"], "files": dict(sorted(files.items())),
                  "sha256": dict(sorted(hashes.items()))}
        storage.write_text(storage.join(d, COMPLETE_NAME), json.dumps(marker, indent=1))
        others = {rel for part in gathered[1:] for rel in part}
        return sum(size for rel, size in files.items() if rel not in others)  # and the shared files
    own_bytes = _all_or_none(write_marker, f"save {d}", process_group)
    return {"url": d, "iteration": int(iteration), "save_s": time.perf_counter() - start, "bytes": own_bytes}


def _check_finite_local(role, iteration, state: dict[str, torch.Tensor], process_group) -> None:
    """No checkpoint with a non-finite weight, EMA weight or optimizer moment is written. Each
    rank checks its own shards and every rank learns the verdict, so all of them refuse."""
    import torch.distributed as dist

    bad = first_nonfinite((k, parallel.local(v)) for k, v in state.items())
    if process_group is not None:
        verdicts: list = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(verdicts, bad, group=process_group)
        bad = next((v for v in verdicts if v is not None), None)
    if bad is not None:
        raise NonFiniteError(f"{role}: not saving iteration {iteration}: '{bad[0]}' holds {bad[1]} non-finite values")


# ---- load -------------------------------------------------------------------------------------

def _read_marker(d: str) -> dict:
    """The parsed complete.json of a trainer dir; CheckpointLoadError when missing or unreadable."""
    marker_url = storage.join(d, COMPLETE_NAME)
    try:
        if not storage.exists(marker_url):
            if not storage.exists(d):
                raise CheckpointLoadError(f"{d}: checkpoint directory does not exist")
            raise CheckpointLoadError(
                f"{d}: incomplete checkpoint (no {COMPLETE_NAME}; its save was interrupted)"
            )
        marker = json.loads(storage.read_text(marker_url))
        if not isinstance(marker, dict) or not isinstance(marker.get("files"), dict):
            raise ValueError("not a checkpoint marker")
        return marker
    except (CheckpointLoadError, storage.StorageUnavailableError):
        raise
    except Exception as exc:  # noqa: BLE001
        raise CheckpointLoadError(f"{marker_url}: unreadable checkpoint marker ({one_line(exc)})") from None


def _check_files(d: str, marker: dict, hashes: bool = True, unhashed: tuple[str, ...] = ()) -> None:
    """Every file the marker lists is there with its recorded size and (``hashes``) sha256;
    the ``unhashed`` ones are left to a caller that hashes the bytes it reads anyway."""
    try:
        present = _listing(d)
    except storage.StorageUnavailableError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise CheckpointLoadError(f"{d}: cannot list checkpoint ({one_line(exc)})") from None
    for rel, size in marker["files"].items():
        url = storage.join(d, rel)
        if rel not in present:
            raise CheckpointLoadError(f"{url}: missing from checkpoint")
        if present[rel] != int(size):
            raise CheckpointLoadError(f"{url}: corrupt ({present[rel]} bytes, {size} recorded at save)")
    if not hashes:
        return
    for rel, digest in (marker.get("sha256") or {}).items():  # markers before format 1.1 lack them
        if rel in unhashed:
            continue
        url = storage.join(d, rel)
        try:
            actual = storage.sha256(url)
        except storage.StorageUnavailableError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise CheckpointLoadError(f"{url}: cannot read ({one_line(exc)})") from None
        if actual != digest:
            raise CheckpointLoadError(f"{url}: corrupt (sha256 differs from the one recorded at save)")


def _load_weights(model_url: str) -> dict[str, torch.Tensor]:
    """The whole state dict of the safetensors under ``model_url``/transformer."""
    from safetensors.torch import load_file

    transformer_url = storage.join(model_url, "transformer")
    try:
        with storage.local_copy(transformer_url) as local:
            shards = sorted(local.glob("*.safetensors"))
            if not shards:
                raise CheckpointLoadError(f"{transformer_url}: no .safetensors weights")
            state: dict[str, torch.Tensor] = {}
            for shard in shards:  # big models are sharded: one file per shard
                try:
                    state.update(load_file(str(shard)))
                except Exception as exc:  # noqa: BLE001
                    raise CheckpointLoadError(
                        f"{storage.join(transformer_url, shard.name)}: corrupt weights ({one_line(exc)})"
                    ) from None
            return state
    except (CheckpointLoadError, storage.StorageUnavailableError):
        raise
    except Exception as exc:  # noqa: BLE001
        raise CheckpointLoadError(f"{transformer_url}: cannot read weights ({one_line(exc)})") from None


def _named_optimizer_state(saved: dict, param_names: list[str], state_url: str) -> dict:
    """The optimizer state keyed by parameter name. Format 1 (a plain ``optimizer.state_dict()``,
    keyed by parameter position) is translated by the model's parameter order."""
    groups = saved.get("param_groups") or []
    positional = any(isinstance(i, int) for g in groups for i in g.get("params", []))
    if not positional:
        return saved
    count = sum(len(g["params"]) for g in groups)
    if count != len(param_names):
        raise CheckpointLoadError(f"{state_url}: optimizer state holds {count} parameters, the model has {len(param_names)}")
    return {
        "state": {param_names[int(i)]: v for i, v in saved.get("state", {}).items()},
        "param_groups": [{**g, "params": [param_names[int(i)] for i in g["params"]]} for g in groups],
    }


def load_trainer(
    load_url: str,
    role: str,
    iteration: int,
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    ema: Optional[Sequence[torch.Tensor]] = None,
    process_group=None,
) -> dict:
    """Load a trainer checkpoint INTO ``model`` (strict), ``optimizer`` (skipped when None) and
    ``ema`` (tensors in parameter order), each rank into its own shards, so any number of ranks
    loads any checkpoint; returns the saved ``extra``. A collective for a sharded (format 3)
    checkpoint: every rank of the group calls it (``process_group`` as for save_trainer). Raises
    CheckpointLoadError naming the path when the directory is missing, incomplete, corrupt or
    does not fit; nothing under the checkpoint is modified."""
    d = trainer_dir(load_url, role, iteration)
    marker = _read_marker(d)
    if ema is not None and not marker.get("has_ema"):
        raise CheckpointLoadError(f"{d}: checkpoint has no ema weights but the trainer keeps an EMA")
    if int(marker.get("format", 1)) < 3:
        return _load_whole(d, marker, model, optimizer, ema)
    if int(marker["format"]) > FORMAT:
        raise CheckpointLoadError(f"{d}: checkpoint format {marker['format']} is newer than this dmd2 reads "
                                  f"({FORMAT}); resume it with the version that wrote it")
    _all_or_none(lambda: _check_files(d, marker, hashes=False), f"load {d}", process_group)
    _check_hashes_shared(d, marker, process_group)
    meta = _all_or_none(lambda: _read_state(d, marker), f"load {d}", process_group)
    _load_sharded(d, model, optimizer, ema, meta, process_group)
    return dict(meta.get("extra") or {})


def read_weights(load_url: str, role: str, iteration: int, section: str = "model") -> dict[str, torch.Tensor]:
    """The whole ``section`` ('model', 'ema' or 'optim') of a sharded checkpoint as plain tensors,
    read in this one process (no process group; any number of ranks wrote it): for tools and
    tests, not for resuming."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    d = trainer_dir(load_url, role, iteration)
    _read_marker(d)
    reader = FsspecReader(storage.join(d, DCP_DIR))
    saved = reader.read_metadata().state_dict_metadata
    prefix = f"{section}."
    target = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in saved.items()
              if k.startswith(prefix) and hasattr(m, "size")}
    dcp.load(target, storage_reader=reader, no_dist=True)
    return {k[len(prefix):]: v for k, v in target.items()}


def _check_hashes_shared(d: str, marker: dict, process_group) -> None:
    """Every file's sha256 against the marker, the files split between the group's ranks; when
    any rank fails (a mismatch, storage), every rank raises (``_all_or_none``)."""
    import torch.distributed as dist

    files = sorted(marker.get("sha256") or {})
    rank, world = (dist.get_rank(process_group), dist.get_world_size(process_group)) if process_group else (0, 1)
    _all_or_none(lambda: _check_files(d, {**marker, "sha256": {f: marker["sha256"][f] for f in files[rank::world]}},
                                      hashes=True), f"check {d}", process_group)


def _read_state(d: str, marker: dict) -> dict:
    state_url = storage.join(d, STATE_NAME)
    try:
        data = storage.read_bytes(state_url)
    except storage.StorageUnavailableError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise CheckpointLoadError(f"{state_url}: cannot read ({one_line(exc)})") from None
    digest = (marker.get("sha256") or {}).get(STATE_NAME) or marker.get("trainer_state_sha256")
    if digest and hashlib.sha256(data).hexdigest() != digest:
        raise CheckpointLoadError(f"{state_url}: corrupt (sha256 differs from the one recorded at save)")
    try:
        state = _torch_load(data)
        if not isinstance(state, dict):
            raise ValueError("not a dict")
        return state
    except Exception as exc:  # noqa: BLE001
        raise CheckpointLoadError(f"{state_url}: corrupt trainer state ({one_line(exc)})") from None


def _load_sharded(d: str, model, optimizer, ema, meta: dict, process_group) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    dcp_url = storage.join(d, DCP_DIR)
    state_url = storage.join(d, STATE_NAME)

    def prepare():
        if optimizer is not None:
            try:
                _apply_param_groups(model, optimizer, meta.get("param_groups") or [])
            except ValueError as exc:
                raise CheckpointLoadError(f"{state_url}: optimizer state does not fit ({one_line(exc)})") from None
        target = _sharded_state(model, optimizer, ema, init_optimizer=True)
        reader = FsspecReader(dcp_url)
        try:
            saved = storage.retrying(reader.read_metadata, f"read {dcp_url}/.metadata").state_dict_metadata
        except storage.StorageUnavailableError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise CheckpointLoadError(f"{dcp_url}/.metadata: corrupt ({one_line(exc)})") from None
        _check_fits(dcp_url, saved, target)
        return target, reader
    target, reader = _all_or_none(prepare, f"load {d}", process_group)
    try:
        _collective_retrying(lambda: dcp.load(target, storage_reader=reader, process_group=process_group,
                                              no_dist=process_group is None), f"load {dcp_url}", process_group)
    except (storage.StorageUnavailableError, CheckpointError):
        raise
    except Exception as exc:  # noqa: BLE001 - DCP wraps every rank's failure in one exception
        raise CheckpointLoadError(f"{dcp_url}: does not fit the trainer ({_dcp_reason(exc)})") from None
    loaded = _sharded_state(model, optimizer, ema)
    for key, value in target.items():  # DCP loads in place; a tensor it replaced is copied back
        if loaded[key] is not value and parallel.local(loaded[key]).data_ptr() != parallel.local(value).data_ptr():
            parallel.local(loaded[key]).copy_(parallel.local(value))


def _check_fits(dcp_url: str, saved: dict, target: dict[str, torch.Tensor]) -> None:
    """Strict loading: DCP would load a subset silently; every saved weight (and EMA weight) must
    have its place in the model and every tensor to load its saved value, with the same shape."""
    sections = {k.split(".", 1)[0] for k in target}
    relevant = {k for k in saved if k.split(".", 1)[0] in sections | {"model"}}
    missing, unexpected = sorted(set(target) - relevant), sorted(relevant - set(target))
    what = "weights" if any(k.startswith(("model.", "ema.")) for k in missing + unexpected) else "optimizer state"
    if missing or unexpected:
        raise CheckpointLoadError(f"{dcp_url}: {what} do not fit the trainer (missing {missing[:2]}, unexpected {unexpected[:2]})")
    for key, value in target.items():
        size = tuple(getattr(saved[key], "size", ()) or ())
        if size != tuple(value.shape):
            raise CheckpointLoadError(f"{dcp_url}: '{key}' has shape {size} in the checkpoint, {tuple(value.shape)} here")


def _dcp_reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    for needle in ("Missing key in checkpoint state_dict:", "Size mismatch", "size mismatch"):
        if needle in text:
            return text[text.index(needle):][:200]
    return one_line(exc)


def _apply_param_groups(model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved_groups: list[dict]) -> None:
    """The saved settings (lr, betas, ...) win over the ones the optimizer was built with."""
    names = {id(p): n for n, p in model.named_parameters()}
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"{len(saved_groups)} parameter groups saved, the optimizer has {len(optimizer.param_groups)}")
    for saved, group in zip(saved_groups, optimizer.param_groups):
        if any(id(p) not in names for p in group["params"]):
            raise ValueError("the optimizer holds parameters that are not the model's")
        current = [names[id(p)] for p in group["params"]]
        if sorted(saved["params"]) != sorted(current):
            extra = sorted(set(saved["params"]) ^ set(current))
            raise ValueError(f"saved parameters do not match the model's (e.g. {extra[:2]})")
        group.update({k: v for k, v in saved.items() if k != "params"})


def _load_whole(d: str, marker: dict, model, optimizer, ema) -> dict:
    """Formats 1 and 2: whole weights (diffusers safetensors) and the whole optimizer."""
    _check_files(d, marker, hashes=True, unhashed=(STATE_NAME,))  # the state is hashed as read
    state = _read_state(d, marker)
    state_url = storage.join(d, STATE_NAME)
    if "optimizer" not in state:
        raise CheckpointLoadError(f"{state_url}: corrupt trainer state (no optimizer entry)")
    _apply_weights(storage.join(d, "model"), model)
    if ema is not None:
        _apply_weights(storage.join(d, "ema"), model, ema)
    if optimizer is not None:
        names = [n for n, _ in model.named_parameters()]
        try:
            parallel.load_optimizer_state(model, optimizer, _named_optimizer_state(state["optimizer"], names, state_url))
        except CheckpointLoadError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise CheckpointLoadError(f"{state_url}: optimizer state does not fit ({one_line(exc)})") from None
    return dict(state.get("extra") or {})


def _apply_weights(model_url: str, model: torch.nn.Module, shards: Optional[Sequence[torch.Tensor]] = None) -> None:
    transformer_url = storage.join(model_url, "transformer")
    try:
        parallel.load_full_state_dict(model, _load_weights(model_url), shards)
    except CheckpointLoadError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise CheckpointLoadError(f"{transformer_url}: weights do not fit the model ({one_line(exc)})") from None


# ---- tracker ----------------------------------------------------------------------------------

def write_tracker(save_url: str, iteration: int, roles: Optional[Iterable[str]] = None) -> None:
    """Record ``iteration`` as the run's latest checkpoint (atomic). Call it from the driver after
    every trainer's save_trainer returned; with ``roles`` it first checks each one's marker."""
    if roles is not None:
        for role in roles:
            url = _complete_url(save_url, role, iteration)
            if not storage.exists(url):
                raise CheckpointLoadError(f"{url}: missing; not recording iteration {iteration} as checkpointed")
    storage.write_text(tracker_url(save_url), f"{int(iteration)}\n")


def read_tracker(load_url: str) -> Optional[int]:
    """The latest checkpointed iteration, or None for a fresh start (no save dir or no tracker)."""
    url = tracker_url(load_url)
    try:
        if not storage.exists(url):
            return None
        text = storage.read_text(url).strip()
    except storage.StorageUnavailableError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise CheckpointLoadError(f"{url}: cannot read tracker ({one_line(exc)})") from None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise CheckpointLoadError(f"{url}: tracker must hold a non-negative integer (got {text[:40]!r})")
    return value


def validate_resume(load_url: str, roles: Iterable[str]) -> Optional[int]:
    """Cheap pre-flight check before any actor starts: the tracker's iteration (None: fresh start)
    after checking that every role has a complete checkpoint there: listing and sizes (and, for
    the small whole-weights formats, hashes; a sharded checkpoint's hashes are checked by its
    ranks at load, in parallel)."""
    iteration = read_tracker(load_url)
    if iteration is None:
        return None
    for role in roles:
        d = trainer_dir(load_url, role, iteration)
        marker = _read_marker(d)
        if int(marker.get("format", 1)) > FORMAT:
            raise CheckpointLoadError(f"{d}: checkpoint format {marker['format']} is newer than this dmd2 reads "
                                      f"({FORMAT}); resume it with the version that wrote it")
        _check_files(d, marker, hashes=int(marker.get("format", 1)) < 3)
    return iteration


# ---- retention --------------------------------------------------------------------------------

def saved_iterations(save_url: str, role: str) -> dict[int, bool]:
    """Iteration -> complete (has its marker) of every checkpoint directory of ``role``."""
    root = storage.join(save_url, "trainers", role)
    if not storage.exists(root):
        return {}
    fs, path = storage.filesystem(root)
    out = {}
    for entry in storage.retrying(lambda: fs.ls(path, detail=False), f"list {root}"):
        name = str(entry).rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("iter_") and name[5:].isdigit():
            out[int(name[5:])] = storage.exists(_complete_url(save_url, role, int(name[5:])))
    return out


def prune(save_url: str, roles: Iterable[str], keep_last_n: int) -> list[str]:
    """Delete the checkpoints of ``roles`` older than the ``keep_last_n`` newest complete ones up
    to the tracked one (0: keep all). Run it after the tracker moved: it never deletes the tracked
    checkpoint or anything newer (a save in flight), and deletes an older one only once a newer
    one is tracked. Older incomplete directories (saves that failed midway) go too. Returns the
    deleted directories."""
    if keep_last_n <= 0:
        return []
    tracked = read_tracker(save_url)
    if tracked is None:
        return []
    deleted = []
    for role in roles:
        found = saved_iterations(save_url, role)
        complete = sorted((i for i, ok in found.items() if ok and i <= tracked), reverse=True)
        keep = set(complete[:keep_last_n]) | {tracked}
        for i in sorted(found):
            if i < tracked and i not in keep:
                d = trainer_dir(save_url, role, i)
                storage.remove(_complete_url(save_url, role, i))  # no reader takes it for complete meanwhile
                storage.remove(d)
                deleted.append(d)
    return deleted
