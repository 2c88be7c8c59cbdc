"""The short metrics table of a run (a few columns, 4 significant digits, newest first) and how a
figure is written in a cell."""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

from dmd2_core.evaluation.evaluator import Evaluator

TRAINING_COLUMNS = ("iteration", "dmd2_loss", "critic_loss", "dmd2_grad_norm", "actor_grad_norm")
GAN_KEYS = ("gan_d_loss_real", "gan_d_loss_fake", "gan_grad_norm", "gan_dmd_grad_ratio")
SIGNIFICANT = 4
TABLE_ROWS = 200  # the table sees the newest TABLE_ROWS: a summary costs the same at iteration 4000 as at 40

def round_sig(value: Any, digits: int = SIGNIFICANT) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if math.isfinite(value) else None
    return str(value)


def table_columns(evaluator: Evaluator) -> tuple[str, ...]:
    """The short metrics table's columns: the training figures, the evaluator's, the pace."""
    return (*TRAINING_COLUMNS, *evaluator.table, "iteration_s")


def metrics_table(rows: Iterable[dict], columns: tuple[str, ...], max_rows: Optional[int] = None) -> list[dict]:
    """The rows that matter for a screen: a few columns (those that ever have a value), 4
    significant digits, newest first. The full set of keys stays in the metrics log."""
    rows = list(rows)
    present = [c for c in columns if any(r.get(c) is not None for r in rows)]
    newest = sorted(rows, key=lambda r: -int(r.get("iteration", 0)))
    if max_rows is not None:
        newest = newest[:max_rows]
    return [{c: round_sig(r.get(c)) for c in present} for r in newest]


def cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return f"`{value}`" if isinstance(value, str) else str(value)
