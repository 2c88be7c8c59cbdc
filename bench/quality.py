"""Does DMD2 distill, and does the GAN head stop the drift? On the digits teacher, distill 4-step
and 1-step students with the plain reference loop, without (``student``) and with the GAN head
(``student_gan``), over several training seeds, for a fixed number of iterations (contention on a
busy machine slows it down but does not change its figures: every job is seeded and single-threaded), and print one JSON line:

  {"teacher": {"50": {"fd", "acc", "diversity"}, "8": .., "4": .., "2": .., "1": ..},
   "student":     {"4": {"best": {"fd", "acc", "diversity", "iteration"}, "final": {..}, "per_seed": [..]}, "1": ..},
   "student_gan": {"4": .., "1": ..}, "targets": {..}, "iterations": .., "wall_s": ..}

Fréchet distance (lower is better), class accuracy and within-prompt diversity are measured
against held-out digits, every sampler from the same eval noise. Each student is evaluated every
``--eval-every`` iterations: ``best`` is the evaluation kept by its distance to the teacher's
50-step samples (a criterion that never sees the test split), ``final`` the last iteration's
(steady state). Figures are means over the training seeds.

    python bench/quality.py [--iterations 1000] [--variants student_gan] [--seeds 0 1] [--workers 2]

By default it distills the tiny recipe as shipped (GAN head on, the student's schedule unshifted,
real-score guidance 1.05) for 1000 iterations (~19 min on the 2-core machine) and checks the finals
against the teacher's own 50 steps (plain conditional sampling, ``--teacher-guidance``): the 4-step
FD at or below it, the 1-step within 10%, both diversities within 10%. ``--variants student
student_gan`` adds the students without the head; ``--set KEY=VALUE`` changes one flag of every
student (the levers in bench/README.md).
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing as mp
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dmd2_core.args import load_args, parse_set  # noqa: E402
from dmd2_core.errors import ArgsError
from dmd2_core.toys.digits_metrics import balanced_labels, evaluate_digits, features, frechet_distance, teacher_table  # noqa: E402
from dmd2_core.train import dmd2_iteration  # noqa: E402
from dmd2_core.train.reference import ReferenceLoop, adamw  # noqa: E402
from dmd2_core.toys.digits_teacher import ensure_teacher  # noqa: E402

TEACHER_STEPS = (50, 8, 4, 2, 1)
METRICS = ("fd", "acc", "diversity")


def teacher_reference_features(teacher: str, num_samples: int, seed: int, guidance: float):
    """Features of the teacher's 50-step samples: the selection target (no test data)."""
    from dmd2_core import flow_matching as fm
    from dmd2_core.toys.digits import digits_prompt_set
    from dmd2_core.toys.digits_metrics import eval_noise
    from dmd2_core.models import load_model_dir
    from dmd2_core.sampling import euler_sample

    loaded = load_model_dir(teacher)
    prompts = digits_prompt_set()
    labels = balanced_labels(num_samples)
    with torch.no_grad():
        x = euler_sample(loaded.family, loaded.model, eval_noise(num_samples, seed + 1), prompts.cond(labels),
                         fm.euler_sigmas(50, loaded.shift), prompts.uncond(num_samples), guidance)
    return features(x.clamp(-1, 1))


