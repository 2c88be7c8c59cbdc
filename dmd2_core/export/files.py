"""What both export writers share: the format number in ``export.json``, the state a diffusers
directory holds, and a writable directory for a local or object-store URL."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from dmd2_core import storage

EXPORT_FORMAT = 1


def persistent(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop non-persistent buffers (e.g. Wan's rope tables): not in a diffusers state dict."""
    skip = {f"{prefix}.{name}" if prefix else name
            for prefix, module in model.named_modules() for name in module._non_persistent_buffers_set}
    return {k: v for k, v in state.items() if k not in skip}


def cast(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


@contextmanager
def writable_dir(url: str) -> Iterator[Path]:
    """A directory to write into: ``url`` itself when local, else staged and uploaded."""
    if storage.is_local(url):
        _, path = storage.filesystem(url)
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    with storage.staged_dir(url) as tmp:
        yield tmp


def total_bytes(url: str) -> int:
    def run():
        fs, path = storage.filesystem(url)
        return sum(int(info.get("size") or 0) for info in fs.find(path, detail=True).values())
    return storage.retrying(run, f"list {url}")
