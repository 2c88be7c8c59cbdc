"""A full student's transformer written as it is gathered: tensor by tensor into safetensors files
whose headers are laid out before the first tensor arrives (every rank knows the names, global
shapes and dtypes), so the writer rank never holds more than one whole tensor; then checked by
reading each tensor back from storage (a ranged read) against the checksum taken as it was
written, and its names and shapes against the family's model built on the meta device. Neither
step holds the model whole on the host.

The files are what ``write_transformer`` (``save_pretrained``) writes: config.json,
``diffusion_pytorch_model.safetensors`` or, above ``max_shard_bytes``, numbered shards and their
index.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Optional

import torch

from dmd2_core import parallel, storage
from dmd2_core.errors import ModelDirError, WeightFilesError

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = f"{WEIGHTS_NAME}.index.json"
MAX_SHARD_BYTES = 10 * 1000 ** 3  # save_pretrained's default "10GB"
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


@dataclass
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: str = ""
    start: int = 0  # in the file's data

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class StreamedTransformer:
    """What the writer keeps of a streamed transformer: its entries in order and each one's crc32."""
    entries: list[Entry]
    checksums: dict[str, int] = field(default_factory=dict)


def non_persistent(model: torch.nn.Module) -> set[str]:
    """The model's non-persistent buffers (e.g. Wan's rope tables): not in a diffusers state dict."""
    return {f"{prefix}.{name}" if prefix else name
            for prefix, module in model.named_modules() for name in module._non_persistent_buffers_set}


def _layout(entries: list[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    files: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        if files[-1] and size + entry.nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += entry.nbytes
    names = [WEIGHTS_NAME] if len(files) == 1 else [
        f"diffusion_pytorch_model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    for name, members in zip(names, files):
        offset = 0
        for entry in members:
            entry.file, entry.start = name, offset
            offset += entry.nbytes
    return files


def _header(members: list[Entry]) -> bytes:
    header = {e.name: {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                       "data_offsets": [e.start, e.start + e.nbytes]} for e in members}
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
    return len(text).to_bytes(8, "little") + text


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes as stored (row-major), without a copy when it is contiguous."""
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def model_tensors(model: torch.nn.Module, shards: Optional[Iterable[torch.Tensor]] = None) -> dict[str, torch.Tensor]:
    """The model's parameters (or, with ``shards``, a same-layout copy's: the EMA) and buffers, by name."""
    params = dict(model.named_parameters())
    values: dict[str, torch.Tensor] = dict(zip(params, shards)) if shards is not None else params
    values.update(model.named_buffers())
    return values


def tensor_specs(values: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of ``values``: a mapping that reads its tensors only when indexed
    (a checkpoint read tensor by tensor) says them through its ``specs`` without reading any."""
    specs = getattr(values, "specs", None)
    if specs is not None:
        return dict(specs)
    return {name: (tuple(v.shape), v.dtype) for name, v in values.items()}


def stream_tensors(values: Mapping[str, torch.Tensor], dtype: torch.dtype, directory: Optional[Path],
                   skip: frozenset[str] | set[str] = frozenset(), max_shard_bytes: int = MAX_SHARD_BYTES
                   ) -> Optional[StreamedTransformer]:
    """Write ``values`` (local or distributed tensors, or a mapping that reads each when indexed:
    ``tensor_specs``; floating ones cast to ``dtype``, names in
    ``skip`` left out) as a transformer's safetensors files in the local ``directory``, one whole
    tensor at a time. A collective where the tensors are distributed: every rank of the group
    calls it (in the training thread) and takes part in every gather; only the writer (the rank
    given a ``directory``) writes, keeping each tensor's crc32. Returns the writer's
    StreamedTransformer, None on the other ranks."""
    entries = [Entry(name, shape, dtype if stored.is_floating_point else stored)
               for name, (shape, stored) in tensor_specs(values).items() if name not in skip]
    by_name = {e.name: e for e in entries}
    out, handles = None, {}
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        out = StreamedTransformer(entries)
        for members in _layout(entries, max_shard_bytes):
            handles[members[0].file] = handle = open(directory / members[0].file, "wb")
            handle.write(_header(members))
    try:
        for name in values:
            whole = parallel.full(values[name]).detach()  # every rank takes part in every gather
            if out is None or name not in by_name:
                continue
            # a copy even where the dtype and device agree: numpy's view of a tensor makes its storage
            # unresizable, and a sleeping trainer frees its parameters' storages by resizing them
            data = tensor_bytes(whole.to("cpu", dtype=by_name[name].dtype, copy=True))
            handles[by_name[name].file].write(data)
            out.checksums[name] = zlib.crc32(data)
            del whole, data
    finally:
        for handle in handles.values():
            handle.close()
    if out is not None and len(handles) > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
                 "weight_map": {e.name: e.file for e in entries}}
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2))
    return out


def write_config(family, config, directory: Path) -> None:
    """The transformer's config.json, as ``write_transformer`` writes it."""
    import diffusers

    values = {k: v for k, v in dict(config).items() if not k.startswith("_")}
    values.update({"_class_name": family.class_name, "_diffusers_version": diffusers.__version__})
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(values, indent=2, sort_keys=True, default=list) + "\n")


def verify_streamed(url: str, family, streamed: StreamedTransformer) -> None:
    """The transformer directory at ``url`` holds every streamed tensor with its dtype, shape and
    bytes (read back one at a time, compared by crc32), and the family's model class, built from
    its config on the meta device, has exactly those names and shapes (what ``from_pretrained``
    needs). ModelDirError naming ``url`` if not."""
    from dmd2_core.models.weight_files import WeightFiles

    def fail(why: str):
        raise ModelDirError(f"{url}: the exported transformer does not reload as written ({why})")

    try:
        files = WeightFiles(url)
    except WeightFilesError as exc:
        fail(str(exc))
    model = _meta_model(url, family, fail)
    expected = {e.name: e for e in streamed.entries}
    wanted = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for name, shape in wanted.items():
        if name not in expected:
            fail(f"the model has '{name}', the export does not")
        if expected[name].shape != shape:
            fail(f"'{name}' has shape {shape}, written {expected[name].shape}")
    for name, entry in expected.items():
        if name not in files:
            fail(f"'{name}' is missing from the safetensors")
        stored = files.tensor(name)
        if stored.dtype != entry.dtype or stored.shape != entry.shape:
            fail(f"'{name}' is stored as {stored.dtype} {stored.shape}, written {entry.dtype} {entry.shape}")
        if name not in wanted:
            fail(f"the model has no '{name}'")
        rows = entry.shape[0] if entry.shape else 1  # a 0-d tensor is read whole
        read = next(iter(files.read_rows([(name, 0, rows)], batch_bytes=0)))[3]
        if zlib.crc32(tensor_bytes(read)) != streamed.checksums[name]:
            fail(f"'{name}' differs from the gathered weights")


def _meta_model(url: str, family, fail):
    try:
        config = json.loads(storage.read_text(storage.join(url, "config.json")))
        with torch.device("meta"):
            return family.model_class.from_config(config)
    except Exception as exc:  # noqa: BLE001 - one line naming the path
        fail(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
