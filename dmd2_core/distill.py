"""The driver of a distillation run: it owns the trainer groups and hands each group's outputs to
the next. Every phase is a method returning small metrics, so an orchestrator (the Prefect flow)
only sequences them. A phase that fails on Ray marks the run broken; the next phase call (a
retry) rebuilds the groups from the latest checkpoint and replays, deterministically, every phase
between that checkpoint and itself, so the run ends with the same weights as an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from statistics import fmean
from typing import Any, Callable, Optional

from dmd2_core import checkpoint, checks, lease, memory
from dmd2_core.args import Args, ArgsError
from dmd2_core.finite import NonFiniteError
from dmd2_core.hooks import load_hook
from dmd2_core.models import FAMILIES, CheckpointError, describe_checkpoint
from dmd2_core.trainer_config import compute_trainer_args, compute_trainer_configs

log = logging.getLogger("dmd2")

PHASES = ("rollout", "critic_train_and_score", "sleep_critic", "student_train", "sleep_actor")


class RayWorkError(RuntimeError):
    """Ray work failed (an actor died, a call timed out); retrying recovers from the checkpoint."""


def preflight(args: Args, owner: str | None = None) -> dict[str, Args]:
    """Everything that can be checked before an actor starts: checkpoints, hooks, prompts and the
    resume point. Returns each trainer's args (shift resolved). Raises ArgsError / CheckpointError."""
    for key, what in (("hf_checkpoint", "the teacher's diffusers model directory"),
                      ("prompts", "a prompt-embedding set (safetensors) or 'digits'"),
                      ("save", "the run's storage URL")):
        if not getattr(args, key):
            raise ArgsError(f"{key} is not set: point it at {what}")
    checks.check_ray_address(args.ray_address)
    teacher = describe_checkpoint(args.hf_checkpoint)
    args = checks.check_family_args(args, teacher)
    if FAMILIES[teacher["family"]].is_video and not args.latent_shape:
        raise ArgsError(f"latent_shape: {args.hf_checkpoint} is a video model ({teacher['family']}); "
                        "set latent_shape to its latents' [C, F, H, W]")
    checks.check_latent_shape(args, teacher)
    if args.dmd2_shift is None:
        args = args.model_copy(update={"dmd2_shift": teacher["shift"]})
    if args.global_batch_size % args.num_devices:
        raise ArgsError(f"global_batch_size: {args.global_batch_size} is not divisible by num_devices {args.num_devices}")
    trainer_args = {}
    for cfg in compute_trainer_configs(args):
        targs = compute_trainer_args(args, cfg)
        describe_checkpoint(targs.hf_checkpoint)
        if targs.loss_type == "dmd2_critic":
            describe_checkpoint(targs.teacher_checkpoint or targs.hf_checkpoint)
        if targs.train_input_hook_path:
            flag = "critic_train_input_hook_path" if cfg.role == "critic" else "train_input_hook_path"
            load_hook(targs.train_input_hook_path, flag=flag)
        trainer_args[cfg.role] = targs
    if args.prompts != "digits":
        from dmd2_core import storage

        if not storage.exists(args.prompts):
            raise ArgsError(f"prompts: no prompt set at {args.prompts}{storage.nearest_sibling(args.prompts)}")
        checks.check_prompt_set(args.prompts, needs_negative=args.dmd2_guidance_scale != 1.0,
                                cond_keys=FAMILIES[teacher["family"]].cond_keys)
    from dmd2_core.media import eval_prompt_indices, prompt_texts

    eval_prompt_indices(args, len(prompt_texts(args.prompts)))
    if "critic" in trainer_args and args.gan_critic_weight:
        _check_gan(trainer_args["critic"])
    if memory.device_limit(args) is not None:
        memory.check(memory.plan(trainer_args))
    source = resume_url(args)
    resumed = checkpoint.validate_resume(source, list(trainer_args))
    if resumed is None and args.load and args.load != args.save:
        from dmd2_core import storage

        raise checkpoint.CheckpointLoadError(
            f"load: no checkpoint at {args.load} (no {checkpoint.TRACKER_NAME})"
            f"{storage.nearest_sibling(args.load)}")
    # a finished run rerun (its own save at num_iterations) completes at once; anything else that
    # starts at or past num_iterations would train nothing and report Completed
    if resumed is not None and (resumed > args.num_iterations or (resumed == args.num_iterations and source != args.save)):
        raise ArgsError(f"num_iterations: {args.num_iterations} does not go beyond iteration {resumed} of the checkpoint "
                        f"at {source}, where this run starts; iterations count on from it (set num_iterations to "
                        f"{resumed + max(args.num_iterations, 1)} for {max(args.num_iterations, 1)} more)")
    checks.check_local_devices(args, len(trainer_args))
    lease.check(args.save, owner, args.lease_timeout_s)  # one run per save URL
    checks.probe_write(args.save)  # last: nothing is written for input that fails earlier
    return trainer_args


