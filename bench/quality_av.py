"""Does joint DMD2 work? Distill the small MiniMax-H3 teacher of sounding digits
(``dmd2_core.toys.sounding_digits_teacher``) into 4-step and 1-step students with the ``minimax-h3`` recipe at CPU
sizes, through the reference loop (the trainers' DMD2 steps), and print one JSON line:

  {"teacher": {"50": {frame_fd, frame_acc, sound_acc, agreement, ..}, "8": .., "4": .., "1": ..},
   "real": {..}, "student": {"4": {"best": {..}, "final": {..}, "per_seed": [..]}, "1": ..},
   "targets": {..}, "iterations": .., "wall_s": ..}

Metrics: ``dmd2_core.toys.sounding_digits_metrics`` (frames against the held-out digits, sound class, agreement
of sound and picture, diversity), every sampler from the same eval noise; ``real`` is the train
clips' own figures. Each student is evaluated every ``--eval-every`` iterations: ``best`` is the
evaluation closest (frame FD) to the teacher's 50-step frames (never the test split), ``final``
the last. Figures are means over the training seeds.

CPU sizes (the recipe's other values kept: backward simulation, critic ratio 5, AdamW betas
(0, 0.999), clip 10, fused scoring, global batch 16): device cpu, float32, learning rates 1e-4 (the
recipe's 2e-6 is the 33 B model's), an EMA of 0.9 (the recipe's 0.99 averages over more
iterations than a CPU run has), and the GAN head (the recipe's is off until measured at 33 B):
``--gan-weight 2 --gan-critic-weight 0.1`` on the teacher's real set, its train clips
(``--gan-weight 0 --gan-critic-weight 0`` for none), and a noise floor of 0.2 for the DMD gradient and
the critic (``--min-sigma``; the recipe's 0.02 is DMD2's). The 1-step student also takes DMD's regression
pull towards the teacher's own 4-step samples (``--regression-weight 0.25``; 0 for none), which
a 4-step student would not move with.

``--set KEY=VALUE`` changes one recipe flag of every student.

``--workflow fl2va`` runs the keyframe world (issue 56): the teacher at ``runs/av-kf-teacher``
(``make av-kf-teacher``) was trained with every clip conditioned on its own first and last
frames, the students train on the train clips' keyframes, and every sampler is evaluated on the
held-out clips' keyframes, with ``keyframe_agreement`` (the clip's first and last frames show the
digit where its keyframes do) and ``keyframe_l1`` beside the figures above.

``--workflow ref2va`` runs the reference world: the teacher at ``runs/av-ref-teacher`` (``make
av-ref-teacher``, in ``transformer_ref/``) was trained with a prompt that names no digit and, as
each clip's picture reference, the glyph of another clip of its digit; students train on the
train clips' references and are evaluated on held-out ones, so the digit and sound accuracies
say whether a sampler follows its reference.

    python bench/quality_av.py [--iterations 240] [--eval-every 40] [--num-samples 600] [--seeds 0 1] [--workers 2] [--teacher runs/av-teacher]
    python bench/quality_av.py --workflow fl2va --steps 4   # the keyframe world
    python bench/quality_av.py --workflow ref2va --steps 4  # the reference world
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dmd2_core.toys import sounding_digits_metrics
from dmd2_core.toys import sounding_digits_teacher
from dmd2_core.toys import digits_metrics  # noqa: E402
from dmd2_core.toys import sounding_digits as sd  # noqa: E402
from dmd2_core.args import load_args, parse_set  # noqa: E402
from dmd2_core.errors import ArgsError
from dmd2_core.train.reference import ReferenceLoop  # noqa: E402

TEACHER_STEPS = (50, 8, 4, 1)
METRICS = (*sounding_digits_metrics.METRICS, "sound_fd", "sound_mel_kid")  # each student's, as each teacher sampler's
KEYFRAME_METRICS = ("keyframe_agreement", "keyframe_l1")  # an fl2va student's too
WORLD_TEACHERS = {"t2va": "runs/av-teacher", "fl2va": "runs/av-kf-teacher", "ref2va": "runs/av-ref-teacher"}


def frame_features(samples: torch.Tensor):
    frames, _ = sd.decode(samples)
    _, crops = sounding_digits_metrics.locate_digits(frames)
    return digits_metrics.features(crops.reshape(-1, 1, sd.DIGIT, sd.DIGIT))


def gan_weights(ns, sets: dict) -> dict:
    """The GAN head's weights every student runs with: the flags, unless ``--set`` names them."""
    return {k: sets.get(k, getattr(ns, k, 0.0)) for k in ("gan_weight", "gan_critic_weight")}


