"""An export is never deleted before its replacement is whole: written beside its URL and swapped
in once complete, a swap a kill interrupts finished by the next writer, an object store's export
uploaded once where nothing is at its URL, and a killed export's local staging swept
(dmd2_core/export/files.py); not written again once the tracker names its iteration
(run/checkpoint_commits.py), and a finished run's rerun does not export its last iteration again
(flows/driver.py)."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
import torch

from dmd2_core import checkpoint, storage
from dmd2_core.export import files, stream
from dmd2_core.export.files import LocalStaging, relative_files, swap_record_url
from dmd2_core.export.retention import latest_exports
from dmd2_core.export.pipeline import export_student
from dmd2_core.models import load_model_dir
from dmd2_core.run.checkpoint_commits import CheckpointCommits
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


def fail_before_the_swap(monkeypatch) -> list:
    """The next export dies inside its staged block: its transformers written (and uploaded), the
    other components copied, when it verifies what it wrote, before its marker and the swap."""
    failed = []

    def dying(*a, **kw):
        failed.append(1)
        raise RuntimeError("killed before the swap")

    monkeypatch.setattr(stream, "verify_streamed", dying)
    return failed


class Killed(BaseException):
    """A kill: no handler of the code under test runs."""


def student(tiny_teacher: str) -> torch.nn.Module:
    model = load_model_dir(tiny_teacher).model
    for p in model.parameters():  # storages of their own, as a trainer's (a sleeping trainer frees them by resizing)
        p.data = p.data.clone()
    return model


def export(url: str, model: torch.nn.Module, teacher: str) -> dict:
    return export_student(url, model, teacher_url=teacher, shift=SHIFT, num_steps=2, export_dtype=torch.float32,
                          iteration=3)


def moved(model: torch.nn.Module, by: float) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)
    return model


def assert_holds(url: str, model: torch.nn.Module) -> None:
    with storage.local_copy(url) as local:
        reloaded = load_model_dir(str(local)).model.state_dict()
    assert all(torch.equal(reloaded[k], v) for k, v in model.state_dict().items() if k in reloaded)


@pytest.fixture
def run_root(request, tmp_path):
    return lambda where: request.getfixturevalue("s3_bucket") if where == "s3" else str(tmp_path)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_failed_export_leaves_the_export_at_its_url_whole(tiny_teacher, run_root, monkeypatch, where):
    url = checkpoint.export_url(f"{run_root(where)}/run", 3)
    model = student(tiny_teacher)
    export(url, model, tiny_teacher)
    before = file_hashes(url)
    assert "export.json" in before and any(rel.endswith(".safetensors") for rel in before)
    assert all(p.untyped_storage().resizable() for p in model.parameters())

    moved(model, 0.5)
    with monkeypatch.context() as patched:
        failed = fail_before_the_swap(patched)
        with pytest.raises(RuntimeError, match="killed"):
            export(url, model, tiny_teacher)
    assert failed and file_hashes(url) == before  # every file, unchanged

    export(url, model, tiny_teacher)  # a whole replacement is swapped in
    after = file_hashes(url)
    assert set(after) == set(before) and after != before
    assert_holds(url, model)
    # no staging left, nor a swap record
    assert storage.list_names(checkpoint.exports_root(f"{run_root(where)}/run")) == ["iter_0000003"]


class InProcessGroup:
    """A trainer group of one rank, in this process (what CheckpointCommits calls)."""

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


def test_a_retry_after_the_tracker_moved_keeps_the_tracked_export(tiny_teacher, tmp_path, monkeypatch):
    """A checkpoint task's retry saves the tracked iteration again: its export is the run's and is
    not rewritten (the first write would fail here), and the save still names it."""
    args = tiny_args(tiny_teacher, str(tmp_path / "run"), loss_type="flow_matching")
    trainers = in_process_trainers(args)
    groups = {"actor": InProcessGroup(trainers["actor"])}
    trainers["actor"].train(1, trainers["actor"].rollout(1)[0])
    tracker = CheckpointCommits(args)
    first = tracker.save(groups, HeldLease(), 1, export=True, wait=True)
    url = checkpoint.export_url(args.save, 1)
    assert first["export_url"] == url and checkpoint.read_latest(args.save) == 1
    before = file_hashes(url)

    failed = fail_first_write(monkeypatch)
    tracker.resume(checkpoint.read_latest(args.save))  # the retry rebuilt the groups from the tracked checkpoint
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
    CheckpointCommits(base).save({r: InProcessGroup(t) for r, t in base_trainers.items()}, HeldLease(), 1,
                           export=False, wait=True)

    args = tiny_args(tiny_teacher, str(tmp_path / "tune"), load=base.save, num_iterations=2)
    trainers = in_process_trainers(args)
    for role, trainer in trainers.items():
        trainer.load(1)
    iterate_in_process(trainers, 2)
    CheckpointCommits(args).save({r: InProcessGroup(t) for r, t in trainers.items()}, HeldLease(), 2,
                           export=True, wait=True)
    url = checkpoint.export_url(args.save, 2)

    class Rerun:  # what the driver reads of a DistillRun that resumed from where the run saved
        trainer_args = {"actor": args}
        resumed_with: list[str] = []  # the rerun changed no optimizer setting
        startup_s: dict[str, float] = {}

        def start(self) -> int:
            self.resumed_from = checkpoint.resume_url(args)
            return checkpoint.read_latest(self.resumed_from)

    monkeypatch.setattr(driver_module.artifacts, "RunArtifacts", lambda *a, **kw: None)
    rerun = Driver(Rerun(), "rerun", args, "dmd2-tune", logging.getLogger("test"))
    assert rerun.start == rerun.final == 2
    assert rerun.requested_ckpt == 2  # Driver.drive saves the final iteration only when it differs
    assert rerun.result["student"] == url and rerun.result["checkpoint"]["iteration"] == 2


# ---- object stores: one upload, swaps a kill interrupts, local staging ---------------------------

def s3_traffic(monkeypatch, under: str) -> dict:
    """Bytes uploaded to, and copied server-side into, objects under the s3:// URL ``under``
    (counted on the process's S3 filesystem, which fsspec caches: every helper of storage gets it)."""
    import s3fs

    fs, path = storage.filesystem(under)
    prefix = path.rstrip("/") + "/"
    traffic = {"uploaded": 0, "copied": 0}
    cp, put, pipe = s3fs.S3FileSystem._cp_file, fs.put_file, fs.pipe_file

    async def copied(self, path1, path2, **kw):
        if path2.startswith(prefix):
            traffic["copied"] += (await self._info(path1))["size"]
        return await cp(self, path1, path2, **kw)

    def uploaded(lpath, rpath, *a, **kw):
        if rpath.startswith(prefix):
            traffic["uploaded"] += os.path.getsize(lpath)
        return put(lpath, rpath, *a, **kw)

    def piped(path, data, *a, **kw):
        if path.startswith(prefix):
            traffic["uploaded"] += len(data)
        return pipe(path, data, *a, **kw)

    monkeypatch.setattr(s3fs.S3FileSystem, "_cp_file", copied)
    monkeypatch.setattr(fs, "put_file", uploaded)
    monkeypatch.setattr(fs, "pipe_file", piped)
    return traffic


def test_an_s3_export_where_nothing_is_is_uploaded_once(tiny_teacher, s3_bucket, monkeypatch):
    url = checkpoint.export_url(f"{s3_bucket}/run", 3)
    model = student(tiny_teacher)
    traffic = s3_traffic(monkeypatch, url)
    export(url, model, tiny_teacher)
    size = files.total_bytes(url)
    assert traffic == {"uploaded": size, "copied": 0}  # every byte once, straight to its place
    assert_holds(url, model)

    traffic.update(uploaded=0, copied=0)
    export(url, moved(model, 0.5), tiny_teacher)  # over an export: staged beside it, then copied in
    assert traffic["copied"] == files.total_bytes(url) and files.is_marked(url)
    assert_holds(url, model)


def test_a_killed_direct_write_is_rolled_back_and_the_retry_uploads_once(tiny_teacher, s3_bucket, monkeypatch):
    """What a kill leaves of an export written straight at an empty s3:// URL: some files, no
    marker, its swap record. Readers take none of it for an export; the next writer removes it
    and writes straight there again, its bytes uploaded once."""
    run = f"{s3_bucket}/run"
    url = checkpoint.export_url(run, 3)
    storage.write_text(swap_record_url(url), json.dumps({"staging": url}))
    storage.write_bytes(storage.join(url, "transformer", "diffusion_pytorch_model.safetensors"), b"cut off")
    assert latest_exports(run) == []
    model = student(tiny_teacher)
    traffic = s3_traffic(monkeypatch, url)
    export(url, model, tiny_teacher)
    assert traffic == {"uploaded": files.total_bytes(url), "copied": 0}
    assert_holds(url, model)
    assert storage.list_names(checkpoint.exports_root(run)) == ["iter_0000003"]


def kill_inside_the_swap(monkeypatch, url: str, where: str) -> dict:
    """The next swap into ``url`` is killed once the old export there is no longer whole: on an
    object store after the first file is copied in, locally once the old directory is renamed
    aside. Returns {'staging': the new export's file hashes}, filled when it happened."""
    seen: dict = {}

    def kill():
        seen["staging"] = file_hashes(json.loads(storage.read_text(swap_record_url(url)))["staging"])
        raise Killed()

    if where == "s3":
        copy = files.copy_object

        def dying(source, target):
            copy(source, target)
            kill()
        monkeypatch.setattr(files, "copy_object", dying)
    else:
        rename = os.rename

        def dying(source, target):
            rename(source, target)
            if files.EXPORT_STAGING_SEP + "replaced-" in str(target):  # the old export set aside
                kill()
        monkeypatch.setattr(files.os, "rename", dying)
    return seen


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_swap_a_kill_interrupts_is_finished_by_the_next_writer(tiny_teacher, run_root, monkeypatch, where):
    root = checkpoint.exports_root(f"{run_root(where)}/run")
    url = checkpoint.export_url(f"{run_root(where)}/run", 3)
    model = student(tiny_teacher)
    export(url, model, tiny_teacher)
    with monkeypatch.context() as patched:
        killed = kill_inside_the_swap(patched, url, where)
        with pytest.raises(Killed):
            export(url, moved(model, 0.5), tiny_teacher)
    # what a reader sees meanwhile: no complete export (never the half-overwritten one)
    assert killed and not files.is_marked(url) and latest_exports(f"{run_root(where)}/run") == []

    with monkeypatch.context() as patched:  # the next writer fails before its own swap
        failed = fail_before_the_swap(patched)
        with pytest.raises(RuntimeError, match="killed"):
            export(url, moved(student(tiny_teacher), 1.0), tiny_teacher)
    assert failed and file_hashes(url) == killed["staging"]  # the interrupted swap, completed
    assert_holds(url, model)
    assert storage.list_names(root) == ["iter_0000003"]  # no staging, no record, nothing set aside


def test_a_killed_exports_local_staging_is_swept_when_the_next_starts(tiny_teacher, s3_bucket, tmp_path,
                                                                      monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    pid = os.fork()
    if pid == 0:  # an export killed while it streamed: its staging stays, its lock goes with it
        held = LocalStaging()
        (held.path / "transformer").mkdir()
        (held.path / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"x" * 1000)
        os._exit(0)
    os.waitpid(pid, 0)
    killed = [p for p in tmp_path.iterdir() if p.is_dir()]
    live = LocalStaging()  # another export, still writing
    untold = {age: tmp_path / f"{files.LOCAL_STAGING_PREFIX}older-{age}" for age in ("old", "young")}  # no lock
    for age, path in untold.items():
        path.mkdir()
        stamp = time.time() - (files.UNLOCKED_STAGING_STALE_S + 60 if age == "old" else 60)
        os.utime(path, (stamp, stamp))
    try:
        export(checkpoint.export_url(f"{s3_bucket}/run", 3), student(tiny_teacher), tiny_teacher)
        left = sorted(p.name for p in tmp_path.iterdir())
        assert len(killed) == 1 and killed[0].name not in left and killed[0].name + ".lock" not in left
        assert live.path.is_dir() and untold["young"].is_dir() and not untold["old"].exists()
        assert left == sorted([live.path.name, live.lock.name, untold["young"].name])  # the export's own: gone
    finally:
        live.remove()
