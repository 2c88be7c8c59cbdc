"""Checkpoints of one trainer and the run tracker, at any fsspec URL (path, file://, s3://).

Layout under the run's ``save`` URL::

    {save}/latest_checkpointed_iteration.txt          the run tracker: one integer
    {save}/trainers/{role}/iter_{iteration:07d}/
        model/             the trained model, diffusers pipeline-style dir (transformer/, scheduler/)
        ema/               optional EMA weights, same format
        trainer_state.pt   {'format', 'optimizer': whole state keyed by parameter name, 'extra': {...}}
        complete.json      written LAST: every file with its size and its sha256

A trainer directory counts only once ``complete.json`` exists; a save interrupted midway leaves a
directory without it, which ``load_trainer`` and ``validate_resume`` refuse. The sha256 of every
file is read back from storage after it was written; ``validate_resume`` (preflight, before any
actor) and ``load_trainer`` check the listing, the sizes and the hashes, so a flipped byte is one
line naming the file. The tracker is written
by the driver alone (``write_tracker``), after every trainer's ``save_trainer`` has returned, so it
only ever names an iteration that every role finished saving; a crash during a save leaves it at
the previous checkpoint.

The weights and optimizer state are whole (gathered from every rank's shards), so a checkpoint
resumes on any number of ranks. Exact resume: the weights are restored from the safetensors
(bit-exact, fp32 master weights), the optimizer from its own state dict (AdamW moments, per-parameter ``step`` counts and every param-group setting,
including ``lr``: the saved values win over the ones the optimizer was built with). Anything else
a trainer needs (iteration, step counters, RNG states, LR-scheduler state) goes in ``extra``, which
must hold only what ``torch.load(weights_only=True)`` reads back (tensors, numbers, strings, bools,
None, lists/tuples/dicts of those); ``save_trainer`` checks that before it writes anything.

Only one process per role should call ``save_trainer`` (rank 0 of the trainer group).
"""

from __future__ import annotations

import hashlib
import io
import json
from typing import Any, Iterable, Optional, Sequence

import torch

from dmd2_core import parallel, storage
from dmd2_core.finite import NonFiniteError, first_nonfinite
from dmd2_core.models import CheckpointError, save_checkpoint

TRACKER_NAME = "latest_checkpointed_iteration.txt"
COMPLETE_NAME = "complete.json"
STATE_NAME = "trainer_state.pt"
FORMAT = 2  # 2: optimizer state keyed by parameter name (1: by position; still read)


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


# ---- save -------------------------------------------------------------------------------------

def save_trainer(
    save_url: str,
    role: str,
    iteration: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    shift: float,
    scheduler: str = "FlowMatchEulerDiscreteScheduler",
    ema: Optional[Sequence[torch.Tensor]] = None,
    extra: Optional[dict] = None,
    writer: bool = True,
) -> Optional[str]:
    """Write one trainer's checkpoint for ``iteration`` and return its directory URL. The whole
    weights, ``ema`` (tensors in parameter order) and optimizer state are gathered from the
    shards (a collective: every rank of the group calls it); only the ``writer`` rank writes.
    A directory already there for this iteration is replaced (its marker goes first, so no
    reader ever takes a half-replaced directory for a complete one)."""
    extra = dict(extra or {})
    try:  # fail now, not at resume time, on anything weights_only loading would refuse
        _torch_load(_torch_bytes(extra))
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"save_trainer({role!r}): extra must hold plain values and tensors ({one_line(exc)})") from None
    model_state = parallel.full_state_dict(model, keep=writer)
    ema_state = parallel.full_state_dict(model, ema, keep=writer) if ema is not None else None
    optimizer_state = parallel.full_optimizer_state(model, optimizer, keep=writer)
    if not writer:
        return None
    _check_finite(role, iteration, model_state, ema_state, optimizer_state)
    state = _torch_bytes({"format": FORMAT, "optimizer": optimizer_state, "extra": extra})

    d = trainer_dir(save_url, role, iteration)
    storage.remove(storage.join(d, COMPLETE_NAME))
    storage.remove(d)
    save_checkpoint(model, storage.join(d, "model"), shift, scheduler=scheduler, state=model_state)
    if ema_state is not None:
        save_checkpoint(model, storage.join(d, "ema"), shift, scheduler=scheduler, state=ema_state)
    storage.write_bytes(storage.join(d, STATE_NAME), state)

    files = _listing(d)
    files.pop(COMPLETE_NAME, None)
    hashes = {rel: storage.sha256(storage.join(d, rel)) for rel in sorted(files)}
    marker = {
        "format": FORMAT,
        "role": role,
        "iteration": int(iteration),
        "has_ema": ema_state is not None,
        "trainer_state_sha256": hashlib.sha256(state).hexdigest(),
        "files": dict(sorted(files.items())),
        "sha256": hashes,
    }
    storage.write_text(storage.join(d, COMPLETE_NAME), json.dumps(marker, indent=1))
    return d


def _check_finite(role, iteration, model_state: dict, ema_state: Optional[dict], optimizer_state: dict) -> None:
    """No checkpoint with a non-finite weight (or EMA weight, or optimizer moment) is written."""
    named = [(f"model.{k}", v) for k, v in model_state.items()]
    if ema_state is not None:
        named += [(f"ema.{k}", v) for k, v in ema_state.items()]
    for name, state in optimizer_state["state"].items():
        named += [(f"optimizer.{name}.{k}", v) for k, v in state.items()]
    bad = first_nonfinite(named)
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
) -> dict:
    """Load a trainer checkpoint INTO ``model`` (strict), ``optimizer`` (skipped when None) and
    ``ema`` (tensors in parameter order), each rank into its own shards, so any number of ranks
    loads any checkpoint; returns the saved ``extra``. Raises CheckpointLoadError naming the path
    when the directory is missing, incomplete, corrupt or does not fit."""
    d = trainer_dir(load_url, role, iteration)
    marker = _read_marker(d)
    _check_files(d, marker, hashes=True, unhashed=(STATE_NAME,))  # the state is hashed as read below

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
        if not isinstance(state, dict) or "optimizer" not in state:
            raise ValueError("no optimizer entry")
    except Exception as exc:  # noqa: BLE001
        raise CheckpointLoadError(f"{state_url}: corrupt trainer state ({one_line(exc)})") from None

    _apply_weights(storage.join(d, "model"), model)
    if ema is not None:
        if not marker.get("has_ema"):
            raise CheckpointLoadError(f"{d}: checkpoint has no ema/ weights but the trainer keeps an EMA")
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
    after checking that every role has a complete checkpoint there."""
    iteration = read_tracker(load_url)
    if iteration is None:
        return None
    for role in roles:
        d = trainer_dir(load_url, role, iteration)
        _check_files(d, _read_marker(d), hashes=True)
    return iteration
