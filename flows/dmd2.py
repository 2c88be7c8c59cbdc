"""The DMD2 distillation as a Prefect flow: every phase of every iteration is a task dispatching
to persistent Ray trainer groups held by a DistillRun.

    python -m flows.dmd2 --recipe tiny [--set key=value ...] [--num-iterations N] [--save URL]

Parameters are checked (recipe, overrides, checkpoints, hooks, resume point) before Ray starts;
a bad one fails the flow run with one line naming it. Artifacts: a metrics table, a progress bar,
eval media and checkpoint links; the metrics also go to ``{save}/metrics.jsonl`` and the media
under ``{save}/media/``.
"""

from __future__ import annotations

import os

for _key, _value in {
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
}.items():
    os.environ.setdefault(_key, _value)

import argparse  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

import torch  # noqa: E402
from prefect import flow, get_run_logger  # noqa: E402

from dmd2_core import checkpoint as ckpt  # noqa: E402
from dmd2_core import storage  # noqa: E402
from dmd2_core.args import Args, ArgsError, load_args, parse_set  # noqa: E402
from dmd2_core.distill import DistillRun  # noqa: E402
from dmd2_core.finite import NonFiniteError  # noqa: E402
from dmd2_core.lease import LeaseLostError  # noqa: E402
from dmd2_core.storage import StorageUnavailableError  # noqa: E402
from dmd2_core.models import CheckpointError  # noqa: E402
from tasks import artifacts, registry  # noqa: E402
from tasks.checkpoint import checkpoint  # noqa: E402
from tasks.eval import eval_media  # noqa: E402
from tasks.phases import critic_train_and_score, rollout, sleep_groups, student_train  # noqa: E402

METRICS_NAME = "metrics.jsonl"
QUALITY_KEYS = ("fd", "acc", "diversity")
LOGGED_KEYS = ("dmd2_loss", "critic_loss", "dmd2_grad_norm", "actor_grad_norm", "fd", "acc", "diversity")


# ---- parameters -------------------------------------------------------------------------------

def resolve_args(recipe: str, overrides: Optional[dict] = None, **flat: Any) -> Args:
    """The recipe, ``overrides`` on top, then the flat parameters that are not None."""
    merged = dict(overrides or {})
    merged.update({k: v for k, v in flat.items() if v is not None})
    return load_args(recipe, merged)


def _slug(recipe: str) -> str:
    from prefect.runtime import deployment

    name = deployment.name
    return artifacts.slugify(name if name else Path(str(recipe)).stem)


def _run_id() -> str:
    from prefect.runtime import flow_run

    return str(flow_run.id or uuid.uuid4())


# ---- the metrics log ({save}/metrics.jsonl) ----------------------------------------------------

class MetricsLog:
    """One JSON line per iteration, rewritten whole through storage (object stores cannot
    append). On resume, lines of iterations after the checkpoint are dropped: they are replayed."""

    def __init__(self, save_url: str, resume_after: int):
        self.url = storage.join(save_url, METRICS_NAME)
        self.rows: dict[int, dict] = {}
        if resume_after > 0 and storage.exists(self.url):
            for line in storage.read_text(self.url).splitlines():
                if line.strip():
                    row = json.loads(line)
                    if int(row.get("iteration", -1)) <= resume_after:
                        self.rows[int(row["iteration"])] = row

    def update(self, iteration: int, values: dict) -> dict:
        row = self.rows.setdefault(int(iteration), {"iteration": int(iteration)})
        row.update({k: v for k, v in values.items() if k != "skipped"})
        return row

    def write(self) -> None:
        text = "".join(json.dumps(self.rows[i], default=str) + "\n" for i in sorted(self.rows))
        storage.write_text(self.url, text)

    def table(self) -> list[dict]:
        return [self.rows[i] for i in sorted(self.rows)]


def _fmt(metrics: dict) -> str:
    return " ".join(f"{k}={metrics[k]:.4g}" for k in LOGGED_KEYS if isinstance(metrics.get(k), (int, float)))


def _cleanup_hook(flow_obj, flow_run, state) -> None:
    """On cancellation or crash in this process: kill the run's actors and placement group."""
    registry.shutdown_run(str(flow_run.id))


# ---- the flow ---------------------------------------------------------------------------------

@flow(name="dmd2", on_cancellation=[_cleanup_hook], on_crashed=[_cleanup_hook])
def dmd2(
    recipe: str = "tiny",
    overrides: Optional[dict[str, Any]] = None,
    num_iterations: Optional[int] = None,
    hf_checkpoint: Optional[str] = None,
    save: Optional[str] = None,
    prompts: Optional[str] = None,
    seed: Optional[int] = None,
) -> dict:
    """DMD2 distillation of ``recipe`` (a name under deployments/recipes or a YAML path) with
    ``overrides`` (flag name -> value); the flat parameters, when set, override both."""
    logger = get_run_logger()
    args = resolve_args(recipe, overrides, num_iterations=num_iterations, hf_checkpoint=hf_checkpoint,
                        save=save, prompts=prompts, seed=seed)
    run = DistillRun(args, owner=_run_id())  # preflight (and the save URL's lease owner); no actor yet
    args = run.args
    torch.set_num_threads(args.torch_threads)  # the driver's own work (digits metrics)
    keys = artifacts.artifact_keys(_slug(recipe))
    run_id = registry.register(_run_id(), run)
    try:
        return _drive(run, run_id, args, keys, logger)
    finally:
        registry.unregister(run_id)
        run.shutdown()


