"""The weight-free evaluation core (dmd2_core.evaluation): the kernel distance is unbiased at a few
dozen samples and sees shifts and scale changes; its projection is one fixed matrix everywhere; the
teacher's features are deterministic, per modality, and each modality's features follow its own
part of the sample; the drift statistics move the way their names say; AV-Align falls as the sound
slips out of step with the picture."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from dmd2_core.evaluation import drift
from dmd2_core.evaluation.kernel import (kernel_distance, projected_kid, projection,
                                         standardised_projection)
from dmd2_core.evaluation.teacher_features import sample_noise, teacher_features

N = 32
REPEATS = 200
WIDTH = 96


# ---- the kernel distance --------------------------------------------------------------------------

def _mixing(width: int = WIDTH) -> torch.Tensor:
    """Correlated, offset features, as a network's are."""
    return torch.randn(width, width, generator=torch.Generator().manual_seed(1), dtype=torch.float64) / width ** 0.5


def _draws(g, mix, n=N, scale=1.0, shift=0.0, shared=None, share=0.0, offset=0.0):
    own = torch.randn(n, mix.shape[0], generator=g, dtype=torch.float64)
    z = own if shared is None else share ** 0.5 * shared + (1 - share) ** 0.5 * own
    return (z @ mix) * scale + shift + offset


def _mean_se(values) -> tuple[float, float]:
    v = torch.tensor(values, dtype=torch.float64)
    return float(v.mean()), float(v.std() / len(v) ** 0.5)


def test_kernel_distance_matches_its_formula():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(7, 3, generator=g, dtype=torch.float64)

    def k(a, b):
        return (float(a @ b) / 3 + 1) ** 3

    want = (sum(k(x[i], x[j]) for i in range(5) for j in range(5) if i != j) / 20
            + sum(k(y[i], y[j]) for i in range(7) for j in range(7) if i != j) / 42
            - 2 * sum(k(a, b) for a in x for b in y) / 35)
    assert kernel_distance(x, y) == pytest.approx(want, rel=1e-12)
    # equal sizes: the (i, i) pairs leave the cross term (Gretton's U-statistic)
    y5 = y[:5]
    want5 = (sum(k(x[i], x[j]) + k(y5[i], y5[j]) - k(x[i], y5[j]) - k(x[j], y5[i])
                 for i in range(5) for j in range(5) if i != j) / 20)
    assert kernel_distance(x, y5) == pytest.approx(want5, rel=1e-12)
    assert kernel_distance(x, x) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError):
        kernel_distance(x[:1], y)


def test_kernel_distance_is_unbiased_at_32_samples_and_sees_shift_and_scale():
    g, mix = torch.Generator().manual_seed(0), _mixing()
    p = projection(WIDTH, 64, 0).double()
    same = [kernel_distance(_draws(g, mix) @ p, _draws(g, mix) @ p) for _ in range(REPEATS)]
    mean, se = _mean_se(same)
    assert abs(mean) < 3 * se and min(same) < 0 < max(same)  # unbiased: scattered around 0, both signs
    shifted = _mean_se([kernel_distance(_draws(g, mix) @ p, _draws(g, mix, shift=0.3) @ p) for _ in range(REPEATS)])
    scaled = _mean_se([kernel_distance(_draws(g, mix) @ p, _draws(g, mix, scale=1.5) @ p) for _ in range(REPEATS)])
    for m, s in (shifted, scaled):
        assert m > 5 * s and m > 5 * abs(mean)


