"""Weight-free drift statistics of decoded samples: what a person would notice first when a student
drifts from its teacher (washed-out or dark pictures, flicker, clipped or silent sound, collapsed
variety, sound out of step with the picture), each a plain function of the decoded media.

Conventions (the project's decoders, ``ModelFamily.decode``): pictures are float in [-1, 1],
images ``[N, C, H, W]`` and videos ``[N, C, F, H, W]`` with C = 3 (RGB) or 1 (grey); audio is a
float waveform ``[N, C, S]`` in [-1, 1] at ``sample_rate`` Hz (C = 1 or 2). Every figure is a mean
over the N samples (a float), so a student's and its teacher's figures compare directly.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

import torch

LUMA = (0.299, 0.587, 0.114)  # Rec. 601 luma of gamma-encoded RGB
CLIP_LEVEL = 0.999  # |x| at or above this counts as clipped
SILENCE_DBFS = -60.0
SILENCE_WINDOW_S = 0.020
DB_FLOOR = -120.0  # dBFS of digital silence (log of 0)
PEAK_FLOOR = 0.1  # a peak must reach this fraction of its clip's largest value (AV sync)
# each statistic's unit, as a table names it (``drift_stats``: keys without their modality)
DRIFT_UNITS = {
    "brightness": "mean luma, 0-1", "saturation": "HSV, 0-1", "contrast": "luma std, 0-1",
    "flicker": "1 = steady", "loudness": "dBFS", "peak": "of full scale", "clipping": "fraction of samples",
    "centroid": "Hz", "silence": "fraction of 20 ms windows", "av_align": "IoU, 0-1",
    "floor": "dBFS of white noise",
}
FLOOR_WINDOW_S = 0.032  # the spectrum's window (at most a quarter of the clip, so a clip has frames to choose from)
FLOOR_MIN_WINDOW = 32  # samples: at least this many bins' worth, whatever the rate (a toy's 40 Hz "audio")
FLOOR_QUANTILE = 0.1  # a band's floor: its level in its quietest tenth of the clip


def drift_unit(name: str) -> str:
    """The unit of drift statistic ``name`` (``brightness_video``, ``loudness_audio``, ``av_align``)."""
    return DRIFT_UNITS.get(name if name in DRIFT_UNITS else name.rsplit("_", 1)[0], "")


# ---- pictures ------------------------------------------------------------------------------------

def _unit_pixels(pictures: torch.Tensor) -> torch.Tensor:
    """[-1, 1] -> [0, 1], float32 on the CPU, clamped as saved media would be."""
    return ((torch.as_tensor(pictures).detach().float().cpu().clamp(-1, 1) + 1) / 2)


def _frames(pictures: torch.Tensor) -> torch.Tensor:
    """Images [N, C, H, W] or videos [N, C, F, H, W] -> frames [N, F, C, H, W] in [0, 1] (F = 1 for images)."""
    x = _unit_pixels(pictures)
    if x.dim() == 4:
        x = x[:, :, None]
    if x.dim() != 5 or x.shape[1] not in (1, 3):
        raise ValueError(f"pictures must be [N, C, H, W] or [N, C, F, H, W] with C = 1 or 3, got {tuple(x.shape)}")
    return x.transpose(1, 2)


def luma(frames: torch.Tensor) -> torch.Tensor:
    """Frames [..., C, H, W] in [0, 1] -> luma [..., H, W] in [0, 1] (grey: the value itself)."""
    if frames.shape[-3] == 1:
        return frames[..., 0, :, :]
    w = torch.tensor(LUMA, dtype=frames.dtype).view(3, 1, 1)
    return (frames * w).sum(-3)


def saturation(frames: torch.Tensor) -> torch.Tensor:
    """HSV saturation per pixel, ``(max - min) / max`` over RGB (0 where max is 0, and for grey)."""
    if frames.shape[-3] == 1:
        return torch.zeros_like(frames[..., 0, :, :])
    hi, lo = frames.amax(-3), frames.amin(-3)
    return torch.where(hi > 0, (hi - lo) / hi.clamp_min(1e-12), torch.zeros_like(hi))


def temporal_flicker(videos: torch.Tensor) -> float:
    """VBench's temporal_flickering of videos [N, C, F, H, W] (F >= 2): per video the mean absolute
    difference of consecutive frames on the 0-255 scale (uint8-rounded, as saved), averaged over
    frame pairs, reported as ``(255 - mad) / 255`` (1: no change between frames), mean over videos."""
    frames = (_frames(videos) * 255).round()
    if frames.shape[1] < 2:
        raise ValueError("temporal_flicker needs at least 2 frames")
    mad = (frames[:, 1:] - frames[:, :-1]).abs().flatten(2).mean(2).mean(1)
    return float(((255.0 - mad) / 255.0).mean())


def picture_stats(pictures: torch.Tensor) -> dict[str, float]:
    """Images [N, C, H, W] or videos [N, C, F, H, W] in [-1, 1] -> {brightness: mean luma,
    saturation: mean HSV saturation, contrast: std of luma within a frame, averaged}, all in
    [0, 1]; videos add ``flicker`` (``temporal_flicker``: 1 is steady)."""
    frames = _frames(pictures)
    y = luma(frames)  # [N, F, H, W]
    stats = {"brightness": float(y.mean()), "saturation": float(saturation(frames).mean()),
             "contrast": float(y.flatten(2).std(2, correction=0).mean())}
    if torch.as_tensor(pictures).dim() == 5 and frames.shape[1] >= 2:
        stats["flicker"] = temporal_flicker(pictures)
    return stats


# ---- sound ---------------------------------------------------------------------------------------

def _audio(audio: torch.Tensor) -> torch.Tensor:
    a = torch.as_tensor(audio).detach().to("cpu", torch.float64)
    if a.dim() != 3:
        raise ValueError(f"audio must be [N, C, S], got {tuple(a.shape)}")
    return a


def dbfs(rms: torch.Tensor) -> torch.Tensor:
    """RMS -> dB relative to full scale (20 log10 rms: a full-scale square wave is 0 dBFS, a
    full-scale sine -3), floored at ``DB_FLOOR``."""
    return (20 * torch.log10(rms.clamp_min(10 ** (DB_FLOOR / 20)))).clamp_min(DB_FLOOR)


def spectral_centroid(audio: torch.Tensor, sample_rate: int) -> torch.Tensor:
    """Per clip [N] (Hz): the magnitude-weighted mean frequency of the whole clip's spectrum (the
    channels' magnitudes summed); NaN for a silent clip."""
    a = _audio(audio)
    mag = torch.fft.rfft(a, dim=-1).abs().sum(1)  # [N, S // 2 + 1]
    freqs = torch.fft.rfftfreq(a.shape[-1], d=1.0 / sample_rate, dtype=torch.float64)
    total = mag.sum(-1)
    return torch.where(total > 0, (mag * freqs).sum(-1) / total.clamp_min(1e-300), torch.full_like(total, math.nan))


