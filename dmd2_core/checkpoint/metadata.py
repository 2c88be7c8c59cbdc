"""DCP's ``.metadata``, read without trusting it: torch pickles it, and a plain unpickler runs
whatever the file names. Its sha256 in ``complete.json`` detects damage, not tampering (whoever
can write the checkpoint can rewrite both), so the unpickler admits only the classes DCP writes
and refuses anything else in one line naming the file."""

from __future__ import annotations

import enum
import importlib
import pickle

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

from dmd2_core.errors import CheckpointError

# what DCP's metadata pickle may name beyond the classes of torch.distributed.checkpoint.metadata
# and the torch dtypes (checked by kind below): (module, name), looked up when a pickle names it
_ALSO_ADMITTED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict"),
}


class _DcpUnpickler(pickle.Unpickler):
    def __init__(self, stream, url: str):
        super().__init__(stream)
        self.url = url

    def find_class(self, module: str, name: str):
        if (module, name) in _ALSO_ADMITTED:
            return getattr(importlib.import_module(module), name)
        if module == dcp_metadata.__name__ and not name.startswith("__"):
            value = getattr(dcp_metadata, name, None)
            if isinstance(value, type) and value.__module__ == dcp_metadata.__name__ and (
                    _is_plain_record(value) or issubclass(value, enum.Enum)):
                return value
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"{self.url}: refused: it names {module}.{name}, which DCP never writes "
                              "(a tampered or foreign checkpoint; nothing in it was run)")

    def persistent_load(self, pid):
        raise CheckpointError(f"{self.url}: refused: a persistent id, which DCP never writes")


def _is_plain_record(cls: type) -> bool:
    """A dataclass (DCP's metadata records are), so unpickling it sets fields and calls nothing."""
    return hasattr(cls, "__dataclass_fields__")


def load_metadata(stream, url: str):
    """The DCP ``Metadata`` pickled in ``stream`` (``url`` names the file in errors)."""
    try:
        metadata = _DcpUnpickler(stream, url).load()
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a truncated or garbled pickle
        raise CheckpointError(f"{url}: corrupt DCP metadata ({type(exc).__name__}: {exc})"[:300]) from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{url}: refused: holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeReader(FsspecReader):
    """DCP's fsspec reader of the checkpoint at ``url``, its ``.metadata`` read through
    ``load_metadata``."""

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
