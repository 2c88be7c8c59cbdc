"""Evaluators by name. Each is imported only when a run (or a report of one) uses it, so a
production run never imports the toy worlds. A new evaluator: its module, and one line here (or
``register`` from a plugin)."""

from __future__ import annotations

import difflib
import importlib
from typing import Any

from dmd2_core.errors import ArgsError

TEACHER = "teacher"
EVALUATORS: dict[str, str] = {  # name -> "module:Evaluator subclass"
    TEACHER: "dmd2_core.evaluation.teacher_evaluator:TeacherEvaluator",
    "digits": "dmd2_core.toys.digits_world:DigitsEvaluator",
    "sounding-digits": "dmd2_core.toys.sounding_digits_world:SoundingDigitsEvaluator",
}
_LOADED: dict[str, Any] = {}


def names() -> tuple[str, ...]:
    return tuple(EVALUATORS)


def register(name: str, target: str) -> None:
    """Add (or replace) the evaluator ``name``: ``target`` is "module:Class"."""
    EVALUATORS[name] = target
    _LOADED.pop(name, None)


def check_name(name: str, key: str = "evaluator") -> str:
    """``name`` when it is a registered evaluator, else one line naming ``key`` and the nearest."""
    if name not in EVALUATORS:
        near = difflib.get_close_matches(name, EVALUATORS, n=1)
        raise ArgsError(f"{key}: no evaluator {name!r}; " + (f"did you mean {near[0]!r}?" if near
                                                             else f"one of {', '.join(EVALUATORS)}"))
    return name


def get(name: str):
    """The evaluator ``name`` (an ``evaluator.Evaluator``), imported on first use."""
    check_name(name)
    if name not in _LOADED:
        module, _, attr = EVALUATORS[name].partition(":")
        _LOADED[name] = getattr(importlib.import_module(module), attr)()
    return _LOADED[name]


def evaluator_for(view: dict):
    """The evaluator whose figures a run's summary view or nights row holds: the one it names
    (``evaluator``), else the first whose criterion its evals carry (a view written before views
    named theirs), else ``teacher``."""
    if view.get("evaluator") in EVALUATORS:
        return get(view["evaluator"])
    keys = {k for e in view.get("evals") or [view] for k, v in e.items() if v is not None}
    keys |= {view.get("criterion")} if view.get("criterion") else set()
    return next((get(n) for n in EVALUATORS if keys & set(get(n).criteria)), get(TEACHER))
