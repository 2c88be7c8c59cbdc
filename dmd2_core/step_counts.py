"""One student, several step counts (``dmd2_student_steps: [1, 2, 4, 8]``): how its figures are
named. Each K's figure is ``<name>@<K>`` in the metrics log; the mean over K of each criterion
keeps its plain name, so the best eval and the nights compare one figure."""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

STEPS_MARK = "@"  # a student of several step counts: each K's figure is "<name>@<K>"


def at_steps(key: str, num_steps: int) -> str:
    """The name of figure ``key`` at ``num_steps`` steps, for a student of several step counts."""
    return f"{key}{STEPS_MARK}{num_steps}"


def split_steps(key: str) -> tuple[str, Optional[int]]:
    """(the figure's name, its step count or None): the inverse of ``at_steps``."""
    name, mark, steps = key.rpartition(STEPS_MARK)
    return (name, int(steps)) if mark and steps.isdigit() else (key, None)


def counts_in(keys: Iterable[str]) -> list[int]:
    """The step counts figures named ``keys`` carry (``at_steps``), ascending; [] for a student of one K."""
    return sorted({k for key in keys for k in [split_steps(key)[1]] if k is not None})


def mean_over_steps(metrics: dict[str, Any], counts: Iterable[int], keys: Iterable[str]) -> dict[str, float]:
    """Each of ``keys`` (the run evaluator's criteria) that every step count has, as its mean
    over them: the one figure that ranks a student of several step counts (its best eval, the
    nights)."""
    counts = list(counts)
    out = {}
    for key in keys:
        values = [metrics.get(at_steps(key, k)) for k in counts]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
            out[key] = sum(values) / len(values)
    return out


def per_steps_rows(row: dict) -> list[dict]:
    """A metrics row as the summary shows it: itself for a student of one K; for one of several,
    its means (steps "mean") and a row per K with that K's figures under their own names."""
    by_steps: dict[int, dict] = {}
    plain = {}
    for key, value in row.items():
        name, steps = split_steps(key)
        if steps is None:
            plain[key] = value
        else:
            by_steps.setdefault(steps, {})[name] = value
    if not by_steps:
        return [row]
    return [{**plain, "steps": "mean"}] + [{"iteration": row.get("iteration"), "steps": k, **by_steps[k]}
                                           for k in sorted(by_steps)]


def steps_label(row: dict) -> str:
    """How a summary row of ``per_steps_rows`` is named in a sentence."""
    steps = row.get("steps")
    return "" if steps is None else " (mean over step counts)" if steps == "mean" else f" at {steps} steps"
