"""One criterion for a joint night (dmd2_core/evaluation/criterion.py): the best student is not one
whose picture improved while its sound degraded, a night within the KID's own noise is not called
regressed while a real regression is, the KID's standard error is the jackknife's, and the sound's
drift row sees a noise floor."""

from __future__ import annotations

import math

import pytest
import torch

from dmd2_core import evaluators, report
from dmd2_core.evaluation import drift
from dmd2_core.evaluation.kernel import kernel_distance, kernel_distance_sample_se
from dmd2_core.evaluation.teacher_evaluator import drift_flags
from dmd2_core.report import nights_view
from flows.alerts import night_regression

SE = 0.01


def joint_eval(iteration: int, picture: float, sound: float, se: float = SE) -> dict:
    """An eval row of a joint run with a real set, as the driver keeps it (figures and their SEs)."""
    return {"iteration": iteration, "real_kid": (picture + sound) / 2, "real_kid_video": picture,
            "real_kid_video_se": se, "real_kid_audio": sound, "real_kid_audio_se": se}


def test_a_student_whose_picture_improves_while_its_sound_degrades_is_not_the_best():
    teacher = evaluators.get("teacher")
    start, balanced = joint_eval(0, 0.50, 0.50), joint_eval(10, 0.10, 0.05)
    louder = joint_eval(20, 0.02, 0.12)  # the picture 8 SE better, the sound 7 SE worse; its mean KID lower
    assert louder["real_kid"] < balanced["real_kid"]
    evals = [start, balanced, louder]
    assert report.campaign_best(evals, teacher.joint_criteria)["iteration"] == 10
    assert report.best_eval(evals, teacher.joint_criteria)["iteration"] == 10
    # within its noise the sound does not veto: a later student better on balance is the best
    steady = joint_eval(30, 0.02, 0.055)
    assert report.campaign_best(evals + [steady], teacher.joint_criteria)["iteration"] == 30
    # one figure (an image run, or rows before figures had standard errors): the lowest, the latest of equals
    assert report.best_eval([{"iteration": 1, "fd": 2.0}, {"iteration": 2, "fd": 1.0}, {"iteration": 3, "fd": 1.0}],
                            ("fd",))["iteration"] == 3
    # the nights row and the summary name the same student
    view = {"name": "n", "evaluator": "teacher", "evals": evals, "start": 0, "iteration": 20, "final": 20}
    row = nights_view.night_row(view, "completed", 1.0, "id", None, "2026-12-07")
    assert (row["best_iteration"], row["campaign_best_iteration"]) == (10, 10)
    assert row["best_figures"]["sound"] == {"key": "real_kid_audio", "value": 0.05, "se": SE, "lower_is_better": True}


def night(picture: float, sound: float, se: float = SE, iteration: int = 10) -> dict:
    view = {"name": "n", "evaluator": "teacher", "start": 0, "iteration": iteration, "final": iteration,
            "evals": [joint_eval(0, 1.0, 1.0), joint_eval(iteration, picture, sound, se)]}
    return nights_view.night_row(view, "completed", 1.0, f"id-{picture}-{sound}", None, "d")


def test_a_night_within_the_kids_noise_is_no_regression_and_a_sound_regression_is():
    previous = [night(0.030, 0.030), night(0.040, 0.035), night(0.035, 0.040)]
    # 57% above the median in both: today's 25% margin alone called this; 2 standard errors do not
    healthy = night(0.055, 0.055)
    assert night_regression(previous, healthy, 0.25) is None
    sound_only = night(0.020, 0.150)  # the picture better, the sound 11 standard errors worse
    reason = night_regression(previous, sound_only, 0.25)
    assert reason.startswith("sound: best ") and "0.15 is 0.115 above the median 0.035 of 3 previous nights" in reason
    assert "picture" not in reason
    both = night_regression(previous, night(0.200, 0.150), 0.25)
    assert both.startswith("picture: ") and "; sound: " in both
    # without standard errors (rows before them) the margin alone decides, per modality
    assert night_regression([night(0.030, 0.030, se=None)], night(0.040, 0.030, se=None), 0.25).startswith("picture")


def test_the_kids_standard_error_is_the_jackknife_over_the_samples():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(7, 5, generator=g, dtype=torch.float64), torch.randn(7, 5, generator=g, dtype=torch.float64) + 0.3

    def jackknife(values):
        values = torch.tensor(values, dtype=torch.float64)
        return float(((len(values) - 1) / len(values) * (values - values.mean()).pow(2).sum()).sqrt())

    pairs = [kernel_distance(torch.cat([x[:i], x[i + 1:]]), torch.cat([y[:i], y[i + 1:]])) for i in range(7)]
    assert kernel_distance_sample_se(x, y) == pytest.approx(jackknife(pairs), rel=1e-9)  # paired rows: a pair out
    reference = torch.randn(11, 5, generator=g, dtype=torch.float64)
    samples = [kernel_distance(reference, torch.cat([y[:i], y[i + 1:]])) for i in range(7)]
    assert kernel_distance_sample_se(reference, y) == pytest.approx(jackknife(samples), rel=1e-9)  # the reference fixed


def _tones(n=8, rate=8000, samples=2048) -> torch.Tensor:
    t = torch.arange(samples) / rate
    freqs = torch.linspace(300.0, 900.0, n)[:, None]
    return (0.8 * torch.sin(2 * math.pi * freqs * t))[:, None].expand(n, 2, samples).clone()


def _per_clip(audio: torch.Tensor, rate: int) -> dict:
    """``drift.pooled`` of each clip's sound statistics, keyed as an eval's (``<statistic>_audio``)."""
    return drift.pooled([{f"{k}_audio": v for k, v in drift.audio_stats(clip[None], rate).items()} for clip in audio])


def test_the_sounds_drift_row_sees_a_noise_floor():
    rate, g = 8000, torch.Generator().manual_seed(0)
    clean = _tones()
    floors = [float(drift.noise_floor(clean + r * torch.randn(clean.shape, generator=g), rate).mean())
              for r in (1e-3, 1e-2, 1e-1)]
    assert floors[0] < floors[1] < floors[2] and floors[2] - floors[1] == pytest.approx(20.0, abs=2.0)
    # loudness and peak barely move under a floor 5x higher, far below the tone; the floor statistic by 14 dB
    start = _per_clip(clean + 1e-3 * torch.randn(clean.shape, generator=g), rate)
    hissing = _per_clip(clean + 5e-3 * torch.randn(clean.shape, generator=g), rate)
    real = _per_clip(clean, rate)
    latest = {f"drift_{k}": v for k, v in hissing["value"].items()}
    first = {f"drift_{k}": v for k, v in start["value"].items()}
    assert abs(latest["drift_loudness_audio"] - first["drift_loudness_audio"]) < 0.1
    assert drift_flags(latest, first, real) == ["drift_floor_audio"]
