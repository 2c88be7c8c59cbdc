"""Model families: diffusers transformers that predict the flow-matching velocity.

A checkpoint is a diffusers directory, either a pipeline-style one (``model_index.json`` with a
``transformer/`` subfolder, a ``scheduler/`` one and optionally ``vae/``) or a bare transformer
directory (``config.json``). The family is chosen from the transformer config's ``_class_name``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Optional

import torch

from dmd2_core import storage
from dmd2_core.models.base import ModelFamily
from dmd2_core.models.minimax_h3 import MiniMaxH3Family
from dmd2_core.models.sd3 import SD3ImageFamily
from dmd2_core.models.wan import WanVideoFamily
from dmd2_core.errors import ModelDirError, SafetensorsHeaderError, StorageUnavailableError

FAMILIES: dict[str, ModelFamily] = {f.class_name: f for f in (SD3ImageFamily(), WanVideoFamily(), MiniMaxH3Family())}
PIPELINE_INDEXES = ("model_index.json", "modular_model_index.json")  # diffusers pipelines; modular ones
DEFAULT_SHIFT = 3.0


@dataclass
class LoadedModel:
    model: torch.nn.Module
    family: ModelFamily
    shift: float
    vae: Optional[torch.nn.Module] = None
    modality_shifts: Optional[tuple[float, ...]] = None


def family_of(model: torch.nn.Module) -> ModelFamily:
    # through the MRO: FSDP2 swaps a sharded model's class for a subclass named FSDP<class>
    for cls in type(model).__mro__:
        if cls.__name__ in FAMILIES:
            return FAMILIES[cls.__name__]
    raise KeyError(f"{type(model).__name__} is not a supported model family")


def _read_json(url: str) -> dict[str, Any]:
    return json.loads(storage.read_text(url))


@contextlib.contextmanager
def named_by(key: Optional[str]):
    """A model directory's refusal inside starts with ``key``, the argument that named the
    directory (``hf_checkpoint: /models/t: no such checkpoint``): the user sees what to change."""
    try:
        yield
    except ModelDirError as exc:
        if key is None or str(exc).startswith(key):
            raise
        raise type(exc)(f"{key}: {exc}") from None


def describe_model_dir(url: str, key: Optional[str] = None, transformer: str = "transformer") -> dict[str, Any]:
    """What a checkpoint holds, read from its JSON files alone (cheap, before any actor starts):
    {'family', 'transformer_url', 'shift', 'vae_url'}. ``transformer``: a repository's folder the
    run distills (MiniMax-H3's ref2va: ``transformer_ref``; ``transformer_folder``). Raises
    ModelDirError naming the path (and ``key``, the argument that named it, when given)."""
    with named_by(key):
        return _describe_model_dir(url, transformer)


def transformer_folder(workflow: str) -> str:
    """The repository folder a run of ``workflow`` distills (``transformer`` but for MiniMax-H3's ref2va)."""
    from dmd2_core.models.minimax_h3 import WORKFLOW_TRANSFORMER

    return WORKFLOW_TRANSFORMER.get(workflow, "transformer")


def _describe_model_dir(url: str, transformer: str = "transformer") -> dict[str, Any]:
    if not url:
        raise ModelDirError("hf_checkpoint is not set: point it at a diffusers model directory")
    try:
        root_has_index = any(storage.exists(storage.join(url, name)) for name in PIPELINE_INDEXES)
        if root_has_index:
            transformer_url = storage.join(url, transformer)
            if transformer != "transformer" and not storage.exists(storage.join(transformer_url, "config.json")):
                raise ModelDirError(f"{transformer_url}: missing: the repository has no {transformer}/ partition, "
                                    "which this workflow distills")
        elif storage.exists(storage.join(url, "config.json")):
            transformer_url = url
        elif not storage.exists(url):
            raise ModelDirError(f"{url}: no such checkpoint{storage.nearest_sibling(url)}")
        else:
            raise ModelDirError(
                f"{url}: not a diffusers model directory (no model_index.json, modular_model_index.json or config.json)"
            )
        config = _read_json(storage.join(transformer_url, "config.json"))
        if not isinstance(config, dict):
            raise ValueError(f"{storage.join(transformer_url, 'config.json')} is not a JSON object")
    except (ModelDirError, StorageUnavailableError):
        raise
    except Exception as exc:  # noqa: BLE001 - any storage failure becomes one clear line
        raise ModelDirError(f"{url}: cannot read checkpoint ({type(exc).__name__}: {exc})") from None
    class_name = config.get("_class_name", "")
    if class_name not in FAMILIES:
        raise ModelDirError(
            f"{transformer_url}: unsupported transformer class '{class_name}' (supported: {', '.join(FAMILIES)})"
        )
    family = FAMILIES[class_name]
    shift = DEFAULT_SHIFT
    vae_url = None
    modality_shifts = None
    if root_has_index:
        shift = _scheduler_shift(url, "scheduler", DEFAULT_SHIFT)
        if family.has_audio:  # a schedule per modality: video's scheduler/, audio's audio_scheduler/
            modality_shifts = (shift, _scheduler_shift(url, "audio_scheduler", 3.0))
        export_url = storage.join(url, "export.json")
        try:  # a student export (dmd2_core.export.pipeline): its scheduler's shift is solved for
            # set_timesteps(K), not the training shift, which export.json records
            if storage.exists(export_url):
                shift = float(_read_json(export_url)["shift"])
        except StorageUnavailableError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise ModelDirError(f"{export_url}: unreadable export marker ({type(exc).__name__}: {exc})") from None
        if storage.exists(storage.join(url, "vae", "config.json")):
            vae_url = storage.join(url, "vae")
        if family.has_audio and vae_url and not storage.exists(storage.join(url, "audio_vae", "config.json")):
            raise ModelDirError(f"{storage.join(url, 'audio_vae')}: missing: {class_name} generates sound, its "
                                  f"checkpoint needs the audio VAE beside vae/")
    if family.fixed_shift is not None:  # the family maps the project's sigma itself (per modality)
        shift = family.fixed_shift
    return {"family": class_name, "transformer_url": transformer_url, "shift": shift, "vae_url": vae_url,
            "modality_shifts": modality_shifts}


def check_weight_files(url: str, key: Optional[str] = None, transformer: str = "transformer") -> None:
    """Every weights file training reads from checkpoint ``url`` (its transformer, its VAE and, for
    a model with sound, its audio VAE) is whole: each safetensors file (each shard of a sharded
    one) has a readable header whose tensors end within the file. Reads the headers alone, never
    the weights. Raises CheckpointError naming the file (a download cut off is the usual cause).
    Only safetensors count: a folder of ``.bin`` files alone is refused, as every loader of dmd2
    reads safetensors only (``use_safetensors=True``). ``key``: the argument that named ``url``."""
    with named_by(key):
        _check_weight_files(url, transformer)


def _check_weight_files(url: str, transformer: str) -> None:
    info = describe_model_dir(url, transformer=transformer)
    folders = [info["transformer_url"]]
    if info["vae_url"]:
        folders.append(info["vae_url"])
        if FAMILIES[info["family"]].has_audio:
            folders.append(storage.join(url, "audio_vae"))
    for folder in folders:
        names = storage.list_names(folder)
        files = {n for n in names if n.endswith(".safetensors")}
        for index in (n for n in names if n.endswith(".safetensors.index.json")):
            try:
                weight_map = json.loads(storage.read_text(storage.join(folder, index)))["weight_map"]
            except StorageUnavailableError:
                raise
            except Exception as exc:  # noqa: BLE001
                raise ModelDirError(f"{storage.join(folder, index)}: unreadable shard index ({type(exc).__name__}: {exc})") from None
            missing = sorted(set(weight_map.values()) - files)
            if missing:
                raise ModelDirError(f"{storage.join(folder, missing[0])}: missing (listed in {index}); download the "
                                      "checkpoint again")
        if not files and any(n.endswith(".bin") for n in names):  # pickles: loading one runs its code
            raise ModelDirError(f"{folder}: only .bin weight files, which dmd2 never loads (pickles); it needs "
                                "*.safetensors (convert them, or download the checkpoint's safetensors)")
        if not files:
            raise ModelDirError(f"{folder}: no weights (no *.safetensors); a config-only directory can be planned, not trained")
        for name in sorted(files):
            file_url = storage.join(folder, name)
            try:
                storage.read_safetensors_header(file_url)
            except SafetensorsHeaderError as exc:
                raise ModelDirError(f"{file_url}: not a whole safetensors file ({exc}); download it again") from None


def _scheduler_shift(url: str, folder: str, default: float) -> float:
    sched_url = storage.join(url, folder, "scheduler_config.json")
    try:  # parsed inside the error handling: a broken file is one line naming it
        if not storage.exists(sched_url):
            return default
        shift = float(_read_json(sched_url).get("shift", default))
        if not shift > 0:
            raise ValueError(f"shift must be positive, got {shift}")
        return shift
    except StorageUnavailableError:
        raise
    except Exception as exc:  # noqa: BLE001
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ModelDirError(f"{sched_url}: unreadable scheduler config ({type(exc).__name__}: {first})") from None


def load_model_dir(url: str, device: str = "cpu", dtype: torch.dtype = torch.float32, with_vae: bool = False,
                   transformer: str = "transformer") -> LoadedModel:
    info = describe_model_dir(url, transformer=transformer)
    family = FAMILIES[info["family"]]
    with storage.local_copy(info["transformer_url"]) as local:
        model = family.model_class.from_pretrained(str(local), torch_dtype=dtype, use_safetensors=True)
    vae = None
    if with_vae and info["vae_url"]:
        vae = family.load_vae(info["vae_url"], dtype)
        vae.to(device)
    return LoadedModel(model.to(device), family, info["shift"], vae, info["modality_shifts"])


def save_model_dir(
    model: torch.nn.Module,
    url: str,
    shift: float,
    scheduler: str = "FlowMatchEulerDiscreteScheduler",
    vae: "torch.nn.Module | str | None" = None,
    state: Optional[dict[str, torch.Tensor]] = None,
    folder: str = "transformer",
) -> None:
    """Save in diffusers format (safetensors) as a pipeline-style directory at any fsspec URL:
    transformer/ (``folder``: MiniMax-H3's ref2va partition is transformer_ref/), scheduler/ and
    model_index.json, plus a VAE (a module, or a URL copied along). With ``state`` (a whole state
    dict, e.g. gathered from shards) those weights are written under ``model``'s config instead of
    the model's own."""
    import shutil

    import diffusers

    family = family_of(model)
    with storage.staged_dir(url) as tmp:
        if state is None:
            model.save_pretrained(str(tmp / folder), safe_serialization=True)
        else:
            write_transformer(family, model.config, state, tmp / folder)
        getattr(diffusers, scheduler)(shift=shift).save_pretrained(str(tmp / "scheduler"))
        index = {
            "_class_name": family.pipeline_class,
            "_diffusers_version": diffusers.__version__,
            folder: ["diffusers", family.class_name],
            "scheduler": ["diffusers", scheduler],
        }
        if isinstance(vae, str):
            with storage.local_copy(vae) as vae_local:
                shutil.copytree(vae_local, tmp / "vae")
        elif vae is not None:
            vae.save_pretrained(str(tmp / "vae"), safe_serialization=True)
        if vae is not None:
            index["vae"] = ["diffusers", json.loads((tmp / "vae" / "config.json").read_text())["_class_name"]]
        (tmp / "model_index.json").write_text(json.dumps(index, indent=2))


def write_transformer(family: ModelFamily, config, state: dict[str, torch.Tensor], directory,
                      max_shard_size: str = "10GB") -> None:
    """A diffusers transformer directory (config.json and safetensors, sharded with an index
    like ``save_pretrained`` above ``max_shard_size``) from a whole state dict."""
    from pathlib import Path

    import diffusers
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    values = {k: v for k, v in dict(config).items() if not k.startswith("_")}
    values.update({"_class_name": family.class_name, "_diffusers_version": diffusers.__version__})
    (directory / "config.json").write_text(json.dumps(values, indent=2, sort_keys=True, default=list) + "\n")
    state = {k: v.contiguous() for k, v in state.items()}
    split = split_torch_state_dict_into_shards(
        state, filename_pattern="diffusion_pytorch_model{suffix}.safetensors", max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: state[n] for n in names}, str(directory / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (directory / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index, indent=2))


IDENTITY_SAMPLE_BYTES = 1 << 20


def base_identity(url: str, transformer: str = "transformer") -> str:
    """An identity of a model directory's transformer weights, cheap enough for every resume: the
    sha256 of its config and, per safetensors file, its name, size, header and the first and last
    MiB of its tensor bytes (a fine-tune of the same architecture differs there, a copy does not)."""
    transformer = describe_model_dir(url, transformer=transformer)["transformer_url"]
    digest = hashlib.sha256(storage.read_bytes(storage.join(transformer, "config.json")))
    for name in sorted(n for n in storage.list_names(transformer) if n.endswith(".safetensors")):
        file_url = storage.join(transformer, name)
        entries, data_size, data_start = storage.safetensors_layout(file_url)
        head = min(IDENTITY_SAMPLE_BYTES, data_size)
        ranges = [(file_url, data_start, data_start + head),
                  (file_url, data_start + data_size - head, data_start + data_size)]
        digest.update(json.dumps([name, data_size, entries], sort_keys=True).encode())
        for part in storage.read_ranges(ranges):
            digest.update(part)
    return digest.hexdigest()[:16]
