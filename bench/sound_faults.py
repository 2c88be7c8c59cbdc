"""Does ``sound_mel_kid`` grow with each fault of the sound as the ground truth does? On the
sounding-digits world's real clips, where the change is known: the real set's clips (the train
split, what a run's real set holds) are the reference, the held-out test clips are the "student"
with one fault at three sizes, and beside the distance the world's ground truth, the sound FD
(``sounding_digits_metrics``: the sound classifier's features of the faulted held-out clips
against the clean ones'). Faults (waveforms in [-1, 1]; the tone peaks at 0.8):

- ``white_floor``: Gaussian noise of RMS 0.003 / 0.01 / 0.03 (-50 / -40 / -30 dB): the hiss the
  joint recipe's students grow;
- ``gain_down``: x0.7 / 0.5 / 0.25 (-3 / -6 / -12 dB); ``gain_up``: x1.1 / 1.2 / 1.25 (the
  largest that does not clip a 0.8 tone);
- ``hard_clip``: at 0.6 / 0.4 / 0.2 of full scale;
- ``low_pass``: a brick-wall low-pass at 200 / 120 / 60 Hz (the tones are 48-264 Hz, Nyquist 768);
- ``clicks``: 1 / 3 / 10 single-sample clicks of 0.5 at random places per clip;
- ``silence``: the last 25% / 50% / 100% of each clip zeroed.

Per fault and size: ``sound_mel_kid`` at the recipe's 32 eval samples (32 real clips against 32
faulted held-out clips, the product's sizes), the mean over ``--draws`` disjoint draws of the
held-out clips and the mean of its standard error, and the sound FD on all held-out clips; ``grows``
says whether each grows with the size. One JSON line:

    python bench/sound_faults.py [--num-samples 32] [--draws 8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from dmd2_core.evaluation.sound_distance import clip_features, sound_mel_kid
from dmd2_core.toys import digits_metrics, sounding_digits_metrics
from dmd2_core.toys import sounding_digits as sd

SIZES = {
    "white_floor": (0.003, 0.01, 0.03), "gain_down": (0.7, 0.5, 0.25), "gain_up": (1.1, 1.2, 1.25),
    "hard_clip": (0.6, 0.4, 0.2), "low_pass": (200.0, 120.0, 60.0), "clicks": (1, 3, 10),
    "silence": (0.25, 0.5, 1.0),
}


def inject(audio: torch.Tensor, fault: str, size: float, seed: int = 0) -> torch.Tensor:
    """``audio`` [N, C, S] with ``fault`` at ``size`` (see the module doc), clamped to [-1, 1]."""
    g = torch.Generator().manual_seed(seed)
    a = audio.clone().double()
    if fault == "white_floor":
        a = a + size * torch.randn(a.shape, generator=g, dtype=torch.float64)
    elif fault in ("gain_down", "gain_up"):
        a = a * size
    elif fault == "hard_clip":
        a = a.clamp(-size, size)
    elif fault == "low_pass":
        spectrum = torch.fft.rfft(a, dim=-1)
        freqs = torch.fft.rfftfreq(a.shape[-1], d=1.0 / sd.SAMPLE_RATE)
        a = torch.fft.irfft(spectrum * (freqs <= size), n=a.shape[-1], dim=-1)
    elif fault == "clicks":
        for i in range(a.shape[0]):
            at = torch.randint(0, a.shape[-1], (int(size),), generator=g)
            a[i, :, at] += 0.5
    elif fault == "silence":
        a[..., a.shape[-1] - int(round(size * a.shape[-1])):] = 0.0
    else:
        raise ValueError(f"no fault {fault!r}")
    return a.clamp(-1, 1).float()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-samples", type=int, default=32, help="clips per side (the minimax-h3 recipe's eval_num_samples)")
    parser.add_argument("--draws", type=int, default=8, help="disjoint draws of the held-out clips averaged")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    real, test = sd.make_clips("train", 0), sd.make_clips("test", 0)
    rows = torch.randperm(len(real), generator=torch.Generator().manual_seed(0))[:ns.num_samples]
    reference = clip_features(real.audio[rows], sd.SAMPLE_RATE)
    clean_sound = sounding_digits_metrics.sound_features(test.audio)
    draws = [torch.arange(d * ns.num_samples, (d + 1) * ns.num_samples) for d in range(ns.draws)]

    def figures(audio):
        kids = [sound_mel_kid(reference, clip_features(audio[d], sd.SAMPLE_RATE)) for d in draws]
        return {"sound_mel_kid": round(sum(k["sound_mel_kid"] for k in kids) / len(kids), 4),
                "sound_mel_kid_se": round(sum(k["sound_mel_kid_se"] for k in kids) / len(kids), 4),
                "sound_fd": round(digits_metrics.frechet_distance(sounding_digits_metrics.sound_features(audio),
                                                                  clean_sound), 3)}

    out = {"clean": figures(test.audio), "faults": {}, "grows": {}}
    for fault, sizes in SIZES.items():
        rows_out = [{"size": size, **figures(inject(test.audio, fault, size))} for size in sizes]
        out["faults"][fault] = rows_out
        for key in ("sound_mel_kid", "sound_fd"):
            series = [out["clean"][key]] + [r[key] for r in rows_out]
            out["grows"].setdefault(key, {})[fault] = all(b > a for a, b in zip(series, series[1:]))
    out.update({"num_samples": ns.num_samples, "draws": ns.draws, "sample_rate": sd.SAMPLE_RATE,
                "wall_s": round(time.perf_counter() - start, 1)})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
