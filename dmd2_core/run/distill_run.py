"""The driver of a distillation run: it owns the trainer groups and hands each group's outputs to
the next. Every phase is a method returning small metrics, so an orchestrator (the Prefect flow)
only sequences them. A phase that fails on Ray marks the run broken; the next phase call (a
retry) rebuilds the groups from the latest checkpoint and replays, deterministically, every phase
between that checkpoint and itself, so the run ends with the same weights as an uninterrupted one.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from statistics import fmean
from typing import Any, Callable, Optional

from dmd2_core import checkpoint
from dmd2_core.run import preflight_checks
from dmd2_core.run import lease, resume_check
from dmd2_core.args import Args
from dmd2_core.errors import NonFiniteError, RayWorkError, StoredFilesError
from dmd2_core.run.preflight import handed_over, preflight
from dmd2_core.run.checkpoint_commits import CheckpointCommits
from dmd2_core.run.schedule import Schedule

log = logging.getLogger("dmd2")

PHASES = ("rollout", "critic_train_and_score", "sleep_critic", "student_train", "sleep_actor")


class DistillRun:
    def __init__(self, args: Args, owner: str | None = None):
        # the run that owns the save URL's lease: the flow run's id (the lease adds a holder token of its own)
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        checked = handed_over(args)  # the CLI's preflight of these args, before Prefect started
        if checked is None:
            self.trainer_args = preflight(args, self.owner)
        else:
            lease.check_free(args.save, self.owner, args.lease_timeout_s)  # the owner is this run's
            self.trainer_args = checked
        self.args = self.trainer_args["actor"]
        self.lease: lease.Lease | None = None
        self.groups: dict[str, Any] = {}
        self.startup_s: dict[str, float] = {}  # the last start's phases (start)
        self.pg = None
        self.broken = False
        self.handoff: dict[str, list] = {}
        self.started: dict[str, tuple[int, Callable[[], dict]]] = {}  # phase -> (iteration, collector)
        # whether iteration i+1's rollout may start as soon as iteration i's last phase is
        # collected: the orchestrator sets it where nothing (an eval, a checkpoint) runs between
        self.rollout_ahead: Callable[[int], bool] = lambda iteration: False
        self.start_iteration = 0
        self.resumed_with: list[str] = []  # 'role key saved -> now': this run's optimizer settings, not the checkpoint's
        self.resumed_from: Optional[str] = None  # the URL whose checkpoint the groups loaded (None: a fresh start)
        self.done: tuple[int, int] = (0, len(PHASES))  # (iteration, phases of it done)
        self.schedule = Schedule.of(self.args)  # the orchestrator sets its own (the run's final iteration)
        self.checkpoint_commits = CheckpointCommits(self.args)

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> int:
        """Start or join Ray, create the groups, resume from the latest pointer. Returns the iteration
        the run resumes after (0 for a fresh start)."""
        from dmd2_core.run.groups import TrainerGroup, create_placement_group, init_ray

        clock = _Phases()
        init_ray(self.args, num_groups=len(self.trainer_args))
        preflight_checks.check_cluster_resources(self.args, len(self.trainer_args))  # not a placement-group timeout
        clock.done("ray")
        if self.lease is not None and self.lease.lost:  # a retry after a takeover: refused while the other lives
            self.lease.release()
            self.lease = None
        if self.lease is None:  # before any actor: a second run on the URL refuses here
            self.lease = lease.Lease.acquire(self.args.save, self.owner, self.args.lease_timeout_s)
        self.lease.ensure()
        clock.done("lease")
        self.pg = create_placement_group(self.args, num_groups=len(self.trainer_args))
        clock.done("placement group")
        share = 1.0 / len(self.trainer_args) if self.args.colocate else 1.0
        try:
            for index, (role, targs) in enumerate(self.trainer_args.items()):
                offset = 0 if self.args.colocate else index * self.args.num_devices
                self.groups[role] = TrainerGroup(targs, role, self.pg, share, bundle_offset=offset)
            joining = [call for group in self.groups.values() for call in group.begin_connect()]
            next(iter(self.groups.values())).get(joining)  # every group reads its shards at once
            clock.done("ranks up and models read")
            source = checkpoint.resume_url(self.args)
            resumed = checkpoint.read_latest(source)
            if resumed is not None:
                self.resumed_with = resume_check.resumed_with(self.trainer_args, source, resumed)
                if self.resumed_with:
                    log.warning("resume: this run's optimizer settings win over the checkpoint's: "
                                + ", ".join(self.resumed_with))
                for group in self.groups.values():
                    group.call("load", resumed, source)
        except Exception as exc:
            self._stop_groups()
            raise _as_ray_error(exc) from exc
        clock.done("resume")
        self.startup_s = clock.seconds
        self.start_iteration = resumed or 0
        self.resumed_from = source if resumed is not None else None
        self.done = (self.start_iteration, len(PHASES))
        self.handoff, self.started = {}, {}
        self.broken = False
        self.checkpoint_commits.resume(resumed if source == self.args.save else None)  # a save in flight is never tracked
        return self.start_iteration

    def __enter__(self) -> "DistillRun":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Kill the groups and release the save URL's lease (the run is over)."""
        self._stop_groups()
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def _stop_groups(self) -> None:
        from dmd2_core.run.groups import shutdown_placement_group

        for group in self.groups.values():
            group.kill()
        self.groups = {}
        shutdown_placement_group(self.pg)
        self.pg = None

    @property
    def pending_save(self) -> Optional[int]:
        """The iteration of an asynchronous save not yet tracked."""
        return self.checkpoint_commits.pending

    @property
    def has_critic(self) -> bool:
        return "critic" in self.trainer_args

    # ---- phase bookkeeping --------------------------------------------------------------------
    # A phase is started (its Ray calls submitted, outputs handed on as ObjectRefs) and then
    # collected (its metrics fetched). A phase starts, before collecting its own metrics, every
    # phase after it that Ray orders by itself (same actor, or an ObjectRef argument), and the last
    # phase of an iteration starts the next iteration where nothing runs between the two: the
    # trainers run back to back while the orchestrator (Prefect's task boundaries, the metrics
    # log) does its bookkeeping, instead of waiting for it. The order of work on each actor, the
    # metrics and so the weights are the same as one phase at a time.
    def _run_phase(self, iteration: int, phase: str) -> dict:
        index = PHASES.index(phase)
        if self.broken:
            self.recover(iteration, index)
        if self.done >= (iteration, index + 1):  # already done (replayed during a recovery)
            return {"skipped": True}
        try:
            pending = self._take_started(iteration, phase)
            self._start_ahead(iteration, self._follower(phase))
            metrics = pending() if pending is not None else {}
            if phase == self._last_phase() and self.rollout_ahead(iteration):
                self._start_ahead(iteration + 1, "rollout")
        except Exception as exc:
            self.broken = True
            self.started = {}
            raise _as_ray_error(exc) from exc
        self.done = (iteration, index + 1)
        return metrics

    def _take_started(self, iteration: int, phase: str) -> Optional[Callable[[], dict]]:
        """The phase's collector: started ahead by the phase before it, or started now."""
        ahead = self.started.pop(phase, None)
        if ahead is not None and ahead[0] == iteration:
            return ahead[1]
        return self._start(phase, iteration)

    def _start_ahead(self, iteration: int, phase: Optional[str]) -> None:
        """Start ``phase`` and, after it, every phase Ray can order behind it."""
        while phase is not None:
            if phase not in self.started:
                self.started[phase] = (iteration, self._start(phase, iteration))
            phase = self._follower(phase)

    def _follower(self, phase: str) -> Optional[str]:
        """The phase that may start before ``phase`` is collected (Ray orders the two)."""
        sleeping = self.args.sleep_after_train
        if phase == "rollout":
            return "critic_train_and_score" if self.has_critic else "student_train"
        if phase == "critic_train_and_score":
            return "sleep_critic" if sleeping else "student_train"
        if phase == "student_train" and sleeping:
            return "sleep_actor"
        # sleep_critic -> student_train: the two run on different actors and the student must wake
        # only once the critic has freed the device, so it starts after the sleep is collected
        return None

    def _last_phase(self) -> str:
        return "sleep_actor" if self.args.sleep_after_train else "student_train"

    def _start(self, phase: str, iteration: int) -> Optional[Callable[[], dict]]:
        """Submit the phase's Ray calls; returns what collects its metrics (None: nothing to run)."""
        if phase == "rollout":
            group = self.groups["actor"]
            refs = group.call_per_rank("rollout", [(iteration,)] * self.args.num_devices, num_returns=2)
            self.handoff["pairs"] = [p for p, _ in refs]
            return lambda: _merge(group.get([m for _, m in refs]))
        if phase == "critic_train_and_score":
            if not self.has_critic:
                return None
            group = self.groups["critic"]
            refs = group.train_async(iteration, self.handoff["pairs"])
            self.handoff["scores"] = [o for o, _ in refs]
            return lambda: _merge(group.get([m for _, m in refs]))
        if phase == "student_train":
            group = self.groups["actor"]
            refs = group.train_async(iteration, self.handoff.pop("pairs"), self.handoff.pop("scores", None))

            def collect() -> dict:
                metrics = _merge(group.get([m for _, m in refs]))
                metrics.update(self.checkpoint_commits.finish(self.groups, self.lease, wait=False))  # an asynchronous save written meanwhile
                return metrics
            return collect
        role = phase.removeprefix("sleep_")
        if not self.args.sleep_after_train or role not in self.groups:
            return None
        group = self.groups[role]
        refs = group.call_async("sleep")

        def collect_sleep() -> dict:
            return _merge([{f"{role}_sleep_s": o["sleep_s"], f"{role}_device_bytes_awake": o["device_bytes_awake"],
                            f"{role}_bytes_freed": o["bytes_freed"]} for o in group.get(refs)])
        return collect_sleep

    def recover(self, iteration: int, phase_index: int) -> None:
        """Rebuild the groups from the latest checkpoint and replay up to (iteration, phase)."""
        log.warning("recovering: rebuilding trainer groups from the latest checkpoint")
        self._stop_groups()
        start = self.start()
        for i in range(start + 1, iteration + 1):
            upto = phase_index if i == iteration else len(PHASES)
            for name in PHASES[:upto]:
                getattr(self, name)(i)

    # ---- phases -------------------------------------------------------------------------------
    def rollout(self, iteration: int) -> dict:
        return self._run_phase(iteration, "rollout")

    def critic_train_and_score(self, iteration: int) -> dict:
        return self._run_phase(iteration, "critic_train_and_score")

    def student_train(self, iteration: int) -> dict:
        return self._run_phase(iteration, "student_train")

    def sleep_critic(self, iteration: int) -> dict:
        return self._run_phase(iteration, "sleep_critic")

    def sleep_actor(self, iteration: int) -> dict:
        return self._run_phase(iteration, "sleep_actor")

    def iterate(self, iteration: int) -> dict:
        """All phases of one iteration (the plain sequence the flow spreads over tasks)."""
        metrics: dict = {"iteration": iteration}
        for name in PHASES:
            metrics.update(getattr(self, name)(iteration))
        metrics.pop("skipped", None)
        return metrics

    # ---- eval and checkpoints -----------------------------------------------------------------
    def sample(self, prompt_index: list[int], seed: int, num_steps: Optional[int] = None):
        """K-step student samples in pixel space (``num_steps``: one of its step counts, default
        its largest): every actor rank samples (a sharded forward is a collective), rank 0
        decodes and returns them."""
        return self._call_or_break(lambda: self.groups["actor"].call("sample", prompt_index, seed,
                                                                     num_steps=num_steps)[0])

    def eval_latents(self, prompt_index: list[int], seed: int, num_steps: Optional[int] = None):
        """The same samples as latents (the teacher evaluator's input)."""
        return self._call_or_break(lambda: self.groups["actor"].call("sample", prompt_index, seed, decode=False,
                                                                     num_steps=num_steps)[0])

    def decode(self, latents):
        return self._call_or_break(lambda: self.groups["actor"].call("decode", latents)[0])

    def drift_stats(self, latents) -> list[dict]:
        """Each sample's drift statistics, decoded and measured by the actor's rank 0."""
        return self._call_or_break(lambda: self.groups["actor"].call("drift_stats", latents)[0])

    def teacher_reference(self, prompt_index: list[int], seed: int, num_steps: int):
        """The frozen teacher's own samples (latents) from the noise of ``sample(prompt_index, seed)``."""
        return self._call_or_break(lambda: self._scorer().call("teacher_reference", prompt_index, seed, num_steps)[0])

    def teacher_features(self, latents, prompt_index: list[int], u: float, seed: int) -> dict:
        return self._call_or_break(lambda: self._scorer().call("teacher_features", latents, prompt_index, u, seed)[0])

    def real_features(self, rows: list[int], u: float, seed: int, index_offset: int) -> dict:
        """The teacher's features of real rows (``real_data``) under their own conditions."""
        return self._call_or_break(lambda: self._scorer().call("real_features", rows, u, seed, index_offset)[0])

    def _scorer(self):
        """The group that holds the frozen teacher: the critic's."""
        if "critic" not in self.groups:
            from dmd2_core.errors import ArgsError

            raise ArgsError("evaluator: 'teacher' needs the critic group (loss dmd2 with its critic), which holds the teacher")
        return self.groups["critic"]

    def checkpoint(self, iteration: int, wait: bool = False, export: Optional[bool] = None) -> dict:
        """Every trainer saves; the latest pointer moves once every role's save is durable (CheckpointCommits):
        at once for synchronous saves, for asynchronous ones when a later poll (``poll_saves``,
        after each student train), the next checkpoint or ``wait`` finds them written. ``export``
        (default: the schedule's, every ``export_interval``-th iteration and any save that waits)
        also writes the student as a diffusers pipeline. Returns the blocked time and, once
        tracked, the save's time."""
        if export is None:
            export = self.schedule.exports_at(iteration, wait)
        return self._call_or_break(lambda: self.checkpoint_commits.save(self.groups, self.lease, iteration, export, wait))

    def poll_saves(self) -> dict:
        """Move the latest pointer if the save in flight became durable (no wait); its metrics then."""
        return self._call_or_break(lambda: self.checkpoint_commits.finish(self.groups, self.lease, wait=False))

    def _call_or_break(self, fn):
        if self.broken:
            self.recover(*_next_position(self.done))
        try:
            return fn()
        except Exception as exc:
            self.broken = True
            raise _as_ray_error(exc) from exc

    def group_call(self, role: str, method: str, *a) -> list:
        return self._call_or_break(lambda: self.groups[role].call(method, *a))


