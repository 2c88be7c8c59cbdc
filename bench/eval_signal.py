"""Does the frozen teacher's own feature distance rank students the way ground truth does? On the two
toy worlds where ground truth exists (digits: the SD3 digits teacher; sounding digits: the small
MiniMax-H3 teacher), train students of different quality with the in-process reference loop, and
at each of their evaluations measure

- the signal, at the sample count a run evaluates with (``--num-samples``, 32: the minimax-h3
  recipe's ``eval_num_samples``): ``projected_kid`` between the teacher's features
  (``teacher_features``) of the teacher's 50-step Euler samples and of the student's K-step
  samples, both from the same prompts and the same starting noise (row i of each), per modality;
- the ground truth on many samples (``--gt-samples``): digits FD (lower better); sounding digits'
  frame FD (lower better) and sound accuracy (higher better);
- the drift statistics (``dmd2_core.evaluation.drift``) of the student's decoded samples and the
  within-prompt diversity of its teacher features, against the teacher reference's,

and print one JSON line:

  {"digits_image_spearman": .., "av_video_spearman": .., "av_audio_spearman": .. (means over the
   seeds), "..._per_seed": [..], "targets": {..}, "oversaturation_flag_eval": [..],
   "oversaturation_fd_worsens_eval": [..], "collapse_...", "healthy_...", "bands": {..},
   "sync": {..}, "students": {..}, "wall_s": ..}

Students, per training seed (``--seeds``): the recipe's 4-step student at the iterations of
``--evals`` (0 is the teacher's weights sampled in 4 student steps), a 1-step student at its first
and fourth evaluation, and the injected failures along the same evaluations: on digits an
over-saturating student (real-score guidance ``--oversaturation-guidance`` 8, the recipe's 1.05)
and a collapsing one (learning rates ``--collapse-lr-factor`` 30 x the recipe's); on sounding
digits the collapsing one (the teacher is guidance-distilled: it has no unconditional branch to
guide with). Digits students run the ``tiny`` recipe as shipped; sounding-digits students
bench/quality_av.py's CPU sizes of the ``minimax-h3`` recipe with its defaults.

Spearman: per seed, over that seed's distinct students (the 4-step iteration 0 is one student,
shared by the runs of 4 steps), of the KID against the ground truth, sign-adjusted so that +1 is
a perfect ranking: digits image KID against FD, video KID against frame FD, audio KID against
the sound error rate (1 - sound accuracy).

Noise level of the features: every modality at sigma 0.5 (SD3: u = 0.5; MiniMax-H3: video at
u = 1/13, where shift(u, 12) = 0.5, audio at u = 1/4, where shift(u, 3) = 0.5); the figures at
the family's default u = 0.5 for both H3 modalities (video at sigma 0.92) are reported beside
them as ``..._spearman_u0.5``.

Drift bands: the teacher's 50-step reference is drawn ``BAND_DRAWS`` more times (32 samples each,
other seeds); a statistic's spread s is its standard deviation over those draws, and a student
leaves the band when |student - reference| > max(BAND_K * sqrt(2) * s, floor), the sqrt(2) for a
difference of two draws of that size and the floor (``BAND_FLOORS``) a resolution below which no
change matters. A run is flagged at its first evaluation where any statistic leaves its band;
its ground-truth FD worsens at its first evaluation whose FD is more than ``WORSE_MARGIN`` above
the best before it.

Sync: AV-Align needs sound onsets and motion peaks, and a sounding digit has neither (a steady tone,
a digit sliding at constant speed). What the world does have is the stereo balance following the
digit's column: ``balance_sync`` scores that per frame, and ``delay_audio`` shifts a clip's sound
by k frames, so a sync figure must fall with k (reported at k = 0, 1, 2, 4).

    python bench/eval_signal.py [--seeds 0 1] [--num-samples 32] [--evals 0 10 20 40 80 160] [--workers 2]

The teacher's reference features and band draws are cached under ``--run-dir`` per (teacher,
settings): a rerun does not resample them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing as mp
import os
import signal
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch

from dmd2_core import flow_matching as fm
from dmd2_core.args import load_args
from dmd2_core.evaluation import drift
from dmd2_core.evaluation.kernel import projected_kid
from dmd2_core.evaluation.teacher_features import teacher_features
from dmd2_core.models import load_model_dir
from dmd2_core.sampling import euler_sample
from dmd2_core.toys import (
    digits_metrics,
    sounding_digits_metrics,
    sounding_digits_teacher,
)
from dmd2_core.toys import sounding_digits as sd
from dmd2_core.toys.digits import digits_prompt_set
from dmd2_core.toys.digits_teacher import ensure_teacher
from dmd2_core.train.reference import ReferenceLoop

REFERENCE_STEPS = 50  # the teacher's Euler steps of the reference
TEACHER_GUIDANCE = 1.0  # the digits teacher's reference sampler: plain conditional (as bench/quality.py)
DEFAULT_U = 0.5  # teacher_features' default schedule position
# every modality at sigma 0.5: SD3 at u; H3 video at shift(u, 12) = 0.5, audio at shift(u, 3) = 0.5
SIGNAL_U = {"digits": {"image": 0.5}, "av": {"video": 1.0 / 13.0, "audio": 1.0 / 4.0}}
FPS = 16.0  # the minimax-h3 recipe's eval_fps: a clip of 4 frames is 0.25 s ...
SAMPLE_RATE = int(sd.AUDIO_SAMPLES * FPS / sd.FRAMES)  # ... so its 256 samples are at 1024 Hz
BAND_DRAWS = 8
BAND_SEED = 10_000  # band draw r uses eval seed BAND_SEED + 1000 r
SEED_STRIDE = 1000  # the signal's eval seed of training seed s: eval_seed + 1000 s (H3 draws sample j from seed + j)
BAND_K = 3.0
# the smallest change a band flags, per statistic (a statistic the teacher never moves, such as
# clipping, would otherwise be flagged by any sample that touches it)
BAND_FLOORS = {"brightness": 0.01, "contrast": 0.01, "flicker": 0.01, "audio_loudness": 1.0, "audio_peak": 0.02,
               "audio_clipping": 0.01, "audio_centroid": 10.0, "audio_silence": 0.02}
DIVERSITY_FLOOR = 0.05  # relative: 5% of the reference's within-prompt diversity
WORSE_MARGIN = 0.10
SYNC_SHIFTS = (0, 1, 2, 4)
# bench/quality_av.py's defaults: the CPU sizes of the minimax-h3 recipe
AV_DEFAULTS = {"batch_size": 16, "lr": 1e-4, "ema": 0.9, "update_ratio": 5, "gan_weight": 2.0, "gan_critic_weight": 0.1,
               "video_weight": 1.0, "audio_weight": 1.0, "min_sigma": 0.2, "regression_weight": 0.25,
               "regression_steps": 4}


# ---- sync: the stereo balance follows the digit ---------------------------------------------------

def delay_audio(audio: torch.Tensor, k: int) -> torch.Tensor:
    """Stereo clips [N, 2, S] whose sound comes ``k`` frames late: the waveform shifted right by k
    frames' samples, the gap filled with the clip's first frame of sound repeated (the sound holds
    where it starts, so the gap has a balance; silence has none)."""
    if k <= 0:
        return audio
    per_frame = audio.shape[-1] // sd.FRAMES
    k = min(k, sd.FRAMES)
    head = audio[..., :per_frame].repeat(1, 1, k)
    return torch.cat([head, audio], dim=-1)[..., :audio.shape[-1]]


def expected_balance(columns: torch.Tensor) -> torch.Tensor:
    """The right share of a frame's energy for a digit at ``columns`` [N, F]: the world's
    constant-power pan (``sd.pan_gains``) puts sin^2(pi/2 c / MAX_COLUMN) of it on the right."""
    return torch.sin(columns.float() / sd.MAX_COLUMN * math.pi / 2) ** 2


def balance_sync(frames: torch.Tensor, audio: torch.Tensor, k: int = 0) -> float:
    """How well the sound's stereo balance tracks the digit's column, frame by frame, with the sound
    delayed by ``k`` frames (``delay_audio``): 1 - the mean |balance - expected balance| over
    frames and clips (``sounding_digits_metrics.balance`` per frame, the digit's column from
    ``locate_digits``). 1: the sound is where the picture is at every frame."""
    columns, _ = sounding_digits_metrics.locate_digits(frames)
    got = sounding_digits_metrics.balance(delay_audio(audio, k))
    return float(1.0 - (got - expected_balance(columns)).abs().mean())


def sync_table(frames, audio) -> dict[str, float]:
    return {str(k): round(balance_sync(frames, audio, k), 4) for k in SYNC_SHIFTS}


# ---- the worlds -----------------------------------------------------------------------------------

def start_noise(family, shape, seed: int) -> torch.Tensor:
    """The starting noise of ``dmd2_method.eval_samples`` for ``seed``: the student's and the
    teacher's sample i start from the same noise."""
    noise = family.eval_noise(shape[0], seed)
    return noise if noise is not None else torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def labels_for(world: str, n: int) -> torch.Tensor:
    return digits_metrics.balanced_labels(n) if world == "digits" else sounding_digits_metrics.balanced_labels(n)


