"""How often does the regression call fire on healthy nights, and how often on real regressions?
(issue 55, item 2). Prints one JSON line.

Simulated nights of a joint run, the KID's sampling noise as the product computes it: per
modality (picture, sound) a fixed real set of ``--real`` rows (the cached reference every night is
measured against) and, each night, ``--samples`` fresh student samples from a fixed feature
distribution, both ``--width`` wide; the figure is ``kernel.projected_kid`` and its standard error
``kernel.projected_kid_se``, as the teacher evaluator writes them. A healthy student is a little
off the real set (mean shift ``--healthy-shift`` per coordinate, scale 1.1: a KID well above 0, as
a trained student's is); a regressed one moves further (``--regressions``: the extra mean shift)
in the picture, the sound, or both. A campaign is ``--nights`` nights; every night after the
first is judged against those before it (one eval a night: its best is its eval).

Rules compared on the same nights:
- ``margin``: today's, the mean of the modalities' KIDs (the run's ``real_kid``) above the median
  of the previous nights' by more than 25% (flows.alerts.night_regression on rows without
  per-modality figures);
- ``joint_k2``: ``evaluation.criterion.regression`` per modality (``REGRESSION_K`` = 2 standard
  errors and the 25% margin), as flows.alerts.night_regression calls it on today's rows;
  ``joint_k3`` and ``joint_k1.5`` the same at 3 and 1.5 standard errors, for the trade-off.

Also the standard error's calibration: its median over healthy nights against the spread of the
KID over those nights (the jackknife is known to be a little conservative).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dmd2_core.evaluation import criterion
from dmd2_core.evaluation.kernel import STD_FLOOR, kernel_distance, kernel_distance_sample_se, projection

MODALITIES = ("picture", "sound")


def night_figures(reference: dict, generator: torch.Generator, ns, shift: dict) -> dict:
    """One night's figures per modality: {modality: {key, value, se}} (``criterion.best_figures``'s shape)."""
    out = {}
    for m in MODALITIES:
        samples = torch.randn(ns.samples, ns.width, generator=generator) * 1.1 + ns.healthy_shift + shift.get(m, 0.0)
        # projected_kid and projected_kid_se, the reference's projection and statistics made once a campaign
        ref, p, mean, std = reference[m]
        projected = (samples.double() @ p - mean) / std
        out[m] = {"key": f"real_kid_{m}", "value": kernel_distance(ref, projected),
                  "se": kernel_distance_sample_se(ref, projected), "lower_is_better": True}
    return out


def margin_rule(previous: list[dict], tonight: dict, margin: float) -> bool:
    """Today's rule on the mean of the modalities (``flows.alerts.night_regression``, scalar path)."""
    values = [statistics.mean(p[m]["value"] for m in MODALITIES) for p in previous]
    best = statistics.mean(tonight[m]["value"] for m in MODALITIES)
    median = statistics.median(values)
    scale = median if median > 0 else max(abs(median), max(values) - min(values))
    return best > median + margin * scale


def cached_reference(rows: torch.Tensor) -> tuple:
    """A real set as ``kernel.standardised_projection`` uses it: (its projected, standardised rows,
    the projection, the mean and std the samples are standardised with)."""
    p = projection(rows.shape[1]).double()
    basis = rows.double() @ p
    mean, std = basis.mean(0), basis.std(0).clamp_min(STD_FLOOR)
    return (basis - mean) / std, p, mean, std


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--campaigns", type=int, default=300)
    parser.add_argument("--nights", type=int, default=8)
    parser.add_argument("--samples", type=int, default=32, help="the student's eval samples (the recipe's 32)")
    parser.add_argument("--real", type=int, default=256, help="the real set's rows (eval_real_samples)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--healthy-shift", type=float, default=0.1)
    parser.add_argument("--regressions", type=float, nargs="+", default=[0.1, 0.2, 0.3])
    parser.add_argument("--margin", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args()
    started = time.perf_counter()
    g = torch.Generator().manual_seed(ns.seed)
    rules = {"margin": lambda prev, now: margin_rule(prev, now, ns.margin),
             "joint_k3": lambda prev, now: bool(criterion.regression(prev, now, ns.margin, k=3.0)),
             "joint_k2": lambda prev, now: bool(criterion.regression(prev, now, ns.margin, k=criterion.REGRESSION_K)),
             "joint_k1.5": lambda prev, now: bool(criterion.regression(prev, now, ns.margin, k=1.5))}
    kinds = {"picture": ("picture",), "sound": ("sound",), "both": MODALITIES}
    false_alarms = {r: 0 for r in rules}
    detected = {r: {f"{kind}_{size:g}": 0 for kind in kinds for size in ns.regressions} for r in rules}
    judged = campaigns_judged = 0
    healthy_values, healthy_ses = {m: [] for m in MODALITIES}, {m: [] for m in MODALITIES}
    for _ in range(ns.campaigns):
        reference = {m: cached_reference(torch.randn(ns.real, ns.width, generator=g)) for m in MODALITIES}
        nights = [night_figures(reference, g, ns, {}) for _ in range(ns.nights)]
        for m in MODALITIES:
            healthy_values[m] += [n[m]["value"] for n in nights]
            healthy_ses[m] += [n[m]["se"] for n in nights]
        for i in range(1, ns.nights):
            judged += 1
            for r, rule in rules.items():
                false_alarms[r] += rule(nights[:i], nights[i])
        # the last night regressed instead, each kind and size, against the same healthy nights before it
        campaigns_judged += 1
        for kind, modalities in kinds.items():
            for size in ns.regressions:
                regressed = night_figures(reference, g, ns, {m: size for m in modalities})
                for r, rule in rules.items():
                    detected[r][f"{kind}_{size:g}"] += rule(nights[:-1], regressed)
    out = {
        "bench": "joint_criterion", "campaigns": ns.campaigns, "nights": ns.nights, "samples": ns.samples,
        "real": ns.real, "width": ns.width, "healthy_shift": ns.healthy_shift, "margin": ns.margin,
        "healthy_kid_mean": {m: round(statistics.mean(v), 4) for m, v in healthy_values.items()},
        "healthy_kid_sd": {m: round(statistics.stdev(v), 4) for m, v in healthy_values.items()},
        "healthy_se_median": {m: round(statistics.median(v), 4) for m, v in healthy_ses.items()},
        "healthy_nights_judged": judged,
        "false_alarm_rate": {r: round(v / judged, 4) for r, v in false_alarms.items()},
        "detection_rate": {r: {k: round(v / campaigns_judged, 3) for k, v in d.items()} for r, d in detected.items()},
        "regressed_kid_mean": {f"{size:g}": round(statistics.mean(
            night_figures(reference, g, ns, {"picture": size})["picture"]["value"] for _ in range(20)), 4)
            for size in ns.regressions},
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