def test_rows_that_share_noise_stay_unbiased():
    """The teacher's and the student's sample i share prompt i and noise i: the cross pairs (i, i)
    are dependent. The estimator stays unbiased (the full cross mean would be far below 0), and
    the shared part cancels: the spread shrinks (common random numbers)."""
    g, mix = torch.Generator().manual_seed(2), _mixing()
    p = projection(WIDTH, 64, 0).double()
    null, alt, full = [], [], []
    for _ in range(REPEATS):
        shared = torch.randn(N, WIDTH, generator=g, dtype=torch.float64)
        x = _draws(g, mix, shared=shared, share=0.8) @ p
        y = _draws(g, mix, shared=shared, share=0.8) @ p
        y_alt = _draws(g, mix, shared=shared, share=0.8, scale=1.3) @ p
        null.append(kernel_distance(x, y))
        alt.append(kernel_distance(x, y_alt))
        full.append(kernel_distance(x, y[:-1]))  # unequal sizes: the full cross mean, biased here
    mean, se = _mean_se(null)
    assert abs(mean) < 3 * se
    assert _mean_se(alt)[0] > 10 * _mean_se(alt)[1]
    assert _mean_se(full)[0] < -10 * se


def test_projected_kid_on_the_reference_yardstick():
    g, mix = torch.Generator().manual_seed(3), _mixing()
    def draws(**kw):  # features far from 0, at no particular scale: the standardisation's work
        return 7.0 * _draws(g, mix, offset=2.0, **kw)

    same = [projected_kid(draws(), draws()) for _ in range(REPEATS)]
    shifted = [projected_kid(draws(), draws(shift=0.3)) for _ in range(REPEATS)]
    scaled = [projected_kid(draws(), draws(scale=1.5)) for _ in range(REPEATS)]
    m0, m_shift, m_scale = _mean_se(same)[0], _mean_se(shifted)[0], _mean_se(scaled)[0]
    # the reference's own statistics leave a small offset (documented), far below a real change
    assert min(same) < 0 and abs(m0) < 0.2 * min(m_shift, m_scale)
    assert m_shift > 5 * _mean_se(shifted)[1] and m_scale > 5 * _mean_se(scaled)[1]
    # statistics from an independent set of the reference's kind: unbiased
    with_stats = [projected_kid(draws(), draws(), stats=draws(n=64)) for _ in range(REPEATS)]
    mean, se = _mean_se(with_stats)
    assert abs(mean) < 3 * se


def test_standardised_by_the_reference_alone():
    g, mix = torch.Generator().manual_seed(4), _mixing()
    ref, samples = _draws(g, mix), _draws(g, mix, scale=3.0, shift=5.0)
    r, s = standardised_projection(ref, samples, dim=16)
    assert r.shape == (N, 16) and s.shape == (N, 16)
    assert torch.allclose(r.mean(0), torch.zeros(16, dtype=r.dtype), atol=1e-9)
    assert torch.allclose(r.std(0), torch.ones(16, dtype=r.dtype))
    r2, _ = standardised_projection(ref, samples * 10, dim=16)
    assert torch.equal(r, r2)  # the samples do not move the yardstick
    assert s.std(0).mean() > 2  # ... and stand out on it


