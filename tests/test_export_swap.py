"""An export is never deleted before its replacement is whole: written beside its URL and swapped
in once complete (dmd2_core/export/files.py), not written again once the tracker names its
iteration (run/save_tracker.py), and a finished run's rerun does not export its last iteration
again (flows/driver.py). Each test injects a failure on the first write of an export."""

from __future__ import annotations

import logging

import time

import pytest
import torch

from dmd2_core import checkpoint, storage
from dmd2_core.export import stream
from dmd2_core.export.files import relative_files
from dmd2_core.export.pipeline import export_student
from dmd2_core.models import load_model_dir
from dmd2_core.run.save_tracker import SaveTracker
from tests.helpers import in_process_trainers, iterate_in_process, tiny_args

SHIFT = 3.0  # the tiny teacher's


def file_hashes(url: str) -> dict[str, str]:
    return {rel: storage.sha256(storage.join(url, rel)) for rel in relative_files(url)}


def fail_first_write(monkeypatch) -> list:
    """The next export dies on its first file write (the transformer's weights, as they stream in)."""
    failed = []

    def dying(*a, **kw):
        failed.append(1)
        raise RuntimeError("killed while writing the export")

    monkeypatch.setattr(stream, "stream_tensors", dying)
    return failed


class InProcessGroup:
    """A trainer group of one rank, in this process (what SaveTracker calls)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def call(self, method, *a):
        return [getattr(self.trainer, method)(*a)]


class HeldLease:
    """A lease held throughout (the lease's own behaviour is tests/test_lease.py's)."""

    def ensure(self) -> None:
        pass

    def expires(self) -> float:
        return time.monotonic() + 3600.0


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_failed_export_leaves_the_export_at_its_url_whole(tiny_teacher, tmp_path, monkeypatch, request, where):
    root = request.getfixturevalue("s3_bucket") if where == "s3" else str(tmp_path)
    url = checkpoint.export_url(f"{root}/run", 3)
    model = load_model_dir(tiny_teacher).model
    for p in model.parameters():  # storages of their own, as a trainer's (a sleeping trainer frees them by resizing)
        p.data = p.data.clone()
    export_student(url, model, teacher_url=tiny_teacher, shift=SHIFT, num_steps=2, export_dtype=torch.float32,
                   iteration=3)
    before = file_hashes(url)
    assert "export.json" in before and any(rel.endswith(".safetensors") for rel in before)
    assert all(p.untyped_storage().resizable() for p in model.parameters())

    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    with monkeypatch.context() as patched:
        failed = fail_first_write(patched)
        with pytest.raises(RuntimeError, match="killed"):
            export_student(url, model, teacher_url=tiny_teacher, shift=SHIFT, num_steps=2,
                           export_dtype=torch.float32, iteration=3)
    assert failed and file_hashes(url) == before  # every file, unchanged

    export_student(url, model, teacher_url=tiny_teacher, shift=SHIFT, num_steps=2, export_dtype=torch.float32,
                   iteration=3)  # a whole replacement is swapped in
    after = file_hashes(url)
    assert set(after) == set(before) and after != before
    with storage.local_copy(url) as local:
        reloaded = load_model_dir(str(local)).model.state_dict()
    assert all(torch.equal(reloaded[k], v) for k, v in model.state_dict().items() if k in reloaded)
    assert storage.list_names(checkpoint.exports_root(f"{root}/run")) == ["iter_0000003"]  # no staging left


def test_a_retry_after_the_tracker_moved_keeps_the_tracked_export(tiny_teacher, tmp_path, monkeypatch):
    """A checkpoint task's retry saves the tracked iteration again: its export is the run's and is
    not rewritten (the first write would fail here), and the save still names it."""
    args = tiny_args(tiny_teacher, str(tmp_path / "run"), loss_type="flow_matching")
    trainers = in_process_trainers(args)
    groups = {"actor": InProcessGroup(trainers["actor"])}
    trainers["actor"].train(1, trainers["actor"].rollout(1)[0])
    tracker = SaveTracker(args)
    first = tracker.save(groups, HeldLease(), 1, export=True, wait=True)
    url = checkpoint.export_url(args.save, 1)
    assert first["export_url"] == url and checkpoint.read_tracker(args.save) == 1
    before = file_hashes(url)

    failed = fail_first_write(monkeypatch)
    tracker.resume(checkpoint.read_tracker(args.save))  # the retry rebuilt the groups from the tracked checkpoint
    retry = tracker.save(groups, HeldLease(), 1, export=True, wait=True)
    assert retry["export_url"] == url and retry["checkpoint_iteration"] == 1
    assert not failed and file_hashes(url) == before


def test_a_rerun_of_a_finished_fine_tune_does_not_save_or_export_its_end_again(tiny_teacher, tmp_path, monkeypatch):
    """A run whose ``load`` is another run's save, rerun once it finished: it resumed from its own
    save, so the driver counts the last checkpoint (and its export) as done; the flow does not save
    and export the final iteration again."""
    from flows import driver as driver_module
    from flows.dmd2 import Driver

    base = tiny_args(tiny_teacher, str(tmp_path / "base"))
    base_trainers = in_process_trainers(base)
    iterate_in_process(base_trainers, 1)
    SaveTracker(base).save({r: InProcessGroup(t) for r, t in base_trainers.items()}, HeldLease(), 1,
                           export=False, wait=True)

    args = tiny_args(tiny_teacher, str(tmp_path / "tune"), load=base.save, num_iterations=2)
    trainers = in_process_trainers(args)
    for role, trainer in trainers.items():
        trainer.load(1)
    iterate_in_process(trainers, 2)
    SaveTracker(args).save({r: InProcessGroup(t) for r, t in trainers.items()}, HeldLease(), 2,
                           export=True, wait=True)
    url = checkpoint.export_url(args.save, 2)

    class Rerun:  # what the driver reads of a DistillRun that resumed from where the run saved
        trainer_args = {"actor": args}
        resumed_with: list[str] = []  # the rerun changed no optimizer setting

        def start(self) -> int:
            self.resumed_from = checkpoint.resume_url(args)
            return checkpoint.read_tracker(self.resumed_from)

    monkeypatch.setattr(driver_module.artifacts, "RunArtifacts", lambda *a, **kw: None)
    rerun = Driver(Rerun(), "rerun", args, "dmd2-tune", logging.getLogger("test"))
    assert rerun.start == rerun.final == 2
    assert rerun.requested_ckpt == 2  # Driver.drive saves the final iteration only when it differs
    assert rerun.result["student"] == url and rerun.result["checkpoint"]["iteration"] == 2
