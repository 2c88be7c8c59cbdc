"""The run summary's markdown: status and before -> after, the latest samples, the plot, the
evals, the drift table, checkpoint and student, the configuration; and which eval is the run's
best by its evaluator's criterion."""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

from dmd2_core.args import Args
from dmd2_core.evaluation.criterion import Criteria, best_of
from dmd2_core.evaluators import evaluator_for
from dmd2_core.media.images import data_uri
from dmd2_core.report.table import GAN_KEYS, cell, round_sig
from dmd2_core.step_counts import STEPS_MARK, counts_in, per_steps_rows, steps_label

# the order of a value's source in the configuration: what the user set first, the defaults last
SOURCES = ("set", "recipe", "per role", "derived", "default")


def config_rows(trainer_args: dict[str, dict], sources: Optional[dict[str, str]] = None
                ) -> tuple[list[str], list[tuple[str, str, list[Any]]]]:
    """(roles, [(key, source, [value per role])]) of every resolved per-trainer argument (role ->
    dict), what the run used, by source (``SOURCES``): the user's (``sources``: key -> 'set' for
    a flag, --set or a parameter, 'recipe' for its recipe's), then the values each role resolves
    on its own, then those the run resolved off their defaults (a shift read from the model,
    preflight's choices), then the defaults; alphabetical within each."""
    defaults = Args.model_construct().model_dump(mode="json")
    sources = sources or {}
    roles = list(trainer_args)
    rows = []
    for k in dict.fromkeys(k for a in trainer_args.values() for k in a):
        values = [trainer_args[r].get(k) for r in roles]
        source = sources.get(k) or ("per role" if any(v != values[0] for v in values)
                                    else "default" if k in defaults and values[0] == defaults[k] else "derived")
        rows.append((k, source, values))
    rows.sort(key=lambda row: (SOURCES.index(row[1]) if row[1] in SOURCES else len(SOURCES), row[0]))
    return roles, rows


def _quality(q: Optional[dict], keys: Iterable[str]) -> str:
    return ", ".join(f"{k} {q[k]:.4g}" for k in keys if isinstance((q or {}).get(k), (int, float)))


def criterion(evals: list[dict], criteria: Iterable[str]) -> Optional[str]:
    """The run's quality criterion (lower is better): the first of ``criteria`` (its evaluator's)
    its evals carry."""
    return next((c for c in criteria if any(_number(e.get(c)) for e in evals)), None)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def best_eval(evals: list[dict], criteria: Criteria) -> Optional[dict]:
    """The best eval by the run's criterion (``evaluation.criterion.best_of``; None without one):
    ``criteria`` its evaluator's ``joint_criteria`` (each modality within its own noise: a student
    whose picture improves while its sound degrades is not the best), or figure names (one figure:
    the lowest value, the latest of equals)."""
    return best_of(evals, criteria)


def campaign_best(evals: list[dict], criteria: Criteria) -> Optional[dict]:
    """The campaign's best eval: ``best_eval`` of the evals after the campaign's first (the student
    it started from is its starting point, not its result), over every night of its save (the
    metrics log keeps every night's evals), so a night whose evals are all worse keeps an earlier
    night's. What the run exports as its student, its summary names and its nights row offers."""
    if not evals:
        return None
    origin = min(e["iteration"] for e in evals)
    return best_eval([e for e in evals if e["iteration"] > origin], criteria)


