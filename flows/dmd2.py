"""The DMD2 distillation as a Prefect flow: every phase of every iteration is a task dispatching
to persistent Ray trainer groups held by a DistillRun.

    python -m flows.dmd2 --recipe tiny [--set key=value ...] [--num-iterations N] [--save URL]

Parameters are checked (recipe, overrides, checkpoints, hooks, resume point) before Ray starts;
a bad one fails the flow run with one line naming it.

Structure (what the UI's run graph shows): the flow run ``{run_name}-{date}`` holds the first eval
and one subflow run per window of ``iterations_per_window`` iterations, named by its range
(``iterations-0001-0100``); a window holds its iterations' phases as tasks, chained by edges so
one iteration reads as one row (rollout -> critic train and score -> sleep critic -> student train
-> sleep actor; no sleep tasks where the groups do not sleep), plus its evals and checkpoints. No
graph grows with the run's length: the parent has one node per window, a window about 5 per
iteration. A task waits for and reports its phase; the phase's Ray work may already have been
queued by the task before it (DistillRun starts every phase Ray can order ahead), so the trainers
never wait for Prefect between tasks.

Logs: one INFO line per iteration (losses and time) on the flow run; task runs log at WARNING.
Artifacts (flows/artifacts.py): a run summary, a short metrics table and a progress bar, updated in
place. The full metrics go to ``{save}/metrics.jsonl`` (strict JSON; dmd2_core/report.py).
"""

from __future__ import annotations

from flows.environment import configure_environment

if __name__ == "__main__":  # the CLI: Prefect and Ray read these settings when they are imported
    configure_environment()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

import torch  # noqa: E402
from prefect import flow, get_run_logger  # noqa: E402

from dmd2_core import checkpoint as ckpt  # noqa: E402
from dmd2_core import report  # noqa: E402
from dmd2_core.args import Args, ArgsError, load_args, parse_set  # noqa: E402
from dmd2_core.distill import DistillRun  # noqa: E402
from dmd2_core.finite import NonFiniteError  # noqa: E402
from dmd2_core.lease import LeaseLostError  # noqa: E402
from dmd2_core.models import CheckpointError  # noqa: E402
from dmd2_core.schedule import Schedule  # noqa: E402
from dmd2_core.storage import StorageUnavailableError  # noqa: E402
from dmd2_core.report import METRICS_NAME, QUALITY_KEYS, MetricsLog  # noqa: E402,F401
from flows import artifacts  # noqa: E402
from tasks import registry  # noqa: E402
from tasks.checkpoint import checkpoint  # noqa: E402
from tasks.eval import eval_media  # noqa: E402
from tasks.phases import critic_train_and_score, rollout, sleep_groups, student_train  # noqa: E402

LOGGED_KEYS = ("dmd2_loss", "critic_loss", "dmd2_grad_norm", "actor_grad_norm", "fd", "acc", "diversity")
TASK_LOGGER = "prefect.task_runs"


# ---- parameters -------------------------------------------------------------------------------

def resolve_args(recipe: str, overrides: Optional[dict] = None, **flat: Any) -> Args:
    """The recipe, ``overrides`` on top, then the flat parameters that are not None."""
    merged = dict(overrides or {})
    merged.update({k: v for k, v in flat.items() if v is not None})
    return load_args(recipe, merged)


def run_display_name(parameters: dict, today: Optional[datetime.date] = None) -> str:
    """``{run_name}-{date}`` (UTC date) of a flow run with these parameters; the recipe's stem when
    the parameters do not resolve (the run then fails with the reason, under this name)."""
    try:
        name = resolve_args(**parameters).run_name
    except Exception:  # noqa: BLE001 - bad input still gets a readable name; the flow reports it
        name = Path(str(parameters.get("recipe") or "dmd2")).stem
    day = today or datetime.datetime.now(datetime.timezone.utc).date()
    return f"{artifacts.slugify(name)}-{day.isoformat()}"


def _flow_run_name() -> str:
    from prefect.runtime import flow_run

    return run_display_name(dict(flow_run.parameters or {}))


def _run_id() -> str:
    from prefect.runtime import flow_run

    return str(flow_run.id or uuid.uuid4())


def _fmt(metrics: dict) -> str:
    return " ".join(f"{k}={metrics[k]:.4g}" for k in LOGGED_KEYS if isinstance(metrics.get(k), (int, float)))


def _cleanup_hook(flow_obj, flow_run, state) -> None:
    """On cancellation or crash in this process: kill the run's actors and placement group."""
    registry.shutdown_run(str(flow_run.id))