def regression(ns, steps: int) -> dict:
    """The regression pull of a student of fewer steps than the teacher's sampler it is pulled to
    (a student of as many steps would only be pulled back to where it starts)."""
    weight, n = getattr(ns, "regression_weight", 0.0), getattr(ns, "regression_steps", 4)
    most = max(steps) if isinstance(steps, list) else steps  # a set: its largest K is not pulled back
    return {"dmd2_regression_weight": weight, "dmd2_regression_steps": n} if weight and most < n else {}


def critic_lr(ns) -> float:
    """--critic-lr, or the bench's --lr scaled as the recipe scales its critic's (critic_lr / lr)."""
    if getattr(ns, "critic_lr", None):
        return ns.critic_lr
    recipe = load_args("minimax-h3", {})
    return ns.lr * recipe.critic_lr / recipe.lr


def cpu_overrides(teacher: str, steps: int, seed: int, ns, sets: dict) -> dict:
    heads = gan_weights(ns, sets)
    if any(heads.values()):
        heads["real_data"] = sets.get("real_data") or sounding_digits_teacher.real_set_url(teacher)
    return {"hf_checkpoint": teacher, "prompts": sounding_digits_teacher.prompts_url(teacher), "save": "runs/bench-quality-av",
            "device": "cpu", "num_devices": 1, "cp_size": 1, "lora_rank": 0, "dtype": "float32", "gradient_checkpointing": False,
            "sleep_after_train": False, "num_frames": None, "height": None, "width": None,
            "latent_shape": sd.VIDEO_LATENT_SHAPE, "global_batch_size": ns.batch_size,
            "micro_batch_size": ns.batch_size, "lr": ns.lr, "critic_lr": critic_lr(ns), "ema_decay": ns.ema or None,
            "dmd2_update_ratio": ns.update_ratio, "dmd2_min_sigma": ns.min_sigma, "dmd2_student_steps": steps,
            "seed": seed, "torch_threads": 1, "workflow": getattr(ns, "workflow", "t2va"),
            **({"dmd2_modality_weights": {"video": ns.video_weight, "audio": ns.audio_weight}}
               if (ns.video_weight, ns.audio_weight) != (1.0, 1.0) else {}), **regression(ns, steps), **sets, **heads}


def distill(job: dict) -> dict:
    torch.set_num_threads(1)
    start = time.perf_counter()
    args = load_args("minimax-h3", job["overrides"])
    loop = ReferenceLoop(args)
    clips = sounding_digits_teacher.EvalClips(job["workflow"], job["num_samples"])
    evals = []

    def evaluate(iteration):
        for k in args.student_step_counts:  # a student of several step counts: a line per K
            samples = loop.sample(clips.labels.tolist(), job["eval_seed"], num_steps=k, cond=clips.cond)
            selection = digits_metrics.frechet_distance(frame_features(samples), job["target"])
            line = {"steps": job["steps"], "seed": job["seed"], "iteration": iteration, "selection_fd": selection,
                    **({"at_steps": k} if isinstance(job["steps"], list) else {}), **clips.figures(samples)}
            evals.append(line)
            _log(job, line)

    evaluate(0)
    for i in range(1, job["iterations"] + 1):
        loop.iterate(i)
        if i % job["eval_every"] == 0 or i == job["iterations"]:
            evaluate(i)
    return {"steps": job["steps"], "seed": job["seed"], "evals": evals, "wall_s": time.perf_counter() - start}


def _log(job: dict, line: dict) -> None:
    if job.get("progress"):
        with open(job["progress"], "a") as f:
            f.write(json.dumps(line) + "\n")


def metrics_in(line: dict) -> tuple[str, ...]:
    """The figures an evaluation holds: ``METRICS``, and an fl2va student's keyframe figures."""
    return (*METRICS, *(m for m in KEYFRAME_METRICS if m in line))


def _pick(evals: list[dict]) -> dict:
    best = min(evals, key=lambda e: e["selection_fd"])
    final = max(evals, key=lambda e: e["iteration"])
    keep = (*metrics_in(final), "iteration", "selection_fd")
    return {"best": {k: best[k] for k in keep}, "final": {k: final[k] for k in keep},
            "history": [(e["iteration"], round(e["frame_fd"], 3), round(e["sound_fd"], 1), round(e["sound_acc"], 3),
                         round(e["agreement"], 3))
                        for e in sorted(evals, key=lambda e: e["iteration"])]}


