"""Every random draw of a run derives from (seed, iteration, stream), so a resumed or replayed
iteration draws exactly what the uninterrupted run drew, whatever the number of ranks. Draws of
one tensor per sample (noise) come row by row from streams of their own, so a rank builds only its
rows and every row is the same whichever rank draws it."""

from __future__ import annotations

import hashlib

import torch


def generator(seed: int, iteration: int, stream: str) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}/{iteration}/{stream}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def randn(shape, seed: int, iteration: int, stream: str) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=generator(seed, iteration, stream))


def randn_rows(shape, rows: slice, seed: int, iteration: int, stream: str) -> torch.Tensor:
    """Rows ``rows`` of a standard-normal ``shape`` ([G, ...]): row i from stream ``{stream}/{i}``."""
    indices = range(*rows.indices(int(shape[0])))
    per_row = tuple(int(d) for d in shape[1:])
    if not indices:
        return torch.empty((0, *per_row))
    return torch.stack([torch.randn(per_row, generator=generator(seed, iteration, f"{stream}/{i}")) for i in indices])
