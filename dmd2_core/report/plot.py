"""The metrics plot of a run: a panel per kind of figure, each on its own scale."""

from __future__ import annotations

import io
import math
from typing import Iterable, Optional

from dmd2_core.evaluation.evaluator import Evaluator, Panel
from dmd2_core.report.table import GAN_KEYS
from dmd2_core.step_counts import split_steps

PLOT_POINTS = 400  # the plot sees at most this many rows (thin): its cost is bounded whatever the run's length

TRAINING_PANELS = (  # one scale a panel: dmd2_loss (~1e-8) beside critic_loss (~2.5) read as a flat line
    Panel("DMD2 loss", ("dmd2_loss",)),
    Panel("critic loss", ("critic_loss",)),
    Panel("grad norms (log)", ("dmd2_grad_norm", "actor_grad_norm", "critic_grad_norm")),
)
GAN_PANEL = Panel("GAN head", GAN_KEYS)  # only when the head is on (its keys are in the rows)


def plot_panels(evaluator: Evaluator) -> tuple[Panel, ...]:
    return (*TRAINING_PANELS, *evaluator.panels, GAN_PANEL)


def thin(rows: list[dict], most: int, keep: Iterable[str] = ()) -> list[dict]:
    """At most ``most`` rows, evenly spread, always keeping the rows with any of ``keep`` (the
    quality figures) and the last one: what a plot needs, at a cost bounded whatever the run's length."""
    if len(rows) <= most:
        return list(rows)
    step = math.ceil(len(rows) / most)
    keep = tuple(keep)
    return [r for n, r in enumerate(rows)
            if n % step == 0 or n == len(rows) - 1 or any(r.get(k) is not None for k in keep)]


def plot_png(rows: list[dict], title: str = "", panels: Iterable[Panel] = TRAINING_PANELS) -> Optional[bytes]:
    """A PNG of losses, grad norms, FD, accuracy/diversity and the GAN head's metrics over
    iterations (one panel each of ``panels``; panels without data are left out). None when no
    panel has data."""
    drawn = []
    stepped = sorted({key for r in rows for key in r if split_steps(key)[1] is not None},
                     key=lambda key: (split_steps(key)[0], split_steps(key)[1]))
    for panel in panels:
        name, keys, series = panel.title, panel.keys, {}
        for k in [*keys, *(s for s in stepped if split_steps(s)[0] in keys)]:  # each step count's beside
            pts = [(int(r["iteration"]), float(r[k])) for r in rows
                   if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)
                   and math.isfinite(float(r[k]))]
            if pts:
                series[k] = pts
        if series:
            drawn.append((name, series))
    if not drawn:
        return None
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    cols = min(3, len(drawn))
    rows_n = math.ceil(len(drawn) / cols)
    fig = Figure(figsize=(4.0 * cols, 3.0 * rows_n), dpi=80)
    for n, (name, series) in enumerate(drawn):
        ax = fig.add_subplot(rows_n, cols, n + 1)
        for key, pts in series.items():
            xs, ys = zip(*pts)
            ax.plot(xs, ys, label=key, linewidth=1.0, marker="o" if len(pts) <= 30 else None, markersize=3)
        ax.set_title(name, fontsize=10)
        if name.endswith("(log)") and all(y > 0 for pts in series.values() for _, y in pts):
            ax.set_yscale("log")
        ax.set_xlabel("iteration", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
