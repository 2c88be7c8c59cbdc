"""The weight-free sound distance ``sound_mel_kid``: centred on 0 for one set of clips, growing
with the hiss the joint recipe's students grow, with a standard error a regression rule can use;
carried beside the drift statistics where the eval decodes, and shown in the run's summary,
metrics table and nights view."""

from __future__ import annotations

import math

import pytest
import torch

from dmd2_core.evaluation import drift
from dmd2_core.evaluation.sound_distance import (SOUND_FEATURES, clip_features, sound_mel_kid, split_sound_features,
                                                 with_sound_features)

RATE = 8000
SAMPLES = 2000  # 0.25 s


def tones(n: int, seed: int, floor: float = 0.0) -> torch.Tensor:
    """``n`` stereo clips [n, 2, SAMPLES]: a tone of 200-1200 Hz at 0.5, panned at random, plus a
    white floor of RMS ``floor``."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(SAMPLES) / RATE
    freq = 200 + 1000 * torch.rand(n, 1, generator=g)
    phase = 2 * math.pi * torch.rand(n, 1, generator=g)
    pan = torch.rand(n, 1, generator=g) * math.pi / 2
    tone = 0.5 * torch.sin(2 * math.pi * freq * t + phase)
    audio = torch.stack([tone * pan.cos(), tone * pan.sin()], dim=1)
    return audio + floor * torch.randn(audio.shape, generator=g)


def test_one_set_of_clips_is_at_zero_and_a_white_floor_moves_it_further_the_louder_it_is():
    reference = clip_features(tones(32, 0), RATE)
    same = sound_mel_kid(reference, clip_features(tones(32, 1), RATE))
    assert abs(same["sound_mel_kid"]) < 2 * same["sound_mel_kid_se"], same
    hiss = [sound_mel_kid(reference, clip_features(tones(32, 1, floor), RATE)) for floor in (0.001, 0.01, 0.05)]
    values = [h["sound_mel_kid"] for h in hiss]
    assert values == sorted(values) and values[0] > same["sound_mel_kid"] + 3 * hiss[0]["sound_mel_kid_se"], values
    assert all(math.isfinite(h["sound_mel_kid"]) and h["sound_mel_kid"] < 1e4 for h in hiss), values


def test_the_clips_features_ride_beside_the_drift_statistics_and_come_apart_for_pooling():
    decoded = {"video": torch.zeros(3, 3, 2, 8, 8), "audio": tones(3, 0), "sample_rate": RATE, "fps": 24}
    per_sample = with_sound_features(drift.per_sample_stats(decoded), decoded)
    assert all(SOUND_FEATURES in p for p in per_sample)
    stats, features = split_sound_features(per_sample)
    assert features.shape[0] == 3 and torch.equal(features, clip_features(decoded["audio"], RATE))
    assert drift.pooled(stats) == drift.pooled(drift.per_sample_stats(decoded))
    pictures = torch.zeros(3, 3, 8, 8)  # no sound: nothing beside the statistics
    assert split_sound_features(with_sound_features(drift.per_sample_stats(pictures), pictures))[1] is None


class SoundRun:
    """What an eval asks of a run with sound, answered from latents that are clips: a latent's
    first entry is its white floor's RMS (the student's is ``floor``, the teacher's and the real
    set's 0). The teacher's features are noise: the alarm, not what is tested here."""

    def __init__(self, args, floor: float):
        self.args, self.has_critic, self.floor = args, True, floor

    def _latents(self, order, seed, floor):
        return torch.full((len(order), 1), floor) + 0 * seed

    def eval_latents(self, order, seed, num_steps=None):
        return self._latents(order, seed, self.floor)

    def sample(self, order, seed, num_steps=None):
        return self.decode(self.eval_latents(order, seed, num_steps))

    def teacher_reference(self, order, seed, steps):
        return self._latents(order, seed, 0.0)

    def teacher_features(self, latents, order, u, seed):
        g = torch.Generator().manual_seed(int(seed) + 1000 * int(latents[0, 0] * 1000))
        return {m: torch.randn(len(order), 16, generator=g) for m in ("video", "audio")}

    def decode(self, latents):
        clips = [tones(1, i, float(latents[i, 0])) for i in range(latents.shape[0])]
        return {"video": torch.zeros(latents.shape[0], 3, 2, 8, 8), "audio": torch.cat(clips), "sample_rate": RATE,
                "fps": 24}

    def drift_stats(self, latents):
        decoded = self.decode(latents)
        return with_sound_features(drift.per_sample_stats(decoded), decoded)


def test_a_night_with_sound_shows_sound_mel_kid_in_its_summary_table_and_nights_view(tiny_teacher, tmp_path):
    from dmd2_core import evaluators as registry
    from dmd2_core import report
    from dmd2_core.evaluation import teacher_evaluator
    from dmd2_core.report import nights_view
    from tests.helpers import tiny_args

    args = tiny_args(tiny_teacher, str(tmp_path / "run"), evaluator="teacher", eval_interval=1, eval_num_samples=12,
                     eval_reference_steps=2, eval_prompts=[0, 1, 2])
    clean = teacher_evaluator.evaluate(SoundRun(args, 0.0), args)["metrics"]
    hissing = teacher_evaluator.evaluate(SoundRun(args, 0.02), args)["metrics"]
    assert abs(clean["sound_mel_kid"]) <= 3 * clean["sound_mel_kid_se"], clean  # the same clips: 0 within 0
    assert hissing["sound_mel_kid"] > clean["sound_mel_kid"] + 3 * hissing["sound_mel_kid_se"], (clean, hissing)

    teacher = registry.get("teacher")
    rows = [{"iteration": 0, "dmd2_loss": 1.0, **clean}, {"iteration": 5, "dmd2_loss": 0.5, **hissing}]
    view = {"name": "n", "evaluator": "teacher", "iteration": 5, "final": 5, "start": 0, "evals": rows}
    summary = report.summary_markdown(view)
    assert "sound_mel_kid" in next(line for line in summary.splitlines() if line.startswith("Quality before")), summary
    assert any(line.startswith("| iteration |") and "sound_mel_kid" in line for line in summary.splitlines()), summary
    table = report.metrics_table(rows, report.table_columns(teacher))
    assert table[0]["sound_mel_kid"] == report.round_sig(hissing["sound_mel_kid"])
    row = nights_view.night_row(view, "Completed", 1.0, "id", None, "2026-12-06")
    assert row["sound_mel_kid"] == pytest.approx(hissing["sound_mel_kid"])
    header = next(line for line in nights_view.nights_markdown("dmd2/x", [row], None).splitlines()
                  if line.startswith("| date |"))
    assert "sound_mel_kid" in header.split(" | ") and "sound_mel_kid_se" not in header, header
    assert teacher.label("real_kid_audio").startswith("sound alarm")  # the teacher's ears: the alarm, same key


def test_the_sound_is_measured_against_the_teachers_clips_even_beside_a_real_set(tiny_teacher, tmp_path):
    """With a real set whose clips hiss (the real floor far from the teacher's), a student that
    sounds as the teacher does reads 0 within its noise and a hissing one far above: against the
    real set every student would sit far from its floor alike, and the ranking among them be lost
    (bench/README.md, 2026-12-06: Spearman 0.60 against the real set, 0.90 against the teacher)."""
    from dmd2_core.data import REAL_LATENTS, write_safetensors
    from dmd2_core.evaluation import teacher_evaluator
    from tests.helpers import tiny_args

    class WithRealSet(SoundRun):
        def real_features(self, rows, u, seed, offset):
            g = torch.Generator().manual_seed(seed)
            return {m: torch.randn(len(rows), 16, generator=g) for m in ("video", "audio")}

    real = str(tmp_path / "real.safetensors")
    write_safetensors(real, {REAL_LATENTS: torch.full((12, 1), 0.05)})  # every real clip hisses
    args = tiny_args(tiny_teacher, str(tmp_path / "run"), evaluator="teacher", eval_interval=1, eval_num_samples=12,
                     eval_reference_steps=2, eval_prompts=[0, 1, 2], real_data=real, eval_real_samples=12)
    like_teacher = teacher_evaluator.evaluate(WithRealSet(args, 0.0), args)["metrics"]
    hissing = teacher_evaluator.evaluate(WithRealSet(args, 0.02), args)["metrics"]
    assert "real_kid" in like_teacher  # the real set is there, and measured in the teacher's features
    assert abs(like_teacher["sound_mel_kid"]) <= 3 * like_teacher["sound_mel_kid_se"], like_teacher
    assert hissing["sound_mel_kid"] > like_teacher["sound_mel_kid"] + 3 * hissing["sound_mel_kid_se"], hissing


def test_an_eval_that_cannot_measure_the_sound_says_why_and_pictures_alone_say_nothing(caplog):
    """What preflight cannot know (a cached reference made with fewer clips or without their
    features, clips decoded without sound) leaves sound_mel_kid out of that eval with a warning
    naming why, never silently; a run of pictures alone has no sound to measure and no warning."""
    import logging

    from dmd2_core.evaluation.sound_distance import MIN_CLIPS
    from dmd2_core.evaluation.teacher_evaluator import sound_figures

    student = clip_features(tones(4, 1), RATE)
    with caplog.at_level(logging.WARNING, logger="dmd2"):
        assert sound_figures(None, None, "teacher") == {}
        assert not caplog.records
        assert set(sound_figures(clip_features(tones(MIN_CLIPS, 0), RATE), student, "teacher")) == {
            "sound_mel_kid", "sound_mel_kid_se"}
        assert sound_figures(clip_features(tones(2, 0), RATE), student, "real set") == {}
        assert sound_figures(None, student, "teacher") == {}
        assert sound_figures(clip_features(tones(4, 0), RATE), None, "teacher") == {}
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert lines == ["sound_mel_kid left out of this eval (against the real set reference): 4 clips against 2 reference "
                     "clips; it needs at least 3 on each side (its standard error)",
                     "sound_mel_kid left out of this eval (against the teacher reference): the reference has no clip "
                     "features",
                     "sound_mel_kid left out of this eval (against the teacher reference): the samples have no clip "
                     "features"], lines
    with pytest.raises(ValueError, match="sound_mel_kid: 2 clips against 4 reference clips"):
        sound_mel_kid(student, student[:2])


def test_a_floor_that_rises_a_little_on_every_clip_is_judged_against_the_same_clips_at_the_start(tiny_teacher, tmp_path):
    """The run's first eval keeps its clips' statistics in its save; a later eval of the same clips
    (eval seed and prompts) judges the floor's rise clip by clip, so +1.2 dB on every clip is a
    drift, where the yardstick's spread between tones (a band of 3 dB or more) hides it. The same
    clips again are no drift; an eval of other clips is not paired with a start that is not theirs.
    The summary's drift table shows the band the rule judged."""
    from dmd2_core.evaluation.teacher_evaluator import PAIRED_SE, drift_band, drift_flags, evaluate
    from dmd2_core.report.summary import drift_table
    from tests.helpers import tiny_args

    args = tiny_args(tiny_teacher, str(tmp_path / "run"), evaluator="teacher", eval_interval=1, eval_num_samples=12,
                     eval_reference_steps=2, eval_prompts=[0, 1, 2])
    first = evaluate(SoundRun(args, 0.01), args)
    assert not [k for k in first["metrics"] if k.startswith(PAIRED_SE)]  # the start: nothing to pair with
    again = evaluate(SoundRun(args, 0.01), args)["metrics"]
    rising = evaluate(SoundRun(args, 0.0115), args)
    reference, start = rising["reference"], first["metrics"]
    assert rising["metrics"]["drift_floor_audio"] - start["drift_floor_audio"] == pytest.approx(1.2, abs=0.1)
    assert drift_band("floor_audio", reference) >= 3.0
    def drifts(metrics):  # the drift rows (the teacher's features here are noise: their diversity is not tested)
        return [k for k in drift_flags(metrics, start, reference) if k.startswith("drift_")]

    assert drifts(again) == []
    assert drifts(rising["metrics"]) == ["drift_floor_audio"]
    assert drifts({k: v for k, v in rising["metrics"].items() if not k.startswith(PAIRED_SE)}) == []
    row = next(line for line in drift_table(reference, rising["metrics"], ["drift_floor_audio"], start)
               if line.startswith("| floor_audio"))
    assert row.endswith("| no |"), row
    other = evaluate(SoundRun(args, 0.0115), args.model_copy(update={"eval_seed": 7}))["metrics"]
    assert not [k for k in other if k.startswith(PAIRED_SE)]
