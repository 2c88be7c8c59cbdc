"""One section of a trainer checkpoint ('model' or 'ema') read tensor by tensor in this process,
for tools that write it elsewhere (``dmd2_core.export.from_checkpoint``): the names, global shapes and dtypes
come from DCP's ``.metadata`` alone, and indexing a name reads that tensor's bytes and nothing
else (a seek on a local file, a ranged read on S3), so a model is never held whole."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Iterator

import torch
import torch.distributed.checkpoint as dcp

from dmd2_core import storage
from dmd2_core.checkpoint.metadata import SafeReader
from dmd2_core.errors import CheckpointError, StorageUnavailableError, one_line
from dmd2_core.save_layout import DCP_DIR, trainer_dir


class _KnownMetadataReader(SafeReader):
    """DCP's reader with the ``.metadata`` read once: every per-tensor load reuses it."""

    def __init__(self, url: str):
        super().__init__(url)
        self._metadata = None

    def read_metadata(self, *args, **kwargs):
        if self._metadata is None:
            self._metadata = storage.retrying(lambda: super(_KnownMetadataReader, self).read_metadata(*args, **kwargs),
                                              f"read {self.url}/.metadata")
        return self._metadata


def dcp_sections(load_url: str, role: str, iteration: int) -> dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """Section -> name -> (shape, dtype) of every tensor a checkpoint holds, from its metadata."""
    return _sections(_KnownMetadataReader(storage.join(trainer_dir(load_url, role, iteration), DCP_DIR)))


def _sections(reader: _KnownMetadataReader) -> dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    try:
        saved = reader.read_metadata().state_dict_metadata
    except (StorageUnavailableError, CheckpointError):
        raise
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"{reader.url}/.metadata: unreadable ({one_line(exc)})") from None
    out: dict[str, dict] = {}
    for key, meta in saved.items():  # tensor entries alone: the metadata reader refuses any other
        section, _, name = key.partition(".")
        out.setdefault(section, {})[name] = (tuple(meta.size), meta.properties.dtype)
    return out


class CheckpointTensors(Mapping):
    """The ``section`` of a checkpoint as a read-on-index mapping (``specs``: name -> (shape,
    dtype) without reading any tensor; ``checkpoint.read_weights`` reads a section whole)."""

    def __init__(self, load_url: str, role: str, iteration: int, section: str):
        self.url = storage.join(trainer_dir(load_url, role, iteration), DCP_DIR)
        self.section = section
        self._reader = _KnownMetadataReader(self.url)
        self.specs = _sections(self._reader).get(section, {})

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.specs:
            raise KeyError(name)
        shape, dtype = self.specs[name]
        target = {f"{self.section}.{name}": torch.empty(shape, dtype=dtype)}
        try:
            storage.retrying(lambda: dcp.load(target, storage_reader=self._reader, no_dist=True),
                             f"read {self.url}")
        except (StorageUnavailableError, CheckpointError):
            raise
        except Exception as exc:  # noqa: BLE001 - a shard missing or cut short
            raise CheckpointError(f"{self.url}: cannot read '{self.section}.{name}' ({one_line(exc)})") from None
        return target[f"{self.section}.{name}"]

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)