def _mean(rows: list[dict], key: str) -> dict:
    out = {m: round(sum(r[key][m] for r in rows) / len(rows), 4) for m in metrics_in(rows[0][key])}
    out["iteration"] = [r[key]["iteration"] for r in rows]
    return out


def targets(teacher: dict, student: dict, workflow: str = "t2va") -> dict:
    t50, t8, t4 = teacher["50"], teacher["8"], teacher["4"]
    out = {}
    if "4" in student:
        s4 = student["4"]["final"]
        out.update({
            "s4_frame_fd_at_or_below_teacher_8": s4["frame_fd"] <= t8["frame_fd"],
            "s4_frame_fd_within_1.25x_teacher_50": s4["frame_fd"] <= 1.25 * t50["frame_fd"],
            "s4_sound_acc_within_3pt_teacher_50": s4["sound_acc"] >= t50["sound_acc"] - 0.03,
            "s4_agreement_within_3pt_teacher_50": s4["agreement"] >= t50["agreement"] - 0.03,
            "s4_sound_fd_at_or_below_teacher_50": s4["sound_fd"] <= t50["sound_fd"],
            "s4_final_within_15pct_of_best": s4["frame_fd"] <= 1.15 * student["4"]["best"]["frame_fd"]})
        if "keyframe_agreement" in s4:  # issue 56: an fl2va student keeps its keyframes as its teacher does
            out.update({"s4_frame_fd_at_or_below_teacher_50": s4["frame_fd"] <= t50["frame_fd"],
                        "s4_keyframe_agreement_at_or_above_teacher_50":
                            s4["keyframe_agreement"] >= t50["keyframe_agreement"]})
        if workflow == "ref2va":  # issue 56: a ref2va student draws the digit its reference shows, as its teacher
            out.update({"s4_frame_fd_at_or_below_teacher_50": s4["frame_fd"] <= t50["frame_fd"],
                        "s4_frame_acc_within_3pt_teacher_50": s4["frame_acc"] >= t50["frame_acc"] - 0.03})
    if "1" in student:
        s1 = student["1"]["final"]
        out.update({
            "s1_frame_fd_below_teacher_4": s1["frame_fd"] < t4["frame_fd"],
            "s1_agreement_at_least_teacher_4": s1["agreement"] >= t4["agreement"],
            "s1_final_within_15pct_of_best": s1["frame_fd"] <= 1.15 * student["1"]["best"]["frame_fd"]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workflow", choices=tuple(WORLD_TEACHERS), default="t2va",
                        help="fl2va: the keyframe world (each clip conditioned on its own first and last frames), "
                             "its teacher at runs/av-kf-teacher, evaluated on held-out clips' keyframes; ref2va: the "
                             "reference world (a picture of the digit, the prompt naming none), runs/av-ref-teacher")
    parser.add_argument("--teacher", default=None, help="default runs/av-teacher (fl2va: runs/av-kf-teacher, ref2va: "
                        "runs/av-ref-teacher)")
    parser.add_argument("--iterations", type=int, default=240)
    parser.add_argument("--eval-every", type=int, default=40)
    parser.add_argument("--num-samples", type=int, default=600, help="eval clips (at 200 one seed's agreement has a "
                        "standard error of 3 points)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--eval-seed", type=int, default=0)
    parser.add_argument("--steps", type=step_counts, nargs="+", default=[4, 1],
                        help="the students' step counts; a comma list (2,4,8) is one student of that set")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="the recipe's global batch (at 8 the 1-step "
                        "student's stereo agreement was 3.5 points lower)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--critic-lr", type=float, default=None, help="the fake score's learning rate; default "
                        "--lr times the recipe's critic_lr / lr")
    parser.add_argument("--ema", type=float, default=0.9, help="EMA decay of the students (0: none)")
    parser.add_argument("--update-ratio", type=int, default=5, help="critic steps per student step (the recipe's 5)")
    parser.add_argument("--gan-weight", type=float, default=2.0, help="the GAN head on the train clips (0: none)")
    parser.add_argument("--gan-critic-weight", type=float, default=0.1)
    parser.add_argument("--video-weight", type=float, default=1.0)
    parser.add_argument("--audio-weight", type=float, default=1.0)
    parser.add_argument("--min-sigma", type=float, default=0.2,
                        help="the noise floor of the DMD gradient and the critic (dmd2_min_sigma; the recipe's "
                        "0.02): at 0.2 both students agree with their pictures more often")
    parser.add_argument("--regression-weight", type=float, default=0.25,
                        help="DMD's regression pull towards the teacher's own --regression-steps sampler, for the "
                             "students of fewer steps: the 1-step one (0: none)")
    parser.add_argument("--regression-steps", type=int, default=4)
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a minimax-h3 recipe override for every student (repeatable), e.g. gan_weight=0.5; "
                             "GAN weights bring the teacher's real set (the train clips) as real_data")
    parser.add_argument("--progress", default=None, help="append every evaluation to this JSONL file")
    parser.add_argument("--summarise", default=None, help="print the JSON line from a progress file (a run cut short)")
    ns = parser.parse_args()
    ns.teacher = ns.teacher or WORLD_TEACHERS[ns.workflow]
    ns.critic_lr = critic_lr(ns)
    if ns.summarise:
        return summarise(ns.summarise)
    try:
        sets = parse_set(ns.sets)
        for k in ns.steps:
            load_args("minimax-h3", {**cpu_overrides(ns.teacher, k, ns.seeds[0], ns, sets), "prompts": None})
    except ArgsError as err:
        parser.exit(2, f"error: {err}\n")
    torch.set_num_threads(1)
    start = time.perf_counter()
    teacher = sounding_digits_teacher.ensure_av_teacher(ns.teacher, log=lambda m: print(m, file=sys.stderr),
                                                        workflow=ns.workflow)
    loaded = sounding_digits_teacher.load_teacher(teacher)
    family = sounding_digits_teacher.bound_family(loaded.model)
    clips = sounding_digits_teacher.EvalClips(ns.workflow, ns.num_samples)
    table, target = {}, None
    for k in TEACHER_STEPS:
        samples = clips.sample(family, loaded.model.eval(), k, ns.eval_seed)
        table[str(k)] = {m: round(v, 4) for m, v in clips.figures(samples).items()}
        if k == 50:
            target = frame_features(samples)
    print(f"teacher table: {json.dumps(table)} ({time.perf_counter() - start:.0f}s)", file=sys.stderr)
    if ns.progress:
        _log({"progress": ns.progress}, {"teacher": table, "ns": vars(ns)})
    jobs = [{"steps": k, "seed": s, "workflow": ns.workflow, "iterations": ns.iterations, "eval_every": ns.eval_every,
             "num_samples": ns.num_samples, "eval_seed": ns.eval_seed, "target": target, "progress": ns.progress,
             "overrides": cpu_overrides(teacher, k, s, ns, sets)} for k in ns.steps for s in ns.seeds]
    # a TERM (kill, timeout) leaves through the pool's exit, which stops the jobs, instead of
    # leaving them running with no one to read their results
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with mp.get_context("spawn").Pool(ns.workers) as pool:
        results = []
        for r in pool.imap_unordered(distill, jobs):
            results.append(r)
            print(f"done: {steps_name(r['steps'])}-step seed {r['seed']} in {r['wall_s']:.0f}s ({len(results)}/{len(jobs)})",
                  file=sys.stderr)
    report(table, [e for r in results for e in r["evals"]], ns, time.perf_counter() - start)


