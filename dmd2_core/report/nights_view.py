"""The nights view of a deployment: a row per run (its outcome, its quality by the run's criterion,
final and best, per modality, the drift statistics that left their band, the campaign's best student
(kept across nights: a night whose evals are all worse offers an earlier night's), the
iterations it did from -> to, its measured seconds per iteration and the nights that remain at
that pace) under a plot of the criterion over nights. No Prefect here: flows/nights.py keeps the rows in an artifact."""

from __future__ import annotations

import io
import math
from typing import Optional

from dmd2_core.evaluation.criterion import best_figures
from dmd2_core.evaluators import evaluator_for
from dmd2_core.media.images import data_uri
from dmd2_core.report.summary import best_eval, campaign_best, criterion
from dmd2_core.report.table import cell, round_sig
from dmd2_core.step_counts import at_steps, counts_in


def night_columns(evaluator) -> tuple[str, ...]:
    """The evaluator's figures a night's row shows beside its criterion's final and best."""
    return tuple(f.key for f in evaluator.figures if f.on_nights and f.key not in evaluator.criteria)


def night_row(view: dict, outcome: str, wall_s: float, run_id: str, link: Optional[str], date: str) -> dict:
    """A run's row of the nights view, from its summary's view (evals, drift flags, students)."""
    evals = [e for e in view.get("evals") or [] if e.get("iteration") is not None]
    last = max(evals, key=lambda e: e["iteration"]) if evals else {}
    trained = [e for e in evals if e["iteration"] > (view.get("start") or 0)]  # not the start, every night's same
    evaluator = evaluator_for(view)
    columns = night_columns(evaluator)
    best = best_eval(trained or evals, evaluator.joint_criteria) or {}
    key = criterion(evals, evaluator.criteria)
    kept = campaign_best(evals, evaluator.joint_criteria) or {}  # over every night: the student the campaign offers
    row = {"run_id": run_id, "name": view.get("name"), "date": date, "outcome": outcome,
           "evaluator": evaluator.name, "criterion": key,
           "final": last.get(key) if key else None, "best": best.get(key) if key else None,
           "best_iteration": best.get("iteration"), "best_tkd": best.get("teacher_kid"),
           # the best eval's figure and standard error per modality: what a regression is judged on
           "best_figures": best_figures(best, evaluator.joint_criteria, trained or evals),
           "fd": last.get("fd"), "best_fd": best.get("fd") if key == "fd" else None,
           "drift_out": list(view.get("drift_flags") or []),
           "iteration": view.get("iteration"), "final_iteration": view.get("final"),
           "from_iteration": view.get("start"), "s_per_iteration": view.get("seconds_per_iteration"),
           "mfu": view.get("mfu"),
           "nights_left": nights_left(view.get("start"), view.get("iteration"), view.get("final")),
           "wall_s": round(float(wall_s), 1), "link": link,
           "campaign_best": kept.get(key) if key else None, "campaign_best_iteration": kept.get("iteration"),
           "student": view.get("best_student") or view.get("student"),
           "student_iteration": view.get("best_iteration") if view.get("best_student") else None}
    row.update({k: last.get(k) for k in columns if last.get(k) is not None})
    counts = counts_in(key for e in evals for key in e)
    if key and counts:  # a student of several step counts: its final and best (the run's student) at each
        row["steps"] = {str(k): {"final": last.get(at_steps(key, k)), "best": best.get(at_steps(key, k)),
                                 **{c: last.get(at_steps(c, k)) for c in columns if last.get(at_steps(c, k)) is not None}}
                        for k in counts}
    return row


