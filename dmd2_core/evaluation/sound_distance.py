"""``sound_mel_kid``: a weight-free distance between two sets of sound clips, read from the
waveform's spectrum, where hiss, hum, clipping and loudness live.

Why not the teacher's features alone: at the product's re-noising level the teacher sees the
sound at sigma 0.75, so a broadband floor 20x under that noise is invisible to it, and its clean
features weigh loudness far above the floor (bench/README.md, "Why does the teacher-feature
distance miss the sound's ranking?"). Those KIDs stay as an alarm (working against broken); the
sound is ranked by this one.

Per clip (``clip_features``), per channel: the log-mel power of each band over the clip's frames,
summarised by
- its **mean** (the spectral envelope: which tone, how loud per band),
- its **spread** over time (a steady tone against a fluttering, clicking or gated one),
- its **10th percentile** (the floor: the level a band keeps 90% of the time; under a steady tone
  that is the tone, in a band the tone does not reach it is the noise floor, which a click lifts
  the mean and spread of but not this),
and the channel's **loudness** (RMS in dB: the band means carry a frequency-weighted level
already, so this is one coordinate, not a weighting). ITU-R BS.1770 loudness (pyloudnorm) is not
used: its 400 ms gating blocks are longer than the toy world's clips (1/6 s) and its K-weighting
shelf sits at 1.5 kHz, above their 768 Hz Nyquist; over an eval's clips of a few seconds the
gate has little to gate, and its weighting is one more linear band weighting the means hold.
Per channel, not summed: a fault on one side (a dead channel, hiss on the left) must show.

Choices, each for a reason:
- The filterbank is transformers' (``audio_utils.mel_filter_bank``, already a dependency: the
  torchaudio / librosa filters), Slaney's mel scale, triangles of peak 1 (band power, so that
  0 dB is a full-scale sine's level and the floor below means the same in every band).
- Frames in samples, not seconds, so that a clip of a few hundred samples (the toy world) and one
  of seconds at 48 kHz are both framed sensibly: ``n_fft`` the largest power of two up to 2048
  (43 ms at 48 kHz, the usual music window) and half the clip (several frames to take a spread
  and a floor over), hop a quarter of it (Hann's usual overlap), only frames wholly inside the
  clip (a zero-padded edge frame would read as a quieter one and fake a floor).
- ``min(64, n_fft // 4)`` bands: a band narrower than two FFT bins is empty or repeats its
  neighbour; 64 where the FFT resolves them.
- dB floored at -100 (under 16-bit quantisation's -96: what no playback reproduces), so silence
  and a clean band are a finite level, not log 0.

The distance (``sound_mel_kid``): each coordinate centred on the reference's mean and divided by
its spread over the reference's clips, but by no less than 1 dB (about the smallest level change a
listener notices), then compressed with asinh (linear within a few spreads, logarithmic beyond),
then ``kernel.kernel_distance``: the unbiased KID the teacher evaluator uses. The compression is
there because the reference's clean bands sit at the dB floor with no spread: a student's hiss at
-50 dB is 50 units out in dozens of coordinates, and the cubic kernel would raise that to the
sixth power (measured on real clips: 2e8 for a -50 dB floor against 2.8 for a 3 dB gain drop);
asinh keeps every coordinate's order, so more hiss is still farther, and keeps one fault from
drowning every other (the same floor reads 306, the gain drop 0.73; bench/sound_faults.py). No
projection to 64 coordinates as the teacher's features have: these are a few hundred wide, their
scale is set here, and on the fault table the projection only added spread. The small-sample
argument that chose KID for the teacher's features holds: an eval draws 32 clips, the features
are hundreds wide, and the Fréchet distance's bias at n < d would measure the sample count. Its
standard error is ``kernel.kernel_distance_sample_se`` (the jackknife over the student's clips,
the cached reference shared by every eval it is compared with; a pair out at a time for 32 against
32 clips: conservative, measured 1.4x the spread over draws), what a rule calling a regression
from sampling noise needs.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Callable, Optional

import numpy as np
import torch

from dmd2_core.errors import ArgsError
from dmd2_core.evaluation.kernel import SE_MIN_SAMPLES, kernel_distance, kernel_distance_sample_se

MAX_FFT = 2048
MAX_BANDS = 64
FLOOR_PERCENTILE = 0.10
DB_FLOOR = -100.0
MIN_SPREAD_DB = 1.0
STATISTICS = ("mean", "spread", "floor")  # per channel and band, then the channel's loudness
# the fewest clips per side ``sound_mel_kid`` is defined for: its standard error
# (``kernel.kernel_distance_sample_se``, a jackknife leaving a clip or a pair out) is NaN below 3
MIN_CLIPS = SE_MIN_SAMPLES
# the key a sample's drift statistics carry its clip's features under (``split_sound_features``)
SOUND_FEATURES = "sound_mel_features"


def framing(num_samples: int) -> tuple[int, int, int]:
    """(n_fft, hop, bands) for clips of ``num_samples`` samples (see the module doc)."""
    if num_samples < 16:
        raise ValueError(f"sound_mel_kid needs clips of at least 16 samples, got {num_samples}")
    n_fft = 1 << int(math.floor(math.log2(min(MAX_FFT, num_samples // 2))))
    return n_fft, n_fft // 4, min(MAX_BANDS, n_fft // 4)


@lru_cache(maxsize=8)
def _filterbank(n_fft: int, bands: int, sample_rate: int) -> torch.Tensor:
    from transformers.audio_utils import mel_filter_bank

    bank = mel_filter_bank(num_frequency_bins=n_fft // 2 + 1, num_mel_filters=bands, min_frequency=0.0,
                           max_frequency=sample_rate / 2, sampling_rate=sample_rate, norm=None, mel_scale="slaney")
    return torch.from_numpy(np.ascontiguousarray(bank))  # [bins, bands], float64


def _db(power: torch.Tensor) -> torch.Tensor:
    return 10 * torch.log10(power.clamp_min(10 ** (DB_FLOOR / 10)))


def clip_features(audio: torch.Tensor, sample_rate: int) -> torch.Tensor:
    """Waveforms [N, C, S] in [-1, 1] at ``sample_rate`` Hz -> per clip [N, C * (3 * bands + 1)]
    float32: per channel the bands' mean, spread and floor (``STATISTICS``) in dB, then its RMS
    loudness in dB. Samples as saved media would hold them: NaN as 0, clamped to [-1, 1]."""
    a = torch.as_tensor(audio).detach().to("cpu", torch.float64)
    if a.dim() != 3:
        raise ValueError(f"sound_mel_kid needs audio [N, C, S], got {tuple(a.shape)}")
    a = torch.nan_to_num(a, nan=0.0).clamp(-1, 1)
    n, c, s = a.shape
    n_fft, hop, bands = framing(s)
    window = torch.hann_window(n_fft, periodic=True, dtype=torch.float64)
    spec = torch.stft(a.reshape(n * c, s), n_fft, hop_length=hop, window=window, center=False, return_complex=True)
    power = spec.abs().pow(2) * (4 / window.sum() ** 2)  # a full-scale sine's bin: 1 (0 dB)
    mel = _db(torch.einsum("xkf,kb->xbf", power, _filterbank(n_fft, bands, int(sample_rate))))  # [N * C, bands, frames]
    stats = torch.cat([mel.mean(-1), mel.std(-1, correction=0), mel.quantile(FLOOR_PERCENTILE, dim=-1),
                       _db(a.reshape(n * c, s).pow(2).mean(-1, keepdim=True))], dim=1)  # [N * C, 3 * bands + 1]
    return stats.reshape(n, -1).float()


def decoded_features(decoded: Any) -> Optional[torch.Tensor]:
    """``clip_features`` of a family's decoded samples when they have sound (a joint model's
    {'audio', 'sample_rate', ...}); None for pictures alone."""
    if isinstance(decoded, dict) and torch.is_tensor(decoded.get("audio")) and decoded.get("sample_rate"):
        return clip_features(decoded["audio"], int(decoded["sample_rate"]))
    return None


def with_sound_features(per_sample: list[dict], decoded: Any) -> list[dict]:
    """Each sample's drift statistics with its clip's features beside them (``SOUND_FEATURES``):
    computed where the eval decodes, so the clips are decoded once."""
    features = decoded_features(decoded)
    if features is None:
        return per_sample
    return [{**stats, SOUND_FEATURES: f} for stats, f in zip(per_sample, features)]


def split_sound_features(per_sample: Optional[list[dict]]) -> tuple[list[dict], Optional[torch.Tensor]]:
    """(the drift statistics alone, the clips' features [N, D] or None when the samples have no
    sound): what ``drift.pooled`` and ``sound_mel_kid`` each read."""
    per_sample = per_sample or []
    features = [p[SOUND_FEATURES] for p in per_sample if SOUND_FEATURES in p]
    stats = [{k: v for k, v in p.items() if k != SOUND_FEATURES} for p in per_sample]
    if not features or len(features) != len(per_sample):
        return stats, None
    return stats, torch.stack([torch.as_tensor(f) for f in features]).float()


def standardised_db(reference: torch.Tensor, samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both sets centred on the reference's per-coordinate mean, divided by its spread (at least
    ``MIN_SPREAD_DB``) and compressed with asinh: float64 [n, D] and [m, D]. The samples never
    move the yardstick they are measured with."""
    reference = torch.as_tensor(reference).to(torch.float64)
    samples = torch.as_tensor(samples).to(torch.float64)
    if reference.dim() != 2 or samples.dim() != 2 or reference.shape[1] != samples.shape[1]:
        raise ValueError(f"sound_mel_kid needs [n, D] and [m, D] clip features, got {tuple(reference.shape)} "
                         f"and {tuple(samples.shape)}")
    mean, spread = reference.mean(0), reference.std(0).clamp_min(MIN_SPREAD_DB)
    return torch.asinh((reference - mean) / spread), torch.asinh((samples - mean) / spread)


