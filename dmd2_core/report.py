"""What a person reads about a run: the metrics log ({save}/metrics.jsonl, strict JSON), the short
metrics table, the plot, how media embed and the run summary's markdown. No Prefect here: the flow
turns these into artifacts (flows/artifacts.py).

Strict JSON: every line of the metrics log parses with any JSON reader. A non-finite float
(NaN, +-inf) is written as ``null`` and its key is listed in the row's ``nonfinite`` field, so a
reader can tell a missing value from a diverged one.
"""

from __future__ import annotations

import io
import json
import math
from typing import Any, Iterable, Optional

from dmd2_core import storage
from dmd2_core.save_layout import METRICS_SEGMENTS_DIR, metrics_segment_url, metrics_url
from dmd2_core.args import Args
from dmd2_core.media.images import data_uri

SEGMENT_ITERATIONS = 100  # lines per segment file: the open one is rewritten, its size is bounded
QUALITY_KEYS = ("fd", "acc", "diversity")
TABLE_COLUMNS = ("iteration", "dmd2_loss", "critic_loss", "dmd2_grad_norm", "actor_grad_norm",
                 "fd", "iteration_s")
SIGNIFICANT = 4
PLOT_POINTS = 400  # the plot sees at most this many rows (thin), the table the newest TABLE_ROWS:
TABLE_ROWS = 200   # a summary costs the same at iteration 4000 as at 40
GAN_KEYS = ("gan_d_loss_real", "gan_d_loss_fake", "gan_grad_norm", "gan_dmd_grad_ratio")


# ---- strict JSON ------------------------------------------------------------------------------

def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def json_line(row: dict) -> str:
    """One strict-JSON line: non-finite floats become null and are named in ``nonfinite``."""
    bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
    out = _finite({k: v for k, v in row.items() if k != "nonfinite"})
    if bad:
        out["nonfinite"] = bad
    return json.dumps(out, default=str, allow_nan=False) + "\n"


# ---- the metrics log --------------------------------------------------------------------------