def summarise(path: str) -> None:
    """The JSON line from a progress file: per student, its evaluations so far (``final`` is the
    last one made; ``complete`` says whether every student reached its last iteration)."""
    lines = [json.loads(x) for x in open(path) if x.strip()]
    head = next(x for x in lines if "teacher" in x)
    ns = {"critic_lr": head["ns"]["lr"], **head["ns"]}  # files from before --critic-lr trained the critic at --lr
    report(head["teacher"], [x for x in lines if "iteration" in x], argparse.Namespace(**ns), None)


def step_counts(text: str):
    """``4`` one step count; ``2,4,8`` one student of that set."""
    counts = [int(k) for k in text.split(",")]
    return counts[0] if len(counts) == 1 else counts


def steps_name(steps) -> str:
    return ",".join(str(k) for k in steps) if isinstance(steps, list) else str(steps)


def any_steps(evals: list[dict], steps: list[int], seeds) -> dict:
    """One student of several step counts: per K its figures at the student's best eval (the
    lowest mean selection distance over its K, the product's criterion) and its final one."""
    mine = [e for e in evals if e["steps"] == steps]
    out = {}
    for k in steps:
        rows = []
        for s in seeds:
            lines = [e for e in mine if e["seed"] == s]
            complete = [i for i in {e["iteration"] for e in lines} if sum(e["iteration"] == i for e in lines) == len(steps)]
            if not complete:
                continue
            mean = {i: sum(e["selection_fd"] for e in lines if e["iteration"] == i) / len(steps) for i in complete}
            best = min(complete, key=lambda i: (mean[i], i))
            at = {e["iteration"]: e for e in lines if e["at_steps"] == k and e["iteration"] in complete}
            picked = _pick([at[i] for i in sorted(at)])
            picked["best"] = {m: at[best][m] for m in (*METRICS, "iteration", "selection_fd")}
            rows.append({"seed": s, **picked})
        if rows:
            out[str(k)] = {"best": _mean(rows, "best"), "final": _mean(rows, "final"), "per_seed": rows}
    return out


