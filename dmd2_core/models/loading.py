"""A model's start without any process holding it whole: built on the meta device from its config
(``build_empty``), sharded there (``parallel.shard_model`` then gives each parameter storage for
this rank's shard alone), then filled (``fill``) by reading from the safetensors files only the rows
of each tensor this rank keeps. The values are ``from_pretrained``'s followed by the shard cast,
bit for bit:

- a tensor is read in its stored dtype, cast as ``from_pretrained(torch_dtype=...)`` casts it
  (fp32 for the class's ``_keep_in_fp32_modules``), then to the dtype sharding gave it;
- non-persistent buffers (rotary tables) are not in the files: they are computed on the host when
  the model is built, under the same default dtype as ``from_pretrained`` builds it;
- several models of one checkpoint (the critic's fake score and frozen teacher) are filled from
  one read of each slice.
"""

from __future__ import annotations

import json
from typing import Callable

import torch

from dmd2_core import parallel, storage
from dmd2_core.models import FAMILIES, LoadedModel, describe_model_dir
from dmd2_core.errors import ModelDirError, WeightFilesError
from dmd2_core.models.weight_files import WeightFiles

BATCH_BYTES = 16 << 20  # bytes read per batch of ranges (or the largest tensor's rows, when more)
LoadDtype = Callable[[str, torch.dtype], torch.dtype]  # (tensor name, stored dtype) -> loaded dtype


def load_dtype(model_class, dtype: torch.dtype) -> LoadDtype:
    """The dtype ``from_pretrained(torch_dtype=dtype)`` gives a floating tensor of the files."""
    keep = tuple(getattr(model_class, "_keep_in_fp32_modules", None) or ())

    def rule(name: str, stored: torch.dtype) -> torch.dtype:
        if not stored.is_floating_point:
            return stored
        return torch.float32 if any(k in name.split(".") for k in keep) else dtype
    return rule


def build_empty(url: str, dtype: torch.dtype = torch.float32, transformer: str = "transformer") -> LoadedModel:
    """The model of checkpoint ``url`` as ``from_pretrained(torch_dtype=dtype)`` builds it before
    reading weights: parameters on the meta device in their loaded dtypes, buffers on the host
    (persistent ones are overwritten by ``fill`` or a resume). Reads the JSON files alone."""
    from accelerate import init_empty_weights
    from diffusers.models.modeling_utils import no_init_weights

    info = describe_model_dir(url, transformer=transformer)
    family = FAMILIES[info["family"]]
    config_url = storage.join(info["transformer_url"], "config.json")
    config = json.loads(storage.read_text(config_url))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # from_pretrained builds under its torch_dtype: buffers computed in it
    try:
        with no_init_weights(), init_empty_weights():
            model = family.model_class.from_config(config)
    except Exception as exc:  # noqa: BLE001 - a config the class rejects is bad input
        raise ModelDirError(f"{config_url}: cannot build {family.class_name} ({type(exc).__name__}: {exc})") from None
    finally:
        torch.set_default_dtype(previous)
    rule = load_dtype(family.model_class, dtype)
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, param in module._parameters.items():
            if param is not None:
                meta = torch.empty(param.shape, dtype=rule(prefix + name, param.dtype), device="meta")
                module._parameters[name] = torch.nn.Parameter(meta, requires_grad=param.requires_grad)
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                module._buffers[name] = buf.to(rule(prefix + name, buf.dtype))
    model.register_to_config(_name_or_path=info["transformer_url"])
    model.eval()
    return LoadedModel(model, family, info["shift"], None, info["modality_shifts"])


def stored_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint holds for ``model``: its parameters and persistent buffers, by
    name (FSDP keeps the diffusers names), as the model holds them (shards or whole)."""
    from dmd2_core.models import lora

    from dmd2_core.models import step_conditioning

    # a LoRA's base under its diffusers names, no adapters; no fake score's step vectors (never in a checkpoint)
    out = lora.base_names((n, p) for n, p in model.named_parameters() if not step_conditioning.is_step_embedding(n))
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        out.update({prefix + n: b for n, b in module._buffers.items()
                    if b is not None and n not in module._non_persistent_buffers_set})
    return out


@torch.no_grad()
def fill(targets: list[tuple[torch.nn.Module, LoadDtype]], files: WeightFiles) -> int:
    """Fill each model's parameters and persistent buffers (this rank's shards, or whole for a
    plain module) from ``files``, reading each tensor's rows once for all the models; returns the
    bytes read. ``targets``: (model, the load-dtype rule it was built with)."""
    wanted: dict[str, list[tuple[torch.Tensor, LoadDtype, int, int]]] = {}
    for model, rule in targets:
        for name, value in stored_tensors(model).items():
            stored = files.tensor(name)
            if tuple(stored.shape) != tuple(value.shape):
                raise WeightFilesError(f"{stored.file_url}: '{name}' has shape {stored.shape}, the model "
                                       f"{tuple(value.shape)}")
            wanted.setdefault(name, []).append((parallel.local(value), rule, *parallel.shard_rows(name, value)))
    spans = [(name, min(p[2] for p in places), max(p[3] for p in places)) for name, places in wanted.items()]
    spans = [s for s in spans if s[2] > s[1]]
    largest = max((files.tensor(n).row_bytes() * (hi - lo) for n, lo, hi in spans if files.shape(n)), default=0)
    read = 0
    for name, lo, _, rows in files.read_rows(spans, batch_bytes=max(BATCH_BYTES, largest)):
        read += rows.nbytes
        for local, rule, start, stop in wanted[name]:
            piece = rows[start - lo:stop - lo] if rows.dim() else rows
            local.copy_(piece.to(rule(name, piece.dtype)).to(local.dtype).reshape(local.shape))
    return read


def weight_files(url: str, transformer: str = "transformer") -> WeightFiles:
    """The transformer weights of checkpoint ``url`` (its ``transformer`` folder, where it is a
    repository: headers read; no weight bytes)."""
    return WeightFiles(describe_model_dir(url, transformer=transformer)["transformer_url"])
