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
from dmd2_core.evaluation.evaluator import Evaluator, Panel
from dmd2_core.evaluation.registry import evaluator_for
from dmd2_core.media.images import data_uri
from dmd2_core.step_counts import STEPS_MARK, counts_in, per_steps_rows, split_steps, steps_label

SEGMENT_ITERATIONS = 100  # lines per segment file: the open one is rewritten, its size is bounded
# An eval's quality figures, its criterion (lower is better) and their columns and panels are the
# run's evaluator's (evaluation.registry): its name rides in the summary's view.
TRAINING_COLUMNS = ("iteration", "dmd2_loss", "critic_loss", "dmd2_grad_norm", "actor_grad_norm")
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
    iterations are replayed. ``last_found``: the last iteration the log held before (-1: none),
    what an earlier attempt got to (the trackers' replay rule, trackers/sinks.py)."""

    def __init__(self, save_url: str, resume_after: int, segment: int = SEGMENT_ITERATIONS):
        self.save_url = save_url
        self.url = metrics_url(save_url)
        self.segment = int(segment)
        self.rows: dict[int, dict] = {}
        self._dirty: set[int] = set()
        found = read_metrics(save_url)
        self.last_found = max((int(row.get("iteration", -1)) for row in found), default=-1)
        if resume_after > 0:
            for row in found:
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


# ---- the plot ---------------------------------------------------------------------------------

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


def _quality(q: Optional[dict], keys: Iterable[str]) -> str:
    return ", ".join(f"{k} {q[k]:.4g}" for k in keys if isinstance((q or {}).get(k), (int, float)))


def criterion(evals: list[dict], criteria: Iterable[str]) -> Optional[str]:
    """The run's quality criterion (lower is better): the first of ``criteria`` (its evaluator's)
    its evals carry."""
    return next((c for c in criteria if any(_number(e.get(c)) for e in evals)), None)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def best_eval(evals: list[dict], criteria: Iterable[str]) -> Optional[dict]:
    """The eval with the lowest value of the run's criterion (the latest of equals); None without one."""
    key = criterion(evals, criteria)
    scored = [e for e in evals if _number(e.get(key))] if key else []
    return min(scored, key=lambda e: (e[key], -e["iteration"])) if scored else None


def summary_markdown(s: dict) -> str:
    """The run summary, top-down: status and before -> after, the latest samples, the plot, the
    evals (newest first), checkpoint and exported student, then the configuration.

    ``s``: name, iteration, final, start, status, trainer_args (role -> dict), evals (list of
    {iteration, fd, acc, diversity, dmd2_loss, critic_loss}), media (list of embed() dicts with
    caption), media_iteration, plot (PNG bytes or None), checkpoint ({iteration, trainers, tracker}),
    student (URL), metrics_url."""
    evaluator = evaluator_for(s)
    quality_keys = evaluator.quality_keys
    out = [f"# {s['name']}", ""]
    out.append(f"**{s.get('status', 'running')}**: iteration {s['iteration']} of {s['final']}"
               + (f" (resumed after {s['start']})" if s.get("start") else "") + "."
               + (f" Resumed with this run's optimizer settings, not the checkpoint's: {', '.join(s['resumed_with'])}."
                  if s.get("resumed_with") else "")
               + (f" Updated {s['updated']}." if s.get("updated") else ""))
    evals = s.get("evals") or []
    if len(evals) >= 2:
        for first, last in zip(per_steps_rows(evals[0]), per_steps_rows(evals[-1])):
            if _quality(first, quality_keys):
                out.append(f"Quality{steps_label(first)} before -> after: {_quality(first, quality_keys)} -> "
                           f"{_quality(last, quality_keys)} "
                           f"(iterations {evals[0]['iteration']} -> {evals[-1]['iteration']}).")
    best = best_eval(evals, evaluator.criteria)
    if best:
        out.append(f"Best eval so far: iteration {best['iteration']} ({_quality(best, quality_keys)}"
                   f"{steps_label(per_steps_rows(best)[0])}).")
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
            if m.get("video_url") and str(m.get("play", "")).startswith(("http://", "https://")):
                out += [f"[MP4 with sound]({m['play']}) (stored at `{m['video_url']}`)", ""]
            elif m.get("inline_video"):  # a local path: a link to it would open a page of the UI's, not the clip
                out += [f'<div><video controls preload="metadata" src="{m["inline_video"]}"></video></div>', "",
                        f"MP4 with sound, played in place (stored at `{m['video_url']}`)", ""]
            elif m.get("video_url"):
                out += [f"MP4 with sound: `{m['video_url']}` (local storage, too large to play in place: open it "
                        "with a video player)", ""]
    if s.get("plot"):
        out += ["## Losses, grad norms and quality", "", f"![metrics plot]({data_uri(s['plot'], 'image/png')})", ""]
    if evals:
        shown = [r for e in sorted(evals, key=lambda e: -e["iteration"]) for r in per_steps_rows(e)]
        cols = [c for c in ("iteration", "steps", *quality_keys, "dmd2_loss", "critic_loss", *GAN_KEYS)
                if any(e.get(c) is not None for e in shown)]
        out += ["## Evals (newest first)", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for e in shown:
            out.append("| " + " | ".join(_v(round_sig(e.get(c))) if e.get(c) is not None else "" for c in cols) + " |")
        out.append("")
    if s.get("reference"):
        out += drift_table(s["reference"], evals[-1] if evals else {}, s.get("drift_flags") or [])
    ck = s.get("checkpoint")
    out += ["## Checkpoint and student", ""]
    if ck:
        out.append(f"- latest checkpoint: iteration {ck['iteration']}, tracker `{ck.get('tracker')}`")
        for role, url in sorted((ck.get("trainers") or {}).items()):
            out.append(f"  - {role}: `{url}`")
    else:
        out.append("- no checkpoint yet")
    if s.get("best_student"):
        out.append(f"- **the run's student** (its best eval, iteration {s.get('best_iteration')}; kept by retention): "
                   f"`{s['best_student']}`")
    if s.get("student"):
        out.append(f"- latest exported student (diffusers): `{s['student']}`")
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


def drift_table(reference: dict, latest: dict, flags: list[str]) -> list[str]:
    """The latest eval's drift statistics beside the yardstick's (the real set's samples, or the
    teacher's reference samples: ``drift.pooled``), and whether each is in its band
    (``Evaluator.drift_flags``); a student of several step counts has a column per K."""
    source = "real set" if reference.get("source") == "real" else "teacher"
    counts = counts_in(latest)
    names = [f"drift_{{}}{STEPS_MARK}{k}" for k in counts] or ["drift_{}"]
    students = [f"{k} steps" for k in counts] or ["student"]
    out = [f"## Drift against the {source} (latest eval)", "",
           f"| statistic | {source} | ± (standard error) | " + " | ".join(students) + " | in band |",
           "|---|---|---|" + "---|" * len(students) + "---|"]
    for key, value in sorted((reference.get("value") or {}).items()):
        cells = [latest.get(name.format(key)) for name in names]
        out.append(f"| {key} | {_v(round_sig(value))} | {_v(round_sig((reference.get('se') or {}).get(key)))} | "
                   + " | ".join("" if c is None else _v(round_sig(c)) for c in cells) + " | "
                   + ("no" if any(name.format(key) in flags for name in names) else "yes") + " |")
    collapsed = [k for k in flags if k.startswith("diversity_")]
    if collapsed:
        out += ["", f"Within-prompt diversity fell steeply from the first eval's (collapsing): {', '.join(collapsed)}."]
    return out + [""]