def any_steps_targets(student: dict, steps: list[int]) -> dict:
    """Issue 42's checks: at 4 steps the student of the set no worse than the dedicated 4-step one
    in frame FD, sound accuracy and agreement; each figure improving (or equal) with K."""
    per_k, name = student.get(steps_name(steps), {}).get("at_steps", {}), steps_name(steps)
    out = {}
    if "4" in per_k and "4" in student:
        a, d = per_k["4"]["final"], student["4"]["final"]
        out.update({f"{name}_at_4_frame_fd_no_worse_than_dedicated_4": a["frame_fd"] <= d["frame_fd"],
                    f"{name}_at_4_sound_acc_no_worse_than_dedicated_4": a["sound_acc"] >= d["sound_acc"],
                    f"{name}_at_4_agreement_no_worse_than_dedicated_4": a["agreement"] >= d["agreement"]})
    finals = [per_k[str(k)]["final"] for k in steps if str(k) in per_k]
    if len(finals) == len(steps):
        out.update({f"{name}_frame_fd_improving_with_k": all(x["frame_fd"] >= y["frame_fd"] for x, y in zip(finals, finals[1:])),
                    f"{name}_sound_acc_improving_with_k": all(x["sound_acc"] <= y["sound_acc"] for x, y in zip(finals, finals[1:])),
                    f"{name}_agreement_improving_with_k": all(x["agreement"] <= y["agreement"] for x, y in zip(finals, finals[1:]))})
    return out


def report(table: dict, evals: list[dict], ns, wall_s) -> None:
    student = {}
    for k in ns.steps:
        if isinstance(k, list):
            per_k = any_steps(evals, k, ns.seeds)
            if per_k:
                student[steps_name(k)] = {"at_steps": per_k}
            continue
        rows = sorted(({"seed": s, **_pick([e for e in evals if (e["steps"], e["seed"]) == (k, s)])}
                       for s in ns.seeds if any((e["steps"], e["seed"]) == (k, s) for e in evals)),
                      key=lambda r: r["seed"])
        if rows:
            student[str(k)] = {"best": _mean(rows, "best"), "final": _mean(rows, "final"), "per_seed": rows}
    checks = targets(table, student, getattr(ns, "workflow", "t2va"))
    for k in (s for s in ns.steps if isinstance(s, list)):
        checks.update(any_steps_targets(student, k))
    out = {"teacher": table, "real": {m: round(v, 4) for m, v in sounding_digits_metrics.real_clip_stats(ns.num_samples).items()},
           "student": student, "targets": checks,
           "complete": all(r["final"]["iteration"] == ns.iterations for v in student.values()
                           for per in ([v] if "per_seed" in v else v["at_steps"].values()) for r in per["per_seed"])
           and len(student) == len(ns.steps),
           "iterations": ns.iterations, "eval_every": ns.eval_every, "seeds": ns.seeds, "num_samples": ns.num_samples,
           "batch_size": ns.batch_size, "lr": ns.lr, "critic_lr": ns.critic_lr, "ema_decay": ns.ema or None, "update_ratio": ns.update_ratio,
           "min_sigma": getattr(ns, "min_sigma", 0.02),
           "modality_weights": {"video": ns.video_weight, "audio": ns.audio_weight},
           "gan": gan_weights(ns, parse_set(getattr(ns, "sets", []))),
           "regression": {steps_name(k): regression(ns, k) for k in ns.steps if regression(ns, k)},
           "set": getattr(ns, "sets", []),
           "wall_s": None if wall_s is None else round(wall_s, 1)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