def _next_position(done: tuple[int, int]) -> tuple[int, int]:
    iteration, phases = done
    return (iteration + 1, 0) if phases == len(PHASES) else (iteration, phases)


def _as_ray_error(exc: Exception) -> Exception:
    """Lost actors and timed-out calls become RayWorkError (worth a retry); an exception raised by
    trainer code comes back as itself."""
    import ray.exceptions

    if isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, TimeoutError)):
        return RayWorkError(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    if isinstance(exc, ray.exceptions.RayTaskError):
        if isinstance(exc.cause, (NonFiniteError, StoredFilesError)):  # one line, no remote traceback
            return exc.cause
        return exc.as_instanceof_cause()
    return exc


def _merge(per_rank: list[dict]) -> dict:
    """Per-rank metrics -> one dict, each number reduced over ranks as its meaning asks
    (``_reduction``)."""
    out: dict = {}
    for key in per_rank[0]:
        values = [m[key] for m in per_rank]
        out[key] = _reduction(key)(values) if all(isinstance(v, (int, float)) for v in values) else values[0]
    return out


def _reduction(key: str) -> Callable[[list], float]:
    """Counts of bad rows (``*_nonfinite``: each rank counts its own rows) add up; times (``*_s``:
    the group waits for its slowest rank), maxima (``*_max``, ``*_drift``) and skipped steps (every
    rank skips the same ones) take the largest; minima the smallest; the rest (losses, norms,
    means over equal local batches) the mean."""
    if key.endswith("_nonfinite"):
        return sum
    if key.endswith(("_s", "_max", "_drift", "_nonfinite_steps")):
        return max
    if key.endswith("_min"):
        return min
    return fmean


class _Phases:
    """Seconds of each phase of a start, in order (where a slow start spent its time)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = round(now - self._last, 1)
        self._last = now