def load_teacher(world: str, url: str):
    loaded = load_model_dir(url)
    model = loaded.model.eval().requires_grad_(False)
    family = loaded.family if world == "digits" else sounding_digits_teacher.bound_family(model)
    return family, model, loaded.shift


def prompt_cond(world: str, labels: torch.Tensor) -> dict:
    return (digits_prompt_set() if world == "digits" else sd.prompt_set()).cond(labels)


@torch.no_grad()
def teacher_samples(world: str, family, model, shift, labels, seed: int) -> torch.Tensor:
    if world == "av":
        return sounding_digits_teacher.sample_clips(family, model, labels, REFERENCE_STEPS, seed)
    prompts = digits_prompt_set()
    noise = start_noise(family, (len(labels), 1, 8, 8), seed)
    return euler_sample(family, model, noise, prompts.cond(labels), fm.euler_sigmas(REFERENCE_STEPS, shift),
                        prompts.uncond(len(labels)), TEACHER_GUIDANCE)


def features_at(family, model, x0, cond, us: dict[str, float]) -> dict[str, torch.Tensor]:
    """Teacher features per modality, each at its own u."""
    out = {}
    for u in sorted(set(us.values())):
        feats = teacher_features(family, model, x0, cond, u=u, seed=0)
        out.update({m: feats[m] for m, mu in us.items() if mu == u})
    return out