def _check_gan(critic: Args) -> None:
    """The GAN head's feature block exists and the real set fits the model and the prompts."""
    from types import SimpleNamespace

    from dmd2_core import storage
    from dmd2_core.data import check_real_set

    info = describe_checkpoint(critic.hf_checkpoint)
    config = json.loads(storage.read_text(storage.join(info["transformer_url"], "config.json")))
    family = FAMILIES[info["family"]]
    blocks = int(config.get("num_layers", 0))
    if critic.gan_feature_block is not None and not -blocks <= critic.gan_feature_block < blocks:
        raise ArgsError(f"gan_feature_block: {critic.gan_feature_block} out of range for {blocks} blocks of {critic.hf_checkpoint}")
    shape = family.sample_shape(SimpleNamespace(config=SimpleNamespace(**config)), critic.latent_shape)
    try:
        check_real_set(critic.real_data, shape, critic.prompts, family.cond_keys)
    except ValueError as exc:
        raise ArgsError(str(exc)) from None


def resume_url(args: Args) -> str:
    """Where a (re)start resumes from: the run's own save once it has a checkpoint there (a retry
    or a rerun continues the run), else ``load`` (a fine-tune from another run)."""
    if args.save and checkpoint.read_tracker(args.save) is not None:
        return args.save
    return args.load_url


