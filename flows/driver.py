"""The state of one run the dmd2 flow drives (flows/dmd2.py's Driver builds on it): the metrics
log, the run summary's view, evals and checkpoints as tasks, publishing the artifacts.

A crash rerun is the same flow run: it finds the run's artifacts (keys from the run's name, which
carries the flow run's id) and updates them from the resumed iteration on, and its summary's
before -> after is the first eval of the run (iteration 0's, read back from the metrics log)
against the last, as the log line says.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from dmd2_core import checkpoint as ckpt
from dmd2_core.args import Args
from dmd2_core.export.retention import latest_exports
from dmd2_core.run.distill_run import DistillRun
from dmd2_core.evaluation.evaluator import evaluator_of
from dmd2_core.report import GAN_KEYS, MetricsLog, campaign_best, criterion
from dmd2_core.step_counts import split_steps
from dmd2_core.run.checkpoint_commits import read_best_student, write_best_student
from dmd2_core.run.schedule import Schedule
from dmd2_core.run import time_budget
from dmd2_core.run.time_budget import TimeBudget
from dmd2_core.trackers.sinks import Trackers
from flows import artifacts, runs
from tasks.checkpoint import checkpoint
from tasks.eval import evaluate

TRAINING_LOGGED = ("dmd2_loss", "critic_loss", "dmd2_grad_norm", "actor_grad_norm")


def fmt(metrics: dict, keys: tuple[str, ...]) -> str:
    return " ".join(f"{k}={metrics[k]:.4g}" for k in keys if isinstance(metrics.get(k), (int, float)))


def eval_row(row: dict, quality_keys: tuple[str, ...]) -> dict:
    """What the summary's evals table keeps of a metrics row: quality (with each figure's standard
    error, ``<key>_se``, which the joint criterion weighs it by), losses, the GAN head's."""
    columns = ("iteration", *quality_keys, *(f"{k}_se" for k in quality_keys), "dmd2_loss", "critic_loss", *GAN_KEYS)
    kept = {k: row.get(k) for k in columns if k in row or k in ("iteration", *quality_keys)}
    return kept | {k: v for k, v in row.items() if k.startswith(("drift_", "diversity_"))  # beside the teacher's
                   or split_steps(k)[0] in columns}  # each step count's of a student of several


