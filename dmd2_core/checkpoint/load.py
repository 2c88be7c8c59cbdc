"""Loading one trainer's checkpoint into its shards: the marker and every file's hash checked
first (the files split between the ranks), then DCP loads each rank's part in place, strictly
(every saved tensor has its place, with its shape). Any number of ranks loads any checkpoint."""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dmd2_core import parallel, storage
from dmd2_core.checkpoint.collective import all_or_none, collective_retrying
from dmd2_core.checkpoint.integrity import check_files, read_current_marker
from dmd2_core.checkpoint.metadata import SafeReader
from dmd2_core.errors import CheckpointError, StorageUnavailableError, StoredFilesError, TransientError, one_line
from dmd2_core.save_layout import DCP_DIR, STATE_NAME, trainer_dir
from dmd2_core.checkpoint.state import check_param_groups, sharded_state, torch_load


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
    loads any checkpoint; returns the saved ``extra``. A collective: every rank of the group
    calls it (``process_group`` as for save_trainer). Raises CheckpointError naming the path
    when the directory is missing, incomplete, in another format, corrupt or does not fit;
    nothing under the checkpoint is modified."""
    d = trainer_dir(load_url, role, iteration)
    rank = dist.get_rank(process_group) if process_group is not None else 0
    # rank 0 reads the marker for the group: inside the wrapper, so its failure reaches every rank
    marker = all_or_none(lambda: _read_marker_for(d, ema) if rank == 0 else None, f"load {d}", process_group,
                         gather=True)[0]
    all_or_none(lambda: check_files(d, marker, hashes=False), f"load {d}", process_group)
    _check_hashes_shared(d, marker, process_group)
    meta = all_or_none(lambda: _read_state(d, marker), f"load {d}", process_group)
    _load_sharded(d, model, optimizer, ema, meta, process_group)
    return dict(meta.get("extra") or {})


def _read_marker_for(d: str, ema) -> dict:
    marker = read_current_marker(d)
    if ema is not None and not marker.get("has_ema"):
        raise CheckpointError(f"{d}: checkpoint has no ema weights but the trainer keeps an EMA")
    return marker


def read_weights(load_url: str, role: str, iteration: int, section: str = "model") -> dict[str, torch.Tensor]:
    """The whole ``section`` ('model', 'ema' or 'optim') of a sharded checkpoint as plain tensors,
    read in this one process (no process group; any number of ranks wrote it): for tools and
    tests, not for resuming."""
    d = trainer_dir(load_url, role, iteration)
    read_current_marker(d)
    reader = SafeReader(storage.join(d, DCP_DIR))
    saved = reader.read_metadata().state_dict_metadata
    prefix = f"{section}."
    target = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in saved.items()
              if k.startswith(prefix)}
    dcp.load(target, storage_reader=reader, no_dist=True)
    return {k[len(prefix):]: v for k, v in target.items()}


def _check_hashes_shared(d: str, marker: dict, process_group) -> None:
    """Every file's sha256 against the marker, the files split between the group's ranks; when
    any rank fails (a mismatch, storage), every rank raises (``all_or_none``)."""
    files = sorted(marker.get("sha256") or {})
    rank, world = (dist.get_rank(process_group), dist.get_world_size(process_group)) if process_group else (0, 1)
    all_or_none(lambda: check_files(d, {**marker, "sha256": {f: marker["sha256"][f] for f in files[rank::world]}},
                                     hashes=True), f"check {d}", process_group)


def _read_state(d: str, marker: dict) -> dict:
    state_url = storage.join(d, STATE_NAME)
    try:
        data = storage.read_bytes(state_url)
    except StorageUnavailableError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"{state_url}: cannot read ({one_line(exc)})") from None
    digest = (marker.get("sha256") or {}).get(STATE_NAME)
    if digest and hashlib.sha256(data).hexdigest() != digest:
        raise CheckpointError(f"{state_url}: corrupt (sha256 differs from the one recorded at save)")
    try:
        state = torch_load(data)
        if not isinstance(state, dict):
            raise ValueError("not a dict")
        return state
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"{state_url}: corrupt trainer state ({one_line(exc)})") from None


def _load_sharded(d: str, model, optimizer, ema, meta: dict, process_group) -> None:
    dcp_url = storage.join(d, DCP_DIR)
    state_url = storage.join(d, STATE_NAME)

    def prepare():
        if optimizer is not None:
            try:
                check_param_groups(model, optimizer, meta.get("param_groups") or [])
            except ValueError as exc:
                raise CheckpointError(f"{state_url}: optimizer state does not fit ({one_line(exc)})") from None
        target = sharded_state(model, optimizer, ema, init_optimizer=True)
        reader = SafeReader(dcp_url)
        try:
            saved = storage.retrying(reader.read_metadata, f"read {dcp_url}/.metadata").state_dict_metadata
        except (StorageUnavailableError, CheckpointError):
            raise
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"{dcp_url}/.metadata: corrupt ({one_line(exc)})") from None
        _check_fits(dcp_url, saved, target)
        return target, reader
    target, reader = all_or_none(prepare, f"load {d}", process_group)
    try:
        collective_retrying(lambda: dcp.load(target, storage_reader=reader, process_group=process_group,
                                             no_dist=process_group is None), f"load {dcp_url}", process_group)
    except (StorageUnavailableError, StoredFilesError, TransientError):
        raise
    except Exception as exc:  # noqa: BLE001 - what DCP found wrong (collective_retrying unwrapped it)
        raise CheckpointError(f"{dcp_url}: does not fit the trainer ({_dcp_reason(exc)})") from None
    loaded = sharded_state(model, optimizer, ema)
    for key, value in target.items():  # DCP loads in place; a tensor it replaced is copied back
        if loaded[key] is not value and parallel.local(loaded[key]).data_ptr() != parallel.local(value).data_ptr():
            parallel.local(loaded[key]).copy_(parallel.local(value))


def _check_fits(dcp_url: str, saved: dict, target: dict[str, torch.Tensor]) -> None:
    """Strict loading: DCP would load a subset silently; every saved weight (and EMA weight) must
    have its place in the model and every tensor to load its saved value, with the same shape
    and dtype."""
    sections = {k.split(".", 1)[0] for k in target}
    relevant = {k for k in saved if k.split(".", 1)[0] in sections | {"model"}}
    missing, unexpected = sorted(set(target) - relevant), sorted(relevant - set(target))
    what = "weights" if any(k.startswith(("model.", "ema.")) for k in missing + unexpected) else "optimizer state"
    if missing or unexpected:
        raise CheckpointError(f"{dcp_url}: {what} do not fit the trainer (missing {missing[:2]}, unexpected {unexpected[:2]})")
    for key, value in target.items():  # the metadata reader admitted tensor entries alone
        size, dtype = tuple(saved[key].size), saved[key].properties.dtype
        if size != tuple(value.shape):
            raise CheckpointError(f"{dcp_url}: '{key}' has shape {size} in the checkpoint, {tuple(value.shape)} here")
        if dtype != value.dtype:
            raise CheckpointError(f"{dcp_url}: '{key}' is {dtype} in the checkpoint, {value.dtype} here")


def _dcp_reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    for needle in ("Missing key in checkpoint state_dict:", "Size mismatch", "size mismatch"):
        if needle in text:
            return text[text.index(needle):][:200]
    return one_line(exc)