class DistillRun:
    def __init__(self, args: Args, owner: str | None = None):
        # the lease owner: the flow run's id, so that its retries take the lease over
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.trainer_args = preflight(args, self.owner)
        self.args = self.trainer_args["actor"]
        self.lease: lease.Lease | None = None
        self.groups: dict[str, Any] = {}
        self.pg = None
        self.broken = False
        self.handoff: dict[str, list] = {}
        self.started: dict[str, tuple[int, Callable[[], dict]]] = {}  # phase -> (iteration, collector)
        # whether iteration i+1's rollout may start as soon as iteration i's last phase is
        # collected: the orchestrator sets it where nothing (an eval, a checkpoint) runs between
        self.rollout_ahead: Callable[[int], bool] = lambda iteration: False
        self.start_iteration = 0
        self.done: tuple[int, int] = (0, len(PHASES))  # (iteration, phases of it done)
        self.pending_save: Optional[int] = None  # an asynchronous save not yet tracked
        self.tracked: Optional[dict] = None  # the latest tracked checkpoint: iteration, trainer dirs

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> int:
        """Start or join Ray, create the groups, resume from the tracker. Returns the iteration
        the run resumes after (0 for a fresh start)."""
        from dmd2_core.groups import TrainerGroup, create_placement_group, init_ray

        init_ray(self.args, num_groups=len(self.trainer_args))
        checks.check_cluster_resources(self.args, len(self.trainer_args))  # not a placement-group timeout
        if self.lease is None:  # before any actor: a second run on the URL refuses here
            self.lease = lease.Lease.acquire(self.args.save, self.owner, self.args.lease_timeout_s)
        self.lease.ensure()
        self.pg = create_placement_group(self.args, num_groups=len(self.trainer_args))
        share = 1.0 / len(self.trainer_args) if self.args.colocate else 1.0
        try:
            for index, (role, targs) in enumerate(self.trainer_args.items()):
                offset = 0 if self.args.colocate else index * self.args.num_devices
                self.groups[role] = TrainerGroup(targs, role, self.pg, share, bundle_offset=offset)
            for group in self.groups.values():
                group.connect()
            source = resume_url(self.args)
            resumed = checkpoint.read_tracker(source)
            if resumed is not None:
                for group in self.groups.values():
                    group.call("load", resumed, source)
        except Exception as exc:
            self._stop_groups()
            raise _as_ray_error(exc) from exc
        self.start_iteration = resumed or 0
        self.done = (self.start_iteration, len(PHASES))
        self.handoff, self.started = {}, {}
        self.broken = False
        self.pending_save = None  # a save in flight when the groups broke is never tracked
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
        from dmd2_core.groups import shutdown_placement_group

        for group in self.groups.values():
            group.kill()
        self.groups = {}
        shutdown_placement_group(self.pg)
        self.pg = None

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
                metrics.update(self._finish_saves(wait=False))  # an asynchronous save written meanwhile
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
    def sample(self, prompt_index: list[int], seed: int):
        """K-step student samples in pixel space: every actor rank samples (a sharded forward is
        a collective), rank 0 decodes and returns them."""
        return self._call_or_break(lambda: self.groups["actor"].call("sample", prompt_index, seed)[0])

    def checkpoint(self, iteration: int, wait: bool = False, export: Optional[bool] = None) -> dict:
        """Every trainer saves (each rank its own shards); the tracker moves only once every
        role's save is durable: at once for synchronous saves; for asynchronous ones when a
        later poll (``poll_saves``, after each student train), the next checkpoint or ``wait``
        finds them written. ``export`` (default: every ``export_interval``-th iteration, and
        at the end, ``wait``) also writes the student as a diffusers pipeline. Returns the blocked
        time and, once tracked, the save's time."""
        interval = self.args.export_interval
        if export is None:
            export = wait or not interval or iteration % interval == 0
        def run():
            start = time.perf_counter()
            self.lease.ensure()
            metrics = self._finish_saves(wait=True)  # a later save waits for the earlier one
            out = {role: group.call("save", iteration, export and role == "actor") for role, group in self.groups.items()}
            self.pending_save = iteration
            metrics["checkpoint_blocked_s"] = time.perf_counter() - start
            if all("save_s" in o for outs in out.values() for o in outs):
                metrics.update(self._track(iteration, out))
            elif wait:
                metrics.update(self._finish_saves(wait=True))
            return metrics
        return self._call_or_break(run)

    def poll_saves(self) -> dict:
        """Move the tracker if the save in flight became durable (no wait); its metrics then."""
        return self._call_or_break(lambda: self._finish_saves(wait=False))

    def _finish_saves(self, wait: bool) -> dict:
        if self.pending_save is None:
            return {}
        status = {role: group.call("save_status", wait) for role, group in self.groups.items()}
        if any(s is None or "pending" in s for outs in status.values() for s in outs):
            return {}
        return self._track(self.pending_save, status)

    def _track(self, iteration: int, done: dict[str, list[dict]]) -> dict:
        """Every role's save of ``iteration`` is durable: move the tracker, then apply retention."""
        self.lease.ensure()  # never move the tracker of a URL another run took over
        checkpoint.write_tracker(self.args.save, iteration, roles=list(done))
        self.pending_save = None
        self.tracked = {"iteration": iteration, "trainers": {role: outs[0]["url"] for role, outs in done.items()}}
        pruned = checkpoint.prune(self.args.save, list(done), self.args.keep_last_n)
        exported = {k: v for k, v in done.get("actor", [{}])[0].items() if k.startswith("export_")}
        if exported:
            self.tracked["export"] = exported["export_url"]
            checkpoint.prune_exports(checkpoint.exports_root(self.args.save), self.args.keep_exports,
                                     protect=[exported["export_url"]])
        return {"checkpoint": self.tracked, "checkpoint_iteration": iteration, **exported,
                "checkpoint_save_s": max(o["save_s"] for outs in done.values() for o in outs),
                "checkpoint_bytes_per_rank": max(o["bytes"] for outs in done.values() for o in outs),
                "checkpoints_pruned": len(pruned)}

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
        if isinstance(exc.cause, (NonFiniteError, CheckpointError)):  # one line, no remote traceback
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