class MetricsLog:
    """One strict-JSON line per iteration, kept in segment files of SEGMENT_ITERATIONS iterations
    (``{save}/metrics/iter_XXXXXXX.jsonl``, named by their first iteration). Object stores cannot
    append, so only the open segment is rewritten after an iteration: a write costs the same at
    iteration 4000 as at iteration 10. ``{save}/metrics.jsonl`` (every line, in order) is written
    once when the run ends (``finish``). On resume, lines after the checkpoint are dropped: those
    iterations are replayed."""

    def __init__(self, save_url: str, resume_after: int, segment: int = SEGMENT_ITERATIONS):
        self.save_url = save_url
        self.url = metrics_url(save_url)
        self.segment = int(segment)
        self.rows: dict[int, dict] = {}
        self._dirty: set[int] = set()
        if resume_after > 0:
            for row in read_metrics(save_url):
                if int(row.get("iteration", -1)) <= resume_after:
                    self.rows[int(row["iteration"])] = row
            self._drop_segments_after(resume_after)
        else:
            self._drop_segments_after(-1)

    def segment_url(self, iteration: int) -> str:
        first = (int(iteration) // self.segment) * self.segment
        return metrics_segment_url(self.save_url, first)

    def _drop_segments_after(self, iteration: int) -> None:
        for url in _segment_urls(self.save_url):
            first = int(url.rstrip("/").rpartition("iter_")[2].split(".")[0])
            if first > iteration:
                storage.remove(url)
        if iteration >= 0:
            self._dirty.add(int(iteration))

    def update(self, iteration: int, values: dict) -> dict:
        row = self.rows.setdefault(int(iteration), {"iteration": int(iteration)})
        row.update({k: v for k, v in values.items() if k != "skipped"})
        self._dirty.add(int(iteration))
        return row

    def write(self) -> None:
        """Rewrite the segments touched since the last write (normally the open one)."""
        for seg in sorted({self.segment_url(i) for i in self._dirty}):
            first = int(seg.rpartition("iter_")[2].split(".")[0])
            lines = [json_line(self.rows[i]) for i in sorted(self.rows) if first <= i < first + self.segment]
            storage.write_text(seg, "".join(lines))
        self._dirty.clear()

    def finish(self) -> None:
        """Write the open segment and the whole log as one file, ``{save}/metrics.jsonl``."""
        self.write()
        storage.write_text(self.url, "".join(json_line(self.rows[i]) for i in sorted(self.rows)))

    def table(self) -> list[dict]:
        return [self.rows[i] for i in sorted(self.rows)]


def _segment_urls(save_url: str) -> list[str]:
    root = storage.join(save_url, METRICS_SEGMENTS_DIR)
    return [storage.join(root, name) for name in storage.list_names(root) if name.startswith("iter_")]


def read_metrics(save_url: str) -> list[dict]:
    """Every row of a run's metrics log, in iteration order: the segments when there are any (a
    run in progress or one that crashed), else ``metrics.jsonl``."""
    rows: dict[int, dict] = {}
    urls = _segment_urls(save_url) or [u for u in [metrics_url(save_url)] if storage.exists(u)]
    for url in urls:
        for line in storage.read_text(url).splitlines():
            if line.strip():
                row = json.loads(line)
                rows[int(row.get("iteration", -1))] = row
    return [rows[i] for i in sorted(rows)]


# ---- the short metrics table ------------------------------------------------------------------

def round_sig(value: Any, digits: int = SIGNIFICANT) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if math.isfinite(value) else None
    return str(value)


def metrics_table(rows: Iterable[dict], columns: tuple[str, ...] = TABLE_COLUMNS,
                  max_rows: Optional[int] = None) -> list[dict]:
    """The rows that matter for a screen: a few columns (those that ever have a value), 4
    significant digits, newest first. The full set of keys stays in the metrics log."""
    rows = list(rows)
    present = [c for c in columns if any(r.get(c) is not None for r in rows)]
    newest = sorted(rows, key=lambda r: -int(r.get("iteration", 0)))
    if max_rows is not None:
        newest = newest[:max_rows]
    return [{c: round_sig(r.get(c)) for c in present} for r in newest]


# ---- the plot ---------------------------------------------------------------------------------

PLOT_PANELS = (  # FD (unbounded) on an axis of its own: sharing one with acc and diversity (0-1) hid its drift
    ("losses", ("dmd2_loss", "critic_loss")),
    ("grad norms", ("dmd2_grad_norm", "actor_grad_norm", "critic_grad_norm")),
    ("FD", ("fd",)),
    ("accuracy, diversity", ("acc", "diversity")),
    ("GAN head", GAN_KEYS),  # only when the head is on (its keys are in the rows)
)


def thin(rows: list[dict], most: int) -> list[dict]:
    """At most ``most`` rows, evenly spread, always keeping the rows with quality metrics and the
    last one: what a plot needs, at a cost bounded whatever the run's length."""
    if len(rows) <= most:
        return list(rows)
    step = math.ceil(len(rows) / most)
    return [r for n, r in enumerate(rows)
            if n % step == 0 or n == len(rows) - 1 or any(r.get(k) is not None for k in QUALITY_KEYS)]


def plot_png(rows: list[dict], title: str = "") -> Optional[bytes]:
    """A PNG of losses, grad norms, FD, accuracy/diversity and the GAN head's metrics over
    iterations (one panel each; panels without data are left out). None when no panel has data."""
    panels = []
    for name, keys in PLOT_PANELS:
        series = {}
        for k in keys:
            pts = [(int(r["iteration"]), float(r[k])) for r in rows
                   if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)
                   and math.isfinite(float(r[k]))]
            if pts:
                series[k] = pts
        if series:
            panels.append((name, series))
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    cols = min(3, len(panels))
    rows_n = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(4.0 * cols, 3.0 * rows_n), dpi=80)
    for n, (name, series) in enumerate(panels):
        ax = fig.add_subplot(rows_n, cols, n + 1)
        for key, pts in series.items():
            xs, ys = zip(*pts)
            ax.plot(xs, ys, label=key, linewidth=1.0, marker="o" if len(pts) <= 30 else None, markersize=3)
        ax.set_title(name, fontsize=10)
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


# ---- the run summary --------------------------------------------------------------------------

# shown even at their defaults; any other shared key is shown when the run sets it off its default
SHOWN_SHARED = ("num_iterations", "lr", "critic_lr", "device", "num_devices", "dtype", "global_batch_size",
                "micro_batch_size", "dmd2_student_steps", "dmd2_guidance_scale", "dmd2_update_ratio",
                "dmd2_critic_scoring", "dmd2_shift", "ema_decay", "eval_interval", "save_interval", "seed",
                "hf_checkpoint", "prompts", "save")