def distill(job: dict) -> dict:
    """One student: ``iterations`` DMD2 iterations, evaluated every ``eval_every``; or, for the
    job without a variant, the teacher's table."""
    torch.set_num_threads(1)
    start = time.perf_counter()
    if job["variant"] is None:
        table = teacher_table(job["teacher"], TEACHER_STEPS, job["num_samples"], job["eval_seed"], guidance_scale=job["guidance"])
        _log(job, {"variant": "teacher", "table": table})
        return {"variant": None, "table": table}
    args = load_args("tiny", job["overrides"])
    loop = (CriticPerStepCount if job.get("critic_per_k") else ReferenceLoop)(args)
    labels = balanced_labels(job["num_samples"])
    counts = args.student_step_counts
    best, history, final = None, [], None

    def evaluate(iteration):
        """Every step count of the student; a student of several is selected by the mean of its
        selection distances over them (the product's criterion: ``step_counts.mean_over_steps``)."""
        nonlocal best, final
        scored = {}
        for k in counts:
            images = loop.sample(labels.tolist(), job["eval_seed"], num_steps=k).clamp(-1, 1)
            selection = frechet_distance(features(images), job["target"])
            scored[k] = {**evaluate_digits(images, labels), "selection_fd": selection}
            _log(job, {kk: job[kk] for kk in ("variant", "steps", "seed")} | {"iteration": iteration, "at_steps": k,
                                                                              **scored[k]})
        selection = sum(s["selection_fd"] for s in scored.values()) / len(scored)
        history.append((iteration, round(selection, 4)))
        final = (selection, iteration, scored)
        if best is None or selection < best[0]:
            best = (selection, iteration, scored)

    evaluate(0)
    for i in range(1, job["iterations"] + 1):
        loop.iterate(i)
        if i % job["eval_every"] == 0 or i == job["iterations"]:
            evaluate(i)
    out = {name: {**scored[counts[-1]], "iteration": it, "selection_fd": sel}
           for name, (sel, it, scored) in (("best", best), ("final", final))}
    if len(counts) > 1:  # each step count's figures at the student's best and final evals
        out["at_steps"] = {str(k): {name: {**scored[k], "iteration": it} for name, (_, it, scored) in
                                    (("best", best), ("final", final))} for k in counts}
    return {**{k: job[k] for k in ("variant", "steps", "seed")}, **out, "history": history,
            "wall_s": time.perf_counter() - start}


class CriticPerStepCount(ReferenceLoop):
    """The comparison for a set's critic (``--critic-per-k``): a whole fake score, GAN head and
    optimizers per step count, each iteration training and scoring with its K's. K copies of the
    fake score is what step_conditioning approaches, at a size no real model affords."""

    def __init__(self, args):
        super().__init__(args.model_copy(update={"dmd2_critic_step_conditioning": False}))
        lr = self.args.critic_lr or self.args.lr
        self.per_k = {}
        for k in self.args.student_step_counts:
            critic, disc = copy.deepcopy(self.critic), copy.deepcopy(self.disc)
            self.per_k[k] = (critic, adamw(critic, self.args, lr), disc,
                             adamw(disc, self.args, lr) if disc is not None else None)

    def iterate(self, iteration: int) -> dict:
        k = dmd2_iteration.draw_student_steps(self.args, iteration)
        self.critic, self.critic_opt, self.heads, self.disc_opt = self.per_k[k]
        self.disc = self.heads
        return super().iterate(iteration)


def _log(job: dict, line: dict) -> None:
    """Every evaluation also goes to the progress file, so a run cut short can be summarised."""
    if job.get("progress"):
        with open(job["progress"], "a") as f:
            f.write(json.dumps(line) + "\n")


def summarise(path: str) -> dict:
    """The JSON line's figures from a progress file: per job, best by selection distance and the
    last evaluation as ``final`` (``complete`` says whether it is the last iteration)."""
    lines = [json.loads(x) for x in open(path) if x.strip()]
    meta = next(x for x in lines if x.get("variant") == "meta")
    table = next((x["table"] for x in lines if x.get("variant") == "teacher"), None)
    results = []
    jobs = {(x["variant"], steps_name(x["steps"]), x["seed"]): x["steps"] for x in lines if "iteration" in x}
    for key in sorted(jobs):
        lines_of = [x for x in lines if "iteration" in x and (x["variant"], steps_name(x["steps"]), x["seed"]) == key]
        counts = jobs[key] if isinstance(jobs[key], list) else [jobs[key]]
        evals = {}  # iteration -> {K: figures}, complete evals only
        for x in lines_of:
            evals.setdefault(x["iteration"], {})[x.get("at_steps", counts[-1])] = x
        evals = {i: e for i, e in evals.items() if len(e) == len(counts)}
        mean = {i: sum(e[k]["selection_fd"] for k in counts) / len(counts) for i, e in evals.items()}
        best, final = min(mean, key=lambda i: (mean[i], i)), max(evals)
        figures = lambda e, k, i: {**{m: e[k][m] for m in METRICS}, "iteration": i}  # noqa: E731
        result = {"variant": key[0], "steps": jobs[key], "seed": key[2],
                  **{n: {**figures(evals[i], counts[-1], i), "selection_fd": mean[i]} for n, i in (("best", best), ("final", final))},
                  "history": [(i, round(mean[i], 4)) for i in sorted(evals)]}
        if len(counts) > 1:
            result["at_steps"] = {str(k): {n: figures(evals[i], k, i) for n, i in (("best", best), ("final", final))}
                                  for k in counts}
        results.append(result)
    return {"meta": meta, "table": table, "results": results}


