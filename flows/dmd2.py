"""The DMD2 distillation as a Prefect flow: every phase of every iteration is a task dispatching
to persistent Ray trainer groups held by a DistillRun.

    python -m flows.dmd2 --recipe tiny [--set key=value ...] [--num-iterations N] [--save URL]

Parameters are checked (recipe, overrides, checkpoints, hooks, resume point) before Ray starts;
a bad one fails the flow run with one line naming it.

Structure (what the UI's run graph shows): the flow run ``{run_name}-{date}-{id}`` (UTC date, the
first 8 hex digits of the flow run's id: every run a name of its own, kept by a crash rerun) holds
the first eval and one subflow run per window of ``iterations_per_window`` iterations, named by the
run and its range (``dmd2-tiny-2026-12-03-1a2b3c4d iterations-0001-0100``, `` (rerun 1)`` after a
crash; the crashed attempt's windows are closed as Crashed and keep their names, flows/runs.py);
a window holds its iterations' phases as tasks, chained by edges so
one iteration reads as one row (rollout -> critic train and score -> sleep critic -> student train
-> sleep actor; no sleep tasks where the groups do not sleep), plus its evals and checkpoints. No
graph grows with the run's length: the parent has one node per window, a window about 5 per
iteration. A task waits for and reports its phase; the phase's Ray work may already have been
queued by the task before it (DistillRun starts every phase Ray can order ahead), so the trainers
never wait for Prefect between tasks.

Logs: one INFO line per iteration (losses and time) on the flow run; task runs log at WARNING.
Artifacts (flows/artifacts.py): a run summary, a short metrics table and a progress bar, updated in
place (at evals, checkpoints and every ``summary_interval`` iterations); a deployment's runs add a
row to its nights view (flows/nights.py). The full metrics go to ``{save}/metrics.jsonl`` (strict
JSON; dmd2_core/report/metrics_log.py).
"""

from __future__ import annotations

from flows.environment import configure_environment

if __name__ == "__main__":  # the CLI: Prefect and Ray read these settings when they are imported
    configure_environment()

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
from prefect import flow, get_run_logger, tags  # noqa: E402
from prefect.states import Completed, State  # noqa: E402

from dmd2_core import checkpoint as ckpt  # noqa: E402
from dmd2_core.args import Args, load_args  # noqa: E402
from dmd2_core.errors import (  # noqa: E402
    ArgsError, LeaseLostError, NonFiniteError, StorageUnavailableError, StoredFilesError, TransientError,
)
from dmd2_core.run.distill_run import DistillRun  # noqa: E402
from dmd2_core.run.preflight import hand_over  # noqa: E402
from dmd2_core.run.schedule import Schedule  # noqa: E402
from dmd2_core.run import time_budget  # noqa: E402
from flows import artifacts, nights, runs  # noqa: E402
from flows.driver import TRAINING_LOGGED, DriverBase, fmt  # noqa: E402
from tasks import registry  # noqa: E402
from tasks.phases import critic_train_and_score, rollout, sleep_groups, student_train  # noqa: E402

TASK_LOGGER = "prefect.task_runs"
WINDOW_TAG = "dmd2-window"  # the runs list can hide windows by it (or with its 'hide subflows' toggle)


# ---- parameters -------------------------------------------------------------------------------

def resolve_args(recipe: str, overrides: Optional[dict] = None, **flat: Any) -> Args:
    """The recipe, ``overrides`` on top, then the flat parameters that are not None."""
    merged = dict(overrides or {})
    merged.update({k: v for k, v in flat.items() if v is not None})
    return load_args(recipe, merged)


def config_sources(recipe: str, overrides: Optional[dict] = None, **flat: Any) -> dict[str, str]:
    """Where each value the user gave came from, as ``resolve_args`` merges them: key -> 'set' (a
    flag, --set or a flow parameter) or 'recipe' (the recipe's file); the summary's configuration
    lists these first."""
    from dmd2_core.args import read_recipe

    given = {**dict(overrides or {}), **{k: v for k, v in flat.items() if v is not None}}
    return {**{k: "recipe" for k in read_recipe(recipe)}, **{k: "set" for k in given}}


