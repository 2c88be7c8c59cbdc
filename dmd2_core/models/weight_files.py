"""The tensors of a diffusers transformer directory, found from the safetensors headers alone and
read row range by row range: a rank reads only the bytes of its own shards (a seek on a local
file, a ranged read on S3), never a whole file."""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from dmd2_core import storage
from dmd2_core.errors import SafetensorsHeaderError, StorageUnavailableError, WeightFilesError

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = f"{WEIGHTS_NAME}.index.json"
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def file_tensors(url: str) -> tuple[dict[str, "StoredTensor"], dict[str, str]]:
    """Where each tensor of the safetensors file at ``url`` lies, and its metadata, from the header
    alone (one small read). Each tensor carries the version of the file that header was read from,
    and reads its rows at that version only. Raises WeightFilesError naming the file when it is
    not a whole one."""
    try:
        entries, _, data_start, version = storage.pinned_safetensors_layout(url)
    except (SafetensorsHeaderError, FileNotFoundError) as exc:
        raise WeightFilesError(f"{url}: not a whole safetensors file ({exc})") from None
    tensors = {}
    for key, info in entries.items():
        if key == "__metadata__":
            continue
        if info.get("dtype") not in DTYPES:
            raise WeightFilesError(f"{url}: tensor '{key}' has unsupported dtype {info.get('dtype')}")
        tensors[key] = StoredTensor(url, DTYPES[info["dtype"]], tuple(info["shape"]),
                                    data_start + info["data_offsets"][0], version)
    return tensors, entries.get("__metadata__") or {}


@dataclass(frozen=True)
class StoredTensor:
    file_url: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset of its first element in the file
    version: Optional[storage.FileVersion] = None  # the file's, when its header gave ``start``

    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize


class WeightFiles:
    """Every tensor of the folder's ``diffusion_pytorch_model.safetensors`` (or the shards its
    index lists), by name, as ``from_pretrained`` finds them."""

    def __init__(self, folder: str):
        self.folder = folder
        names = storage.list_names(folder)
        if INDEX_NAME in names:
            index_url = storage.join(folder, INDEX_NAME)
            try:
                files = sorted(set(json.loads(storage.read_text(index_url))["weight_map"].values()))
            except StorageUnavailableError:
                raise
            except Exception as exc:  # noqa: BLE001
                raise WeightFilesError(f"{index_url}: unreadable shard index ({type(exc).__name__}: {exc})") from None
        elif WEIGHTS_NAME in names:
            files = [WEIGHTS_NAME]
        else:
            raise WeightFilesError(f"{folder}: no {WEIGHTS_NAME} nor {INDEX_NAME}")
        self.tensors: dict[str, StoredTensor] = {}
        for name in files:
            self.tensors.update(file_tensors(storage.join(folder, name))[0])

    @classmethod
    def of_file(cls, url: str, tensors: dict[str, StoredTensor]) -> "WeightFiles":
        """The ``tensors`` of one safetensors file (``file_tensors``: a prompt or real set), read
        row range by row range."""
        files = cls.__new__(cls)
        files.folder, files.tensors = url, tensors
        return files

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensor(name).shape

    def tensor(self, name: str) -> StoredTensor:
        if name not in self.tensors:
            raise WeightFilesError(f"{self.folder}: no tensor '{name}' in the checkpoint")
        return self.tensors[name]

    def read_rows(self, requests: list[tuple[str, int, int]],
                  batch_bytes: int = 64 << 20) -> Iterator[tuple[str, int, int, torch.Tensor]]:
        """``(name, start, stop, rows)`` for each ``(name, start, stop)``: the rows ``start:stop``
        (first dimension; a 0-d tensor whole) in the stored dtype. Requests are read in batches
        of about ``batch_bytes`` (ranges adjacent in a file as one read; an object store's
        ranges concurrently), so memory holds one batch."""
        pieces = []
        for name, start, stop in requests:
            stored = self.tensor(name)
            row = stored.row_bytes() if stored.shape else stored.dtype.itemsize
            shape = (stop - start, *stored.shape[1:]) if stored.shape else ()
            pieces.append((name, start, stop, shape, stored, stored.start + start * row, (stop - start) * row))
        pieces.sort(key=lambda p: (p[4].file_url, p[5]))
        batch: list = []
        for piece in pieces:
            if batch and sum(p[6] for p in batch) + piece[6] > batch_bytes:
                yield from self._read_batch(batch)
                batch = []
            batch.append(piece)
        yield from self._read_batch(batch)

    @staticmethod
    def _read_batch(batch: list) -> Iterator[tuple[str, int, int, torch.Tensor]]:
        ranges: list[list] = []  # [url, start, end, [(piece, offset in the range)]]
        pins = {p[4].file_url: p[4].version for p in batch if p[4].version is not None}
        for piece in batch:
            url, begin, size = piece[4].file_url, piece[5], piece[6]
            if ranges and ranges[-1][0] == url and ranges[-1][2] == begin:
                ranges[-1][3].append((piece, begin - ranges[-1][1]))
                ranges[-1][2] = begin + size
            else:
                ranges.append([url, begin, begin + size, [(piece, 0)]])
        with warnings.catch_warnings():  # a remote read's bytes are immutable; the rows are only copied from
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            for (_, _, _, members), data in zip(ranges, storage.read_ranges([tuple(r[:3]) for r in ranges], pins)):
                for (name, start, stop, shape, stored, _, size), offset in members:
                    rows = torch.frombuffer(data, dtype=torch.uint8, count=size, offset=offset) if size else \
                        torch.empty(0, dtype=torch.uint8)
                    yield name, start, stop, rows.view(stored.dtype).reshape(shape)