def signal_features(world: str, family, model, x0, labels) -> dict[str, dict[str, torch.Tensor]]:
    """{"signal": features at SIGNAL_U, "default_u": at u = 0.5} (the latter for H3 only)."""
    cond = prompt_cond(world, labels)
    out = {"signal": features_at(family, model, x0, cond, SIGNAL_U[world])}
    if world == "av":
        out["default_u"] = features_at(family, model, x0, cond, {m: DEFAULT_U for m in SIGNAL_U[world]})
    return out


def drift_of(world: str, x0: torch.Tensor, feats: dict[str, torch.Tensor], labels) -> dict[str, float]:
    """The drift statistics of decoded samples (saturation left out: every picture here is grey)
    and the within-prompt diversity of their teacher features, per modality."""
    if world == "digits":
        stats = drift.picture_stats(x0.clamp(-1, 1))
    else:
        frames, audio = sd.decode(x0)
        stats = {**drift.picture_stats(frames[:, None]),
                 **{f"audio_{k}": v for k, v in drift.audio_stats(audio, SAMPLE_RATE).items()}}
    stats.pop("saturation", None)
    stats.update({f"{m}_diversity": v for m, v in drift.within_prompt_diversity(feats, labels).items()})
    return stats


def ground_truth(world: str, x0: torch.Tensor, labels) -> dict[str, float]:
    if world == "digits":
        return digits_metrics.evaluate_digits(x0.clamp(-1, 1), labels)
    return sounding_digits_metrics.evaluate_clips(x0, labels)


def finite(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    ok = bool(torch.isfinite(x).all())
    return (x if ok else torch.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)), ok


# ---- the teacher's reference, cached --------------------------------------------------------------

def teacher_key(url: str) -> str:
    """What names a teacher: its path and its weights' size and time."""
    path = os.path.abspath(url)
    stamp = []
    for root, _, files in sorted(os.walk(path)):
        for f in sorted(files):
            st = os.stat(os.path.join(root, f))
            stamp.append((os.path.relpath(os.path.join(root, f), path), st.st_size, int(st.st_mtime)))
    return json.dumps([path, stamp])


