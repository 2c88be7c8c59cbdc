"""The run's trackers as one: which exist, the preflight check of the ``trackers`` flag, and
``Trackers``, which fans each iteration out to the sinks and keeps the replay rule.

The replay rule: a step is written to a tracker once. A rerun resumes from its checkpoint and
replays the iterations after it; those the trackers were already given (up to the last row the
metrics log held before the rerun, or the mark ``{save}/trackers.json`` kept from an earlier
rerun, whichever is later) are not written again, so every tracker's steps keep rising. Replays are
bitwise, so a skipped row only differs in its timings (``iteration_s``, ``wall_time``) from the
metrics log's, which keeps the replay's."""

from __future__ import annotations

import importlib
import importlib.util
import json
from typing import Optional

from dmd2_core import storage
from dmd2_core.args import Args, nearest
from dmd2_core.errors import ArgsError
from dmd2_core.save_layout import trackers_url
from dmd2_core.trackers.base import Sink, scalars_of
from dmd2_core.trackers.media import eval_media, stored_media

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
    """The run's sinks. ``written``: the last step each was given (see the replay rule above)."""

    def __init__(self, sinks: list[Sink], written: dict[str, int]):
        self.sinks, self.written = sinks, written

    @classmethod
    def open(cls, args: Args, run_name: str, config: dict, start: int, logged: int,
             rows: Optional[dict[int, dict]] = None) -> "Trackers":
        """The run's trackers at its (re)start from iteration ``start``; ``logged``: the last
        iteration the metrics log held before this (re)start (-1: none); ``rows``: the log's rows
        up to ``start``. A tracker run kept in the save is continued; a new one gets ``config``.
        A tracker that holds less than it was given (W&B after a kill) gets the rest again: the
        log's rows up to ``start`` (with their media from the save) now, the replay after it."""
        if not args.trackers:
            return cls([], {})
        state = read_state(args.save)
        runs, mark = state.get("runs", {}), max(int(state.get("written", -1)), logged)
        sinks, written = [], {}
        for name in args.trackers:
            module, cls_name, _ = SINKS[name]
            kept = runs.get(name)
            # a tracker new to this save starts with the rerun's first row (its eval of the start)
            written[name] = mark if kept else start - 1
            sink = getattr(importlib.import_module(module), cls_name)(args, run_name, kept, written[name])
            if not kept or sink.config_every_open:
                sink.log_config(config)
            if sink.held is not None and sink.held < written[name]:
                written[name] = sink.held
                for step in sorted(i for i in (rows or {}) if sink.held < i <= start):
                    sink.write(step, scalars_of(rows[step]), eval_media(stored_media(args.save, step)))
                    written[name] = step
            sinks.append(sink)
        trackers = cls(sinks, written)
        storage.write_text(trackers_url(args.save), json.dumps(
            {"written": max([mark, *written.values()]), "runs": {**runs, **{s.name: s.state for s in sinks}}}, indent=1))
        return trackers

    def write(self, step: int, row: dict, media: Optional[list[dict]] = None) -> None:
        """Iteration ``step``'s metrics row and its eval media (``run_eval``'s dicts) to every
        tracker that was not given this step yet."""
        due = [s for s in self.sinks if step > self.written[s.name]]
        if not due:
            return
        scalars, items = scalars_of(row), eval_media(media) if media else []
        for sink in due:
            sink.write(step, scalars, items)
            self.written[sink.name] = step

    def close(self, failed: bool = False) -> None:
        for sink in self.sinks:
            sink.close(failed)
        self.sinks = []
