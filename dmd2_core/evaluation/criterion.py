"""One criterion for a run with several modalities: how the picture's and the sound's figures
combine to pick the best student and to call a night regressed.

An evaluator declares its criterion per modality (``Criterion``: the figure, in order of
preference, its standard error under ``<key>_se`` and its direction). The two uses weigh errors
differently, so they use the same comparison at two widths:

- **The best student** (``best_of``): a later eval replaces the best so far only when no modality
  is worse by more than ``BEST_K`` (1) standard error of the difference, and it is better on
  balance (the sum of its differences in standard errors is at most 0; with one modality: its
  figure is at most the best's, the latest of equals, as before). A student whose picture improves
  while its sound degrades beyond its noise is therefore never called the best, however much the
  picture gained: a sum of standardised figures (the other candidate) would trade a real loss of
  sound for a gain of picture, which is the failure this rule exists to stop. The cost of the narrow
  veto is a genuine improvement held back by one noisy eval (the next eval gets its own chance);
  the cost of a wide one is exporting a student that sounds worse.
- **A regressed night** (``regression``): per modality, the night's best figure against the median
  of the previous nights' by more than max(``REGRESSION_K`` standard errors of the difference, the
  run's relative margin of the median), as a drift statistic leaves its band
  (``teacher_evaluator.drift_band``: k standard errors or its floor); any modality beyond its band
  is a regression. Measured on simulated nights at 32 samples (bench/joint_criterion.py): the
  margin alone fired on 36% of healthy nights; 2 standard errors on 0.7% (3 on none, but they
  missed most regressions of 3.7x the healthy KID; 1.5 on 4.1%, too near the 5% asked).

Figures without a standard error (the toy worlds' FD, rows written before figures had one) are
compared as before: worse is any amount worse for the best, the margin alone for a regression.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence, Union

BEST_K = 1.0
REGRESSION_K = 2.0  # measured (bench/joint_criterion.py): 0.7% false alarms at 32 samples; 3 missed 3.7x regressions


@dataclass(frozen=True)
class Criterion:
    """One modality's part of the run's criterion: ``keys`` the figure, in order of preference (a
    run uses the first its evals carry: the real set's before the teacher's, the audio distance
    before the teacher-feature audio KID), each with its standard error at ``<key>_se``."""
    modality: str
    keys: tuple[str, ...]
    lower_is_better: bool = True
    fallback: bool = False  # used only where the evals carry no other modality's figure (older evals)

    @staticmethod
    def se_key(key: str) -> str:
        return f"{key}_se"


Criteria = Union[Sequence[Criterion], Iterable[str]]


def as_criteria(criteria: Criteria) -> tuple[Criterion, ...]:
    """``criteria`` as ``Criterion`` objects: plain figure names (an evaluator's ``criteria``, a
    single-figure criterion) become one modality, ``quality``."""
    criteria = tuple(criteria)
    if all(isinstance(c, Criterion) for c in criteria):
        return criteria
    return (Criterion("quality", tuple(str(c) for c in criteria)),)


def number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def resolved(evals: list[dict], criteria: Criteria) -> dict[Criterion, str]:
    """Each modality's figure for these evals: the first of its keys any of them carries (a
    modality none carries is left out); a ``fallback`` criterion only when no other resolves."""
    out = {}
    criteria = as_criteria(criteria)
    for c in criteria:
        key = next((k for k in c.keys if any(number(e.get(k)) is not None for e in evals)), None)
        if key and not c.fallback:
            out[c] = key
    if not out:
        for c in criteria:
            key = next((k for k in c.keys if any(number(e.get(k)) is not None for e in evals)), None)
            if key and c.fallback:
                return {c: key}
    return out


def differences(a: dict, b: dict, keys: dict[Criterion, str]) -> list[tuple[Criterion, str, float, Optional[float]]]:
    """Per modality both carry: (criterion, key, how much worse ``a`` is than ``b`` in the figure's
    direction, the standard error of that difference or None when either lacks one)."""
    out = []
    for c, key in keys.items():
        va, vb = number(a.get(key)), number(b.get(key))
        if va is None or vb is None:
            continue
        sa, sb = number(a.get(c.se_key(key))), number(b.get(c.se_key(key)))
        worse = (va - vb) if c.lower_is_better else (vb - va)
        out.append((c, key, worse, math.hypot(sa, sb) if sa is not None and sb is not None else None))
    return out


def beats(challenger: dict, best: dict, keys: dict[Criterion, str], k: float = BEST_K) -> bool:
    """Whether ``challenger`` replaces ``best``: on the modalities both carry (at least one), none
    worse by more than ``k`` standard errors of the difference (any amount without one), and better
    on balance (the differences in standard errors sum to at most 0; a difference without one
    counts by its sign)."""
    diffs = differences(challenger, best, keys)
    if not diffs:
        return False
    balance = 0.0
    for _, _, worse, se in diffs:
        if worse > (k * se if se else 0.0):
            return False
        balance += worse / se if se else math.copysign(1.0, worse) if worse else 0.0
    return balance <= 0


def best_of(evals: list[dict], criteria: Criteria) -> Optional[dict]:
    """The best of ``evals`` by the criterion: in iteration order, each eval replaces the best so
    far when it ``beats`` it. None without an eval that carries a figure of the criterion."""
    keys = resolved(evals, criteria)
    scored = sorted((e for e in evals if any(number(e.get(key)) is not None for key in keys.values())),
                    key=lambda e: e.get("iteration", 0))
    best = None
    for e in scored:
        if best is None or beats(e, best, keys):
            best = e
    return best


def best_figures(e: Optional[dict], criteria: Criteria, evals: Optional[list[dict]] = None) -> dict[str, dict]:
    """Eval ``e``'s figures of the criterion, by modality: {modality: {key, value, se}} (the keys
    as ``resolved`` over ``evals``, default ``[e]``): what a nights row keeps for ``regression``."""
    if not e:
        return {}
    out = {}
    for c, key in resolved(evals or [e], criteria).items():
        if number(e.get(key)) is not None:
            out[c.modality] = {"key": key, "value": number(e.get(key)), "se": number(e.get(c.se_key(key))),
                               "lower_is_better": c.lower_is_better}
    return out


def median_se(ses: list[float]) -> Optional[float]:
    """The standard error of the median of nights whose figures each have about these standard
    errors: the mean's for one or two, sqrt(pi / 2) times it from three on (a normal sample's
    median)."""
    if not ses:
        return None
    typical = statistics.median(ses) / math.sqrt(len(ses))
    return typical * (math.sqrt(math.pi / 2) if len(ses) >= 3 else 1.0)


def regression(previous: list[dict], tonight: dict[str, dict], margin: float, k: float = REGRESSION_K,
               label=lambda key: key) -> list[str]:
    """Why a night regressed, one reason per modality (empty: it did not): ``tonight`` and each of
    ``previous`` are ``best_figures`` ({modality: {key, value, se}}). Per modality, the previous
    nights' values of the same figure and their median m; a regression when tonight's is worse than
    m by more than max(k standard errors of the difference (tonight's and the median's,
    ``median_se``), ``margin`` of the scale): the scale is |m|, or for m <= 0 (an unbiased KID at its
    noise floor) the larger of |m| and the previous nights' range. Without standard errors the
    margin alone decides."""
    reasons = []
    for modality, now in tonight.items():
        value, key = number(now.get("value")), now.get("key")
        lower = now.get("lower_is_better", True)
        before = [p[modality] for p in previous if (p.get(modality) or {}).get("key") == key
                  and number(p[modality].get("value")) is not None]
        if value is None or not before:
            continue
        values = [p["value"] for p in before]
        median = statistics.median(values)
        scale = abs(median) if median > 0 else max(abs(median), max(values) - min(values))
        ses = [s for p in before if (s := number(p.get("se"))) is not None]
        se_now = number(now.get("se"))
        noise = math.hypot(se_now, median_se(ses)) if se_now is not None and len(ses) == len(before) else None
        band = max(k * noise if noise is not None else 0.0, margin * scale)
        worse = value - median if lower else median - value
        if worse > band:
            nights = f"{len(values)} previous night{'' if len(values) == 1 else 's'}"
            why = (f"{k:g} standard errors ({noise:.3g}) and " if noise is not None else "") + \
                f"{100 * margin:.0f}% of {'the median' if median > 0 else 'their spread'} {scale:.3g}"
            reasons.append(f"{modality}: best {label(key)} {value:.3g} is {worse:.3g} "
                           f"{'above' if lower else 'below'} the median {median:.3g} of {nights}, beyond {why}")
    return reasons
