"""Does the sound's drift row see a noise floor before the sound FD worsens? (issue 55, item 5).
Prints one JSON line.

Real sounding-digits clips (the held-out test clips, ``--samples`` of them: the recipe's 32 eval
samples) with a white floor of growing RMS added, judged by the product's drift rule
(``teacher_evaluator.drift_flags``) as an eval is: the start is the clips with the smallest floor
(the run's first eval), the yardstick the real train clips' first ``--samples`` (the real set's
rows the eval decodes), statistics as the eval computes them from the family's decoded clips
(``drift.pooled`` of each clip's ``audio_stats``; the toy's 40 "Hz" rate, as its family decodes
without a VAE). Beside each floor: the sound FD of the ground truth on 600 clips with the same
floor (``sounding_digits_metrics``), and whether it worsened (more than 10% above the start's, as
bench/eval_signal.py calls it).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dmd2_core.evaluation import drift
from dmd2_core.evaluation.teacher_evaluator import drift_band, drift_flags
from dmd2_core.models.minimax_h3 import AUDIO_LATENTS_PER_SECOND
from dmd2_core.toys import digits_metrics, sounding_digits as sd, sounding_digits_metrics as sdm

WORSENS = 1.10


def with_floor(audio: torch.Tensor, rms: float, seed: int) -> torch.Tensor:
    noise = torch.randn(audio.shape, generator=torch.Generator().manual_seed(seed))
    return (audio + rms * noise).clamp(-1, 1)


def pooled_audio(audio: torch.Tensor, rate: int) -> dict:
    return drift.pooled([{f"{k}_audio": v for k, v in drift.audio_stats(clip[None], rate).items()} for clip in audio])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--floors", type=float, nargs="+", default=[0.0, 0.003, 0.01, 0.02, 0.03, 0.05, 0.1])
    parser.add_argument("--fd-clips", type=int, default=600)
    ns = parser.parse_args()
    started = time.perf_counter()
    rate = AUDIO_LATENTS_PER_SECOND
    test, train = sd.make_clips("test", 0), sd.make_clips("train", 0)
    real = pooled_audio(train.audio[:ns.samples], rate)
    reference = {"value": {k: v for k, v in real["value"].items()}, "se": real["se"]}
    start = None
    rows = []
    for rms in ns.floors:
        stats = pooled_audio(with_floor(test.audio[:ns.samples], rms, 1), rate)
        latest = {f"drift_{k}": v for k, v in stats["value"].items()}
        fd_clips = with_floor(test.audio[ns.samples:ns.samples + ns.fd_clips], rms, 2)
        sound_fd = digits_metrics.frechet_distance(sdm.sound_features(fd_clips), sdm._test_sound_features())
        if start is None:
            start, start_fd = latest, sound_fd
        flags = drift_flags(latest, start, reference)
        rows.append({"floor_rms": rms, "floor_audio_db": round(latest["drift_floor_audio"], 2),
                     "loudness_audio_db": round(latest["drift_loudness_audio"], 2),
                     "sound_fd": round(sound_fd, 2), "sound_fd_worsens": sound_fd > WORSENS * start_fd,
                     "flagged": flags})
    print(json.dumps({"bench": "sound_floor", "samples": ns.samples, "rate": rate,
                      "real_floor_audio_db": round(real["value"]["floor_audio"], 2),
                      "floor_band_db": round(drift_band("floor_audio", reference), 2),
                      "loudness_band_db": round(drift_band("loudness_audio", reference), 2),
                      "rows": rows, "wall_s": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
