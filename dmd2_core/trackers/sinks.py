"""The run's trackers as one: which exist, the preflight check of the ``trackers`` flag, and
``Trackers``, which fans each iteration out to the sinks and keeps the replay rule.

The replay rule: a step is written to a tracker once. A rerun resumes from its checkpoint and
replays the iterations after it; those the trackers were already given (up to the last row the
metrics log held before the rerun, or the mark ``{save}/trackers.json`` kept from an earlier
rerun, whichever is later) are not written again, so every tracker's steps keep rising. Replays are
bitwise, so a skipped row only differs in its timings (``iteration_s``, ``wall_time``) from the
metrics log's, which keeps the replay's.

Trackers are best effort: the metrics log in the save is the run's record, a tracker a view of it.
A tracker that fails to open, write or close (its server down, a full disk, any error) is one
warning naming it; it stops for the rest of the run, which goes on. ``trackers.json`` keeps the
last step it holds (``behind``), and the next run gives it the rest: the metrics log's rows (their
media from the save) up to that run's start, the replay after it."""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
from typing import Optional

from dmd2_core import storage
from dmd2_core.args import Args
from dmd2_core.errors import ArgsError, nearest, one_line
from dmd2_core.save_layout import trackers_url
from dmd2_core.trackers.base import Sink, scalars_of
from dmd2_core.trackers.media import as_media, stored_media

log = logging.getLogger("dmd2")

# name -> (module of its sink, its class, the package it needs)
SINKS = {
    "tensorboard": ("dmd2_core.trackers.tensorboard_sink", "TensorBoardSink", "tensorboard"),
    "mlflow": ("dmd2_core.trackers.mlflow_sink", "MlflowSink", "mlflow"),
    "wandb": ("dmd2_core.trackers.wandb_sink", "WandbSink", "wandb"),
}


def check_trackers(args: Args) -> None:
    """Each requested tracker exists and its package is installed; else one line naming it."""
    for name in args.trackers:
        if name not in SINKS:
            raise ArgsError(f"trackers: unknown tracker '{name}'{nearest(name, SINKS)} (known: {', '.join(SINKS)})")
        package = SINKS[name][2]
        if importlib.util.find_spec(package) is None:
            raise ArgsError(f"trackers: {name} needs the '{package}' package, which is not installed: "
                            f"pip install 'dmd2[{name}]'")
    if len(set(args.trackers)) != len(args.trackers):
        raise ArgsError(f"trackers: {args.trackers} names a tracker twice")


def read_state(save_url: str) -> dict:
    url = trackers_url(save_url)
    return json.loads(storage.read_text(url)) if storage.exists(url) else {}