def run_display_name(parameters: dict, today: Optional[datetime.date] = None, run_id: Optional[str] = None) -> str:
    """``{run_name}-{date}-{id}`` (UTC date, the flow run id's first 8 hex digits) of a flow run
    with these parameters; the recipe's stem when the parameters do not resolve (the run then
    fails with the reason, under this name)."""
    try:
        name = resolve_args(**parameters).run_name
    except Exception:  # noqa: BLE001 - bad input still gets a readable name; the flow reports it
        name = Path(str(parameters.get("recipe") or "dmd2")).stem
    day = today or datetime.datetime.now(datetime.timezone.utc).date()
    short = str(run_id or "").replace("-", "")[:8]
    return f"{artifacts.slugify(name)}-{day.isoformat()}" + (f"-{short}" if short else "")


def _flow_run_name() -> str:
    """A crash rerun (after midnight too) keeps the name its first attempt got."""
    from prefect.runtime import flow_run

    run_id = str(flow_run.id or "")
    current = str(flow_run.name or "")
    if run_id and current.endswith("-" + run_id.replace("-", "")[:8]):
        return current
    return run_display_name(dict(flow_run.parameters or {}), run_id=run_id or None)


def _run_id() -> str:
    from prefect.runtime import flow_run

    return str(flow_run.id or uuid.uuid4())


def _cleanup_hook(flow, flow_run, state) -> None:
    """On cancellation or crash: kill the run's actors and placement group when they live in this
    process. Prefect calls it positionally in the flow-run process and by keyword (flow=, flow_run=,
    state=) in the serve process that reports a killed one, so the names are Prefect's."""
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