def nights_left(start: Optional[int], reached: Optional[int], final: Optional[int]) -> Optional[int]:
    """Nights still needed to reach ``final`` at the pace of a night that went from ``start`` to
    ``reached``; 0 once reached, None when the night trained nothing short of it (no pace)."""
    if reached is None or final is None:
        return None
    if reached >= final:
        return 0
    done = reached - (start or 0)
    return -(-(final - reached) // done) if done > 0 else None


def nights_plot(rows: list[dict], title: str = "") -> Optional[bytes]:
    """The criterion per night, final and best (oldest left): the regression a team looks for."""
    fig = nights_figure(rows, title)
    if fig is None:
        return None
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def nights_figure(rows: list[dict], title: str = ""):
    """``nights_plot``'s figure: on a log axis (a night at 1e11 beside one at 0.2 flattens the good
    one to 0 on a linear one; symmetric log where a figure is at or below 0, the unbiased KID at its
    noise floor), one tick per night (its number, its date, and its start time where two nights
    share a date). None without a night with the criterion."""
    newest = next((r for r in reversed(rows) if r.get("criterion")), None)
    key = newest and newest["criterion"]
    name = evaluator_for(newest).label(key) if newest else None
    pts = [(n, r) for n, r in enumerate(rows) if r.get("criterion") == key and _finite(r.get("final"))]
    if not pts:
        return None
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0, 3.0), dpi=80)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot([n for n, _ in pts], [r["final"] for _, r in pts], marker="o", label=f"final {name}")
    best = [(n, r["best"]) for n, r in pts if _finite(r.get("best"))]
    if best:
        ax.plot(*zip(*best), marker="x", linestyle="--", label=f"best {name}")
    values = [r["final"] for _, r in pts] + [b for _, b in best]
    if min(values) > 0:
        ax.set_yscale("log")
    else:
        smallest = min((abs(v) for v in values if v != 0), default=1.0)
        ax.set_yscale("symlog", linthresh=smallest)
    dates = [str(r.get("date")) for r in rows]
    ax.set_xticks([n for n, _ in pts], [night_label(n, r, dates.count(str(r.get("date"))) > 1) for n, r in pts],
                  rotation=30, fontsize=7)
    ax.set_ylabel(f"{name} (lower is better)", fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    ax.set_title(title or "quality over nights", fontsize=10)
    fig.tight_layout()
    return fig


def night_label(index: int, row: dict, shared_date: bool) -> str:
    """A night's tick: its number in the view, its date, and its start time (UTC) when another
    night has the same date (a rerun by hand, a second deployment run)."""
    at = f" {row['time']}" if shared_date and row.get("time") else ""
    return f"#{index + 1} {row.get('date')}{at}"


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def nights_markdown(deployment: str, rows: list[dict], plot: Optional[bytes]) -> str:
    """The nights view of a deployment: the plot, then one row per run, newest first; the columns
    are those some row has (a teacher-evaluated night: per modality and drift; digits: FD, acc)."""
    newest = next((r for r in reversed(rows) if r.get("criterion")), None)
    name = evaluator_for(newest).label(newest["criterion"]) if newest else "quality"
    shown = dict.fromkeys(c for r in rows for c in night_columns(evaluator_for(r)))
    extra = [c for c in shown if any(r.get(c) is not None for r in rows)]
    drift = any(r.get("drift_out") or r.get("best_tkd") is not None for r in rows)  # teacher-evaluated nights
    pace = any(r.get("s_per_iteration") is not None for r in rows)  # nights that measured their iterations
    mfu = any(r.get("mfu") is not None for r in rows)  # nights on devices of a known peak
    columns = ["date", "run", "outcome", f"final {name}", f"best {name}", *extra,
               *(["drift out of band"] if drift else []), "iterations",
               *(["s / iteration", *(["MFU"] if mfu else []), "nights left"] if pace else []), "wall"]
    out = [f"# {deployment}: nights", "", f"{len(rows)} run(s), newest first; {name} lower is better.", ""]
    if plot:
        out += [f"![{name} over nights]({data_uri(plot, 'image/png')})", ""]
    out += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in reversed(rows):
        run = f"[{r.get('name')}]({r['link']})" if r.get("link") else f"`{r.get('name')}`"
        several = bool(r.get("steps"))
        cells = [r.get("date"), run + (" (mean over step counts)" if several else ""), r.get("outcome"), r.get("final"),
                 r.get("best"), *(None if several else r.get(c) for c in extra),
                 *([", ".join(r.get("drift_out") or []) or "none"] if drift else []),
                 _iterations(r),
                 *([r.get("s_per_iteration"), *([r.get("mfu")] if mfu else []), r.get("nights_left")] if pace else []),
                 f"{r.get('wall_s')} s"]
        out.append(_cells(cells))
        for k, figures in (r.get("steps") or {}).items():  # a row per step count of the night's student
            out.append(_cells(["", f"at {k} steps", "", figures.get("final"), figures.get("best"),
                               *(figures.get(c) for c in extra), *([""] if drift else []), "",
                               *([""] * (2 + mfu) if pace else []), ""]))
    out.append("")
    offered: dict = {}
    for r in reversed(rows):  # each student once, as its newest night offered it
        offered.setdefault(r.get("student"), r)
    students = [r for url, r in offered.items() if url]
    if students:
        out += ["Best students (the campaign's best eval, kept across nights; newest first): " + "; ".join(
            f"{r.get('date')}: " + (f"iteration {r['student_iteration']} " if r.get("student_iteration") is not None else "")
            + f"`{r['student']}`" for r in students[:5]), ""]
    return "\n".join(out)


def _iterations(row: dict) -> str:
    """The iterations a night did, ``from -> to / of`` (a row older than the leg columns: ``to / of``)."""
    reached = row.get("iteration") if row.get("iteration") is not None else "-"
    start = row.get("from_iteration")
    return (f"{start} -> " if start is not None else "") + f"{reached}/{row.get('final_iteration')}"


def _cells(cells: list) -> str:
    return "| " + " | ".join("" if c is None else cell(round_sig(c)) if isinstance(c, float) else str(c) for c in cells) + " |"