def windows(start: int, final: int, size: int) -> list[tuple[int, int]]:
    """Iterations start+1..final cut at multiples of ``size``: (first, last) of each window."""
    out, i = [], start + 1
    while i <= final:
        last = min(final, (i - 1) // size * size + size)
        out.append((i, last))
        i = last + 1
    return out


# ---- the driver of one run (lives in the flow run's process) ----------------------------------

_DRIVERS: dict[str, "Driver"] = {}


class Driver:
    """Sequences one run: iterations, evals and checkpoints as tasks, the metrics log, the run
    summary. The flow and its window subflows look it up by run id."""

    def __init__(self, run: DistillRun, run_id: str, args: Args, name: str, logger):
        self.run, self.run_id, self.args, self.logger = run, run_id, args, logger
        self.t0 = time.perf_counter()
        self.start = run.start()
        self.final = max(self.start, args.num_iterations)
        self.schedule = run.schedule = Schedule.of(args, final=self.final)
        self.last_eval: Optional[int] = None
        self.last_ckpt: Optional[int] = self.start if (self.start and args.load_url == args.save) else None
        self.requested_ckpt: Optional[int] = self.last_ckpt
        self.log = MetricsLog(args.save, self.start)
        self.keys = artifacts.artifact_keys(args.run_name)
        self.result: dict[str, Any] = {
            "run_id": run_id, "name": name, "start_iteration": self.start, "final_iteration": self.final,
            "metrics_url": self.log.url, "media_urls": [], "checkpoint": None, "artifact_keys": self.keys,
        }
        self.view: dict[str, Any] = {
            "name": name, "iteration": self.start, "final": self.final, "start": self.start, "status": "running",
            "trainer_args": {role: a.model_dump(mode="json") for role, a in run.trainer_args.items()},
            "evals": [r for r in ({k: row.get(k) for k in ("iteration", *QUALITY_KEYS, "dmd2_loss", "critic_loss")}
                                  for row in self.log.table() if any(row.get(q) is not None for q in QUALITY_KEYS))],
            "media": [], "metrics_url": self.log.url, "checkpoint": None, "student": None,
        }
        if self.last_ckpt:
            self._note_checkpoint(self.last_ckpt, {}, next(iter(ckpt.latest_exports(args.save)), None))
        self.artifacts = artifacts.RunArtifacts(self.keys, self.view, total=self.final, done=self.start)
        run.rollout_ahead = self.follows_directly

    # ---- evals and checkpoints ----
    def eval(self, i: int) -> dict:
        out = eval_media(self.run_id, i)
        self.last_eval = i
        row = self.log.update(i, out["metrics"])
        self.result["media_urls"] += [m["url"] for m in out["media"]]
        quality = {k: out["metrics"][k] for k in QUALITY_KEYS if k in out["metrics"]}
        self.view["evals"] = [e for e in self.view["evals"] if e["iteration"] != i]
        self.view["evals"].append({k: row.get(k) for k in ("iteration", *QUALITY_KEYS, "dmd2_loss", "critic_loss")})
        self.view["media"], self.view["media_iteration"] = out["media"], i
        if quality:
            self.logger.info(f"eval at iteration {i}: " + _fmt(quality))
        return quality

    def _note_checkpoint(self, i: int, trainers: dict, export: Optional[str] = None) -> None:
        info = {"iteration": i, "trainers": trainers, "tracker": ckpt.tracker_url(self.args.save)}
        self.result["checkpoint"] = self.view["checkpoint"] = info
        if export:
            self.view["student"] = self.result["student"] = export

    def _saved(self, metrics: dict) -> None:
        """A checkpoint became durable and the tracker names it: note it, log it."""
        tracked = metrics.pop("checkpoint", None)
        export = metrics.pop("export_url", None)
        if tracked is None:
            return
        i = int(metrics["checkpoint_iteration"])
        self.last_ckpt = i
        self._note_checkpoint(i, tracked["trainers"], export)
        self.logger.info(f"checkpoint at iteration {i} tracked ({metrics['checkpoint_save_s']:.2f}s to write)"
                         + (f"; student exported to {export}" if export else ""))

    def checkpoint(self, i: int, wait: bool = False) -> None:
        out = checkpoint(self.run_id, i, wait)
        self.requested_ckpt = i
        self._saved(out)
        self.log.update(i, {k: v for k, v in out.items()
                            if k.startswith(("checkpoint_", "export_")) and k != "checkpoint_iteration"})

    def publish(self, i: int) -> None:
        self.view["iteration"] = i
        self.log.write()
        self.artifacts.publish(self.log.table())
        self.artifacts.progress(i, force=True)

    # ---- one iteration ----
    def follows_directly(self, i: int) -> bool:
        """Iteration i+1 comes right after i, with no eval or checkpoint between them: its rollout
        may start while iteration i's last task is still finishing."""
        return self.schedule.follows_directly(i)

    def phases(self, i: int) -> list[tuple[Any, tuple]]:
        """The iteration's tasks; the sleep tasks only where the groups sleep (on cuda by default)."""
        sleeps = self.args.sleep_after_train
        return [(rollout, (i,)), (critic_train_and_score, (i,)), *([(sleep_groups, (i, "critic"))] if sleeps else []),
                (student_train, (i,)), *([(sleep_groups, (i, "actor"))] if sleeps else [])]

    def iteration(self, i: int) -> dict:
        t = time.perf_counter()
        metrics: dict[str, Any] = {}
        state = None
        for phase, call in self.phases(i):
            # wait_for: an edge in the run graph, so one iteration's phases read as one chain
            state = phase(self.run_id, *call, return_state=True, wait_for=[state] if state is not None else None)
            metrics.update(state.result())
        self._saved(metrics)
        metrics["iteration_s"] = time.perf_counter() - t
        row = self.log.update(i, metrics)
        evals, saves = self.schedule.evals_at(i), self.schedule.saves_at(i)
        if evals:
            self.eval(i)
        if saves:
            self.checkpoint(i, wait=self.schedule.waits_at(i))
        self.log.update(i, {"wall_time": time.time()})
        if evals or saves:
            self.publish(i)
        else:
            self.log.write()
            self.artifacts.progress(i)
        self.logger.info(f"iteration {i}/{self.final} {_fmt(row)} ({metrics['iteration_s']:.2f}s)")
        return row

    # ---- the whole run ----
    def drive(self) -> dict:
        args = self.args
        self.logger.info(
            f"dmd2: {self.final - self.start} iterations ({self.start + 1}..{self.final}) on {args.num_devices} "
            f"device(s), K={args.dmd2_student_steps}, batch {args.global_batch_size}, save {args.save}"
            + (f" (resumed after iteration {self.start})" if self.start else "")
            + f"; groups up in {time.perf_counter() - self.t0:.1f}s; windows of {args.iterations_per_window}")
        if self.schedule.evaluating:
            self.result["quality_before"] = self.eval(self.start) or None
            self.publish(self.start)
        for first, last in windows(self.start, self.final, args.iterations_per_window):
            iterations.with_options(flow_run_name=f"iterations-{first:04d}-{last:04d}")(self.run_id, first, last)
        if self.schedule.evaluating and self.last_eval != self.final:
            self.eval(self.final)
        if self.requested_ckpt != self.final:
            self.checkpoint(self.final, wait=True)
        final_row = dict(self.log.rows.get(self.final, {"iteration": self.final}))
        self.result["final_metrics"] = final_row
        if self.schedule.evaluating:
            self.result["quality_after"] = {k: final_row[k] for k in QUALITY_KEYS if k in final_row} or None
            b, a = self.result.get("quality_before"), self.result.get("quality_after")
            if b and a:
                self.logger.info("quality before -> after: " + ", ".join(f"{k} {b[k]:.4g} -> {a[k]:.4g}" for k in a if k in b))
        self.view["status"] = "completed"
        self.log.finish()
        self.publish(self.final)
        self.result["wall_s"] = round(time.perf_counter() - self.t0, 2)
        self.logger.info(f"dmd2 done: iteration {self.final} in {self.result['wall_s']}s; metrics {self.log.url}")
        return self.result


# ---- the flows --------------------------------------------------------------------------------

@flow(name="dmd2-iterations", persist_result=False, validate_parameters=False, log_prints=False)
def iterations(run_id: str, first: int, last: int) -> dict:
    """Iterations ``first``..``last`` of the run ``run_id`` (a window of the dmd2 flow run)."""
    driver = _DRIVERS[run_id]
    row: dict = {}
    for i in range(first, last + 1):
        row = driver.iteration(i)
    return {"first": first, "last": last, "iteration_s": row.get("iteration_s")}


@contextlib.contextmanager
def _quiet_tasks():
    """Task runs log at WARNING while the run lasts (no 'Finished in state Completed()' per task)."""
    task_logger = logging.getLogger(TASK_LOGGER)
    level = task_logger.level
    task_logger.setLevel(max(logging.WARNING, level))
    try:
        yield
    finally:
        task_logger.setLevel(level)


@flow(name="dmd2", flow_run_name=_flow_run_name, on_cancellation=[_cleanup_hook], on_crashed=[_cleanup_hook])
def dmd2(
    recipe: str,
    overrides: Optional[dict[str, Any]] = None,
    num_iterations: Optional[int] = None,
    hf_checkpoint: Optional[str] = None,
    save: Optional[str] = None,
    prompts: Optional[str] = None,
    seed: Optional[int] = None,
) -> dict:
    """DMD2 distillation of a recipe into a few-step student.

    Args:
        recipe: Recipe name under deployments/recipes (tiny, minimax-h3) or a YAML path.
        overrides: Flag name -> value on top of the recipe, e.g. {"lr": 1e-6, "ray_address": "ray-head:6379"}; `python -m dmd2_core --help` lists every flag.
        num_iterations: Number of DMD2 iterations (student updates); default the recipe's.
        hf_checkpoint: The teacher, a diffusers directory (path, file:// or s3:// URL); default the recipe's.
        save: Storage URL of the run: checkpoints, metrics.jsonl, media; a run with the same save resumes.
        prompts: Prompt-embedding set (safetensors URL) or 'digits'; default the recipe's.
        seed: Seed of every random draw; default the recipe's.
    """
    configure_environment()  # where a worker or serve starts the run: before Ray is imported
    logger = get_run_logger()
    args = resolve_args(recipe, overrides, num_iterations=num_iterations, hf_checkpoint=hf_checkpoint,
                        save=save, prompts=prompts, seed=seed)
    from prefect.runtime import flow_run

    reruns = max(0, int(flow_run.run_count or 1) - 1)  # a crashed run set Scheduled again counts up
    if reruns > args.max_crash_reruns:
        raise RuntimeError(f"run crashed {reruns} times (max_crash_reruns "
                           f"{args.max_crash_reruns}): failing instead of running it again")
    if reruns:
        logger.warning(f"rerun {reruns} of {args.max_crash_reruns} after a crash: resuming from the tracker")
    run = DistillRun(args, owner=_run_id())  # preflight (and the save URL's lease owner); no actor yet
    args = run.args
    torch.set_num_threads(args.torch_threads)  # the driver's own work (digits metrics)
    name = flow_run.name or run_display_name({"recipe": recipe, "overrides": overrides})
    run_id = registry.register(_run_id(), run)
    try:
        with _quiet_tasks():
            driver = Driver(run, run_id, args, name, logger)
            _DRIVERS[run_id] = driver
            return driver.drive()
    finally:
        _DRIVERS.pop(run_id, None)
        registry.unregister(run_id)
        run.shutdown()


# ---- CLI --------------------------------------------------------------------------------------

def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.dmd2", description="Run the dmd2 Prefect flow.")
    parser.add_argument("--recipe", default="tiny", help="Recipe name under deployments/recipes or a YAML path.")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="Override one flag (value parsed as YAML); repeatable.")
    parser.add_argument("--num-iterations", type=int)
    parser.add_argument("--hf-checkpoint")
    parser.add_argument("--save")
    parser.add_argument("--prompts")
    parser.add_argument("--seed", type=int)
    ns = parser.parse_args(argv)
    from dmd2_core import reaper
    from flows.console import tracebacks_to_file

    console = tracebacks_to_file()

    def line(exc: BaseException) -> str:
        where = f" (traceback in {console.path})" if console is not None and console.used else ""
        return f"error: {exc}{where}"

    try:
        overrides = parse_set(ns.overrides)
        flat = dict(num_iterations=ns.num_iterations, hf_checkpoint=ns.hf_checkpoint, save=ns.save,
                    prompts=ns.prompts, seed=ns.seed)
        DistillRun(resolve_args(ns.recipe, overrides, **flat))  # fail fast, before Prefect starts
        if argv is None:  # a process of its own: no orphans, one line on SIGINT/SIGTERM
            reaper.watch()
            reaper.raise_on_signals()
        summary = dmd2(recipe=ns.recipe, overrides=overrides or None, **flat)
    except (ArgsError, CheckpointError) as exc:
        print(line(exc), file=sys.stderr)
        return 2
    except BaseException as exc:  # noqa: BLE001 - signals and runtime failures: one line each
        signum = reaper.interruption(exc)
        if signum is not None:
            print(f"error: interrupted by {signal.Signals(signum).name}; rerun the same command to resume "
                  "from the latest checkpoint", file=sys.stderr)
            return 128 + int(signum)
        if isinstance(exc, (NonFiniteError, LeaseLostError, StorageUnavailableError)):
            print(line(exc), file=sys.stderr)
            return 1
        raise
    print(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
