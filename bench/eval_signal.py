"""Does the frozen teacher's own feature distance rank students the way ground truth does, and does
the drift rule flag failures in time? On the two toy worlds where ground truth exists (digits: the
SD3 digits teacher; sounding digits: the small MiniMax-H3 teacher), train students of different
quality with the in-process reference loop, keep each evaluation's ``--num-samples`` (32: the
minimax-h3 recipe's ``eval_num_samples``) samples, and measure them as the teacher evaluator does
(``dmd2_core.evaluation.teacher_evaluator``):

- ``projected_kid`` of the student's samples in the teacher's features (``teacher_features`` at
  the evaluator's ``FEATURE_U``; two other positions beside it) against two references: the
  teacher's 50-step Euler samples of the same prompts and noise (``teacher_kid``) and 512 rows of
  the world's real set, the GAN head's (``real_kid``, the run's criterion where there is one);
- the drift metrics (``drift.per_sample_stats`` pooled; within-prompt diversity), judged by
  ``evaluators.drift_flags`` from each run's first evaluation against the real set's samples (the
  teacher's samples beside it);
- the ground truth on many samples (``--gt-samples``): digits FD; sounding digits' frame FD and
  sound FD (``sounding_digits_metrics``), the sound accuracy beside it,

and print one JSON line:

  {"digits_image_real_kid_spearman": .., "av_video_real_kid_spearman": .., "av_audio_real_kid_spearman": ..,
   "..._teacher_kid_spearman": .. (means over the seeds; ``_per_seed``, other feature positions and
   the audio against sound accuracy beside), "targets": {..}, "oversaturation_flag_eval": [..],
   "oversaturation_fd_worsens_eval": [..], "collapse_...", "healthy_...", "av_...", "yardsticks": {..},
   "drift_histories": {..}, "sync": {..}, "students": {..}, "wall_s": ..}

Students, per training seed (``--seeds``): the recipe's 4-step student at the iterations of
``--evals`` (0 is the teacher's weights sampled in 4 student steps), a 1-step student at its first
and fourth evaluation, and the injected failures along the same evaluations: on digits an
over-saturating student (real-score guidance ``--oversaturation-guidance`` 8, the recipe's 1.05)
and a collapsing one (learning rates ``--collapse-lr-factor`` 30 x the recipe's); on sounding
digits the collapsing one (the teacher is guidance-distilled: it has no unconditional branch to
guide with). Digits students run the ``tiny`` recipe as shipped; sounding-digits students the
``minimax-h3`` recipe's choices (no GAN head, noise floor 0.02) at bench/quality_av.py's CPU sizes.

Spearman: per seed, over that seed's distinct students (the 4-step iteration 0 is one student,
shared by the runs of 4 steps), of the KID against the ground truth, sign-adjusted so that +1 is
a perfect ranking: digits image KID against FD, video KID against frame FD, audio KID against
sound FD (and, beside, against the sound error rate 1 - sound accuracy).

"FD worsens" at a run's first evaluation more than ``WORSE_MARGIN`` above the best before it
(the recipe's iteration 0 starts every run); a run is flagged at its first evaluation with any
key out of its band.

Sync: AV-Align needs sound onsets and motion peaks, and a sounding digit has neither (a steady tone,
a digit sliding at constant speed). What the world does have is the stereo balance following the
digit's column: ``balance_sync`` scores that per frame, and ``delay_audio`` shifts a clip's sound
by k frames, so a sync figure must fall with k (reported at k = 0, 1, 2, 4).

    cp -r tests/fixtures/av_teacher runs/av-teacher    # once: the committed 4000-step teacher (else trained)
    python bench/eval_signal.py [--seeds 0 1] [--num-samples 32] [--evals 0 10 20 40 80 160] [--workers 2]

The teacher's references (its samples, the real rows' features, their drift) are cached under ``--run-dir`` per (teacher,
settings): a rerun does not resample them.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
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
from dmd2_core.evaluation import teacher_evaluator as evaluators
from dmd2_core.evaluation.kernel import projected_kid
from dmd2_core.evaluation.sound_distance import clip_features, sound_mel_kid
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
FPS = 24  # MiniMax-H3's frame rate: a clip of 4 frames is 1/6 s ...
SAMPLE_RATE = int(sd.AUDIO_SAMPLES * FPS / sd.FRAMES)  # ... so its 256 samples are at 1536 Hz
PRODUCT = f"u{evaluators.FEATURE_U:g}"  # the teacher evaluator's features: the headline figures
SEED_STRIDE = 1000  # the signal's eval seed of training seed s: eval_seed + 1000 s (H3 draws sample j from seed + j)
WORSE_MARGIN = 0.10
SYNC_SHIFTS = (0, 1, 2, 4)
# bench/quality_av.py's CPU sizes of the minimax-h3 recipe (batch, learning rate, EMA) with the
# recipe's own choices: no GAN head, DMD2's noise floor 0.02, no regression pull. The bench's head
# (2 / 0.1 at a floor of 0.2) grows a floor in picture and sound that the frame FD cannot see
# (bench/README.md, 2026-12-06): students trained with it are not the recipe's. The critic at the
# student's rate, as when the signal was validated (the recipe's 2x came after).
AV_DEFAULTS = {"batch_size": 16, "lr": 1e-4, "critic_lr": 1e-4, "ema": 0.9, "update_ratio": 5, "gan_weight": 0.0, "gan_critic_weight": 0.0,
               "video_weight": 1.0, "audio_weight": 1.0, "min_sigma": 0.02, "regression_weight": 0.0,
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
    """The starting noise of ``dmd2_iteration.eval_samples`` for ``seed``: the student's and the
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