def step_counts(text: str):
    """``4`` one step count; ``1,2,4,8`` one student of that set."""
    counts = [int(k) for k in text.split(",")]
    return counts[0] if len(counts) == 1 else counts


def steps_name(steps) -> str:
    return ",".join(str(k) for k in steps) if isinstance(steps, list) else str(steps)


def _mean(rows: list[dict], key: str) -> dict:
    out = {m: round(sum(r[key][m] for r in rows) / len(rows), 4) for m in METRICS}
    its = [r[key]["iteration"] for r in rows]
    out["iteration"] = its if key == "best" or len(set(its)) > 1 else its[0]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--teacher", default="runs/teacher")
    parser.add_argument("--iterations", type=int, default=1000, help="DMD2 iterations per student")
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--num-samples", type=int, default=2000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="training seeds")
    parser.add_argument("--eval-seed", type=int, default=0, help="eval noise of every sampler")
    parser.add_argument("--steps", type=step_counts, nargs="+", default=[4, 1],
                        help="the students' step counts; a comma list (1,2,4,8) is one student of that set "
                             "(dmd2_student_sampler euler: the product's for a set)")
    parser.add_argument("--workers", type=int, default=2, help="jobs (students, the teacher's table) at once, one thread each")
    parser.add_argument("--guidance", type=float, default=None, help="the students' real-score guidance; default the tiny recipe's")
    parser.add_argument("--teacher-guidance", type=float, default=1.0,
                        help="the teacher's own sampler (its table and the selection target): plain conditional by default")
    parser.add_argument("--ema", type=float, default=0.99, help="EMA decay of the students (0: none)")
    parser.add_argument("--gan-weight", type=float, default=None, help="default: the tiny recipe's")
    parser.add_argument("--gan-critic-weight", type=float, default=None, help="default: the tiny recipe's")
    parser.add_argument("--variants", nargs="+", default=["student_gan"],
                        help="student, student_gan, student_lora (LoRA student and fake score over one shared base)")
    parser.add_argument("--lora-rank", type=int, default=16, help="rank of student_lora's adapters (alpha = rank)")
    parser.add_argument("--lora-lr", type=float, default=5e-4, help="student_lora's lr (student and fake score)")
    parser.add_argument("--lora-targets", nargs="+", default=None, help="student_lora's lora_target_modules (default the flag's)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a tiny-recipe override for every student (repeatable), e.g. dmd2_update_ratio=10")
    parser.add_argument("--critic-per-k", action="store_true",
                        help="a set's students with a whole fake score and GAN head per K (the comparison for "
                             "dmd2_critic_step_conditioning, which they replace)")
    parser.add_argument("--progress", default=None, help="append every evaluation to this JSONL file")
    parser.add_argument("--summarise", default=None, help="print the JSON line from a progress file (a run cut short) and exit")
    ns = parser.parse_args()
    if ns.summarise:
        done = summarise(ns.summarise)
        return report(done["table"], done["results"], argparse.Namespace(**done["meta"]["ns"]), done["meta"]["gan"], None)
    try:
        sets = parse_set(ns.sets)
        for steps in ns.steps:  # the overrides as each student takes them (a set's own flags need its set)
            load_args("tiny", {"dmd2_student_steps": steps,
                               **({"dmd2_student_sampler": "euler"} if isinstance(steps, list) else {}), **sets})
    except ArgsError as err:
        parser.exit(2, f"error: {err}\n")
    torch.set_num_threads(1)
    start = time.perf_counter()
    teacher = ensure_teacher(ns.teacher, seed=0, log=lambda m: print(m, file=sys.stderr))
    tiny = load_args("tiny")
    guidance = ns.guidance if ns.guidance is not None else tiny.dmd2_guidance_scale
    gan = {"real_data": tiny.real_data or "digits",
           "gan_weight": ns.gan_weight if ns.gan_weight is not None else tiny.gan_weight,
           "gan_critic_weight": ns.gan_critic_weight if ns.gan_critic_weight is not None else tiny.gan_critic_weight}
    if "student_gan" in ns.variants and not gan["gan_critic_weight"]:
        parser.error("the tiny recipe has no GAN weights: pass --gan-weight and --gan-critic-weight")
    if ns.progress:
        os.makedirs(os.path.dirname(os.path.abspath(ns.progress)), exist_ok=True)
        _log({"progress": ns.progress}, {"variant": "meta", "ns": vars(ns), "gan": gan})
    target = teacher_reference_features(teacher, ns.num_samples, ns.eval_seed, ns.teacher_guidance)
    jobs = [{"variant": None, "teacher": teacher, "num_samples": ns.num_samples, "eval_seed": ns.eval_seed,
             "guidance": ns.teacher_guidance, "progress": ns.progress}]
    for variant in sorted(ns.variants, reverse=True):  # the slower GAN students first
        for steps in ns.steps:
            for seed in ns.seeds:
                heads = gan if variant == "student_gan" else {"gan_weight": 0.0, "gan_critic_weight": 0.0}
                if variant == "student_lora":
                    heads = {**heads, "lora_rank": ns.lora_rank, "lr": ns.lora_lr, "critic_lr": ns.lora_lr,
                             "lora_target_modules": ns.lora_targets}
                jobs.append({"variant": variant, "steps": steps, "seed": seed, "iterations": ns.iterations,
                             "critic_per_k": ns.critic_per_k,
                             "eval_every": ns.eval_every, "num_samples": ns.num_samples, "eval_seed": ns.eval_seed,
                             "teacher": teacher, "guidance": guidance, "target": target, "progress": ns.progress, "overrides": {
                                 "hf_checkpoint": teacher, "save": "runs/bench-quality", "dmd2_student_steps": steps,
                                 **({"dmd2_student_sampler": "euler"} if isinstance(steps, list) else {}),
                                 "dmd2_guidance_scale": guidance, "seed": seed, "ema_decay": ns.ema or None, **sets,
                                 **heads}})
    jobs = jobs[1:] + jobs[:1]  # the students first, the slower GAN ones leading; the table last
    # a TERM (kill, timeout) leaves through the pool's exit, which stops the jobs, instead of
    # leaving them running with no one to read their results
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with mp.get_context("spawn").Pool(ns.workers) as pool:
        results = []
        for r in pool.imap_unordered(distill, jobs):
            results.append(r)
            print(f"done: {r['variant']} {r.get('steps', '')} seed {r.get('seed', '')} ({len(results)}/{len(jobs)})", file=sys.stderr)
    table = next(r["table"] for r in results if r["variant"] is None)
    report(table, [r for r in results if r["variant"]], ns, gan, time.perf_counter() - start)


