"""Broken trainer checkpoints (missing, truncated, garbled, unreadable marker) fail in one line
naming the file; saving again never destroys the tracked one; a failure on one rank of a group
reaches every rank."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dmd2_core import checkpoint as ckpt
from dmd2_core import storage
from dmd2_core.errors import CheckpointError, StorageUnavailableError, one_line
from tests.checkpoint.helpers import (
    assert_same_optimizer, assert_same_state, fresh, optimizer_of, save, saved, tiny_model, train_step, weights_url,
)
from tests.helpers import spawn_ranks


# ---- corrupt and missing checkpoints ----------------------------------------------------------

def test_missing_checkpoint(root):
    d = ckpt.trainer_dir(root, "student", 5)
    with pytest.raises(CheckpointError, match=re.escape(f"{d}: checkpoint directory does not exist")):
        ckpt.load_trainer(root, "student", 5, *fresh())


@pytest.mark.parametrize("damage", ["truncate", "garble"])
@pytest.mark.parametrize("target", ["weights", "state"])
def test_corrupt_checkpoint(tmp_path, damage, target):
    root = str(tmp_path)
    d = saved(root)
    url = weights_url(d) if target == "weights" else storage.join(d, "trainer_state.pt")
    data = storage.read_bytes(url)
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:  # same size: the listing's sizes agree, the content does not
        data = b"\xff" * 64 + data[64:]
    storage.write_bytes(url, data)
    with pytest.raises(CheckpointError, match=re.escape(url)) as info:
        ckpt.load_trainer(root, "student", 1, *fresh())
    assert "corrupt" in str(info.value) and "\n" not in str(info.value)


def test_corrupt_checkpoint_on_s3(s3_bucket):
    root = s3_bucket + "/run"
    d = saved(root)
    url = weights_url(d)
    storage.write_bytes(url, storage.read_bytes(url)[:100])
    with pytest.raises(CheckpointError, match=re.escape(f"{url}: corrupt")):
        ckpt.load_trainer(root, "student", 1, *fresh())
    storage.remove(url)
    with pytest.raises(CheckpointError, match=re.escape(f"{url}: missing")):
        ckpt.load_trainer(root, "student", 1, *fresh())


def test_unreadable_marker_and_mismatched_model(tmp_path):
    root = str(tmp_path)
    d = saved(root)
    with pytest.raises(CheckpointError, match=re.escape(f"{d}/dcp: weights do not fit")):
        ckpt.load_trainer(root, "student", 1, tiny_model(0, num_layers=2), None)
    other = tiny_model(0, num_layers=2)
    with pytest.raises(CheckpointError, match=re.escape("trainer_state.pt: optimizer state does not fit")):
        ckpt.load_trainer(root, "student", 1, tiny_model(0), optimizer_of(other))

    storage.write_text(storage.join(d, "complete.json"), "{not json")
    with pytest.raises(CheckpointError, match=re.escape(f"{d}/complete.json: unreadable")):
        ckpt.load_trainer(root, "student", 1, *fresh())
    ckpt.write_latest(root, 1)
    with pytest.raises(CheckpointError, match=re.escape(f"{d}/complete.json: unreadable")):
        ckpt.validate_resume(root, ["student"])


# ---- saving again, and a failure on one rank of a group -----------------------------------------

def test_saving_the_tracked_iteration_again_never_destroys_it(tmp_path, monkeypatch):
    """A retried checkpoint task, or a finished run rerun, saves the tracked iteration again: a
    crash while doing so must leave the tracked checkpoint whole (the save keeps it: replay is
    bitwise)."""
    root = str(tmp_path)
    model, opt = fresh()
    train_step(model, opt, seed=4)
    d = save(root, "student", 3, model, opt, extra={"iteration": 3})
    ckpt.write_latest(root, 3)
    before = {p: p.read_bytes() for p in Path(root).rglob("*") if p.is_file()}

    def crash(*args, **kwargs):
        raise OSError("simulated crash while saving")

    for name in ("write_bytes", "write_text", "remove"):
        monkeypatch.setattr(storage, name, crash)
    assert ckpt.save_trainer(root, "student", 3, model, opt, extra={"iteration": 3}).result()["url"] == d
    monkeypatch.undo()
    assert {p: p.read_bytes() for p in Path(root).rglob("*") if p.is_file()} == before
    assert ckpt.validate_resume(root, ["student"]) == 3
    again, again_opt = tiny_model(9), optimizer_of(tiny_model(9))
    again_opt = optimizer_of(again)
    assert ckpt.load_trainer(root, "student", 3, again, again_opt) == {"iteration": 3}
    assert_same_state(model.state_dict(), again.state_dict())
    assert_same_optimizer(opt, again_opt)


def test_a_storage_blip_inside_dcp_is_retried_not_called_a_bad_checkpoint(tmp_path, monkeypatch):
    """DCP wraps a rank's read error in its CheckpointException (a BaseException): a connection
    reset while reading the shards is retried and the load completes; a permanent error is
    named as a checkpoint that cannot be loaded."""
    from dmd2_core.checkpoint.metadata import SafeReader

    root = str(tmp_path / "run")
    saved(root)
    read_data, calls = SafeReader.read_data, []

    def blip_once(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionResetError("connection reset by peer")
        return read_data(self, *args, **kwargs)
    monkeypatch.setattr(SafeReader, "read_data", blip_once)
    monkeypatch.setattr(storage, "RETRY_FIRST_DELAY_S", 0.01)
    ckpt.load_trainer(root, "student", 1, *fresh())
    assert len(calls) == 2

    monkeypatch.setattr(SafeReader, "read_data", lambda self, *a, **k: (_ for _ in ()).throw(PermissionError("denied")))
    with pytest.raises(CheckpointError, match="PermissionError: denied"):
        ckpt.load_trainer(root, "student", 1, *fresh())


def _rank_main(rank: int, world: int, scenario: str, root: str) -> list[str]:
    """One rank of a 2-rank gloo group (a process of its own) running ``scenario``; returns its
    outcome of each load or save it tried."""
    import torch.distributed as dist

    def outcome(call) -> str:
        try:
            call()
            return "ok"
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return one_line(exc)

    def load():
        ckpt.load_trainer(root, "student", 1, *fresh(), process_group=dist.group.WORLD)
    if scenario == "save":
        if rank == 0:  # rank 0 cannot write its part before the barrier
            storage.write_bytes = lambda url, data: (_ for _ in ()).throw(OSError("disk gone on rank 0"))
        return [outcome(lambda: ckpt.save_trainer(root, "student", 2, *fresh(), process_group=dist.group.WORLD).result())]
    read_text, sha256, outcomes = storage.read_text, storage.sha256, []
    if rank == 0:  # rank 0 cannot read the checkpoint's marker
        storage.read_text = lambda url: (_ for _ in ()).throw(StorageUnavailableError(f"{url}: down"))
    outcomes.append(outcome(load))
    storage.read_text = read_text
    if rank == 1:  # rank 1 cannot read the files it hashes
        storage.sha256 = lambda url: (_ for _ in ()).throw(StorageUnavailableError(f"{url}: down"))
    outcomes.append(outcome(load))
    storage.sha256 = sha256
    return outcomes


@pytest.mark.multi_rank
@pytest.mark.parametrize("scenario", ["save", "load"])
def test_a_failure_on_one_rank_reaches_every_rank_of_the_group(tmp_path, scenario):
    """Rank 0 fails before the save's first collective; at load rank 0 cannot read the marker,
    then rank 1 cannot read the files it hashes: both ranks raise at once (none waits for the
    group's timeout), the other one naming the failure with the same class: a runtime failure
    stays one (Prefect retries it from the checkpoint whichever rank hit it), never a ValueError
    the CLI would call bad input."""
    root = str(tmp_path / "run")
    saved(root)
    # a rank left waiting in a collective fails the test after 60 s (RankFailure: still running)
    outcomes = spawn_ranks(2, _rank_main, scenario, root, timeout_s=60)
    if scenario == "save":
        assert outcomes[0][0].startswith("OSError: disk gone")
        assert outcomes[1][0].startswith("TransientError") and "rank 0" in outcomes[1][0], outcomes[1]
        return
    for attempt, failing in enumerate((0, 1)):
        assert outcomes[failing][attempt].startswith("StorageUnavailableError: ") and ": down" in outcomes[failing][attempt]
        other = outcomes[1 - failing][attempt]
        assert other.startswith("StorageUnavailableError") and f"rank {failing}" in other, (attempt, other)
