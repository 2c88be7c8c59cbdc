"""A trainer rank's outputs: its latest checkpoint shards and, when asked for, the student's export,
both possibly still written in the background, and their result once durable (the driver's
run/checkpoint_commits.py moves the run's latest pointer once every rank's are; checkpoint/save.py writes the shards)."""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from typing import Optional, Sequence

import torch

from dmd2_core import checkpoint
from dmd2_core.models import lora
from dmd2_core.export import pipeline as exporting
from dmd2_core.export.scheduler import StudentSteps
from dmd2_core.args import Args


class RankOutputs:
    """The latest save of one rank: ``start`` it, then ask ``status`` until (and after) it is
    durable. With ``args.async_save`` the checkpoint and the export are written in the
    background."""

    def __init__(self, args: Args, role: str, rank: int, shift: float, euler: bool = False):
        self.args, self.role, self.rank, self.shift = args, role, rank, shift
        self.steps = StudentSteps.of(args.dmd2_student_steps, euler)  # what the export's scheduler serves
        self.checkpoint: Optional[checkpoint.PendingSave] = None
        self.export: Optional[concurrent.futures.Future] = None

    def start(self, iteration: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              ema: Optional[Sequence[torch.Tensor]], extra: dict, process_group, export: bool) -> checkpoint.PendingSave:
        """Every rank writes its own shards (DCP); rank 0 the marker. ``export``: the student
        (and its EMA) is also gathered to rank 0 tensor by tensor and streamed into its files here,
        in the training thread (export/stream.py: rank 0 never holds it whole); the rest of the
        pipeline, the verification and the swap run in the background with ``async_save``. The
        caller waits for the previous save first (``status(wait=True)``)."""
        args = self.args
        self.checkpoint = checkpoint.save_trainer(args.save, self.role, iteration, model, optimizer, ema=ema, extra=extra,
                                                  process_group=process_group, asynchronous=args.async_save)
        self.export = None
        if export:
            run_write = functools.partial(_in_background, name=f"dmd2-export-{iteration}") if args.async_save else _done
            self.export = exporting.export_student(
                checkpoint.export_url(args.save, iteration), model, teacher_url=args.hf_checkpoint,
                shift=self.shift, num_steps=self.steps,
                export_dtype=getattr(torch, args.export_dtype or args.dtype), ema=ema,
                writer=self.rank == 0, iteration=iteration, run_write=run_write,
                lora_metadata=lora.adapter_metadata(args) if args.lora_rank else None, merged=args.export_merged,
                workflow=args.workflow, schedule_shifts=args.student_modality_shifts)
        return self.checkpoint

    def durable(self) -> bool:
        """Whether the latest save (and its export) finished writing, or failed."""
        return self.checkpoint is not None and self.checkpoint.done() and (self.export is None or self.export.done())

    def status(self, wait: bool = False) -> Optional[dict]:
        """The latest save: None when there is none; ``{'pending': iteration}`` while it (or its
        export) is written (``wait``: block until it is durable); once durable, its result
        (``url``, ``save_s``, ``bytes``, ``export_url``, ``export_s``), every time it is asked. A
        save or export that failed raises its error."""
        if self.checkpoint is None:
            return None
        if not wait and not self.durable():
            return {"pending": self.checkpoint.iteration}
        out = dict(self.checkpoint.result())
        if self.export is not None:
            done = self.export.result()
            out.update(export_url=done["url"], export_s=done["export_s"] + done["verify_s"], export_bytes=done["bytes"])
        return out


def _in_background(fn, name: str) -> concurrent.futures.Future:
    """``fn()`` on a daemon thread of its own (an actor killed meanwhile leaves nothing to join)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - raised by status
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def _done(fn) -> concurrent.futures.Future:
    """``fn()`` run now, as a finished future (its exception kept for whoever asks)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    try:
        future.set_result(fn())
    except Exception as exc:  # noqa: BLE001 - raised by status, like a background failure
        future.set_exception(exc)
    return future
