"""Every random draw of a run derives from (seed, iteration, stream), so a resumed or replayed
iteration draws exactly what the uninterrupted run drew, whatever the number of ranks."""

from __future__ import annotations

import hashlib
import math

import torch

# torch's CPU normal kernel turns uniform draws into normals 16 at a time, one draw per value, and
# draws the last 16 values of a tensor whose size is not a multiple of 16 again: a run of values
# that starts on a multiple of 16 is the same whether it is drawn alone or inside a bigger tensor.
_BLOCK = 16
_SKIP_CHUNK = 1 << 22  # values drawn (and dropped) at a time while skipping to a rank's rows


def generator(seed: int, iteration: int, stream: str) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}/{iteration}/{stream}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def randn(shape, seed: int, iteration: int, stream: str) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=generator(seed, iteration, stream))


def randn_rows(shape, rows: slice, seed: int, iteration: int, stream: str) -> torch.Tensor:
    """``randn(shape, ...)[rows]`` bit for bit, holding only those rows: the draws before them are
    made and dropped a chunk at a time, the ones after them never made."""
    shape = tuple(int(d) for d in shape)
    start, stop, step = rows.indices(shape[0])
    if step != 1:
        raise ValueError(f"rows must be a contiguous slice, got {rows}")
    per_row = math.prod(shape[1:])
    total, first, end = shape[0] * per_row, start * per_row, max(stop, start) * per_row
    if end == first:
        return torch.empty((0, *shape[1:]))
    if total < 2 * _BLOCK:  # the kernel's small-tensor path: nothing worth skipping
        return randn(shape, seed, iteration, stream)[start:stop]
    g = generator(seed, iteration, stream)
    begin = min(first // _BLOCK * _BLOCK, (total - _BLOCK) // _BLOCK * _BLOCK)
    # a run reaching into the last 16 values goes on to the end, where they are drawn again
    finish = total if end > total - _BLOCK else -(-end // _BLOCK) * _BLOCK
    for offset in range(0, begin, _SKIP_CHUNK):
        torch.randn(min(_SKIP_CHUNK, begin - offset), generator=g)
    values = torch.randn(finish - begin, generator=g)
    return values[first - begin:end - begin].view(stop - start, *shape[1:]).clone()