class Driver(DriverBase):
    """Sequences one run: iterations, evals and checkpoints as tasks, the metrics log, the run
    summary (state and evals/checkpoints: flows/driver.py). The flow and its window subflows look
    it up by run id."""

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
        if self.budget is not None and i < self.final and self.must_stop_after(i):
            self.stop_at(i)
        t, self.current = time.perf_counter(), i
        metrics: dict[str, Any] = {}
        state = None
        for phase, call in self.phases(i):
            # wait_for: an edge in the run graph, so one iteration's phases read as one chain
            state = phase(self.run_id, *call, return_state=True, wait_for=[state] if state is not None else None)
            metrics.update(state.result())
        self.note_save_costs(metrics)
        self._saved(metrics)
        metrics["iteration_s"] = time.perf_counter() - t
        self.note_cost("iteration", metrics["iteration_s"])
        row = self.log.update(i, metrics)
        evals, saves = self.schedule.evals_at(i), self.schedule.saves_at(i)
        if evals:
            self.eval(i)
        if saves or self.export_best == i:  # a new best eval: its student is saved and exported now
            self.checkpoint(i, wait=self.schedule.waits_at(i))
        self.log.update(i, {"wall_time": time.time()})
        every = self.args.summary_interval
        if evals or saves or (every and i - self.published >= every):
            self.publish(i)  # costs the same at any iteration (flows/artifacts.py)
        else:
            self.log.write()
            self.artifacts.progress(i)
        self.track(i)  # after the log holds the row: a rerun skips what the log had, never what it lacked
        self.view["iteration"] = i
        self.logger.info(f"iteration {i}/{self.target} {fmt(row, (*TRAINING_LOGGED, *self.quality_keys))} "
                         f"({metrics['iteration_s']:.2f}s)")
        return row

    # ---- the time budget ----
    def must_stop_after(self, i: int) -> bool:
        """Whether iteration i must be this run's last for its end to fit in the time budget."""
        budget, evaluating = self.budget, self.schedule.evaluating
        scheduled = ((budget.estimate("eval") if self.schedule.evals_at(i) else 0.0)
                     + (budget.estimate("checkpoint") if self.schedule.saves_at(i) else 0.0))
        return budget.must_stop_after_next(evaluating, scheduled)

    def stop_at(self, i: int) -> None:
        """Make iteration i the run's last: its schedule then evaluates it, saves it (waiting until
        durable) and exports it, as at a run's end. Decided before the iteration starts, so no
        later iteration was started ahead; every rank stops alike (the trainers follow the driver)."""
        self.logger.info(f"time budget: iteration {i} is this run's last of {self.target} "
                         f"({self.budget.describe(self.schedule.evaluating)}); it is checkpointed, evaluated "
                         f"and exported, and the next run on {self.args.save} goes on from it")
        self.final = i
        self.schedule = self.run.schedule = Schedule.of(self.args, final=i)

    def pace(self) -> Optional[float]:
        """This run's mean seconds per iteration (its metrics rows), None before one."""
        measured = [row["iteration_s"] for n, row in self.log.rows.items()
                    if self.start < n <= self.final and isinstance(row.get("iteration_s"), (int, float))]
        return round(sum(measured) / len(measured), 3) if measured else None

    def implied_mfu(self, pace: Optional[float]) -> Optional[float]:
        """The MFU this run's pace implies: the FLOPs of an iteration (the time plan's count, on the
        meta device) over the devices' peak (the cluster's accelerator kind); None without a pace,
        on CPUs or an unknown device kind, or for a model the plan cannot count (said in the log)."""
        from dmd2_core.memory import time_plan

        peak = time_plan.cluster_peak_flops() if pace else None
        if peak is None:
            return None
        try:
            flops = sum(time_plan.iteration_flops(self.run.trainer_args).values())
        except Exception as exc:  # noqa: BLE001 - a figure for people: the night's outcome stands
            self.logger.warning(f"MFU not measured: the iteration's FLOPs were not counted ({type(exc).__name__}: {exc})")
            return None
        return round(time_plan.implied_mfu(flops, pace, peak, self.args.num_devices), 4)

    # ---- the whole run ----
    def drive(self, reruns: int = 0) -> dict:
        args, self.reruns = self.args, reruns
        self.logger.info(
            f"dmd2: {self.final - self.start} iterations ({self.start + 1}..{self.final}) on {args.num_devices} "
            f"device(s), K={args.dmd2_student_steps}, batch {args.global_batch_size}, save {args.save}"
            + (f" (resumed after iteration {self.start})" if self.start else "")
            + f"; groups up in {time.perf_counter() - self.t0:.1f}s"
            + (f" ({', '.join(f'{k} {v:g}s' for k, v in self.run.startup_s.items())})" if self.run.startup_s else "")
            + f"; windows of {args.iterations_per_window}")
        if self.schedule.evaluating:
            resumed = self.eval(self.start)
            first = next(iter(self.view["evals"]), {})  # iteration 0's, on a rerun too (the metrics log)
            self.result["quality_before"] = {k: first[k] for k in self.quality_keys if first.get(k) is not None} or resumed or None
            self.publish(self.start)
            self.track(self.start)
        rerun = f" (rerun {self.reruns})" if self.reruns else ""
        for first, last in windows(self.start, self.final, args.iterations_per_window):
            if first > self.final:  # the time budget stopped the run in an earlier window
                break
            name = f"{self.view['name']} iterations-{first:04d}-{last:04d}{rerun}"
            with tags(WINDOW_TAG):
                iterations.with_options(flow_run_name=name)(self.run_id, first, last)
        if self.schedule.evaluating and self.last_eval != self.final:
            self.eval(self.final)
        if self.requested_ckpt != self.final:
            self.checkpoint(self.final, wait=True)
        final_row = dict(self.log.rows.get(self.final, {"iteration": self.final}))
        self.result["final_metrics"] = final_row
        if self.schedule.evaluating:
            self.result["quality_after"] = {k: final_row[k] for k in self.quality_keys if k in final_row} or None
            b, a = self.result.get("quality_before"), self.result.get("quality_after")
            if b and a:
                self.logger.info("quality before -> after: " + ", ".join(f"{k} {b[k]:.4g} -> {a[k]:.4g}" for k in a if k in b))
        continues = self.final < self.target
        self.result.update(final_iteration=self.final, stopped_at=self.final, num_iterations=self.target,
                           continues=continues)
        self.view["status"] = "completed, continues" if continues else "completed"
        self.view["seconds_per_iteration"] = self.pace()
        self.view["mfu"] = self.implied_mfu(self.view["seconds_per_iteration"])
        self.log.finish()
        self.trackers.close()
        self.publish(self.final)
        self.result["wall_s"] = round(time.perf_counter() - self.t0, 2)
        self.logger.info(f"dmd2 done: iteration {self.final} in {self.result['wall_s']}s; metrics {self.log.url}"
                         + (f"; continues: {self.target - self.final} of {self.target} iterations left" if continues else ""))
        if self.budget is not None and self.budget.left() < 0:
            self.logger.warning(f"time budget: the run took {self.budget.elapsed():.1f}s of its {self.budget.budget_s:g}s "
                                "(its first iteration or its end took longer than estimated)")
        return self.result


