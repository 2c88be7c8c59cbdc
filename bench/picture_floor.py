"""Does the picture grow a floor beside the sound's? Prints one JSON line.

The sounding digits' background is black (-1) in the real clips, so every background pixel above
``LIT`` is noise the sampler left. Per sampler, the fraction of background pixels lit: the real
held-out clips, the teacher at 50 and 4 steps (``--samples`` clips, eval seed 0), and the students
an ``eval_signal.py`` run kept (``--run-dir``: per run and seed, at each eval). The background is
every column outside the digit's window (``sounding_digits_metrics.locate_digits``, one column of
margin each side), the part of the frame the frame FD's crops never read.

    python bench/picture_floor.py [--run-dir runs/es-mel23] [--teacher runs/av-teacher] [--samples 100]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dmd2_core.models import load_model_dir  # noqa: E402
from dmd2_core.toys import sounding_digits as sd, sounding_digits_metrics as sdm, sounding_digits_teacher  # noqa: E402

LIT = -0.9  # of [-1, 1]: a twentieth of the way from black to white


def lit_background(samples: torch.Tensor) -> float:
    """The fraction of background pixels (outside each frame's digit window) above ``LIT``."""
    frames, _ = sd.decode(samples)
    columns, _ = sdm.locate_digits(frames)
    x = torch.arange(frames.shape[-1])
    digit = (x >= columns[..., None] - 1) & (x <= columns[..., None] + sd.DIGIT)  # [N, F, W]
    background = ~digit[:, :, None, :].expand_as(frames)
    return float((frames[background] > LIT).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/es-mel23")
    parser.add_argument("--teacher", default="runs/av-teacher")
    parser.add_argument("--samples", type=int, default=100)
    ns = parser.parse_args()
    start = time.perf_counter()
    clips = sd.make_clips("test", 0)
    out = {"real": round(lit_background(sd.encode(clips.frames[:ns.samples], clips.audio[:ns.samples])), 4)}
    loaded = load_model_dir(sounding_digits_teacher.ensure_av_teacher(ns.teacher, log=None))
    family = sounding_digits_teacher.bound_family(loaded.model)
    labels = sdm.balanced_labels(ns.samples)
    for k in (50, 4):
        samples = sounding_digits_teacher.sample_clips(family, loaded.model.eval(), labels, k, 0)
        out[f"teacher_{k}"] = round(lit_background(samples), 4)
    for path in sorted(glob.glob(os.path.join(ns.run_dir, "runs", "av-*.pt"))):
        run = torch.load(path, weights_only=False)
        out.setdefault("students", {}).setdefault(run["run"], {})[str(run["seed"])] = {
            str(e["iteration"]): round(lit_background(e["x"]), 4) for e in run["evals"]}
    out["wall_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