def _drive(run: DistillRun, run_id: str, args: Args, keys: dict, logger) -> dict:
    t0 = time.perf_counter()
    start = run.start()
    final = max(start, args.num_iterations)
    logger.info(f"dmd2: {final - start} iterations ({start + 1}..{final}) on {args.num_devices} device(s), "
                f"K={args.dmd2_student_steps}, batch {args.global_batch_size}, save {args.save}"
                + (f" (resumed after iteration {start})" if start else "")
                + f"; groups up in {time.perf_counter() - t0:.1f}s")
    log = MetricsLog(args.save, start)
    progress = artifacts.Progress(keys["progress"], total=final, done=start)
    summary: dict[str, Any] = {"run_id": run_id, "start_iteration": start, "final_iteration": final,
                               "metrics_url": log.url, "media_urls": [], "checkpoint": None}
    evaluating = args.eval_interval > 0
    last_eval = last_ckpt = None
    if start and args.load_url == args.save:
        last_ckpt = start

    def do_eval(i: int) -> dict:
        nonlocal last_eval
        out = eval_media(run_id, i, artifact_key=keys["media"])
        last_eval = i
        log.update(i, out["metrics"])
        summary["media_urls"] += [m["url"] for m in out["media"]]
        quality = {k: out["metrics"][k] for k in QUALITY_KEYS if k in out["metrics"]}
        if quality:
            logger.info(f"eval at iteration {i}: " + _fmt(quality))
        return quality

    def do_checkpoint(i: int) -> None:
        nonlocal last_ckpt
        out = checkpoint(run_id, i)
        last_ckpt = i
        log.update(i, {"checkpoint_s": out.get("checkpoint_s")})
        summary["checkpoint"] = {"iteration": i, "trainers": out.get("checkpoint", {}),
                                 "tracker": ckpt.tracker_url(args.save)}
        artifacts.publish_checkpoint(keys["checkpoint"], i, out, ckpt.tracker_url(args.save))
        logger.info(f"checkpoint at iteration {i}: {out.get('checkpoint', {})}")

    def publish() -> None:
        log.write()
        artifacts.publish_metrics(keys["metrics"], log.table(), log.url)

    if evaluating:
        summary["quality_before"] = do_eval(start) or None
        publish()
    for i in range(start + 1, final + 1):
        t = time.perf_counter()
        metrics: dict[str, Any] = {}
        metrics.update(rollout(run_id, i))
        metrics.update(critic_train_and_score(run_id, i))
        metrics.update(sleep_groups(run_id, i, "critic"))
        metrics.update(student_train(run_id, i))
        metrics.update(sleep_groups(run_id, i, "actor"))
        metrics["iteration_s"] = time.perf_counter() - t
        row = log.update(i, metrics)
        milestone = False
        if evaluating and (i % args.eval_interval == 0 or i == final):
            do_eval(i)
            milestone = True
        if (args.save_interval and i % args.save_interval == 0) or i == final:
            do_checkpoint(i)
            milestone = True
        log.write()
        if milestone:
            artifacts.publish_metrics(keys["metrics"], log.table(), log.url)
        progress.update(i)
        logger.info(f"iteration {i}/{final} {_fmt(row)} ({metrics['iteration_s']:.2f}s)")

    if evaluating and last_eval != final:
        do_eval(final)
    if last_ckpt != final:
        do_checkpoint(final)
    publish()
    progress.update(final)

    if summary["checkpoint"] is None and last_ckpt is not None:
        summary["checkpoint"] = {"iteration": last_ckpt, "tracker": ckpt.tracker_url(args.save)}
    final_row = dict(log.rows.get(final, {"iteration": final}))
    summary["final_metrics"] = final_row
    if evaluating:
        summary["quality_after"] = {k: final_row[k] for k in QUALITY_KEYS if k in final_row} or None
        if summary.get("quality_before") and summary.get("quality_after"):
            b, a = summary["quality_before"], summary["quality_after"]
            logger.info("quality before -> after: " + ", ".join(f"{k} {b[k]:.4g} -> {a[k]:.4g}" for k in a if k in b))
    summary["artifact_keys"] = keys
    summary["wall_s"] = round(time.perf_counter() - t0, 2)
    logger.info(f"dmd2 done: iteration {final} in {summary['wall_s']}s; metrics {log.url}")
    return summary


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
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BaseException as exc:  # noqa: BLE001 - signals and runtime failures: one line each
        signum = reaper.interruption(exc)
        if signum is not None:
            print(f"error: interrupted by {signal.Signals(signum).name}; rerun the same command to resume "
                  "from the latest checkpoint", file=sys.stderr)
            return 128 + int(signum)
        if isinstance(exc, (NonFiniteError, LeaseLostError, StorageUnavailableError)):
            print(f"error: {exc}", file=sys.stderr)
            return 1
        raise
    print(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