def summary_markdown(s: dict) -> str:
    """The run summary, top-down: status and before -> after, the latest samples, the plot, the
    evals (newest first), checkpoint and exported student, then the configuration.

    ``s``: name, iteration, final, start, status, trainer_args (role -> dict), evals (list of
    {iteration, fd, acc, diversity, dmd2_loss, critic_loss}), media (list of embed() dicts with
    caption), media_iteration, plot (PNG bytes or None), checkpoint ({iteration, trainers, latest}),
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
    best = campaign_best(evals, evaluator.joint_criteria)
    if best:
        out.append(f"Best eval so far (the campaign's): iteration {best['iteration']} ({_quality(best, quality_keys)}"
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
            out.append("| " + " | ".join(cell(round_sig(e.get(c))) if e.get(c) is not None else "" for c in cols) + " |")
        out.append("")
    if s.get("reference"):
        start = next((e for e in evals if any(k.startswith("drift_") for k in e)), {})  # what drift is judged from
        out += drift_table(s["reference"], evals[-1] if evals else {}, s.get("drift_flags") or [], start)
    ck = s.get("checkpoint")
    out += ["## Checkpoint and student", ""]
    if ck:
        out.append(f"- latest checkpoint: iteration {ck['iteration']}, pointer `{ck.get('latest')}`")
        for role, url in sorted((ck.get("trainers") or {}).items()):
            out.append(f"  - {role}: `{url}`")
    else:
        out.append("- no checkpoint yet")
    if s.get("best_student"):
        out.append(f"- **the run's student** (the campaign's best eval, iteration {s.get('best_iteration')}; kept by retention): "
                   f"`{s['best_student']}`")
    if s.get("student"):
        out.append(f"- latest exported student (diffusers): `{s['student']}`")
    if s.get("metrics_url"):
        out.append(f"- every metric of every iteration: `{s['metrics_url']}`")
    out.append("")
    roles, rows = config_rows(s.get("trainer_args") or {}, s.get("config_sources"))
    if roles:
        out += ["## Configuration", "", "Every value the run used: what was set (flag, --set or parameter), then the "
                "recipe's, then what each role or the run resolved, then the defaults.", "",
                "| key | " + " | ".join(roles) + " | from |", "|---|" + "---|" * (len(roles) + 1)]
        for k, source, values in rows:
            out.append(f"| {k} | " + " | ".join(cell(v) for v in values) + f" | {source} |")
        out.append("")
    return "\n".join(out)


def drift_table(reference: dict, latest: dict, flags: list[str], start: Optional[dict] = None) -> list[str]:
    """The latest eval's drift statistics beside the yardstick's (the real set's samples, or the
    teacher's reference samples: ``drift.pooled``) and the band each is judged in: the run's first
    eval's value +- the band's half-width (``teacher_evaluator.drift_band``), each in its unit. In
    band: inside it; no: out of it and farther from the yardstick than the start (a drift, what
    ``drift_flags`` flags); out of it towards the yardstick: an improving student, no drift. A
    student of several step counts has a column per K."""
    from dmd2_core.evaluation.drift import drift_unit
    from dmd2_core.evaluation.teacher_evaluator import drift_band, drifted, paired_key

    source = "real set" if reference.get("source") == "real" else "teacher"
    start = start or {}
    counts = counts_in(latest)
    names = [f"drift_{{}}{STEPS_MARK}{k}" for k in counts] or ["drift_{}"]
    students = [f"{k} steps" for k in counts] or ["student"]
    out = [f"## Drift against the {source} (latest eval)", "",
           f"| statistic (unit) | {source} ± standard error | run's start | band (start ± half-width) | "
           + " | ".join(students) + " | in band |",
           "|---|---|---|---|" + "---|" * len(students) + "---|"]
    for key, value in sorted((reference.get("value") or {}).items()):
        cells = [latest.get(name.format(key)) for name in names]
        firsts = [start.get(name.format(key)) for name in names]  # each step count from its own start
        halves = [drift_band(key, reference, latest.get(paired_key(name.format(key)))) for name in names]
        judged = [half is not None and _number(value) and _number(f) and _number(c)
                  for c, f, half in zip(cells, firsts, halves)]
        verdicts = [("yes" if abs(c - f) <= half else "no" if drifted(c, f, value, half)
                     else f"out, towards the {source}: no drift") if ok else ""
                    for c, f, half, ok in zip(cells, firsts, halves, judged)]
        verdict = next((v for v in ("no", f"out, towards the {source}: no drift", "yes") if v in verdicts), "not judged")
        unit = drift_unit(key)
        starts = "; ".join("" if f is None else cell(round_sig(f)) for f in firsts)
        bands = "; ".join(f"{cell(round_sig(f - half))} to {cell(round_sig(f + half))}" if _number(f) and half is not None
                          else "" for f, half in zip(firsts, halves))
        out.append(f"| {key}" + (f" ({unit})" if unit else "") + f" | {cell(round_sig(value))} ± "
                   f"{cell(round_sig((reference.get('se') or {}).get(key)))} | {starts} | {bands} | "
                   + " | ".join("" if c is None else cell(round_sig(c)) for c in cells) + f" | {verdict} |")
    collapsed = [k for k in flags if k.startswith("diversity_")]
    if collapsed:
        out += ["", f"Within-prompt diversity fell steeply from the first eval's (collapsing): {', '.join(collapsed)}."]
    return out + [""]