def cached(run_dir: str, name: str, settings: dict, make):
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    path = os.path.join(run_dir, "cache", f"{name}-{key}.pt")
    if os.path.isfile(path):
        return torch.load(path)
    value = make()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(value, path + ".tmp")
    os.replace(path + ".tmp", path)
    return value


def reference(world: str, url: str, n: int, seed: int, run_dir: str) -> dict:
    """The teacher's 50-step samples of eval seed ``seed``, their features and drift statistics."""
    settings = {"world": world, "teacher": teacher_key(url), "n": n, "seed": seed, "steps": REFERENCE_STEPS,
                "u": SIGNAL_U[world], "default_u": DEFAULT_U, "guidance": TEACHER_GUIDANCE, "v": 1}

    def make():
        family, model, shift = load_teacher(world, url)
        labels = labels_for(world, n)
        x0 = teacher_samples(world, family, model, shift, labels, seed)
        feats = signal_features(world, family, model, x0, labels)
        return {"x0": x0, "features": feats, "drift": drift_of(world, x0, feats["signal"], labels)}

    return cached(run_dir, f"reference-{world}", settings, make)


def bands(world: str, url: str, n: int, run_dir: str) -> dict:
    """Per statistic: the spread of the teacher reference's figure over BAND_DRAWS draws of n
    samples (other eval seeds), and the band's half-width."""
    draws = [reference(world, url, n, BAND_SEED + SEED_STRIDE * r, run_dir)["drift"] for r in range(BAND_DRAWS)]
    out = {}
    for stat in draws[0]:
        values = np.array([d[stat] for d in draws], dtype=np.float64)
        spread = float(np.nanstd(values, ddof=1))
        floor = DIVERSITY_FLOOR * float(np.nanmean(values)) if stat.endswith("_diversity") else BAND_FLOORS[stat]
        out[stat] = {"spread": spread, "half_width": max(BAND_K * math.sqrt(2) * spread, floor)}
    return out


# ---- students -------------------------------------------------------------------------------------

def run_specs(evals: list[int], ns) -> dict[str, list[dict]]:
    """The runs per world: name, student steps, overrides, evaluated iterations (the failures
    share the recipe run's iteration 0, which they do not evaluate again)."""
    one_step = [evals[0], evals[min(3, len(evals) - 1)]]
    lr = load_args("tiny").lr
    digits = [{"run": "recipe", "steps": 4, "set": {}, "evals": evals},
              {"run": "one_step", "steps": 1, "set": {}, "evals": one_step},
              {"run": "oversaturation", "steps": 4, "set": {"dmd2_guidance_scale": ns.oversaturation_guidance},
               "evals": evals[1:]},
              {"run": "collapse", "steps": 4, "set": {"lr": lr * ns.collapse_lr_factor,
                                                      "critic_lr": lr * ns.collapse_lr_factor}, "evals": evals[1:]}]
    av_lr = AV_DEFAULTS["lr"] * ns.collapse_lr_factor
    av = [{"run": "recipe", "steps": 4, "set": {}, "evals": evals},
          {"run": "one_step", "steps": 1, "set": {}, "evals": one_step},
          {"run": "collapse", "steps": 4, "set": {"lr": av_lr, "critic_lr": av_lr}, "evals": evals[1:-1] or evals[1:]}]
    return {"digits": digits, "av": av}


def overrides(world: str, spec: dict, seed: int, teacher: str, run_dir: str) -> dict:
    if world == "digits":
        return {"hf_checkpoint": teacher, "save": os.path.join(run_dir, "students"), "dmd2_student_steps": spec["steps"],
                "seed": seed, **spec["set"]}
    import quality_av  # bench/quality_av.py: the CPU sizes of the minimax-h3 recipe

    ns = SimpleNamespace(**AV_DEFAULTS)
    out = quality_av.cpu_overrides(teacher, spec["steps"], seed, ns, dict(spec["set"]))
    return {**out, "save": os.path.join(run_dir, "students-av")}