def config_rows(trainer_args: dict[str, dict]) -> tuple[list[str], list[tuple[str, list[Any]]], list[tuple[str, Any]]]:
    """(roles, differing keys [(key, [value per role])], shared keys [(key, value)]) of the
    resolved per-trainer arguments (role -> dict): the shared ones are ``SHOWN_SHARED`` and those the
    run set off their defaults (a loss weight, the GAN head, the regression pull)."""
    defaults = Args.model_construct().model_dump(mode="json")
    roles = list(trainer_args)
    keys = list(dict.fromkeys(k for a in trainer_args.values() for k in a))
    differing, shared = [], []
    for k in keys:
        values = [trainer_args[r].get(k) for r in roles]
        if any(v != values[0] for v in values):
            differing.append((k, values))
        elif k in SHOWN_SHARED or (k in defaults and values[0] != defaults[k]):
            shared.append((k, values[0]))
    return roles, differing, shared


def _v(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return f"`{value}`" if isinstance(value, str) else str(value)


def _quality(q: Optional[dict]) -> str:
    return ", ".join(f"{k} {q[k]:.4g}" for k in QUALITY_KEYS if isinstance((q or {}).get(k), (int, float)))


def best_eval(evals: list[dict]) -> Optional[dict]:
    """The eval with the lowest FD (the only quality criterion the run has); None without FD."""
    scored = [e for e in evals if isinstance(e.get("fd"), (int, float)) and math.isfinite(e["fd"])]
    return min(scored, key=lambda e: (e["fd"], -e["iteration"])) if scored else None


def summary_markdown(s: dict) -> str:
    """The run summary, top-down: status and before -> after, the latest samples, the plot, the
    evals (newest first), checkpoint and exported student, then the configuration.

    ``s``: name, iteration, final, start, status, trainer_args (role -> dict), evals (list of
    {iteration, fd, acc, diversity, dmd2_loss, critic_loss}), media (list of embed() dicts with
    caption), media_iteration, plot (PNG bytes or None), checkpoint ({iteration, trainers, tracker}),
    student (URL), metrics_url."""
    out = [f"# {s['name']}", ""]
    out.append(f"**{s.get('status', 'running')}**: iteration {s['iteration']} of {s['final']}"
               + (f" (resumed after {s['start']})" if s.get("start") else "") + "."
               + (f" Updated {s['updated']}." if s.get("updated") else ""))
    evals = s.get("evals") or []
    if len(evals) >= 2 and _quality(evals[0]):
        out.append(f"Quality before -> after: {_quality(evals[0])} -> {_quality(evals[-1])} "
                   f"(iterations {evals[0]['iteration']} -> {evals[-1]['iteration']}).")
    best = best_eval(evals)
    if best:
        out.append(f"Best eval so far: iteration {best['iteration']} ({_quality(best)}).")
    out.append("")
    if s.get("media"):
        out += [f"## Samples, iteration {s.get('media_iteration')}", ""]
        for m in s["media"]:
            alt = str(m.get("caption") or "samples").replace("[", "(").replace("]", ")")  # no brackets in alt text
            out.append(f"![{alt}]({m['src']})")  # never inside a link: the default UI renders that as text
            note = "full size" if m.get("full") else "thumbnail"
            out += ["", f"{m.get('caption', '')} ({note}; stored at `{m['url']}`)", ""]
            if m.get("link"):
                out += [f"[full size]({m['link']}) (link expires)", ""]
            if m.get("video_url"):
                out += [f"[MP4 with sound]({m['play']}) (stored at `{m['video_url']}`)", ""]
    if s.get("plot"):
        out += ["## Losses, grad norms and quality", "", f"![metrics plot]({data_uri(s['plot'], 'image/png')})", ""]
    if evals:
        cols = [c for c in ("iteration", *QUALITY_KEYS, "dmd2_loss", "critic_loss", *GAN_KEYS)
                if any(e.get(c) is not None for e in evals)]
        out += ["## Evals (newest first)", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for e in sorted(evals, key=lambda e: -e["iteration"]):
            out.append("| " + " | ".join(_v(round_sig(e.get(c))) if e.get(c) is not None else "" for c in cols) + " |")
        out.append("")
    ck = s.get("checkpoint")
    out += ["## Checkpoint and student", ""]
    if ck:
        out.append(f"- latest checkpoint: iteration {ck['iteration']}, tracker `{ck.get('tracker')}`")
        for role, url in sorted((ck.get("trainers") or {}).items()):
            out.append(f"  - {role}: `{url}`")
    else:
        out.append("- no checkpoint yet")
    if s.get("student"):
        out.append(f"- exported student (diffusers): `{s['student']}`")
    if s.get("metrics_url"):
        out.append(f"- every metric of every iteration: `{s['metrics_url']}`")
    out.append("")
    roles, differing, shared = config_rows(s.get("trainer_args") or {})
    if roles:
        out += ["## Configuration", "", "| key | " + " | ".join(roles) + " |", "|---|" + "---|" * len(roles)]
        for k, values in differing:
            out.append(f"| {k} | " + " | ".join(_v(v) for v in values) + " |")
        for k, v in shared:
            out.append(f"| {k} | " + " | ".join([_v(v)] * len(roles)) + " |")
        out.append("")
    return "\n".join(out)


# ---- the nights view: one row per run of a deployment -----------------------------------------

NIGHT_COLUMNS = ("date", "run", "outcome", "final FD", "best FD", "acc", "diversity", "iterations", "wall")


def night_row(view: dict, outcome: str, wall_s: float, run_id: str, link: Optional[str], date: str) -> dict:
    """A run's row of the nights view, from its summary's view (evals, student, iteration)."""
    evals = [e for e in view.get("evals") or [] if e.get("iteration") is not None]
    last = max(evals, key=lambda e: e["iteration"]) if evals else {}
    best = best_eval(evals) or {}
    return {"run_id": run_id, "name": view.get("name"), "date": date, "outcome": outcome,
            "fd": last.get("fd"), "best_fd": best.get("fd"), "best_iteration": best.get("iteration"),
            "acc": last.get("acc"), "diversity": last.get("diversity"),
            "iteration": view.get("iteration"), "final": view.get("final"), "wall_s": round(float(wall_s), 1),
            "link": link, "student": view.get("student")}


def nights_plot(rows: list[dict], title: str = "") -> Optional[bytes]:
    """Final and best FD per night (oldest left): the regression a team looks for each morning."""
    pts = [(n, r) for n, r in enumerate(rows) if isinstance(r.get("fd"), (int, float))]
    if not pts:
        return None
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0, 3.0), dpi=80)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot([n for n, _ in pts], [r["fd"] for _, r in pts], marker="o", label="final FD")
    best = [(n, r["best_fd"]) for n, r in pts if isinstance(r.get("best_fd"), (int, float))]
    if best:
        ax.plot(*zip(*best), marker="x", linestyle="--", label="best FD")
    ax.set_xticks([n for n, _ in pts], [str(r.get("date")) for _, r in pts], rotation=30, fontsize=7)
    ax.set_ylabel("FD (lower is better)", fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    ax.set_title(title or "quality over nights", fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def nights_markdown(deployment: str, rows: list[dict], plot: Optional[bytes]) -> str:
    """The nights view of a deployment: the plot, then one row per run, newest first."""
    out = [f"# {deployment}: nights", "", f"{len(rows)} run(s), newest first; FD lower is better.", ""]
    if plot:
        out += [f"![FD over nights]({data_uri(plot, 'image/png')})", ""]
    out += ["| " + " | ".join(NIGHT_COLUMNS) + " |", "|" + "---|" * len(NIGHT_COLUMNS)]
    for r in reversed(rows):
        run = f"[{r.get('name')}]({r['link']})" if r.get("link") else f"`{r.get('name')}`"
        cells = [r.get("date"), run, r.get("outcome"), r.get("fd"), r.get("best_fd"), r.get("acc"),
                 r.get("diversity"), f"{r.get('iteration') if r.get('iteration') is not None else '-'}/{r.get('final')}",
                 f"{r.get('wall_s')} s"]
        out.append("| " + " | ".join("" if c is None else _v(round_sig(c)) if isinstance(c, float) else str(c)
                                     for c in cells) + " |")
    out.append("")
    exports = [r for r in reversed(rows) if r.get("student")]
    if exports:
        out += ["Exported students: " + "; ".join(f"{r.get('date')} `{r['student']}`" for r in exports[:5]), ""]
    return "\n".join(out)