def report(table, results, ns, gan, wall_s) -> None:
    guidance = ns.guidance if ns.guidance is not None else load_args("tiny").dmd2_guidance_scale
    out = {"teacher": {k: {m: round(v[m], 4) for m in METRICS} for k, v in (table or {}).items()}}
    for variant in ns.variants:
        out[variant] = {}
        for steps in ns.steps:
            rows = sorted((r for r in results if r["variant"] == variant and r["steps"] == steps), key=lambda r: r["seed"])
            out[variant][steps_name(steps)] = {
                "best": _mean(rows, "best"), "final": _mean(rows, "final"),
                "per_seed": [{"seed": r["seed"], **{k: {m: round(v, 4) for m, v in r[k].items()} for k in ("best", "final")},
                              "history": r["history"]} for r in rows]}
            if isinstance(steps, list) and rows:  # one student of several step counts: its figures at each K
                out[variant][steps_name(steps)]["at_steps"] = {
                    str(k): {"best": _mean([r["at_steps"][str(k)] for r in rows], "best"),
                             "final": _mean([r["at_steps"][str(k)] for r in rows], "final"),
                             "final_per_seed": [round(r["at_steps"][str(k)]["final"]["fd"], 4) for r in rows]}
                    for k in steps}
    any_steps_targets(out, ns)
    if {"student", "student_gan"} <= set(ns.variants) and 4 in ns.steps and table:
        g4, s = out["student_gan"]["4"], out["student"]
        out["targets"] = {
            "gan_4_final_fd_at_or_below_teacher_8": g4["final"]["fd"] <= out["teacher"]["8"]["fd"],
            "gan_4_final_within_15pct_of_best": g4["final"]["fd"] <= 1.15 * g4["best"]["fd"],
            **{f"gan_at_least_as_good_{k}_steps_final": out["student_gan"][str(k)]["final"]["fd"] <= s[str(k)]["final"]["fd"]
               for k in ns.steps},
            **{f"gan_at_least_as_good_{k}_steps_best": out["student_gan"][str(k)]["best"]["fd"] <= s[str(k)]["best"]["fd"]
               for k in ns.steps},
        }
    if {"student", "student_lora"} <= set(ns.variants) and 4 in ns.steps:
        full, low = out["student"]["4"]["final"]["fd"], out["student_lora"]["4"]["final"]["fd"]
        out.setdefault("targets", {})["lora_4_final_fd_within_10pct_of_full"] = low <= 1.1 * full
        out.update(lora_rank=getattr(ns, "lora_rank", None), lora_lr=getattr(ns, "lora_lr", None),
                   lora_targets=getattr(ns, "lora_targets", None))
    shipped = "student_gan" if "student_gan" in ns.variants else ns.variants[0]  # the tiny recipe has the head on
    if table and "50" in out["teacher"]:
        teacher = out["teacher"]["50"]
        for steps, fd_factor, fd_target in ((4, 1.0, "at_or_below"), (1, 1.1, "within_10pct_of")):
            if steps in ns.steps:
                final = out[shipped][str(steps)]["final"]
                out.setdefault("targets", {}).update({
                    f"{shipped}_{steps}_final_fd_{fd_target}_teacher_50": final["fd"] <= fd_factor * teacher["fd"],
                    f"{shipped}_{steps}_final_diversity_within_10pct_of_teacher_50":
                        abs(final["diversity"] - teacher["diversity"]) <= 0.1 * teacher["diversity"]})
    out.update({"steps": [steps_name(s) for s in ns.steps], "iterations": ns.iterations, "eval_every": ns.eval_every, "seeds": ns.seeds, "guidance_scale": guidance,
                "teacher_guidance_scale": getattr(ns, "teacher_guidance", 1.0), "ema_decay": ns.ema or None, "gan": gan, "num_samples": ns.num_samples, "set": getattr(ns, "sets", []),
                "complete": all(r["final"]["iteration"] == ns.iterations for r in results),
                "wall_s": None if wall_s is None else round(wall_s, 1)})
    print(json.dumps(out))


def any_steps_targets(out: dict, ns) -> None:
    """Issue 42's checks for each student of several step counts, at each of its K: its final FD
    within 5% of the dedicated K-step student's (where this run trained one), at 2 steps and more
    at or below the teacher's 50 steps, at 1 step within 5% of it."""
    teacher = (out.get("teacher") or {}).get("50")
    for variant in ns.variants:
        for steps in (s for s in ns.steps if isinstance(s, list)):
            per_k = out[variant].get(steps_name(steps), {}).get("at_steps") or {}
            for k, figures in per_k.items():
                final = figures["final"]["fd"]
                dedicated = out[variant].get(k)
                checks = {}
                if dedicated:
                    checks[f"{variant}_{steps_name(steps)}_at_{k}_final_fd_within_5pct_of_dedicated"] = \
                        final <= 1.05 * dedicated["final"]["fd"]
                if teacher:
                    name = "at_or_below" if int(k) >= 2 else "within_5pct_of"
                    checks[f"{variant}_{steps_name(steps)}_at_{k}_final_fd_{name}_teacher_50"] = \
                        final <= (1.0 if int(k) >= 2 else 1.05) * teacher["fd"]
                out.setdefault("targets", {}).update(checks)


if __name__ == "__main__":
    main()