def student_job(job: dict) -> dict:
    """One training run: its evaluations (ground truth on many samples; features and drift on the
    signal's few; the final recipe clips' sync)."""
    torch.set_num_threads(1)
    start = time.perf_counter()
    world = job["world"]
    loop = ReferenceLoop(load_args("tiny" if world == "digits" else "minimax-h3", job["overrides"]))
    teacher = loop.teacher  # the frozen teacher (no LoRA here: not a shared base)
    n_labels, gt_labels = labels_for(world, job["num_samples"]), labels_for(world, job["gt_samples"])
    evals = []

    def evaluate(iteration):
        with torch.no_grad():
            x_gt, ok_gt = finite(loop.sample(gt_labels.tolist(), job["gt_seed"]))
            x_sig, ok_sig = finite(loop.sample(n_labels.tolist(), job["signal_seed"]))
            feats = signal_features(world, loop.family, teacher, x_sig, n_labels)
        line = {"world": world, "run": job["run"], "seed": job["seed"], "steps": job["steps"], "iteration": iteration,
                "finite": ok_gt and ok_sig, "gt": ground_truth(world, x_gt, gt_labels),
                "drift": drift_of(world, x_sig, feats["signal"], n_labels)}
        if world == "av" and job["run"] == "recipe" and iteration == job["evals"][-1]:
            line["sync"] = sync_table(*sd.decode(x_gt))
        evals.append({**line, "features": feats})
        if job.get("progress"):
            with open(job["progress"], "a") as f:
                f.write(json.dumps(line) + "\n")

    last = max(job["evals"])
    if 0 in job["evals"]:
        evaluate(0)
    for i in range(1, last + 1):
        loop.iterate(i)
        if i in job["evals"]:
            evaluate(i)
    return {"world": world, "run": job["run"], "seed": job["seed"], "evals": evals, "wall_s": time.perf_counter() - start}


# ---- figures --------------------------------------------------------------------------------------

def spearman(signal: list[float], truth: list[float]) -> float:
    from scipy.stats import spearmanr

    rho = spearmanr(signal, truth).statistic
    return float(rho) if np.isfinite(rho) else math.nan


def first_fd_worsening(fds: list[float]) -> int | None:
    """The first evaluation index whose FD is more than WORSE_MARGIN above the best before it."""
    for e in range(1, len(fds)):
        if fds[e] > (1 + WORSE_MARGIN) * min(fds[:e]):
            return e
    return None


def leaving(stats: dict, ref: dict, band: dict) -> list[str]:
    out = []
    for stat, b in band.items():
        a, r = stats.get(stat, math.nan), ref.get(stat, math.nan)
        if math.isnan(a) != math.isnan(r) or (not math.isnan(a) and abs(a - r) > b["half_width"]):
            out.append(stat)
    return out