# ---- the flows --------------------------------------------------------------------------------

@flow(name="dmd2-iterations", persist_result=False, validate_parameters=False, log_prints=False)
def iterations(run_id: str, first: int, last: int) -> dict:
    """Iterations ``first``..``last`` of the run ``run_id`` (a window of the dmd2 flow run)."""
    driver = _DRIVERS[run_id]
    row: dict = {}
    for i in range(first, last + 1):
        row = driver.iteration(i)
        if i >= driver.final:  # the time budget made it the run's last
            break
    return {"first": first, "last": min(last, driver.final), "iteration_s": row.get("iteration_s")}


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
    time_budget_s: Optional[float] = None,
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
        time_budget_s: Seconds the run may take (a night's window): it stops early enough to checkpoint, evaluate and export where it stopped, and the next run on the same save goes on; unset or 0: none.
    """
    started = time_budget.clock()  # the time budget counts from here: the groups' start-up is part of it
    configure_environment()  # where a worker or serve starts the run: before Ray is imported
    logger = get_run_logger()
    args = resolve_args(recipe, overrides, num_iterations=num_iterations, hf_checkpoint=hf_checkpoint,
                        save=save, prompts=prompts, seed=seed, time_budget_s=time_budget_s)
    from prefect.runtime import flow_run

    reruns = max(0, int(flow_run.run_count or 1) - 1)  # a crashed run set Scheduled again counts up
    try:
        if reruns > args.max_crash_reruns:
            raise RuntimeError(f"run crashed {reruns} times (max_crash_reruns "
                               f"{args.max_crash_reruns}): failing instead of running it again")
        if reruns:
            closed = runs.close_stale_windows(_run_id(), f"its process died; the run resumed in rerun {reruns}")
            logger.warning(f"rerun {reruns} of {args.max_crash_reruns} after a crash: resuming from the latest pointer"
                           + (f" (windows closed as Crashed: {', '.join(closed)})" if closed else ""))
        run = DistillRun(args, owner=_run_id())  # preflight (and the save URL's lease owner); no actor yet
    except Exception as exc:  # the night failed before it started: its row and its message say why
        runs.set_progress_labels(_run_id(), None, error=f"{type(exc).__name__}: {exc}")
        nights.record_night({"name": flow_run.name, "iteration": None, "final": args.num_iterations, "evals": []},
                            "failed", 0.0)
        raise
    args = run.args
    torch.set_num_threads(args.torch_threads)  # the driver's own work (digits metrics)
    name = flow_run.name or run_display_name({"recipe": recipe, "overrides": overrides})
    reached = None if reruns else campaign_complete(args)  # a crash rerun finishes what its attempt began
    if reached is not None:
        return _nothing_to_train(args, name, reached, time_budget.clock() - started, logger)
    run_id = registry.register(_run_id(), run)
    driver = None
    try:
        with _quiet_tasks():
            sources = config_sources(recipe, overrides, num_iterations=num_iterations, hf_checkpoint=hf_checkpoint,
                                     save=save, prompts=prompts, seed=seed, time_budget_s=time_budget_s)
            driver = Driver(run, run_id, args, name, logger, started=started, sources=sources)
            _DRIVERS[run_id] = driver
            result = driver.drive(reruns)
        outcome = "completed, continues" if result["continues"] else "completed"
        regressed = nights.record_night(driver.view, outcome + (f" ({reruns} rerun)" if reruns else ""), result["wall_s"])
        if regressed:  # where a team looks: the run's state message and the summary's first line
            result["regressed"] = regressed
            driver.view["status"] = f"{driver.view['status']}, regressed: {regressed}"
            with contextlib.suppress(Exception):  # the summary is for people; the run's outcome stands
                driver.artifacts.publish(driver.log.table())
        if not args.time_budget_s and not regressed:
            return result
        if result["continues"]:
            message = (f"continues: stopped at iteration {result['stopped_at']} of {result['num_iterations']} to fit "
                       f"its time budget of {args.time_budget_s:g}s; the next run on {args.save} goes on from it")
        elif args.time_budget_s:
            message = f"campaign complete: iteration {result['stopped_at']} of {result['num_iterations']}"
        else:
            message = f"completed at iteration {result['stopped_at']} of {result['num_iterations']}"
        return Completed(message=(f"regressed: {regressed}; " if regressed else "") + message, data=result)
    except BaseException as exc:
        if driver is not None and not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            at = getattr(driver, "current", driver.view["iteration"])  # the iteration it failed in
            runs.set_progress_labels(run_id, at, error=f"{type(exc).__name__}: {exc}")
            driver.view["status"] = f"failed: {runs.last_line(str(exc)) or type(exc).__name__}"
            with contextlib.suppress(Exception):  # the summary says so too (best effort: the error stands)
                driver.artifacts.publish(driver.log.table())
            nights.record_night(driver.view, "failed", time.perf_counter() - driver.t0)
        if driver is not None:
            with contextlib.suppress(Exception):  # what they were given stays theirs; the error stands
                driver.trackers.close(failed=True)
        raise
    finally:
        _DRIVERS.pop(run_id, None)
        registry.unregister(run_id)
        run.shutdown()


def campaign_complete(args: Args) -> Optional[int]:
    """The iteration the run's own save is at when it already reached ``num_iterations`` (its
    distillation is complete: a run on it has nothing to train), else None."""
    reached = ckpt.read_latest(args.save) if args.save else None
    return reached if reached is not None and reached >= args.num_iterations else None


def _nothing_to_train(args: Args, name: str, reached: int, wall_s: float, logger) -> State:
    """A run on a save whose distillation is complete: no actor starts, nothing is written to the
    save; it says so once (this log line, the state message, its nights row) and completes."""
    message = (f"campaign complete: {args.save} is at iteration {reached} of {args.num_iterations}; nothing to "
               "train (a new campaign is a new save)")
    logger.info(message)
    view = {"name": name, "iteration": reached, "start": reached, "final": args.num_iterations, "evals": []}
    nights.record_night(view, "campaign complete", wall_s)
    return Completed(message=message, data={
        "name": name, "start_iteration": reached, "final_iteration": reached, "stopped_at": reached,
        "num_iterations": args.num_iterations, "continues": False, "campaign_complete": True})


# ---- CLI --------------------------------------------------------------------------------------

def main(argv: Optional[list[str]] = None) -> int:
    from dmd2_core.cli import ArgParser, add_arg_flags, arg_overrides

    parser = ArgParser(prog="python -m flows.dmd2", description="Run the dmd2 Prefect flow: every flag of a run "
                       "as its own option (--save URL) or as --set KEY=VALUE (`python -m dmd2_core --help` lists them).")
    parser.add_argument("--recipe", default="tiny", help="Recipe name under deployments/recipes or a YAML path.")
    add_arg_flags(parser)
    ns = parser.parse_args(argv)
    from dmd2_core.run import reaper
    from flows.console import tracebacks_to_file

    console = tracebacks_to_file()

    def line(exc: BaseException) -> str:
        where = f" (traceback in {console.path})" if console is not None and console.used else ""
        return f"error: {exc}{where}"

    try:
        overrides = arg_overrides(ns)
        hand_over(resolve_args(ns.recipe, overrides))  # fail fast, before Prefect starts; the flow's run reuses it
        if argv is None:  # a process of its own: no orphans, one line on SIGINT/SIGTERM
            reaper.watch()
            reaper.raise_on_signals()
        summary = dmd2(recipe=ns.recipe, overrides=overrides or None)
    except (ArgsError, StoredFilesError) as exc:
        print(line(exc), file=sys.stderr)
        return 2
    except BaseException as exc:  # noqa: BLE001 - signals and runtime failures: one line each
        signum = reaper.interruption(exc)
        if signum is not None:
            print(f"error: interrupted by {signal.Signals(signum).name}; rerun the same command to resume "
                  "from the latest checkpoint", file=sys.stderr)
            return 128 + int(signum)
        if isinstance(exc, (NonFiniteError, LeaseLostError, StorageUnavailableError, TransientError)):
            print(line(exc), file=sys.stderr)
            return 1
        raise
    print(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