def test_projection_is_fixed_orthonormal_and_the_same_in_every_process():
    p = projection(WIDTH, 64, 7)
    assert p.shape == (WIDTH, 64) and p.dtype == torch.float32
    assert torch.allclose(p.T @ p, torch.eye(64), atol=1e-5)
    assert torch.equal(p, projection(WIDTH, 64, 7))
    assert not torch.allclose(p, projection(WIDTH, 64, 8))
    assert projection(10, 64, 0).shape == (10, 10)  # narrower than dim: a rotation of the whole space
    # pinned: a change of generator or of the sign convention would move every night's figures
    assert projection(8, 2, 0)[:2].flatten().tolist() == pytest.approx(
        [0.03926178812980652, -0.11886988580226898, 0.1999848484992981, -0.07263956218957901], abs=1e-6)
    code = ("from dmd2_core.evaluation.kernel import projection; import hashlib; "
            f"print(hashlib.sha256(projection({WIDTH}, 64, 7).numpy().tobytes()).hexdigest())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    import hashlib

    assert other == hashlib.sha256(p.numpy().tobytes()).hexdigest()


# ---- the teacher's features ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def digits_teacher(tiny_teacher):
    from dmd2_core.models import load_model_dir
    from dmd2_core.models.sd3 import SD3ImageFamily

    return SD3ImageFamily(), load_model_dir(tiny_teacher).model


@pytest.fixture(scope="module")
def digits_batch():
    from dmd2_core.toys.digits import digits_prompt_set, digits_tensors

    x, y = digits_tensors("test")
    return x[:12], digits_prompt_set().cond(y[:12])


def test_sd3_features_are_fixed_per_sample_and_image_keyed(digits_teacher, digits_batch):
    family, model = digits_teacher
    x, cond = digits_batch
    model.train()
    feats = teacher_features(family, model, x, cond)
    assert model.training  # the caller's mode comes back
    assert set(feats) == {"image"} and feats["image"].shape == (12, family.feature_dim(model))
    assert not feats["image"].requires_grad and torch.isfinite(feats["image"]).all()
    again = teacher_features(family, model, x, cond)
    assert torch.equal(feats["image"], again["image"])
    # the noise is sample i's, whatever the batch: micro-batches and chunks give the same rows
    small = teacher_features(family, model, x, cond, micro_batch=5)
    assert torch.allclose(small["image"], feats["image"], atol=1e-5)
    tail = teacher_features(family, model, x[7:], {k: v[7:] for k, v in cond.items()}, index_offset=7)
    assert torch.allclose(tail["image"], feats["image"][7:], atol=1e-5)
    assert torch.equal(sample_noise((3, 2), 0, 7)[1], sample_noise((9, 2), 0, 0)[8])
    # another seed, block, noise level or picture: other features
    for other in (dict(seed=1), dict(block=0), dict(u=0.2)):
        assert not torch.allclose(teacher_features(family, model, x, cond, **other)["image"], feats["image"])
    flipped = teacher_features(family, model, x.flip(-1), cond)
    assert not torch.allclose(flipped["image"], feats["image"])


@pytest.fixture(scope="module")
def av_teacher():
    from dmd2_core.toys import sounding_digits_teacher

    model = sounding_digits_teacher.new_av_teacher_model(seed=0).eval()
    return sounding_digits_teacher.bound_family(model), model


@pytest.fixture(scope="module")
def av_batch():
    from dmd2_core.toys import sounding_digits as sd

    clips = sd.make_clips("test", 0)
    return clips, sd.prompt_set().cond(clips.labels[:8])


def test_h3_token_rows_are_video_and_audio_only(av_teacher):
    family, model = av_teacher
    rows = family.feature_tokens(5)
    _, frames, height, width = family.video_shape
    pt, ph, pw = family.patch_size
    assert len(rows["video"]) == frames // pt * (height // ph) * (width // pw)
    assert len(rows["audio"]) == family.audio_shape[0] * family.audio_shape[2]
    every = torch.cat([rows["video"], rows["audio"]])
    assert len(every.unique()) == len(every) and int(every.min()) >= 5  # the text rows [0, 5) are in neither


def test_h3_features_per_modality_follow_their_own_part(av_teacher, av_batch):
    from dmd2_core.toys import sounding_digits as sd

    family, model = av_teacher
    clips, cond = av_batch
    x0 = sd.encode(clips.frames[:8], clips.audio[:8])
    feats = teacher_features(family, model, x0, cond)
    assert set(feats) == {"video", "audio"}
    assert all(f.shape == (8, family.feature_dim(model)) for f in feats.values())
    assert all(torch.equal(feats[k], f) for k, f in teacher_features(family, model, x0, cond).items())

    def change(other):
        new = teacher_features(family, model, other, cond)
        return {k: float(((new[k] - feats[k]).norm(dim=1) / feats[k].norm(dim=1)).mean()) for k in feats}

    other_sound = change(sd.encode(clips.frames[:8], clips.audio[8:16]))
    assert other_sound["audio"] > 10 * other_sound["video"]
    other_picture = change(sd.encode(clips.frames[8:16], clips.audio[:8]))
    assert other_picture["video"] > 2 * other_picture["audio"]


def test_h3_prompts_of_several_lengths(av_teacher, av_batch):
    """MiniMax-H3 runs one forward per text length; the stopped tap must see every row."""
    from dmd2_core.toys import sounding_digits as sd
    from dmd2_core.toys.standins import h3_prompt_set

    family, model = av_teacher
    clips, _ = av_batch
    prompts = h3_prompt_set(num_prompts=6, seed=1)
    assert len(set(prompts.embeds["prompt_lengths"].tolist())) == 3
    cond = prompts.cond(torch.arange(6))
    x0 = sd.encode(clips.frames[:6], clips.audio[:6])
    together = teacher_features(family, model, x0, cond)
    for i in (0, 4):
        alone = teacher_features(family, model, x0[i:i + 1], {k: v[i:i + 1] for k, v in cond.items()}, index_offset=i)
        for k in together:
            assert torch.allclose(alone[k][0], together[k][i], atol=1e-5)


# ---- drift -----------------------------------------------------------------------------------------

def _pictures(seed=0, shape=(6, 3, 16, 16)):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 1.2 - 0.6


def test_picture_stats_move_as_named():
    x = _pictures()
    base = drift.picture_stats(x)
    assert set(base) == {"brightness", "saturation", "contrast"}  # images: no flicker
    assert drift.picture_stats((x + 0.3).clamp(-1, 1))["brightness"] > base["brightness"] + 0.1
    assert drift.picture_stats(x * 0.5)["contrast"] < 0.6 * base["contrast"]
    grey = x.mean(1, keepdim=True).expand_as(x)
    assert drift.picture_stats(grey)["saturation"] == pytest.approx(0.0, abs=1e-6)
    assert drift.picture_stats(x[:, :1])["saturation"] == 0.0
    assert drift.picture_stats(torch.full((2, 3, 4, 4), 1.0))["brightness"] == pytest.approx(1.0)
    red = torch.full((1, 3, 2, 2), -1.0)
    red[:, 0] = 1.0
    assert drift.picture_stats(red)["saturation"] == pytest.approx(1.0)


def test_flicker_as_vbench_reports_it():
    still = _pictures(shape=(2, 3, 1, 8, 8)).expand(-1, -1, 5, -1, -1)
    assert drift.picture_stats(still)["flicker"] == 1.0
    black_white = torch.tensor([-1.0, 1.0, -1.0]).view(1, 1, 3, 1, 1).expand(1, 3, 3, 4, 4)
    assert drift.temporal_flicker(black_white) == 0.0  # every pixel jumps 255 levels
    half = black_white.clone()
    half[..., :2] = -1.0  # half the pixels stay: mad 127.5
    assert drift.temporal_flicker(half) == pytest.approx(0.5)
    noisy = still + 0.2 * torch.randn(still.shape, generator=torch.Generator().manual_seed(0))
    assert drift.picture_stats(noisy)["flicker"] < 0.97


def _tone(freq=440.0, amplitude=0.5, seconds=0.5, sample_rate=8000, n=3, channels=2):
    t = torch.arange(int(seconds * sample_rate)) / sample_rate
    return (amplitude * torch.sin(2 * math.pi * freq * t)).expand(n, channels, -1).clone()


def test_audio_stats_move_as_named():
    rate = 8000
    tone = _tone()
    base = drift.audio_stats(tone, rate)
    assert base["loudness"] == pytest.approx(20 * math.log10(0.5 / 2 ** 0.5), abs=0.01)
    assert base["peak"] == pytest.approx(0.5, abs=1e-3)
    assert base["clipping"] == 0.0 and base["silence"] == 0.0
    assert base["centroid"] == pytest.approx(440.0, rel=0.02)
    assert drift.audio_stats(_tone(freq=1760.0), rate)["centroid"] == pytest.approx(1760.0, rel=0.02)
    clipped = drift.audio_stats((tone * 4).clamp(-1, 1), rate)
    assert clipped["clipping"] > 0.5 and clipped["peak"] == 1.0 and clipped["loudness"] > base["loudness"] + 6
    square = torch.ones(1, 1, 800)
    assert drift.audio_stats(square, rate)["loudness"] == pytest.approx(0.0)
    gapped = tone.clone()
    gapped[..., : tone.shape[-1] // 2] = 0.0
    assert drift.audio_stats(gapped, rate)["silence"] == pytest.approx(0.5, abs=0.05)
    quiet = drift.audio_stats(tone * 1e-4, rate)  # -83 dBFS: silent, though not zero
    assert quiet["silence"] == 1.0 and quiet["loudness"] < -80
    nothing = drift.audio_stats(torch.zeros(2, 2, 400), rate)
    assert nothing["loudness"] == drift.DB_FLOOR and math.isnan(nothing["centroid"])


def test_within_prompt_diversity():
    ids = torch.tensor([0, 0, 1, 1, 1, 2])
    spread = torch.tensor([[0.0, 0], [2, 0], [0, 0], [0, 3], [0, 6], [9, 9]])
    collapsed = torch.tensor([[1.0, 1], [1, 1], [5, 5], [5, 5], [5, 5], [0, 0]])
    got = drift.within_prompt_diversity({"video": spread, "audio": collapsed}, ids)
    assert got["audio"] == 0.0
    assert got["video"] == pytest.approx((2.0 + (3 + 6 + 3) / 3) / 2)  # prompt 2 has one sample: left out
    assert math.isnan(drift.within_prompt_diversity({"image": spread}, torch.arange(6))["image"])


# ---- sound in step with the picture ---------------------------------------------------------------

FPS, RATE, FRAMES = 8, 800, 24


def _hits_and_clicks(n=30, seed=0):
    """Clips where a square jumps to a new place at 1 to 3 frames, two frames apart, each jump with
    a click over quiet noise. (Sounding digits cannot serve: a steady tone has no onsets, and a
    digit sliding at constant speed no motion peaks.)"""
    g = torch.Generator().manual_seed(seed)
    per_frame = RATE // FPS
    videos = torch.full((n, 3, FRAMES, 8, 8), -0.8)
    audio = 0.01 * torch.randn(n, 1, FRAMES * per_frame, generator=g)
    click = 0.5 * torch.exp(-torch.arange(per_frame // 2) / 10.0) * torch.sin(torch.arange(per_frame // 2) * 1.3)
    for i in range(n):
        first = int(torch.randint(3, 8, (1,), generator=g))
        events = [first + 2 * e for e in range(1 + i % 3)]
        place = 0
        for f in range(FRAMES):
            if f in events:
                place = (place + 4) % 8
                audio[i, 0, f * per_frame:f * per_frame + len(click)] += click
            videos[i, :, f, place:place + 4, :4] = 0.8
    return videos, audio


def test_av_align_falls_as_the_sound_slips():
    videos, audio = _hits_and_clicks()
    per_frame = RATE // FPS
    scores = [drift.av_align(videos, torch.roll(audio, k * per_frame, dims=-1), RATE, FPS) for k in (0, 2, 4)]
    assert scores[0] == 1.0
    assert scores[0] > scores[1] + 0.2 > scores[2] + 0.3
    assert drift.av_align(videos, torch.roll(audio, -2 * per_frame, dims=-1), RATE, FPS) < 0.8  # early sound too
    onsets = drift.audio_onsets(audio, RATE, FPS, FRAMES)
    assert all(len(o) == 1 + i % 3 for i, o in enumerate(onsets))
    assert all(torch.equal(a, v) for a, v in zip(onsets, drift.motion_peaks(videos)))


def test_drift_stats_in_one_dict():
    videos, audio = _hits_and_clicks(n=4)
    stats = drift.drift_stats(videos, audio, RATE, FPS)
    assert {"brightness", "saturation", "contrast", "flicker", "audio_loudness", "audio_peak", "audio_clipping",
            "audio_centroid", "audio_silence", "audio_floor", "av_align"} == set(stats)
    assert stats["av_align"] == 1.0
    assert set(drift.drift_stats(_pictures())) == {"brightness", "saturation", "contrast"}
    with pytest.raises(ValueError):
        drift.drift_stats(audio=audio)
