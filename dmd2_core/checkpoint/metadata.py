"""DCP's ``.metadata``, read as data only. torch pickles it, and a plain unpickler runs whatever
the file names; its sha256 in ``complete.json`` detects damage, not tampering (whoever can write
the checkpoint can rewrite both). So the unpickler admits only the records a tensor checkpoint of
this project needs, and the result is then checked field by field: every entry a tensor (DCP's
bytes entries are read back with ``torch.load(weights_only=False)``, and this project never writes
one), every size a shape of non-negative ints, every stored file a plain relative name inside the
checkpoint, no load-time transforms. Anything else is refused in one line naming the file, before
any state is read or changed."""

from __future__ import annotations

import importlib
import pickle
from pathlib import PurePosixPath, PureWindowsPath

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType

from dmd2_core.errors import CheckpointError

# everything a tensor checkpoint's metadata pickle names, (module, name); the torch dtypes are
# admitted by kind below. BytesStorageMetadata is deliberately absent.
_ADMITTED = {
    *((dcp_metadata.__name__, name) for name in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
        "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _DcpUnpickler(pickle.Unpickler):
    def __init__(self, stream, url: str):
        super().__init__(stream)
        self.url = url

    def find_class(self, module: str, name: str):
        if (module, name) in _ADMITTED:
            return getattr(importlib.import_module(module), name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"{self.url}: refused: it names {module}.{name}, which a tensor checkpoint never "
                              "holds (a tampered or foreign checkpoint; nothing in it was run)")

    def persistent_load(self, pid):
        raise CheckpointError(f"{self.url}: refused: a persistent id, which DCP never writes")


def load_metadata(stream, url: str):
    """The DCP ``Metadata`` pickled in ``stream``, checked to describe tensors alone (``url``
    names the file in errors)."""
    try:
        metadata = _DcpUnpickler(stream, url).load()
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a truncated or garbled pickle
        raise CheckpointError(f"{url}: corrupt DCP metadata ({type(exc).__name__}: {exc})"[:300]) from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{url}: refused: holds a {type(metadata).__name__}, not DCP metadata")
    problem = _first_problem(metadata)
    if problem:
        raise CheckpointError(f"{url}: refused: {problem} (a tampered or foreign checkpoint; nothing in it was read)")
    return metadata


def _first_problem(metadata) -> str | None:
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        return "its entries are not a mapping"
    for key, entry in entries.items():
        if not isinstance(key, str):
            return f"an entry named by a {type(key).__name__}"
        if type(entry) is not dcp_metadata.TensorStorageMetadata:
            return f"'{key}' is a {type(entry).__name__} entry, not a tensor"
        properties = entry.properties
        if type(properties) is not dcp_metadata.TensorProperties or not isinstance(properties.dtype, torch.dtype):
            return f"'{key}' has no tensor dtype"
        if not _is_shape(entry.size) or not isinstance(entry.chunks, list) or not all(
                type(c) is dcp_metadata.ChunkStorageMetadata and _is_shape(c.offsets) and _is_shape(c.sizes)
                and len(c.offsets) == len(c.sizes) == len(entry.size) for c in entry.chunks):
            return f"'{key}' has a size or chunk that is not a shape"
    storage_data = metadata.storage_data
    if not isinstance(storage_data, dict):
        return "its storage index is not a mapping"
    for index, info in storage_data.items():
        if type(index) is not dcp_metadata.MetadataIndex or type(info) is not _StorageInfo:
            return f"a storage index entry of type {type(info).__name__}"
        if not _is_inside(info.relative_path):
            return f"'{index.fqn}' is stored at {info.relative_path!r}, outside the checkpoint"
        if not (_is_count(info.offset) and _is_count(info.length)):
            return f"'{index.fqn}' has a stored offset or length that is not a byte count"
        if info.transform_descriptors:
            return f"'{index.fqn}' asks for load-time transforms {list(info.transform_descriptors)[:2]}, which this project never writes"
    return None


def _is_count(value) -> bool:
    return type(value) is int and value >= 0


def _is_shape(value) -> bool:
    return isinstance(value, torch.Size) and all(_is_count(n) for n in value)


def _is_inside(relative_path) -> bool:
    """A plain relative file name in the checkpoint's directory: not absolute, no ``..``, no drive."""
    if not isinstance(relative_path, str) or not relative_path or "\\" in relative_path or "\x00" in relative_path:
        return False
    path = PurePosixPath(relative_path)
    return not path.is_absolute() and ".." not in path.parts and not PureWindowsPath(relative_path).drive


class SafeReader(FsspecReader):
    """DCP's fsspec reader of the checkpoint at ``url``: its ``.metadata`` read through
    ``load_metadata``, and a load plan that would read anything but tensors refused (DCP's
    default planner unpickles bytes entries with code paths open)."""

    def __init__(self, url: str):
        super().__init__(url)
        self.url = url

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_metadata(stream, f"{self.url.rstrip('/')}/{str(path).rsplit('/', 1)[-1]}")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:
                raise CheckpointError(f"{self.url}: refused: '{item.dest_index.fqn}' would be read as pickled "
                                      "bytes, which this project never writes (nothing in it was read)")
        return super().read_data(plan, planner)