class DriverBase:
    """Sequences one run: iterations, evals and checkpoints as tasks, the metrics log, the run
    summary. The flow and its window subflows look it up by run id."""

    def __init__(self, run: DistillRun, run_id: str, args: Args, name: str, logger, started: Optional[float] = None,
                 sources: Optional[dict[str, str]] = None):
        """``started``: the run's start on time_budget.clock (default now), from which its
        ``time_budget_s`` counts: the groups' start-up is part of it. ``sources``: where the
        user's values came from (``flows.dmd2.config_sources``), for the summary's configuration."""
        self.run, self.run_id, self.args, self.logger = run, run_id, args, logger
        self.evaluator = evaluator_of(args)
        self.quality_keys = self.evaluator.quality_keys
        self.t0 = time.perf_counter()
        started = time_budget.clock() if started is None else started
        self.start = run.start()
        self.target = max(self.start, args.num_iterations)  # the distillation's last iteration, over every leg
        self.final = self.target  # this run's last: earlier when its time budget stops it (Driver.stop_at)
        # a cost not measured yet is taken as the start-up (reading every group from storage)
        self.budget = (TimeBudget(args.time_budget_s, started, default_s=time_budget.clock() - started)
                       if args.time_budget_s else None)
        self.schedule = run.schedule = Schedule.of(args, final=self.final)
        self.last_eval: Optional[int] = None
        # a rerun that resumed from the run's own save has its start's checkpoint (and export) already
        self.last_ckpt: Optional[int] = self.start if (self.start and run.resumed_from == args.save) else None
        self.requested_ckpt: Optional[int] = self.last_ckpt
        self.log = MetricsLog(args.save, self.start)
        self.trackers = Trackers.open(args, args.tracker_run_name or name, args.model_dump(mode="json"),
                                      self.start, self.log.last_found, self.log.rows)
        self.media_at: dict[int, list[dict]] = {}  # an eval's media, until its iteration's row goes to the trackers
        self.keys = artifacts.artifact_keys(name)  # the run's name carries its flow run id: one set per run
        self.result: dict[str, Any] = {
            "run_id": run_id, "name": name, "start_iteration": self.start, "final_iteration": self.final,
            "metrics_url": self.log.url, "media_urls": [], "checkpoint": None, "artifact_keys": self.keys,
            "resumed_with": run.resumed_with, "startup_s": run.startup_s,
        }
        self.view: dict[str, Any] = {
            "name": name, "evaluator": self.evaluator.name, "iteration": self.start, "final": self.final,
            "start": self.start, "status": "running",
            "trainer_args": shown_args(run.trainer_args), "config_sources": dict(sources or {}),
            "evals": [eval_row(row, self.quality_keys) for row in self.log.table()
                      if any(row.get(q) is not None for q in self.quality_keys)],
            "media": [], "metrics_url": self.log.url, "checkpoint": None, "student": None,
            "best_student": None, "drift_flags": [], "reference": {}, "resumed_with": run.resumed_with,
        }
        self.best = read_best_student(args.save)  # the run's best eval with an export: kept by retention
        self.export_best: Optional[int] = None  # an eval that became the best: its save exports
        if self.last_ckpt:
            self._note_checkpoint(self.last_ckpt, {}, next(iter(latest_exports(args.save)), None))
        self.artifacts = artifacts.RunArtifacts(self.keys, self.view, total=self.final, done=self.start,
                                                flow_run_id=run_id)
        self.published = self.start
        run.rollout_ahead = self.follows_directly

    # ---- evals and checkpoints ----
    def eval(self, i: int) -> dict:
        t = time.perf_counter()
        out = evaluate(self.run_id, i)
        eval_s = time.perf_counter() - t  # the whole eval task, as the time budget and the time plan see it
        self.note_cost("eval", eval_s)
        self.last_eval = i
        flags = self.evaluator.drift_flags(out["metrics"], self.first_eval(out["metrics"]), out.get("reference") or {})
        row = self.log.update(i, {**out["metrics"], "eval_s": eval_s,
                                  **({"drift_out": float(len(flags))} if out.get("reference") else {})})
        self.result["media_urls"] += [m["url"] for m in out["media"]]
        quality = {k: out["metrics"][k] for k in self.quality_keys if k in out["metrics"]}
        self.view["evals"] = [e for e in self.view["evals"] if e["iteration"] != i]
        self.view["evals"].append(eval_row(row, self.quality_keys))
        self.view["media"], self.view["media_iteration"] = out["media"], i
        self.media_at[i] = out["media"]
        self.view["drift_flags"] = flags
        self.view["reference"] = out.get("reference") or self.view["reference"]
        best = self.campaign_best()  # a night whose evals are all worse keeps an earlier night's student
        if best is not None and best["iteration"] == i and (self.best or {}).get("iteration") != i:
            self.export_best = i  # exported by a save of this iteration, now
        if quality:
            self.logger.info(f"eval at iteration {i}: " + fmt(quality, (*TRAINING_LOGGED, *self.quality_keys))
                             + (f"; drift out of band: {', '.join(self.view['drift_flags'])}" if self.view["drift_flags"] else ""))
        return quality

    def track(self, i: int) -> None:
        """Iteration i's metrics row and eval media to the run's trackers (once its row is complete)."""
        self.trackers.write(i, self.log.rows.get(i, {"iteration": i}), self.media_at.pop(i, None))

    def first_eval(self, latest: dict) -> dict:
        """The run's first eval with drift figures (its start, against which drift is judged): from
        the metrics log, which a resumed run reads back; ``latest`` when it is the first."""
        return next((row for row in self.log.table() if any(k.startswith(("drift_", "diversity_")) for k in row)), latest)

    def _note_checkpoint(self, i: int, trainers: dict, export: Optional[str] = None) -> None:
        info = {"iteration": i, "trainers": trainers, "latest": ckpt.latest_url(self.args.save)}
        self.result["checkpoint"] = self.view["checkpoint"] = info
        if export:
            self.view["student"] = self.result["student"] = export
        if export and self.export_best == i:  # the best eval's student, exported: the run's student
            key = criterion(self.view["evals"], self.evaluator.criteria)
            value = (self.campaign_best() or {}).get(key)
            self.best = {"iteration": i, "criterion": key, "value": value, "export_url": export}
            write_best_student(self.args.save, self.best)
            self.export_best = None
        if self.best:
            self.view["best_student"] = self.result["best_student"] = self.best["export_url"]
            self.view["best_iteration"] = self.best["iteration"]

    def campaign_best(self) -> Optional[dict]:
        """The campaign's best eval (``report.campaign_best``): every night's evals of this save
        (the metrics log keeps them), so a later night never replaces a better earlier student."""
        return campaign_best(self.view["evals"], self.evaluator.joint_criteria)

    def _saved(self, metrics: dict) -> None:
        """A checkpoint became durable and the latest pointer names it: note it, log it."""
        tracked = metrics.pop("checkpoint", None)
        export = metrics.pop("export_url", None)
        if tracked is None:
            return
        i = int(metrics["checkpoint_iteration"])
        self.last_ckpt = i
        self._note_checkpoint(i, tracked["trainers"], export)
        self.logger.info(f"checkpoint at iteration {i} tracked ({metrics['checkpoint_save_s']:.2f}s to write)"
                         + (f"; student exported to {export}" if export else ""))

    def note_cost(self, cost: str, seconds: Optional[float]) -> None:
        """A measured cost for the time budget (none without one)."""
        if self.budget is not None and isinstance(seconds, (int, float)):
            self.budget.note(cost, seconds)

    def note_save_costs(self, metrics: dict) -> None:
        """What a checkpoint that became durable took to write, and its export (an asynchronous
        save reports them at a later iteration)."""
        self.note_cost("checkpoint", metrics.get("checkpoint_save_s"))
        self.note_cost("export", metrics.get("export_s"))

    def checkpoint(self, i: int, wait: bool = False) -> None:
        export = True if self.export_best == i else None  # the best eval's student is exported
        t = time.perf_counter()
        out = checkpoint(self.run_id, i, wait, export)
        if wait:  # the driver waited for all of it
            self.note_cost("checkpoint", time.perf_counter() - t)
        self.note_save_costs(out)
        self.requested_ckpt = i
        self._saved(out)
        self.log.update(i, {k: v for k, v in out.items()
                            if k.startswith(("checkpoint_", "export_")) and k != "checkpoint_iteration"})

    def publish(self, i: int) -> None:
        """Metrics log, summary, table and progress at iteration i; the flow run's iteration label
        (what a failure message names, flows/alerts.py)."""
        self.view["iteration"] = i
        self.log.write()
        self.artifacts.publish(self.log.table())
        self.artifacts.progress(i, force=True)
        runs.set_progress_labels(self.run_id, i)
        self.published = i


def shown_args(trainer_args: dict) -> dict:
    """Each trainer's args as the summary shows them: what the run used. A family that shifts each
    modality by its own scheduler (MiniMax-H3) steps at those shifts, not at ``dmd2_shift``; where
    ``student_modality_shifts`` moves one, the student's, with the schedulers' beside them."""
    from dmd2_core.errors import ModelDirError
    from dmd2_core.models import describe_model_dir
    from dmd2_core.models.minimax_h3 import MODALITIES

    shown = {role: a.model_dump(mode="json") for role, a in trainer_args.items()}
    try:
        shifts = describe_model_dir(next(iter(trainer_args.values())).hf_checkpoint).get("modality_shifts")
    except ModelDirError:  # a run without a model directory (bench/orchestration.py's stand-in): as set
        shifts = None
    if shifts:
        def named(values):
            return ", ".join(f"{m} {s:g}" for m, s in zip(MODALITIES, values))

        for role, args in shown.items():
            student = trainer_args[role].student_modality_shifts or {}
            stepped = [student.get(m, s) for m, s in zip(MODALITIES, shifts)]
            args["dmd2_shift"] = named(shifts) if stepped == list(shifts) else \
                f"{named(stepped)} (the schedulers': {named(shifts)})"
    return shown