def silence_fraction(audio: torch.Tensor, sample_rate: int) -> float:
    """The fraction of 20 ms windows (non-overlapping; a shorter tail is a window of its own)
    whose RMS over all channels is under -60 dBFS, over all clips."""
    a = _audio(audio)
    window = max(1, round(SILENCE_WINDOW_S * sample_rate))
    power = a.pow(2).mean(1)  # [N, S]
    starts = range(0, power.shape[-1], window)
    rms = torch.stack([power[:, s:s + window].mean(-1) for s in starts], dim=1).sqrt()
    return float((dbfs(rms) < SILENCE_DBFS).double().mean())


def noise_floor(audio: torch.Tensor, sample_rate: int) -> torch.Tensor:
    """Per clip [N] (dBFS): the level of the hiss under the sound. A short-time spectrum (Hann
    windows of ``FLOOR_WINDOW_S``, at least ``FLOOR_MIN_WINDOW`` samples and at most a quarter of
    the clip, a power of two; half overlapping), each frequency bin's power (the channels' mean) at its ``FLOOR_QUANTILE`` over
    time (where that band is quietest), then the median over bins: tones, hum and speech hold a
    few bins, a noise floor lifts them all, so the median bin is the floor. Scaled per bin so a
    white noise of RMS r has mean power r^2 in every bin, whatever the window: it reads about
    20 log10 r - 2.5 dB (its quiet tenth lies below its mean); ``DB_FLOOR`` for digital silence.
    Weight-free: hiss that a loud tone hides from a loudness or a centroid moves this by its own
    size (a floor 10x higher reads 20 dB higher)."""
    a = _audio(audio)
    longest = max(2, min(max(FLOOR_MIN_WINDOW, round(FLOOR_WINDOW_S * sample_rate)), a.shape[-1] // 4))
    window = 1 << (longest.bit_length() - 1)
    hann = torch.hann_window(window, periodic=True, dtype=torch.float64)
    frames = a.unfold(-1, window, max(1, window // 2))  # [N, C, T, window]
    power = torch.fft.rfft(frames * hann, dim=-1).abs().pow(2).mean(1) / hann.pow(2).sum()  # [N, T, bins]
    power[..., 1:-1] *= 2  # one-sided: a white noise of variance s^2 reads s^2 in every bin
    quiet = torch.quantile(power, FLOOR_QUANTILE, dim=1)  # [N, bins]
    return (10 * torch.log10(quiet.median(dim=-1).values.clamp_min(10 ** (DB_FLOOR / 10)))).clamp_min(DB_FLOOR)


def audio_stats(audio: torch.Tensor, sample_rate: int) -> dict[str, float]:
    """Waveforms [N, C, S] in [-1, 1] at ``sample_rate`` Hz -> {loudness: RMS in dBFS per clip,
    peak: max |x| per clip, clipping: fraction of samples with |x| >= 0.999, centroid: spectral
    centroid in Hz (non-silent clips; NaN if all are silent), silence: fraction of silent 20 ms
    windows, floor: the noise floor under the sound in dBFS (``noise_floor``)}, per-clip figures
    averaged over clips."""
    a = _audio(audio)
    centroid = spectral_centroid(a, sample_rate)
    centroid = centroid[~centroid.isnan()]
    return {"loudness": float(dbfs(a.pow(2).mean((1, 2)).sqrt()).mean()),
            "peak": float(a.abs().amax((1, 2)).mean()),
            "clipping": float((a.abs() >= CLIP_LEVEL).double().mean()),
            "centroid": float(centroid.mean()) if len(centroid) else math.nan,
            "silence": silence_fraction(a, sample_rate),
            "floor": float(noise_floor(a, sample_rate).mean())}


# ---- variety -------------------------------------------------------------------------------------

def within_prompt_diversity(features: Mapping[str, torch.Tensor], prompt_ids) -> dict[str, float]:
    """Per modality, the mean pairwise Euclidean distance between the features [N, d] of samples of
    one prompt (``prompt_ids`` [N]), averaged over the prompts with two samples or more (NaN if
    none): low means the samples of a prompt collapsed onto one. In the features' own units:
    compare like with like (the student's and the teacher's samples on the same features)."""
    ids = torch.as_tensor(prompt_ids).reshape(-1)
    out = {}
    for name, feats in features.items():
        f = torch.as_tensor(feats).detach().to("cpu", torch.float64)
        if f.shape[0] != len(ids):
            raise ValueError(f"within_prompt_diversity: {name} has {f.shape[0]} rows for {len(ids)} prompt ids")
        means = []
        for p in ids.unique():
            group = f[ids == p]
            k = len(group)
            if k > 1:
                means.append(torch.cdist(group, group).sum() / (k * (k - 1)))
        out[name] = float(torch.stack(means).mean()) if means else math.nan
    return out


# ---- sound in step with the picture --------------------------------------------------------------

def _peaks(signal: torch.Tensor, floor: float) -> torch.Tensor:
    """Indices of the peaks of a 1-D signal, as scipy's ``find_peaks`` finds them: samples (or runs
    of equal samples, a plateau, reported at its first index) strictly above both neighbours, the
    two ends excluded; a peak must also reach ``PEAK_FLOOR`` of the signal's largest value and
    exceed ``floor``."""
    s = signal.double().tolist()
    top = max(s, default=0.0)
    found = []
    i = 1
    while i < len(s) - 1:
        if s[i] > s[i - 1]:
            j = i
            while j + 1 < len(s) and s[j + 1] == s[i]:
                j += 1
            if j + 1 < len(s) and s[j + 1] < s[i] and s[i] > floor and s[i] >= PEAK_FLOOR * top:
                found.append(i)
            i = j + 1
        else:
            i += 1
    return torch.tensor(found, dtype=torch.long)


def audio_onsets(audio: torch.Tensor, sample_rate: int, fps: float, num_frames: int,
                 floor: float = 1e-3) -> list[torch.Tensor]:
    """Per clip of ``audio`` [N, C, S], the video frames where a sound starts: peaks of the positive
    derivative of the RMS envelope taken over each frame's span of samples (frame k: samples
    ``[k S_f, (k + 1) S_f)``, S_f = sample_rate / fps; frames past the audio are silent). The rise
    into frame k is at index k; a clip's first and last frames hold no onset (``_peaks``: a clip
    that starts sounding is no event)."""
    a = _audio(audio)
    per_frame = sample_rate / fps
    power = a.pow(2).mean(1)
    env = torch.zeros(a.shape[0], num_frames, dtype=torch.float64)
    for k in range(num_frames):
        lo, hi = round(k * per_frame), round((k + 1) * per_frame)
        if lo < power.shape[-1] and hi > lo:
            env[:, k] = power[:, lo:hi].mean(-1).sqrt()
    rise = torch.cat([torch.zeros_like(env[:, :1]), env[:, 1:] - env[:, :-1]], dim=1).clamp_min(0)
    return [_peaks(r, floor) for r in rise]


def motion_peaks(videos: torch.Tensor, floor: float = 1.0 / 255) -> list[torch.Tensor]:
    """Per video [N, C, F, H, W], the frames where the picture changes most: peaks of the mean
    |frame k - frame k-1| (on the [0, 1] scale) at index k (a one-frame flash at k: a plateau at k,
    k + 1, reported at k). Steady motion is a plateau to the clip's ends, hence no peak."""
    frames = _frames(videos)
    motion = torch.cat([torch.zeros(frames.shape[0], 1), (frames[:, 1:] - frames[:, :-1]).abs().flatten(2).mean(2)], 1)
    return [_peaks(m, floor) for m in motion]


def av_align(videos: torch.Tensor, audio: torch.Tensor, sample_rate: int, fps: float,
             tolerance: int = 1) -> float:
    """AV-Align (Yariv et al. 2024): per clip, audio onsets A and video motion peaks V at the video
    frame rate (``audio_onsets``, ``motion_peaks``), and the IoU-style figure
    ``(#{a in A: some v within tolerance} + #{v in V: some a within tolerance}) / (|A| + |V|)``
    (tolerance in frames, AV-Align's +-1); mean over clips that have a peak in either (NaN if
    none). 1: every sound starts with a visible change and vice versa; steady tones and still
    pictures have no peaks and say nothing."""
    num_frames = torch.as_tensor(videos).shape[2]
    onsets = audio_onsets(audio, sample_rate, fps, num_frames)
    peaks = motion_peaks(videos)
    scores = []
    for a, v in zip(onsets, peaks):
        if len(a) + len(v) == 0:
            continue
        if len(a) == 0 or len(v) == 0:
            scores.append(0.0)
            continue
        close = (a[:, None] - v[None, :]).abs() <= tolerance
        scores.append(float(close.any(1).sum() + close.any(0).sum()) / (len(a) + len(v)))
    return float(sum(scores) / len(scores)) if scores else math.nan


def drift_stats(pictures: Optional[torch.Tensor] = None, audio: Optional[torch.Tensor] = None,
                sample_rate: Optional[int] = None, fps: Optional[float] = None) -> dict[str, float]:
    """All of the above that the media allow, in one flat dict: ``picture_stats`` keys, then
    ``audio_stats`` keys prefixed ``audio_``, then ``av_align`` for videos with sound and an fps."""
    out: dict[str, float] = {}
    if pictures is not None:
        out.update(picture_stats(pictures))
    if audio is not None:
        if sample_rate is None:
            raise ValueError("drift_stats: audio needs its sample_rate")
        out.update({f"audio_{k}": v for k, v in audio_stats(audio, sample_rate).items()})
        if pictures is not None and fps is not None and torch.as_tensor(pictures).dim() == 5:
            out["av_align"] = av_align(pictures, audio, sample_rate, fps)
    return out


# ---- an eval's decoded samples -------------------------------------------------------------------

def media_stats(decoded) -> dict[str, float]:
    """``drift_stats`` of a family's decoded samples, keyed ``<statistic>_<modality>`` (and
    ``av_align``): pictures [N, C, H, W] ('image'), videos [N, C, F, H, W] ('video'), a joint
    model's {'video', 'audio', 'sample_rate', 'fps'}; samples that are not media (latents without
    a decoder) have none."""
    if isinstance(decoded, dict):
        if decoded["video"].dim() != 5 or decoded["video"].shape[1] not in (1, 3):
            return {}
        raw = drift_stats(decoded["video"], decoded["audio"], int(decoded["sample_rate"]), float(decoded["fps"]))
    elif torch.is_tensor(decoded) and decoded.dim() in (4, 5) and decoded.shape[1] in (1, 3):
        raw = drift_stats(decoded)
    else:
        return {}
    visual = "video" if isinstance(decoded, dict) or decoded.dim() == 5 else "image"
    out = {}
    for key, value in raw.items():
        if key == "av_align":
            out[key] = value
        elif key.startswith("audio_"):
            out[f"{key.removeprefix('audio_')}_audio"] = value
        else:
            out[f"{key}_{visual}"] = value
    return out


def per_sample_stats(decoded) -> list[dict[str, float]]:
    """``media_stats`` of each sample on its own: every statistic is a mean over samples, so the
    mean of these is the set's figure and their spread gives its standard error (``pooled``)."""
    if isinstance(decoded, dict):
        n = decoded["video"].shape[0]
        return [media_stats({**decoded, "video": decoded["video"][i:i + 1], "audio": decoded["audio"][i:i + 1]})
                for i in range(n)]
    return [media_stats(decoded[i:i + 1]) for i in range(decoded.shape[0])] if torch.is_tensor(decoded) else []


class TimedStats(list):
    """``per_sample_stats`` of an eval's samples, as a list, with where the seconds went on the rank
    that made them: ``decode_s`` (the decoder) and ``stats_s`` (these statistics, host work) over
    ``clips`` decoded samples. The time plan prices the two apart (``time_plan.calibrate``)."""

    def __init__(self, stats=(), decode_s: float = 0.0, stats_s: float = 0.0, clips: int = 0):
        super().__init__(stats)
        self.decode_s, self.stats_s, self.clips = decode_s, stats_s, clips


def paired_se(now: list[dict[str, float]], start: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the standard error of the mean change of each sample from its own value at the
    start (``per_sample_stats`` of the same eval noise and prompts, row i against row i): what a
    change of the set's mean is judged in when both evals are of the same samples. A clip's level
    that follows its prompt (a tone's leakage floor) cancels in the difference. Rows where either
    side is NaN are left out; NaN below 2 rows or for a different row count."""
    if len(now) != len(start):
        return {key: math.nan for key in (now[0] if now else {})}
    out = {}
    for key in now[0] if now else []:
        d = torch.tensor([a.get(key, math.nan) - b.get(key, math.nan) for a, b in zip(now, start)], dtype=torch.float64)
        d = d[torch.isfinite(d)]
        out[key] = float(d.std() / math.sqrt(len(d))) if len(d) >= 2 else math.nan
    return out


def pooled(per_sample: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """{"value": the mean over samples, "se": its standard error (NaN below 2 samples)} per key;
    a sample's NaN (a silent clip's centroid, a clip without onsets' AV-Align) is left out."""
    value, se = {}, {}
    for key in per_sample[0] if per_sample else []:
        xs = torch.tensor([p.get(key, math.nan) for p in per_sample], dtype=torch.float64)
        xs = xs[torch.isfinite(xs)]
        value[key] = float(xs.mean()) if len(xs) else math.nan
        se[key] = float(xs.std() / math.sqrt(len(xs))) if len(xs) >= 2 else math.nan
    return {"value": value, "se": se}
