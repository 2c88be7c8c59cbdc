"""Every random draw of a run derives from (seed, iteration, stream), so a resumed or replayed
iteration draws exactly what the uninterrupted run drew, whatever the number of ranks."""

from __future__ import annotations

import hashlib

import torch


def generator(seed: int, iteration: int, stream: str) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}/{iteration}/{stream}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def randn(shape, seed: int, iteration: int, stream: str) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=generator(seed, iteration, stream))
