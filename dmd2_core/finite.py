"""Non-finite values: a step whose loss or gradient norm is NaN/inf is skipped (no optimizer and
no EMA update) and counted; too many skips in a row fail the run; nothing non-finite is saved.

The trainer keeps one ``NonFiniteCounter`` per rank, and a critic with a GAN head one more for
the head's own steps (``gan_nonfinite``), limited by the same ``max_nonfinite_steps``. All ranks
see the same all-reduced gradient norm and the all-reduced loss flag, so they skip the same steps
and stay in lockstep.
"""

from __future__ import annotations

import logging
import math
from typing import Iterable, Optional

import torch
from dmd2_core.errors import NonFiniteError

log = logging.getLogger("dmd2")


def is_finite(value: float) -> bool:
    return math.isfinite(float(value))


def nonfinite_rows(t: torch.Tensor) -> int:
    """How many samples (rows along dim 0) hold any NaN or inf."""
    if t.numel() == 0:
        return 0
    return int((~torch.isfinite(t.detach())).reshape(t.shape[0], -1).any(dim=1).sum().item())


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> Optional[tuple[str, int]]:
    """(name, count of non-finite entries) of the first tensor holding NaN/inf, else None."""
    for name, t in named:
        if torch.is_tensor(t) and t.is_floating_point() and t.numel():
            bad = int((~torch.isfinite(t.detach())).sum().item())
            if bad:
                return name, bad
    return None


class NonFiniteCounter:
    """Skipped steps of one trainer: in total, in the current train call, and in a row."""

    def __init__(self, role: str, limit: int, key: str = "nonfinite"):
        """``key``: the prefix of this counter's entries in a checkpoint's ``extra``."""
        self.role, self.limit, self.key = role, int(limit), key
        self.total = 0
        self.in_a_row = 0
        self.this_call = 0

    def begin(self) -> None:
        self.this_call = 0

    def record(self, finite: bool, iteration: Optional[int], what: str) -> None:
        """Count one step; raises NonFiniteError once ``limit`` steps in a row were skipped."""
        if finite:
            self.in_a_row = 0
            return
        self.total += 1
        self.this_call += 1
        self.in_a_row += 1
        at = f"iteration {iteration}" if iteration is not None else "a step"
        log.warning(f"{self.role}: skipped a non-finite step at {at} ({what}); "
                    f"{self.in_a_row} in a row, {self.total} in total")
        if self.limit and self.in_a_row >= self.limit:
            raise NonFiniteError(
                f"{self.role}: {self.in_a_row} non-finite steps in a row at {at} ({what}; "
                f"max_nonfinite_steps={self.limit}); the last checkpoint holds finite weights"
            )

    def state(self) -> dict:
        return {f"{self.key}_steps": self.total, f"{self.key}_in_a_row": self.in_a_row}

    def load(self, extra: dict) -> None:
        self.total = int(extra.get(f"{self.key}_steps", 0))
        self.in_a_row = int(extra.get(f"{self.key}_in_a_row", 0))