class Trackers:
    """The run's sinks. ``written``: the last step each was given (see the replay rule above),
    the stopped ones' too; ``behind``: the trackers that hold less than the mark (stopped, or
    being given what they missed), which ``trackers.json`` keeps for the next run."""

    def __init__(self, sinks: list[Sink], written: dict[str, int], save_url: Optional[str] = None):
        self.sinks, self.written, self.save_url = sinks, written, save_url
        self.stopped: set[str] = set()  # failed in this run: written no more
        self.mark, self.runs, self.behind = -1, {}, {}  # what trackers.json keeps

    @classmethod
    def open(cls, args: Args, run_name: str, config: dict, start: int, logged: int,
             rows: Optional[dict[int, dict]] = None) -> "Trackers":
        """The run's trackers at its (re)start from iteration ``start``; ``logged``: the last
        iteration the metrics log held before this (re)start (-1: none); ``rows``: the log's rows
        up to ``start``. A tracker run kept in the save is continued; a new one gets ``config``.
        A tracker that holds less than it was given (W&B after a kill, one that stopped in an
        earlier run) gets the rest again: the log's rows up to ``start`` (with their media from
        the save) now, the replay after it. One that fails to open is a warning (see above); if
        opening stops on anything else, the ones already open are closed."""
        if not args.trackers:
            return cls([], {})
        state = read_state(args.save)
        mark = max(int(state.get("written", -1)), logged)
        behind = {name: int(step) for name, step in (state.get("behind") or {}).items()}
        trackers = cls([], {}, args.save)
        trackers.runs, trackers.behind = dict(state.get("runs", {})), behind
        try:
            for name in args.trackers:
                kept = trackers.runs.get(name)
                # a tracker new to this save starts with the rerun's first row (its eval of the start)
                due = mark if kept else start - 1
                trackers.written[name] = behind.get(name, due)
                sink = trackers._open_one(name, args, run_name, config, kept, due, start, rows or {})
                if sink is not None:
                    trackers.sinks.append(sink)
            trackers.mark = max([mark, *trackers.written.values()])
            trackers._save_state()
        except BaseException:
            trackers.close(failed=True)
            raise
        return trackers

    def _open_one(self, name: str, args: Args, run_name: str, config: dict, kept: Optional[dict], due: int,
                  start: int, rows: dict[int, dict]) -> Optional[Sink]:
        """One tracker opened and given its configuration; when it holds less than ``due`` (the
        step it should hold), the log's rows it missed up to ``start``. None (and a warning) when
        it fails."""
        module, cls_name, _ = SINKS[name]
        sink = None
        try:
            sink = getattr(importlib.import_module(module), cls_name)(args, run_name, kept, self.written[name])
            self.runs[name] = sink.state
            if not kept or sink.config_every_open or sink.new_run:
                sink.log_config(config)
            if sink.held is not None and sink.held < self.written[name]:
                self.written[name] = sink.held
            missed = self.written[name] < due
            for step in sorted(i for i in rows if missed and self.written[name] < i <= start):
                sink.write(step, scalars_of(rows[step]), as_media(stored_media(args.save, step)))
                self.written[name] = step
            return sink
        except Exception as exc:  # noqa: BLE001 - a tracker is a view of the metrics log; the run goes on
            self._stop(name, sink, "open", exc)
            return None

    def _stop(self, name: str, sink: Optional[Sink], doing: str, exc: Exception) -> None:
        """A tracker that failed: one warning naming it, closed as far as it still can be, and no
        more of this run."""
        log.warning(f"tracker {name} failed to {doing} ({one_line(exc)}); it stops for this run, and the next "
                    f"run gives it iterations {self.written[name] + 1} on")
        self.stopped.add(name)
        if sink is not None:
            self.sinks = [s for s in self.sinks if s is not sink]
            try:
                sink.close(failed=True)
            except Exception:  # noqa: BLE001 - already reported: it failed, and is left as it is
                pass

    def _save_state(self) -> None:
        """``trackers.json``: the tracker runs, the mark, and the last step of each tracker that
        stopped or holds less than the mark (a tracker this run leaves out keeps its own)."""
        self.behind = {**{name: step for name, step in self.behind.items() if name not in self.written},
                       **{name: step for name, step in self.written.items()
                          if name in self.stopped or step < self.mark}}
        storage.write_text(trackers_url(self.save_url), json.dumps(
            {"written": self.mark, "runs": self.runs, **({"behind": self.behind} if self.behind else {})}, indent=1))

    def write(self, step: int, row: dict, media: Optional[list[dict]] = None) -> None:
        """Iteration ``step``'s metrics row and its eval media (``run_eval``'s dicts) to every
        tracker that was not given this step yet."""
        due = [s for s in self.sinks if step > self.written[s.name]]
        if not due:
            return
        scalars, items = scalars_of(row), as_media(media) if media else []
        changed = False  # what trackers.json says of a tracker behind
        for sink in due:
            try:
                sink.write(step, scalars, items)
            except Exception as exc:  # noqa: BLE001 - see the module's docstring
                self._stop(sink.name, sink, f"write iteration {step}", exc)
                changed = True
                continue
            changed = changed or sink.name in self.behind
            self.written[sink.name] = step
        if changed:
            self._save_state()

    def close(self, failed: bool = False) -> None:
        """Each tracker run ended (a failure to is a warning: what it was given stays)."""
        for sink in list(self.sinks):
            try:
                sink.close(failed)
            except Exception as exc:  # noqa: BLE001 - see the module's docstring
                log.warning(f"tracker {sink.name} failed to close ({one_line(exc)})")
        self.sinks = []
