"""Why does the teacher-feature distance rank the sound worse than the pictures, and what would it
take? Issue 39 item 3 asks Spearman >= 0.8 per modality at the minimax-h3 recipe's 32 eval
samples; bench/eval_signal.py measured audio at 0.55 / 0.31 against the sound FD. This reads the
sounding-digits students an eval_signal run kept (``--run-dir``: ``students.pt``, each evaluation's
signal samples and ground truth, and its cached teacher references) and prints one JSON line:

- ``ranking``: Spearman (per seed, then the mean) of the projected KID against the ground truth
  (audio: the sound FD; video: the frame FD) over each seed's distinct students, per
  - feature position ``u``: 0.5 (the product's ``evaluators.FEATURE_U``: the audio at sigma 0.75)
    and 0 (the clean sample, no re-noising);
  - pooling of the feature block's tokens per modality: ``mean`` (the product's), ``mean_std``
    (their mean and standard deviation per channel, concatenated), ``per_time`` (audio only: the
    mean over the two stereo channels' tokens of each time row, the rows concatenated);
  - signal sample count (``--counts``: each evaluation's first n samples; 32 is the recipe's);
  - reference: the real set (512 rows, the run's criterion) or the teacher's 50-step samples.
- ``students``: each student's ground truth and what its sound's spectrum has (RMS, the median
  bin's magnitude: the floor under the tone), ``real_test_clips`` the same of the held-out clips.
- ``probe``: what the features see, on real clips where the change is known: 512 real rows as the
  reference, ``--probe-samples`` other real rows as the "student", their sound scaled by a gain
  (louder, quieter) or given a white floor (latent units; the students' spectra sit on such a
  floor), with the sound FD of each and its KID per (u, pooling).

Everything but the ``probe``'s sound FD reads the teacher's features only; the forwards are the
product's (``teacher_features``' noise, block and micro-batches), with the tokens kept so that the
pooling can change.

    python bench/eval_signal.py --worlds av --workers 1 --run-dir runs/es-audio --num-samples 128   # once
    python bench/audio_signal.py --run-dir runs/es-audio [--counts 32 64 128] [--us 0.5 0]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import eval_signal as es  # bench/eval_signal.py: its worlds, references and students
import torch

from dmd2_core.evaluation import teacher_evaluator as evaluators
from dmd2_core.evaluation.kernel import projected_kid
from dmd2_core.evaluation.teacher_features import modality_name, sample_noise
from dmd2_core.models.feature_tap import FeatureTap
from dmd2_core.models.minimax_h3 import AUDIO_CHANNELS
from dmd2_core.toys import digits_metrics, sounding_digits_metrics
from dmd2_core.toys import sounding_digits as sd

TRUTH = {"audio": "sound_fd", "video": "frame_fd"}
MICRO_BATCH = 8  # teacher_features' default


@torch.no_grad()
def teacher_tokens(family, model, x0: torch.Tensor, cond: dict, u: float, index_offset: int = 0) -> dict[str, torch.Tensor]:
    """The feature block's tokens per modality {modality: [N, tokens, width]}: ``teacher_features``'
    forwards (its noise ``evaluators.FEATURE_SEED`` from ``index_offset``, its default block)
    before the pooling. Sounding-digits prompts have one text length, so one forward group."""
    n = x0.shape[0]
    cond = {k: torch.as_tensor(v) for k, v in cond.items() if k in family.cond_keys}
    noise = sample_noise(x0.shape, evaluators.FEATURE_SEED, index_offset)
    text_tokens = cond["prompt_embeds"].shape[1]
    out: dict[str, torch.Tensor] = {}
    model.eval()
    for start in range(0, n, MICRO_BATCH):
        index = torch.arange(start, min(n, start + MICRO_BATCH))
        x_t = family.add_noise(x0[index].float(), noise[index], u)
        with FeatureTap(family, model, None, stop=True) as tap:
            family.predict_velocity(model, x_t, torch.full((len(index),), float(u)), {k: v[index] for k, v in cond.items()})
        for name, span in (family.feature_tokens(text_tokens) or {modality_name(family): None}).items():
            part = tap.features if span is None else tap.features.index_select(1, span)
            out.setdefault(name, torch.empty(n, *part.shape[1:]))[index] = part.float()
    return out


def per_time(tokens: torch.Tensor) -> torch.Tensor:
    """Audio tokens [N, channels x rows, width] (channel-major, ``minimax_h3``'s audio rows) ->
    the channels' mean per time row, concatenated [N, rows x width]."""
    n, count, width = tokens.shape
    return tokens.reshape(n, AUDIO_CHANNELS, count // AUDIO_CHANNELS, width).mean(1).reshape(n, -1)


POOLS = {
    "mean": lambda t, mod: t.mean(1),
    "mean_std": lambda t, mod: torch.cat([t.mean(1), t.std(1, correction=0)], 1),
    "per_time": lambda t, mod: per_time(t) if mod == "audio" else None,
}


def spearman_table(results, url: str, run_dir: str, ns, family, model) -> dict:
    kept = min(e["x"].shape[0] for r in results for e in r["evals"])
    counts = [c for c in ns.counts if c <= kept]
    real_x, real_cond = es.real_rows("av", url, ns.real_samples)
    labels = es.labels_for("av", kept)
    cond = es.prompt_cond("av", labels)
    out: dict = {}
    for u in ns.us:
        real = teacher_tokens(family, model, real_x, real_cond, u, evaluators.REAL_NOISE_OFFSET)
        for seed in ns.seeds:
            rows = es.distinct_students(results, "av", seed)
            teacher_x = es.reference("av", url, kept, ns.eval_seed + es.SEED_STRIDE * seed, run_dir)["x0"]
            refs = {"real": real, "teacher": teacher_tokens(family, model, teacher_x, cond, u)}
            students = [teacher_tokens(family, model, es.finite(e["x"])[0], cond, u) for _, e in rows]
            for mod, pool, n, ref in itertools.product(TRUTH, POOLS, counts, refs):
                reference = POOLS[pool](refs[ref][mod] if ref == "real" else refs[ref][mod][:n], mod)
                if reference is None:
                    continue
                kids = [projected_kid(reference, POOLS[pool](s[mod][:n], mod), dim=evaluators.PROJECTION_DIM)
                        for s in students]
                rho = es.spearman(kids, [e["gt"][TRUTH[mod]] for _, e in rows])
                out.setdefault(f"{mod}_u{u:g}_{pool}_n{n}_{ref}_kid_spearman_per_seed", []).append(es.r4(rho))
                if ns.kids:
                    out.setdefault(f"{mod}_u{u:g}_{pool}_n{n}_{ref}_kids", []).append([es.r4(k) for k in kids])
    for key in [k for k in out if k.endswith("_per_seed")]:
        out[key.removesuffix("_per_seed")] = es.r4(sum(out[key]) / len(out[key]))
    out["students"] = {str(seed): [{"run": run, "steps": e["steps"], "iteration": e["iteration"],
                                    **{t: es.r4(e["gt"][t]) for t in TRUTH.values()}, **sound_level(e["x"])}
                                   for run, e in es.distinct_students(results, "av", seed)] for seed in ns.seeds}
    out["real_test_clips"] = sound_level_of(sd.make_clips("test", 0).audio)
    return out


def sound_level_of(audio: torch.Tensor) -> dict[str, float]:
    """What the sound FD's spectrum sees of stereo clips [N, 2, S]: their RMS and the median
    magnitude of their spectrum's bins (``sounding_digits_metrics.spectrum`` before its log: a
    tone is one bin, so the median is the floor under it)."""
    magnitude = torch.fft.rfft(audio.float(), dim=-1).abs().pow(2).sum(1).sqrt()
    return {"rms": es.r4(audio.pow(2).mean().sqrt()), "median_bin": es.r4(magnitude.median())}


def sound_level(x: torch.Tensor) -> dict[str, float]:
    return sound_level_of(sd.decode(es.finite(x)[0])[1])


def probe(url: str, ns, family, model) -> dict:
    """Real clips with a known change to their sound against the real set, in the features."""
    n, m = ns.real_samples, ns.probe_samples
    x0, cond = es.real_rows("av", url, n + m)
    video_size = sd.FRAMES * sd.HEIGHT * sd.WIDTH
    noise = torch.randn((m, x0.shape[1] - video_size), generator=torch.Generator().manual_seed(ns.probe_seed))
    changes = [("none", 1.0, 0.0), *[(f"gain{g:g}", g, 0.0) for g in ns.probe_gains],
               *[(f"floor{f:g}", 1.0, f) for f in ns.probe_floors]]
    samples_cond = {k: v[n:] for k, v in cond.items()}
    held_out = sounding_digits_metrics.sound_features(sd.make_clips("test", 0).audio)  # the sound FD's yardstick
    out: dict = {}
    for name, gain, floor in changes:
        x = x0[n:].clone()
        x[:, video_size:] = gain * x[:, video_size:] + floor * noise
        _, audio = sd.decode(x)
        out[name] = {"sound_fd": es.r4(digits_metrics.frechet_distance(sounding_digits_metrics.sound_features(audio), held_out)),
                     "rms": es.r4(audio.pow(2).mean().sqrt())}
    for u in ns.us:
        ref = teacher_tokens(family, model, x0[:n], {k: v[:n] for k, v in cond.items()}, u, evaluators.REAL_NOISE_OFFSET)
        for name, gain, floor in changes:
            x = x0[n:].clone()
            x[:, video_size:] = gain * x[:, video_size:] + floor * noise
            tokens = teacher_tokens(family, model, x, samples_cond, u)["audio"]
            for pool in ("mean", "mean_std"):
                out[name][f"u{u:g}_{pool}_kid"] = es.r4(projected_kid(POOLS[pool](ref["audio"], "audio"),
                                                                      POOLS[pool](tokens, "audio"),
                                                                      dim=evaluators.PROJECTION_DIM))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", default="runs/es-audio", help="an eval_signal run of the av world (its students.pt)")
    parser.add_argument("--av-teacher", default="runs/av-teacher")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--counts", type=int, nargs="+", default=[32, 64, 128], help="signal samples (first n kept)")
    parser.add_argument("--us", type=float, nargs="+", default=[evaluators.FEATURE_U, 0.0], help="feature positions")
    parser.add_argument("--eval-seed", type=int, default=1234, help="as eval_signal's")
    parser.add_argument("--real-samples", type=int, default=512)
    parser.add_argument("--probe-samples", type=int, default=96)
    parser.add_argument("--probe-gains", type=float, nargs="*", default=[0.7, 1.2])
    parser.add_argument("--probe-floors", type=float, nargs="*", default=[0.05, 0.1, 0.2])
    parser.add_argument("--probe-seed", type=int, default=5)
    parser.add_argument("--kids", action="store_true", help="also print every student's KID")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    family, model, _ = es.load_teacher("av", ns.av_teacher)
    results = [r for r in torch.load(os.path.join(ns.run_dir, "students.pt")) if r["world"] == "av"]
    out = {"ranking": spearman_table(results, ns.av_teacher, ns.run_dir, ns, family, model),
           "probe": probe(ns.av_teacher, ns, family, model),
           "us": ns.us, "counts": ns.counts, "seeds": ns.seeds, "wall_s": None}
    out["wall_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
