"""A run's checkpoints from 'every trainer saved' to 'the latest pointer names them'. Each role's group
saves (each rank its own shards); the latest pointer moves only once every role's save is durable: at
once for synchronous saves, for an asynchronous one when a later poll, the next save or a wait
finds it written. Then retention prunes older checkpoints and exports."""

from __future__ import annotations

import json
import time
from typing import Any, Optional

from dmd2_core import checkpoint, storage
from dmd2_core.export import retention as export_retention
from dmd2_core.save_layout import EXPORT_MARKER_NAME, best_student_url, export_url
from dmd2_core.args import Args


class CheckpointCommits:
    def __init__(self, args: Args):
        self.args = args
        self.pending: Optional[int] = None  # the iteration of an asynchronous save not yet tracked
        self.tracked: Optional[dict] = None  # the latest tracked checkpoint: iteration, trainer dirs
        self.reused_export: Optional[str] = None  # the pending save's export, already complete: not rewritten
        self.tracked_iteration: Optional[int] = None  # the latest pointer's iteration as this process knows it

    def save(self, groups: dict[str, Any], lease, iteration: int, export: bool, wait: bool) -> dict:
        """Every group saves ``iteration`` (the actor also exports the student when ``export``).
        An iteration the latest pointer already names whose export is complete (a checkpoint-task retry
        after the latest pointer moved, a rerun of a finished run) is not exported again: that export is
        the run's. Returns the blocked time and, once tracked, the save's time."""
        start = time.perf_counter()
        lease.ensure()
        metrics = self.finish(groups, lease, wait=True)  # a later save waits for the earlier one
        reused = export_url(self.args.save, iteration) if export and self.exported(iteration) else None
        out = {role: group.call("save", iteration, export and not reused and role == "actor")
               for role, group in groups.items()}
        self.pending, self.reused_export = iteration, reused
        metrics["checkpoint_blocked_s"] = time.perf_counter() - start
        if all("save_s" in o for outs in out.values() for o in outs):
            metrics.update(self.track(lease, iteration, out))
        elif wait:
            metrics.update(self.finish(groups, lease, wait=True))
        return metrics

    def finish(self, groups: dict[str, Any], lease, wait: bool) -> dict:
        """Track the save in flight if every role's part of it is durable (``wait``: wait for it)."""
        if self.pending is None:
            return {}
        status = {role: group.call("save_status", wait) for role, group in groups.items()}
        if any(s is None or "pending" in s for outs in status.values() for s in outs):
            return {}
        return self.track(lease, self.pending, status)

    def resume(self, tracked: Optional[int]) -> None:
        """The groups were (re)built from the run's own checkpoint of ``tracked`` (None: from
        ``load`` or from scratch): the save in flight when they broke is never tracked."""
        self.pending = self.reused_export = None
        self.tracked_iteration = tracked

    def exported(self, iteration: int) -> bool:
        """Whether ``iteration``'s export is complete and belongs to a tracked checkpoint (one at or
        before the latest pointer's iteration), so that the weights it holds are the run's for good. A save
        past the latest pointer (every save of a run going forward) reads no storage here."""
        if self.tracked_iteration is None or iteration > self.tracked_iteration:
            return False
        return storage.exists(storage.join(export_url(self.args.save, iteration), EXPORT_MARKER_NAME))

    def track(self, lease, iteration: int, done: dict[str, list[dict]]) -> dict:
        """Every role's save of ``iteration`` is durable: move the latest pointer, then apply retention."""
        lease.ensure()  # never move the latest pointer of a URL another run took over, nor retry past the lease
        checkpoint.write_latest(self.args.save, iteration, roles=list(done), deadline=lease.expires())
        self.pending, self.tracked_iteration = None, iteration
        self.tracked = {"iteration": iteration, "trainers": {role: outs[0]["url"] for role, outs in done.items()}}
        pruned = checkpoint.prune(self.args.save, list(done), self.args.keep_last_n)
        exported = {k: v for k, v in done.get("actor", [{}])[0].items() if k.startswith("export_")}
        if self.reused_export and not exported:
            exported = {"export_url": self.reused_export}
        self.reused_export = None
        if exported:
            self.tracked["export"] = exported["export_url"]
            export_retention.prune_exports(checkpoint.exports_root(self.args.save), self.args.keep_exports,
                                     protect=[exported["export_url"], *best_student_exports(self.args.save)])
        return {"checkpoint": self.tracked, "checkpoint_iteration": iteration, **exported,
                "checkpoint_save_s": max(o["save_s"] for outs in done.values() for o in outs),
                "checkpoint_bytes_per_rank": max(o["bytes"] for outs in done.values() for o in outs),
                "checkpoints_pruned": len(pruned)}


def read_best_student(save_url: str) -> Optional[dict]:
    """The run's best eval with its export (``best_student.json``: iteration, criterion, value,
    export_url), or None before it has one."""
    url = best_student_url(save_url)
    return json.loads(storage.read_text(url)) if storage.exists(url) else None


def write_best_student(save_url: str, record: dict) -> None:
    storage.write_text(best_student_url(save_url), json.dumps(record, indent=1))


def best_student_exports(save_url: str) -> list[str]:
    """The export of the run's best eval, which retention never deletes."""
    best = read_best_student(save_url) or {}
    return [best["export_url"]] if best.get("export_url") else []