def r4(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(float(x), 4)


def summarise(results: list[dict], refs: dict, band: dict, ns, worlds: set) -> dict:
    out: dict = {}
    modalities = {"digits": [("image", "fd", 1.0)], "av": [("video", "frame_fd", 1.0), ("audio", "sound_acc", -1.0)]}
    students: dict = {}
    by_run = {}
    for r in results:
        by_run[(r["world"], r["run"], r["seed"])] = r["evals"]
    for world, mods in modalities.items():
        if world not in worlds:
            continue
        students[world] = {}
        for seed in ns.seeds:
            ref = refs[(world, seed)]
            rows, seen = [], set()
            for (w, run, s), ev in sorted(by_run.items()):
                if w != world or s != seed:
                    continue
                for e in ev:
                    ident = ("iteration0", e["steps"]) if e["iteration"] == 0 else (run, e["iteration"])
                    if ident in seen:
                        continue
                    seen.add(ident)
                    row = {"run": run, "steps": e["steps"], "iteration": e["iteration"], "finite": e["finite"],
                           **{k: r4(v) for k, v in e["gt"].items() if k in ("fd", "frame_fd", "sound_acc", "acc", "agreement")}}
                    for mod, _, _ in mods:
                        row[f"kid_{mod}"] = r4(projected_kid(ref["features"]["signal"][mod], e["features"]["signal"][mod]))
                        if "default_u" in ref["features"]:
                            row[f"kid_{mod}_u0.5"] = r4(projected_kid(ref["features"]["default_u"][mod],
                                                                      e["features"]["default_u"][mod]))
                    rows.append(row)
            students[world][str(seed)] = rows
            for mod, truth, sign in mods:
                gt = [sign * r[truth] for r in rows]
                for suffix in ("", "_u0.5"):
                    col = f"kid_{mod}{suffix}"
                    if rows and col in rows[0]:
                        out.setdefault(f"{world}_{mod}_spearman{suffix}_per_seed", []).append(
                            r4(spearman([r[col] for r in rows], gt)))
            out.setdefault(f"{world}_num_students", []).append(len(rows))
    for key in [k for k in out if k.endswith("_per_seed") and "spearman" in k]:
        vals = [v for v in out[key] if v is not None]
        out[key.removesuffix("_per_seed")] = r4(sum(vals) / len(vals)) if vals else None
    out["targets"] = {f"{k}_ge_0.8": out[k] is not None and out[k] >= 0.8
                      for k in ("digits_image_spearman", "av_video_spearman", "av_audio_spearman") if k in out}

    # drift: each run's evaluations, the recipe run's iteration 0 in front of the failures'
    truth_key = {"digits": "fd", "av": "frame_fd"}
    drift_out = {}
    for world, runs in (("digits", ("recipe", "oversaturation", "collapse")), ("av", ("recipe", "collapse"))):
        if world not in worlds:
            continue
        for run in runs:
            name = ("" if world == "digits" else "av_") + ("healthy" if run == "recipe" else run)
            for seed in ns.seeds:
                ev = list(by_run.get((world, run, seed), []))
                if run != "recipe":
                    zero = [e for e in by_run.get((world, "recipe", seed), []) if e["iteration"] == 0]
                    ev = zero + ev
                ref = refs[(world, seed)]["drift"]
                flags = [leaving(e["drift"], ref, band[world]) for e in ev]
                flag = next((i for i, f in enumerate(flags) if f), None)
                fds = [e["gt"][truth_key[world]] for e in ev]
                drift_out.setdefault(f"{name}_flag_eval", []).append(flag)
                drift_out.setdefault(f"{name}_fd_worsens_eval", []).append(first_fd_worsening(fds))
                drift_out.setdefault(f"{name}_history", []).append(
                    [{"iteration": e["iteration"], truth_key[world]: r4(e["gt"][truth_key[world]]), "leaves": f,
                      **{k: r4(v) for k, v in e["drift"].items()}} for e, f in zip(ev, flags)])
    for failure in [f for f in ("oversaturation", "collapse", "av_collapse") if f"{f}_flag_eval" in drift_out]:
        ok = []
        for flag, worse in zip(drift_out[f"{failure}_flag_eval"], drift_out[f"{failure}_fd_worsens_eval"]):
            ok.append(None if worse is None else flag is not None and flag <= worse)
        drift_out[f"{failure}_flagged_at_or_before_fd_worsens"] = ok
    out.update({k: v for k, v in drift_out.items() if not k.endswith("_history")})
    out["drift_histories"] = {k.removesuffix("_history"): v for k, v in drift_out.items() if k.endswith("_history")}
    out["bands"] = {w: {s: {"reference_spread": r4(b["spread"]), "half_width": r4(b["half_width"])} for s, b in bb.items()}
                    for w, bb in band.items()}
    out["reference_drift"] = {f"{w}_{s}": {k: r4(v) for k, v in refs[(w, s)]["drift"].items()} for (w, s) in refs}
    out["students"] = students
    return out


# ---- main -----------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--teacher", default="runs/teacher", help="the digits teacher (trained there if absent)")
    parser.add_argument("--av-teacher", default="runs/av-teacher", help="the sounding-digits teacher (trained there if absent)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="training seeds")
    parser.add_argument("--num-samples", type=int, default=32, help="samples of the signal (the minimax-h3 recipe's eval_num_samples)")
    parser.add_argument("--gt-samples", type=int, nargs=2, default=[1000, 600], metavar=("DIGITS", "AV"),
                        help="samples of the ground truth per world")
    parser.add_argument("--evals", type=int, nargs="+", default=[0, 10, 20, 40, 80, 160], help="evaluated iterations")
    parser.add_argument("--eval-seed", type=int, default=1234, help="the signal's eval seed (the recipe's); seed s adds 1000 s")
    parser.add_argument("--gt-seed", type=int, default=0, help="eval seed of the ground truth's samples")
    parser.add_argument("--oversaturation-guidance", type=float, default=8.0)
    parser.add_argument("--collapse-lr-factor", type=float, default=30.0)
    parser.add_argument("--worlds", nargs="+", default=["digits", "av"], choices=["digits", "av"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--run-dir", default="runs/eval-signal")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()

    def log(message):
        print(message, file=sys.stderr)

    evals = sorted(set(ns.evals))
    if evals[0] != 0 or len(evals) < 3:
        parser.error("--evals needs 0 and at least two more iterations")
    os.makedirs(ns.run_dir, exist_ok=True)
    teachers = {}
    if "digits" in ns.worlds:
        teachers["digits"] = ensure_teacher(ns.teacher, seed=0, log=log)
    if "av" in ns.worlds:
        teachers["av"] = sounding_digits_teacher.ensure_av_teacher(ns.av_teacher, log=log)
        sounding_digits_teacher.ensure_real_set(teachers["av"])
        sounding_digits_metrics.sound_classifier()
    digits_metrics.digits_classifier()  # trained once, before the workers race for it

    refs, band = {}, {}
    for world, url in teachers.items():
        for seed in ns.seeds:
            refs[(world, seed)] = reference(world, url, ns.num_samples, ns.eval_seed + SEED_STRIDE * seed, ns.run_dir)
        band[world] = bands(world, url, ns.num_samples, ns.run_dir)
    log(f"references ready ({time.perf_counter() - start:.0f}s)")

    gt_samples = dict(zip(("digits", "av"), ns.gt_samples))
    progress = os.path.join(ns.run_dir, "progress.jsonl")
    specs = run_specs(evals, ns)
    jobs = [{"world": world, "run": spec["run"], "seed": seed, "steps": spec["steps"], "evals": spec["evals"],
             "num_samples": ns.num_samples, "gt_samples": gt_samples[world], "gt_seed": ns.gt_seed,
             "signal_seed": ns.eval_seed + SEED_STRIDE * seed, "progress": progress,
             "overrides": overrides(world, spec, seed, url, ns.run_dir)}
            for world, url in teachers.items() for spec in specs[world] for seed in ns.seeds]
    # the longest first: H3 iterations are ~3x the digits' and the recipe runs go furthest
    jobs.sort(key=lambda j: -max(j["evals"]) * (3 if j["world"] == "av" else 1))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = []
    with mp.get_context("spawn").Pool(ns.workers) as pool:
        for r in pool.imap_unordered(student_job, jobs):
            results.append(r)
            log(f"done: {r['world']} {r['run']} seed {r['seed']} in {r['wall_s']:.0f}s ({len(results)}/{len(jobs)})")

    out = summarise_worlds(results, refs, band, ns, teachers)
    out.update({"num_samples": ns.num_samples, "gt_samples": gt_samples, "evals": evals, "seeds": ns.seeds,
                "u": SIGNAL_U, "reference_steps": REFERENCE_STEPS, "band_k": BAND_K, "band_draws": BAND_DRAWS,
                "worse_margin": WORSE_MARGIN, "oversaturation_guidance": ns.oversaturation_guidance,
                "collapse_lr_factor": ns.collapse_lr_factor, "wall_s": round(time.perf_counter() - start, 1)})
    print(json.dumps(out))


def summarise_worlds(results, refs, band, ns, teachers) -> dict:
    """``summarise`` for the worlds that ran, plus the sync figures."""
    present = set(teachers)
    out = summarise(results, refs, band, ns, present)
    sync: dict = {"av_align": "not measurable on sounding digits: the tone is steady and the digit slides at "
                              "constant speed, so there are no sound onsets and no motion peaks to align"}
    if "av" in present:
        clips = sd.make_clips("test", 0)
        sync["balance_sync_real_test_clips"] = sync_table(clips.frames, clips.audio)
        sync["balance_sync_teacher_50"] = [sync_table(*sd.decode(refs[("av", s)]["x0"])) for s in ns.seeds]
        sync["balance_sync_student_4_final"] = [e["sync"] for r in results if r["world"] == "av" and r["run"] == "recipe"
                                                for e in r["evals"] if "sync" in e]
    out["sync"] = sync
    return out


if __name__ == "__main__":
    main()
