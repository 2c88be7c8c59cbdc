"""The tensors of a diffusers transformer directory, found from the safetensors headers alone and
read row range by row range: a rank reads only the bytes of its own shards (a seek on a local
file, a ranged read on S3), never a whole file."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from dmd2_core import storage

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = f"{WEIGHTS_NAME}.index.json"
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class WeightFilesError(ValueError):
    """A weights directory or file that cannot be read; the message names the path."""


@dataclass(frozen=True)
class StoredTensor:
    file_url: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset of its first element in the file

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
            except storage.StorageUnavailableError:
                raise
            except Exception as exc:  # noqa: BLE001
                raise WeightFilesError(f"{index_url}: unreadable shard index ({type(exc).__name__}: {exc})") from None
        elif WEIGHTS_NAME in names:
            files = [WEIGHTS_NAME]
        else:
            raise WeightFilesError(f"{folder}: no {WEIGHTS_NAME} nor {INDEX_NAME}")
        self.tensors: dict[str, StoredTensor] = {}
        for name in files:
            url = storage.join(folder, name)
            try:
                entries, _, data_start = storage.safetensors_layout(url)
            except (storage.SafetensorsHeaderError, FileNotFoundError) as exc:
                raise WeightFilesError(f"{url}: not a whole safetensors file ({exc})") from None
            for key, info in entries.items():
                if key == "__metadata__":
                    continue
                if info.get("dtype") not in DTYPES:
                    raise WeightFilesError(f"{url}: tensor '{key}' has unsupported dtype {info.get('dtype')}")
                self.tensors[key] = StoredTensor(url, DTYPES[info["dtype"]], tuple(info["shape"]),
                                                 data_start + info["data_offsets"][0])

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensor(name).shape

    def tensor(self, name: str) -> StoredTensor:
        if name not in self.tensors:
            raise WeightFilesError(f"{self.folder}: no tensor '{name}' in the checkpoint")
        return self.tensors[name]

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` (along the first dimension; a 0-d tensor whole) in the stored dtype."""
        stored = self.tensor(name)
        if not stored.shape:
            start, stop, shape = 0, 1, ()
        else:
            shape = (stop - start, *stored.shape[1:])
        row = stored.row_bytes() if stored.shape else stored.dtype.itemsize
        data = torch.empty((stop - start) * row, dtype=torch.uint8)
        storage.read_range_into(stored.file_url, stored.start + start * row, memoryview(data.numpy()))
        return data.view(stored.dtype).reshape(shape)