def sound_mel_kid(reference: torch.Tensor, samples: torch.Tensor) -> dict[str, float]:
    """{'sound_mel_kid': the KID of ``samples``' clip features [m, D] against ``reference``'s [n, D]
    (row-paired when n == m, as the teacher's reference clips are: see ``kernel.kernel_distance``),
    'sound_mel_kid_se': its standard error}: ~0 (either sign) for one distribution, growing as the
    sound moves away from the reference's. n, m >= ``MIN_CLIPS``: fewer raise ValueError."""
    why = why_unmeasured(reference, samples)
    if why is not None:
        raise ValueError(f"sound_mel_kid: {why}")
    ref, out = standardised_db(reference, samples)
    return {"sound_mel_kid": kernel_distance(ref, out), "sound_mel_kid_se": kernel_distance_sample_se(ref, out)}


def why_unmeasured(reference: Optional[torch.Tensor], samples: Optional[torch.Tensor]) -> Optional[str]:
    """Why ``sound_mel_kid`` cannot measure ``samples``' clip features against ``reference``'s (a
    side without clip features, or with fewer than ``MIN_CLIPS``); None when it can."""
    if reference is None:
        return "the reference has no clip features"
    if samples is None:
        return "the samples have no clip features"
    if min(len(reference), len(samples)) < MIN_CLIPS:
        return (f"{len(samples)} clips against {len(reference)} reference clips; it needs at least {MIN_CLIPS} "
                "on each side (its standard error)")
    return None


def check_eval_clips(key: str, subject: str, clips: int, what: str, remedy: str,
                     has_sound: Callable[[], bool] = lambda: True) -> None:
    """Pre-flight: ArgsError, one line naming ``key`` (``subject``: its value as the line names it),
    when an eval would give ``sound_mel_kid`` ``clips`` ``what``, fewer than ``MIN_CLIPS``, and the
    run has sound (``has_sound``, asked only then: it may read the checkpoint); ``remedy``: what
    would be valid. Else the run's sound would go unmeasured at every eval."""
    if clips < MIN_CLIPS and has_sound():
        raise ArgsError(f"{key}: {subject}: sound_mel_kid (the run's sound distance) would get {clips} {what} where "
                        f"it needs at least {MIN_CLIPS} (its standard error); {remedy}")