def features_at(family, model, x0, cond, us: dict[str, float], index_offset: int = 0) -> dict[str, torch.Tensor]:
    """Teacher features per modality, each at its own u (``evaluators.FEATURE_SEED``'s noise from
    ``index_offset`` on)."""
    out = {}
    for u in sorted(set(us.values())):
        feats = teacher_features(family, model, finite(x0)[0], cond, u=u, seed=evaluators.FEATURE_SEED,
                                 index_offset=index_offset)
        out.update({m: feats[m] for m, mu in us.items() if mu == u})
    return out


def variants(world: str) -> dict[str, dict[str, float]]:
    """The feature positions measured: the product's (``evaluators.FEATURE_U`` for every
    modality, the headline), u = 0.25, and sigma 0.5 per modality (``SIGNAL_U``)."""
    mods = SIGNAL_U[world]
    return {PRODUCT: {m: evaluators.FEATURE_U for m in mods}, "u0.25": {m: 0.25 for m in mods}, "sigma0.5": dict(mods)}


def all_features(world: str, family, model, x0, cond, index_offset: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    return {name: features_at(family, model, x0, cond, us, index_offset) for name, us in variants(world).items()}


def decoded(world: str, x0: torch.Tensor):
    """Samples as the product's decoders give them: digits images [N, 1, 8, 8]; sounding digits
    {'video' [N, 1, F, H, W], 'audio' [N, 2, S], 'sample_rate'}."""
    x0 = finite(x0)[0]
    if world == "digits":
        return x0.clamp(-1, 1)
    frames, audio = sd.decode(x0)
    return {"video": frames[:, None], "audio": audio, "sample_rate": SAMPLE_RATE, "fps": FPS}


def eval_metrics(clip_stats: list[dict[str, float]], feats: dict[str, torch.Tensor], labels) -> dict[str, float]:
    """The product's drift metrics of an eval (its clips' ``drift.per_sample_stats`` pooled, keyed
    ``drift_<statistic>_<modality>``) and the within-prompt diversity of its features (``diversity_<modality>``)."""
    out = {f"drift_{k}": v for k, v in drift.pooled(clip_stats)["value"].items()}
    out.update({f"diversity_{m}": v for m, v in drift.within_prompt_diversity(feats, labels).items()})
    return out


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
    """The teacher's 50-step samples of eval seed ``seed``, their features and drift yardstick."""
    settings = {"world": world, "teacher": teacher_key(url), "n": n, "seed": seed, "steps": REFERENCE_STEPS,
                "variants": variants(world), "guidance": TEACHER_GUIDANCE, "v": 3}

    def make():
        family, model, shift = load_teacher(world, url)
        labels = labels_for(world, n)
        x0 = teacher_samples(world, family, model, shift, labels, seed)
        return {"x0": x0, "features": all_features(world, family, model, x0, prompt_cond(world, labels)),
                "drift": drift.pooled(drift.per_sample_stats(decoded(world, x0)))}

    return cached(run_dir, f"reference-{world}", settings, make)


def real_rows(world: str, url: str, n: int) -> tuple[torch.Tensor, dict]:
    """``n`` rows of the world's real set (the GAN head's: digits' train split, the sounding-digits
    teacher's real clips), a fixed random subset, with their conditions."""
    if world == "digits":
        from dmd2_core.toys import digits_world

        real = digits_world.real_set()
    else:
        from dmd2_core.data import load_real_set

        real = load_real_set(sounding_digits_teacher.ensure_real_set(url))
    rows = torch.randperm(real.latents.shape[0], generator=torch.Generator().manual_seed(evaluators.REAL_ROWS_SEED))[:n]
    return real.latents[rows], {k: v[rows] for k, v in real.cond.items()}


def real_reference(world: str, url: str, n: int, n_drift: int, run_dir: str) -> dict:
    """The second reference, as the teacher evaluator makes it (``evaluators.real_reference``):
    the teacher's features of ``n`` real rows (re-noised from ``evaluators.REAL_NOISE_OFFSET``)
    and the drift yardstick of the first ``n_drift`` of them."""
    settings = {"world": world, "teacher": teacher_key(url), "n": n, "n_drift": n_drift, "variants": variants(world),
                "v": 3}

    def make():
        family, model, _ = load_teacher(world, url)
        x0, cond = real_rows(world, url, n)
        return {"features": all_features(world, family, model, x0, cond, evaluators.REAL_NOISE_OFFSET),
                "drift": drift.pooled(drift.per_sample_stats(decoded(world, x0[:n_drift])))}

    return cached(run_dir, f"real-{world}", settings, make)


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
    """One training run: at each of its evaluations the ground truth on many samples and the
    signal's few samples themselves (``x``: their features, distances and drift are computed by
    the main process, so another choice of features needs no retraining: ``--summarise-only``)."""
    torch.set_num_threads(1)
    start = time.perf_counter()
    world = job["world"]
    loop = ReferenceLoop(load_args("tiny" if world == "digits" else "minimax-h3", job["overrides"]))
    n_labels, gt_labels = labels_for(world, job["num_samples"]), labels_for(world, job["gt_samples"])
    evals = []

    def evaluate(iteration):
        with torch.no_grad():
            x_gt, ok_gt = finite(loop.sample(gt_labels.tolist(), job["gt_seed"]))
            x_sig, ok_sig = finite(loop.sample(n_labels.tolist(), job["signal_seed"]))
        line = {"world": world, "run": job["run"], "seed": job["seed"], "steps": job["steps"], "iteration": iteration,
                "finite": ok_gt and ok_sig, "gt": ground_truth(world, x_gt, gt_labels)}
        if world == "av" and job["run"] == "recipe" and iteration == job["evals"][-1]:
            line["sync"] = sync_table(*sd.decode(x_gt))
        evals.append({**line, "x": x_sig})
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


def job_file(run_dir: str, job: dict) -> str:
    """Where a finished training run's evaluations are kept: named by its world, run and seed and
    a key of everything that makes it (a rerun with other settings does not read it)."""
    key = hashlib.sha256(json.dumps({k: v for k, v in job.items() if k != "progress"}, sort_keys=True,
                                    default=str).encode()).hexdigest()[:12]
    return os.path.join(run_dir, "runs", f"{job['world']}-{job['run']}-seed{job['seed']}-{key}.pt")


def first_samples(results: list[dict], n: int) -> list[dict]:
    """Kept evaluations cut to their first ``n`` signal samples: what a run of ``--num-samples n``
    evaluates (sample j's prompt is j mod 10 and its noise seed + j, whatever the count)."""
    kept = min(e["x"].shape[0] for r in results for e in r["evals"])
    if n > kept:
        raise SystemExit(f"--num-samples {n}: the kept run has {kept} samples per evaluation; pass {kept} or fewer")
    return [{**r, "evals": [{**e, "x": e["x"][:n]} for e in r["evals"]]} for r in results]


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


def r4(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(float(x), 4)


# ground truth per modality: an FD in a classifier's features against held-out real samples
MODALITIES = {"digits": [("image", "fd", 1.0)], "av": [("video", "frame_fd", 1.0), ("audio", "sound_fd", 1.0)]}
ALSO = {"digits": [], "av": [("audio", "sound_acc", -1.0)]}  # reported beside: the sound's class accuracy
TRUTH = {"digits": "fd", "av": "frame_fd"}
FAILURES = {"digits": ("oversaturation", "collapse"), "av": ("collapse",)}


def derive(results: list[dict], teachers: dict, ns) -> None:
    """Per evaluation, in place: its samples' teacher features at every variant and the product's
    eval metrics (drift, diversity) and its clips' drift statistics (a run's clip-by-clip start)."""
    for world, url in teachers.items():
        family, model, _ = load_teacher(world, url)
        labels = labels_for(world, ns.num_samples)
        cond = prompt_cond(world, labels)
        for r in (r for r in results if r["world"] == world):
            for e in r["evals"]:
                e["features"] = all_features(world, family, model, e["x"], cond)
                media = decoded(world, e["x"])
                e["clip_stats"] = drift.per_sample_stats(media)
                e["metrics"] = eval_metrics(e["clip_stats"], e["features"][PRODUCT], labels)
                if world == "av":
                    e["sound_features"] = clip_features(media["audio"], SAMPLE_RATE)


def sound_references(refs: dict, url: str, ns) -> dict:
    """``sound_mel_kid``'s yardsticks: the clip features of each seed's teacher reference clips
    (row-paired with the students'; 'teacher', seed: the teacher evaluator's) and, beside them, of
    the real set's first ``--num-samples`` rows (the clips its drift yardstick decodes; 'real')."""
    real_x0, _ = real_rows("av", url, ns.real_samples)
    out = {"real": clip_features(decoded("av", real_x0[:ns.num_samples])["audio"], SAMPLE_RATE)}
    out.update({("teacher", seed): clip_features(decoded("av", refs[("av", seed)]["x0"][:ns.num_samples])["audio"],
                                                 SAMPLE_RATE) for seed in ns.seeds})
    return out


def distinct_students(results: list[dict], world: str, seed: int) -> list[tuple[str, dict]]:
    """(run, evaluation) of a seed's distinct students: the 4-step iteration 0 once."""
    rows, seen = [], set()
    for r in sorted((r for r in results if r["world"] == world and r["seed"] == seed), key=lambda r: r["run"]):
        for e in r["evals"]:
            ident = ("iteration0", e["steps"]) if e["iteration"] == 0 else (r["run"], e["iteration"])
            if ident not in seen:
                seen.add(ident)
                rows.append((r["run"], e))
    return rows


def ranking(results: list[dict], refs: dict, reals: dict, ns, worlds, sounds: dict | None = None) -> dict:
    """Per world, seed and student: the ground truth and the KIDs (against the teacher's samples
    and against the real set, every variant); on sounding digits ``sound_mel_kid`` against the
    teacher's reference clips (the product's yardstick) and, beside it, against the real set's
    clips (``sound_mel_kid_real``); Spearman per modality, the mean over seeds."""
    out: dict = {}
    students: dict = {}
    for world in worlds:
        students[world] = {}
        for seed in ns.seeds:
            ref, real = refs[(world, seed)], reals[world]
            rows = []
            for run, e in distinct_students(results, world, seed):
                row = {"run": run, "steps": e["steps"], "iteration": e["iteration"], "finite": e["finite"],
                       **{k: r4(v) for k, v in e["gt"].items() if k in ("fd", "frame_fd", "sound_fd", "sound_acc", "acc")}}
                for variant, (mod, _, _) in itertools.product(variants(world), MODALITIES[world]):
                    suffix = "" if variant == PRODUCT else f"_{variant}"
                    ours = e["features"][variant][mod]
                    row[f"teacher_kid_{mod}{suffix}"] = r4(projected_kid(ref["features"][variant][mod], ours))
                    row[f"real_kid_{mod}{suffix}"] = r4(projected_kid(real["features"][variant][mod], ours))
                if world == "av" and sounds:
                    row["sound_mel_kid"] = r4(sound_mel_kid(sounds[("teacher", seed)],
                                                            e["sound_features"])["sound_mel_kid"])
                    row["sound_mel_kid_real"] = r4(sound_mel_kid(sounds["real"], e["sound_features"])["sound_mel_kid"])
                rows.append(row)
            students[world][str(seed)] = rows
            out.setdefault(f"{world}_num_students", []).append(len(rows))
            for (mod, truth, sign), also in [(m, False) for m in MODALITIES[world]] + [(m, True) for m in ALSO[world]]:
                gt = [sign * r[truth] for r in rows]
                for kind, variant in itertools.product(("real_kid", "teacher_kid"), variants(world)):
                    suffix = ("" if variant == PRODUCT else f"_{variant}") + (f"_vs_{truth}" if also else "")
                    col = f"{kind}_{mod}" + ("" if variant == PRODUCT else f"_{variant}")
                    out.setdefault(f"{world}_{mod}_{kind}_spearman{suffix}_per_seed", []).append(
                        r4(spearman([r[col] for r in rows], gt)))
                if mod == "audio" and sounds:
                    for col in ("sound_mel_kid", "sound_mel_kid_real"):
                        out.setdefault(f"{world}_{mod}_{col}_spearman" + (f"_vs_{truth}" if also else "") + "_per_seed",
                                       []).append(r4(spearman([r[col] for r in rows], gt)))
    for key in [k for k in out if k.endswith("_spearman_per_seed") or "_spearman_" in k and k.endswith("_per_seed")]:
        vals = [v for v in out[key] if v is not None]
        out[key.removesuffix("_per_seed")] = r4(sum(vals) / len(vals)) if vals else None
    out["students"] = students
    return out


def drift_runs(results: list[dict], refs: dict, reals: dict, ns, worlds) -> dict:
    """The product's drift rule (``evaluators.drift_flags``) along each run: the recipe's iteration 0
    is every run's start; the yardstick the real set's samples (these runs have a real set: the
    product's choice), the teacher's reference beside it."""
    by_run = {(r["world"], r["run"], r["seed"]): r["evals"] for r in results}
    out: dict = {}
    for world in worlds:
        for run in ("recipe", *FAILURES[world]):
            name = ("" if world == "digits" else "av_") + ("healthy" if run == "recipe" else run)
            for seed in ns.seeds:
                zero = [e for e in by_run.get((world, "recipe", seed), []) if e["iteration"] == 0]
                ev = zero + [e for e in by_run.get((world, run, seed), []) if e["iteration"] != 0]
                fds = [e["gt"][TRUTH[world]] for e in ev]
                out.setdefault(f"{name}_fd_worsens_eval", []).append(first_fd_worsening(fds))
                if world == "av":  # the sound's own ground truth beside the frames'
                    out.setdefault(f"{name}_sound_fd_worsens_eval", []).append(
                        first_fd_worsening([e["gt"]["sound_fd"] for e in ev]))
                for yard, yardstick in (("", reals[world]["drift"]), ("_teacher_yardstick", refs[(world, seed)]["drift"])):
                    start = ev[0]["clip_stats"]  # the product keeps its first eval's clips (drift_start)
                    flags = [evaluators.drift_flags({**e["metrics"], **evaluators.paired_figures(e["clip_stats"], start)},
                                                    ev[0]["metrics"], yardstick) for e in ev]
                    out.setdefault(f"{name}_flag_eval{yard}", []).append(next((i for i, f in enumerate(flags) if f), None))
                    if world == "av" and not yard:  # the sound's floor row, against the eval where the sound FD worsens
                        out.setdefault(f"{name}_floor_flag_eval", []).append(
                            next((i for i, f in enumerate(flags) if any(k.startswith("drift_floor_") for k in f)), None))
                    if not yard:
                        out.setdefault("drift_histories", {}).setdefault(name, []).append(
                            [{"iteration": e["iteration"], **{t: r4(e["gt"][t]) for t in ("fd", "frame_fd", "sound_fd")
                                                              if t in e["gt"]}, "flags": f,
                              **{k: r4(v) for k, v in e["metrics"].items()}} for e, f in zip(ev, flags)])
        out.setdefault("yardsticks", {})[world] = {
            "real": {k: {"value": r4(v), "se": r4(reals[world]["drift"]["se"].get(k))}
                     for k, v in reals[world]["drift"]["value"].items()},
            **{f"teacher_seed{s}": {k: r4(v) for k, v in refs[(world, s)]["drift"]["value"].items()} for s in ns.seeds}}
    for failure in [k.removesuffix("_flag_eval") for k in out
                    if k.endswith("_flag_eval") and "healthy" not in k and not k.endswith("_floor_flag_eval")]:
        out[f"{failure}_flagged_at_or_before_fd_worsens"] = [
            None if worse is None else flag is not None and flag <= worse
            for flag, worse in zip(out[f"{failure}_flag_eval"], out[f"{failure}_fd_worsens_eval"])]
    for floor in [k.removesuffix("_floor_flag_eval") for k in out if k.endswith("_floor_flag_eval")]:
        out[f"{floor}_floor_flagged_at_or_before_sound_fd_worsens"] = [
            None if worse is None else flag is not None and flag <= worse
            for flag, worse in zip(out[f"{floor}_floor_flag_eval"], out[f"{floor}_sound_fd_worsens_eval"])]
    for healthy in [k for k in out if k.endswith("healthy_flag_eval")]:
        out[healthy.replace("_flag_eval", "_never_flagged")] = [f is None for f in out[healthy]]
    return out


def summarise(results: list[dict], refs: dict, reals: dict, ns, teachers: dict) -> dict:
    worlds = [w for w in ("digits", "av") if w in teachers]
    sounds = sound_references(refs, teachers["av"], ns) if "av" in teachers else None
    out = ranking(results, refs, reals, ns, worlds, sounds)
    out.update(drift_runs(results, refs, reals, ns, worlds))
    headline = [f"{w}_{m}_{kind}_spearman" for w in worlds for m, _, _ in MODALITIES[w] for kind in ("real_kid", "teacher_kid")]
    headline += ["av_audio_sound_mel_kid_spearman"] if "av" in worlds else []
    out["targets"] = {
        **{f"{k}_ge_0.8": out.get(k) is not None and out[k] >= 0.8 for k in headline},
        **{f"{k}": all(v is not False for v in out[k]) and any(v for v in out[k])
           for k in out if k.endswith(("_flagged_at_or_before_fd_worsens", "_flagged_at_or_before_sound_fd_worsens"))},
        **{k: all(out[k]) for k in out if k.endswith("healthy_never_flagged")}}
    if "av" in teachers:
        out["sync"] = sync_figures(results, refs, ns)
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
    parser.add_argument("--real-samples", type=int, default=512, help="real rows of the second reference (real_kid)")
    parser.add_argument("--summarise-only", action="store_true",
                        help="read the students' evaluations of the last run (--run-dir) instead of training them; "
                             "--num-samples below the run's takes each evaluation's first samples")
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
    saved = os.path.join(ns.run_dir, "students.pt")  # every evaluation's samples and ground truth
    kept = first_samples(torch.load(saved), ns.num_samples) if ns.summarise_only else None  # before any work
    teachers = {}
    if "digits" in ns.worlds:
        teachers["digits"] = ensure_teacher(ns.teacher, seed=0, log=log)
    if "av" in ns.worlds:
        teachers["av"] = sounding_digits_teacher.ensure_av_teacher(ns.av_teacher, log=log)
        sounding_digits_teacher.ensure_real_set(teachers["av"])
        sounding_digits_metrics.sound_classifier()
    digits_metrics.digits_classifier()  # trained once, before the workers race for it

    refs, reals = {}, {}
    for world, url in teachers.items():
        for seed in ns.seeds:
            refs[(world, seed)] = reference(world, url, ns.num_samples, ns.eval_seed + SEED_STRIDE * seed, ns.run_dir)
        reals[world] = real_reference(world, url, ns.real_samples, ns.num_samples, ns.run_dir)
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
    if kept is not None:
        results = kept
    else:  # each finished run kept as it ends (``job_file``): a run cut short resumes from them
        results = [torch.load(job_file(ns.run_dir, j)) for j in jobs if os.path.isfile(job_file(ns.run_dir, j))]
        todo = [j for j in jobs if not os.path.isfile(job_file(ns.run_dir, j))]
        log(f"{len(results)} of {len(jobs)} runs kept from before")
        with mp.get_context("spawn").Pool(ns.workers) as pool:
            for job, r in zip(todo, pool.imap(student_job, todo)):
                os.makedirs(os.path.dirname(job_file(ns.run_dir, job)), exist_ok=True)
                torch.save(r, job_file(ns.run_dir, job) + ".tmp")
                os.replace(job_file(ns.run_dir, job) + ".tmp", job_file(ns.run_dir, job))
                results.append(r)
                log(f"done: {r['world']} {r['run']} seed {r['seed']} in {r['wall_s']:.0f}s ({len(results)}/{len(jobs)})")
        torch.save(results, saved)

    derive(results, teachers, ns)
    out = summarise(results, refs, reals, ns, teachers)
    out.update({"num_samples": ns.num_samples, "real_samples": ns.real_samples, "gt_samples": gt_samples,
                "evals": evals, "seeds": ns.seeds, "variants": {w: variants(w) for w in teachers}, "headline": PRODUCT,
                "reference_steps": REFERENCE_STEPS, "band_k": evaluators.BAND_K, "worse_margin": WORSE_MARGIN, "oversaturation_guidance": ns.oversaturation_guidance,
                "collapse_lr_factor": ns.collapse_lr_factor, "wall_s": round(time.perf_counter() - start, 1)})
    print(json.dumps(out))


def sync_figures(results, refs, ns) -> dict:
    """The stereo-balance sync of real clips, the teacher's and the final 4-step students', at
    the shifts ``SYNC_SHIFTS`` (AV-Align has nothing to align on sounding digits)."""
    sync: dict = {"av_align": "not measurable on sounding digits: the tone is steady and the digit slides at "
                              "constant speed, so there are no sound onsets and no motion peaks to align"}
    clips = sd.make_clips("test", 0)
    sync["balance_sync_real_test_clips"] = sync_table(clips.frames, clips.audio)
    sync["balance_sync_teacher_50"] = [sync_table(*sd.decode(refs[("av", s)]["x0"])) for s in ns.seeds]
    sync["balance_sync_student_4_final"] = [e["sync"] for r in results if r["world"] == "av" and r["run"] == "recipe"
                                            for e in r["evals"] if "sync" in e]
    return sync


if __name__ == "__main__":
    main()
