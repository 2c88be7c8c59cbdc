"""Model and trainer checkpoints through local paths and S3 (moto), the tracker and retention."""

from __future__ import annotations

import copy
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dmd2_core import checkpoint as ckpt
from dmd2_core import storage
from dmd2_core.errors import CheckpointError, ModelDirError
from dmd2_core.models import describe_model_dir, load_model_dir, save_model_dir
from tests.checkpoint.helpers import (
    SHIFT, assert_same_optimizer, assert_same_state, fresh, local_path, optimizer_of, output, save, saved, tiny_model, train_step,
)


# ---- model checkpoints ------------------------------------------------------------------------

def test_model_round_trip(root):
    model = tiny_model()
    url = storage.join(root, "teacher")
    save_model_dir(model, url, shift=SHIFT)

    info = describe_model_dir(url)
    assert info["family"] == "SD3Transformer2DModel"
    assert info["shift"] == SHIFT
    assert info["transformer_url"] == storage.join(url, "transformer")
    assert info["vae_url"] is None

    loaded = load_model_dir(url)
    assert loaded.shift == SHIFT and loaded.family.class_name == "SD3Transformer2DModel"
    assert_same_state(model.state_dict(), loaded.model.state_dict())
    assert torch.equal(output(model), output(loaded.model))


def test_describe_checkpoint_errors(tmp_path, s3_bucket):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ModelDirError, match=re.escape(str(tmp_path))):
        describe_model_dir(str(tmp_path))
    missing = s3_bucket + "/nothing/here"
    with pytest.raises(ModelDirError, match=re.escape(missing)):
        describe_model_dir(missing)
    with pytest.raises(ModelDirError, match=re.escape("hf_checkpoint")):
        describe_model_dir("")
    # a typo in the path: the nearest existing entry beside it is named, locally and on S3
    (tmp_path / "teacher").mkdir()
    with pytest.raises(ModelDirError, match=re.escape(f"did you mean '{tmp_path}/teacher'?")):
        describe_model_dir(str(tmp_path / "teachr"))
    storage.write_text(s3_bucket + "/models/teacher/config.json", "{}")
    with pytest.raises(ModelDirError, match=re.escape(f"did you mean '{s3_bucket}/models/teacher'?")):
        describe_model_dir(s3_bucket + "/models/teacher2")


def test_child_process_inherits_s3_endpoint(s3_bucket):
    """Ray workers are child processes: the AWS_* environment alone must reach the same store."""
    url = s3_bucket + "/hello.txt"
    storage.write_text(url, "from the parent")
    code = f"from dmd2_core import storage; print(storage.read_text({url!r}))"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "from the parent"


# ---- trainer checkpoints ----------------------------------------------------------------------

@pytest.mark.parametrize("asynchronous", [False, True])
def test_trainer_round_trip_is_exact(root, asynchronous):
    model, ema = tiny_model(0), tiny_model(0)
    opt = optimizer_of(model)
    for i in range(2):
        train_step(model, opt, seed=10 + i)
    with torch.no_grad():
        for pe, p in zip(ema.parameters(), model.parameters()):
            pe.lerp_(p, 0.1)
    extra = {"iteration": 7, "student_steps": 2, "rng": torch.get_rng_state(), "note": "x"}
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = optimizer_of(tiny_model(0))
    saved_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # the optimizer as saved

    pending = ckpt.save_trainer(root, "student", 7, model, opt, ema=list(ema.parameters()), extra=extra,
                                asynchronous=asynchronous)
    if asynchronous:  # the state was staged: training on while it is written changes nothing saved
        train_step(model, opt, seed=55)
    d = pending.result()["url"]
    assert d == ckpt.trainer_dir(root, "student", 7)
    assert d.endswith("trainers/student/iter_0000007")
    marker = json.loads(storage.read_text(storage.join(d, "complete.json")))
    assert marker["format"] == 3 and marker["has_ema"] and marker["world_size"] == 1
    assert {"trainer_state.pt", "dcp/.metadata", "dcp/__0_0.distcp"} <= set(marker["files"]) == set(marker["sha256"])
    assert all(marker["sha256"][rel] == storage.sha256(storage.join(d, rel)) for rel in marker["files"])

    model2, ema2 = tiny_model(123), tiny_model(456)  # different initial weights
    opt2 = optimizer_of(model2)
    opt2.param_groups[0]["lr"] = 5.0  # the loading run's own setting stays (a rerun's lr wins)
    got = ckpt.load_trainer(root, "student", 7, model2, opt2, ema=list(ema2.parameters()))

    assert got["iteration"] == 7 and got["student_steps"] == 2 and got["note"] == "x"
    assert torch.equal(got["rng"], extra["rng"])
    assert_same_state(saved, model2.state_dict())
    assert_same_state(ema.state_dict(), ema2.state_dict())
    assert opt2.param_groups[0]["lr"] == 5.0
    opt2.param_groups[0]["lr"] = 1e-3  # the saved run's lr: from here on the same optimizer
    assert_same_optimizer(saved_opt, opt2)
    if not asynchronous:
        train_step(model, opt, seed=99)
        train_step(model2, opt2, seed=99)
        assert_same_state(model.state_dict(), model2.state_dict())
        assert_same_optimizer(opt, opt2)


def test_save_over_existing_iteration_replaces_it(tmp_path):
    root = str(tmp_path)
    first = tiny_model(0)
    d = save(root, "critic", 3, first, optimizer_of(first), ema=list(tiny_model(1).parameters()))
    stale = local_path(d) / "dcp" / "stale.bin"
    stale.write_bytes(b"old")

    second = tiny_model(5)
    opt = optimizer_of(second)
    train_step(second, opt, seed=3)
    save(root, "critic", 3, second, opt, extra={"iteration": 3})
    assert not stale.exists()
    marker = json.loads((local_path(d) / "complete.json").read_text())
    assert not marker["has_ema"]

    fresh = tiny_model(9)
    fresh_opt = optimizer_of(fresh)
    assert ckpt.load_trainer(root, "critic", 3, fresh, fresh_opt) == {"iteration": 3}
    assert_same_state(second.state_dict(), fresh.state_dict())
    assert_same_optimizer(opt, fresh_opt)
    with pytest.raises(CheckpointError, match=re.escape("no ema")):
        ckpt.load_trainer(root, "critic", 3, tiny_model(9), None, ema=list(tiny_model(9).parameters()))


def test_extra_must_survive_weights_only_load(tmp_path):
    model = tiny_model()
    with pytest.raises(ValueError, match=re.escape("extra")):
        ckpt.save_trainer(str(tmp_path), "student", 1, model, optimizer_of(model), extra={"bad": object()})
    assert not (tmp_path / "trainers").exists()


@pytest.mark.parametrize("found, verdict", [(ckpt.FORMAT + 1, "newer"), (2, "older"), (None, "older")])
def test_a_checkpoint_in_another_format_fails_in_one_line(tmp_path, found, verdict):
    """Only the current format is read; formats 1 and 2 (whole weights, before DCP) never left
    the repository. A marker without a format is format 1."""
    root = str(tmp_path)
    d = saved(root)
    marker_url = storage.join(d, "complete.json")
    marker = json.loads(storage.read_text(marker_url))
    marker.pop("format")
    storage.write_text(marker_url, json.dumps(marker if found is None else {**marker, "format": found}))
    before = {p: p.read_bytes() for p in Path(root).rglob("*") if p.is_file()}
    ckpt.write_latest(root, 1)
    calls = (lambda: ckpt.validate_resume(root, ["student"]), lambda: ckpt.load_trainer(root, "student", 1, *fresh()),
             lambda: ckpt.read_weights(root, "student", 1))
    for call in calls:
        with pytest.raises(CheckpointError, match=re.escape(f"{d}: checkpoint format {found or 1} is {verdict}")) as info:
            call()
        assert "\n" not in str(info.value)
    assert {p: p.read_bytes() for p in Path(root).rglob("*") if p.is_file() and p.name != "latest_checkpointed_iteration.txt"} == \
        {p: b for p, b in before.items()}


class _RunsAShellCommand:
    """A pickle payload: unpickling it runs ``touch <marker>``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_dcp_metadata_that_would_run_code_is_refused_in_one_line(tmp_path):
    """Whoever can write a checkpoint can rewrite its .metadata and the sha256 recorded beside
    it; the metadata is read admitting only what DCP writes, so the payload never runs."""
    import hashlib
    import pickle

    root = str(tmp_path / "run")
    d = saved(root)
    ran = tmp_path / "payload-ran"
    metadata = local_path(storage.join(d, "dcp", ".metadata"))
    metadata.write_bytes(pickle.dumps(_RunsAShellCommand(ran)))
    marker_url = storage.join(d, "complete.json")
    marker = json.loads(storage.read_text(marker_url))
    marker["files"]["dcp/.metadata"] = metadata.stat().st_size
    marker["sha256"]["dcp/.metadata"] = hashlib.sha256(metadata.read_bytes()).hexdigest()
    storage.write_text(marker_url, json.dumps(marker))
    ckpt.write_latest(root, 1)
    for call in (lambda: ckpt.load_trainer(root, "student", 1, *fresh()), lambda: ckpt.read_weights(root, "student", 1)):
        with pytest.raises(CheckpointError) as info:
            call()
        assert str(info.value).startswith(f"{storage.join(d, 'dcp', '.metadata')}: refused: it names ")
        assert "\n" not in str(info.value)
    assert not ran.exists()


def _rewrite_metadata(d: str, change) -> None:
    """Apply ``change(metadata, dcp_dir)`` to the checkpoint's DCP metadata and record the new
    file sizes and hashes in its marker, as whoever can write the save URL can."""
    import hashlib
    import pickle

    dcp_dir = local_path(storage.join(d, "dcp"))
    metadata = pickle.loads((dcp_dir / ".metadata").read_bytes())  # the test's own file: trusted here
    change(metadata, dcp_dir)
    (dcp_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    marker_url = storage.join(d, "complete.json")
    marker = json.loads(storage.read_text(marker_url))
    for path in dcp_dir.iterdir():
        marker["files"][f"dcp/{path.name}"] = path.stat().st_size
        marker["sha256"][f"dcp/{path.name}"] = hashlib.sha256(path.read_bytes()).hexdigest()
    storage.write_text(marker_url, json.dumps(marker))


def _every_reader(root: str):
    from dmd2_core.checkpoint.tensors import CheckpointTensors

    return {"load_trainer": lambda: ckpt.load_trainer(root, "student", 1, *fresh()),
            "read_weights (optim)": lambda: ckpt.read_weights(root, "student", 1, "optim"),
            "CheckpointTensors (export)": lambda: dict(CheckpointTensors(root, "student", 1, "optim"))}


def _refused_by_every_reader(root: str, d: str, match: str) -> None:
    ckpt.write_latest(root, 1)
    for name, call in _every_reader(root).items():
        with pytest.raises(CheckpointError, match=match) as info:
            call()
        assert str(info.value).startswith(f"{storage.join(d, 'dcp', '.metadata')}: refused: "), name
        assert "\n" not in str(info.value), name


def test_a_bytes_entry_holding_a_pickle_is_refused_without_running(tmp_path):
    """The review's attack: the optimizer's 0-d ``step`` declared as a DCP bytes entry pointing at
    a pickled payload has the shape ``()`` a tensor check compares, and DCP's default planner reads
    bytes entries with ``torch.load(weights_only=False)``. No reader of a checkpoint runs it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    root = str(tmp_path / "run")
    d = saved(root)
    ran = tmp_path / "payload-ran"

    def declare_step_as_bytes(metadata, dcp_dir):
        key = next(k for k, m in metadata.state_dict_metadata.items() if k.startswith("optim.") and k.endswith(".step"))
        payload = io.BytesIO()
        torch.save(_RunsAShellCommand(ran), payload)
        (dcp_dir / "payload.distcp").write_bytes(payload.getvalue())
        metadata.state_dict_metadata[key] = BytesStorageMetadata()
        metadata.storage_data = {i: v for i, v in metadata.storage_data.items() if i.fqn != key}
        metadata.storage_data[MetadataIndex(key)] = _StorageInfo("payload.distcp", 0, len(payload.getvalue()))

    _rewrite_metadata(d, declare_step_as_bytes)
    _refused_by_every_reader(root, d, "BytesStorageMetadata")
    assert not ran.exists()


@pytest.mark.parametrize("where", ["absolute", "climbing"])
def test_a_shard_stored_outside_the_checkpoint_is_refused(tmp_path, where):
    """A storage index naming a file outside the checkpoint (an absolute path, or one climbing
    out with ``..``) would read whatever file the path names as the trainer's weights."""
    root = str(tmp_path / "run")
    d = saved(root)
    elsewhere = tmp_path / "elsewhere.distcp"

    def point_outside(metadata, dcp_dir):
        elsewhere.write_bytes((dcp_dir / "__0_0.distcp").read_bytes())
        path = str(elsewhere) if where == "absolute" else os.path.relpath(elsewhere, dcp_dir)
        for info in metadata.storage_data.values():
            info.relative_path = path

    _rewrite_metadata(d, point_outside)
    _refused_by_every_reader(root, d, "outside the checkpoint")


@pytest.mark.parametrize("names", [("builtins", "eval"), ("os", "system"), ("torch", "load"),
                                   ("torch.serialization", "load"), ("pathlib", "PosixPath.write_text"),
                                   ("collections", "OrderedDict.__init__")])
def test_a_metadata_pickle_naming_a_callable_is_refused_without_running(tmp_path, names):
    """Any global beyond the records of a tensor checkpoint, a method of an admitted class
    included, is refused where the unpickler meets it: nothing is called."""
    from dmd2_core.checkpoint.metadata import load_metadata

    module, name = names
    ran = tmp_path / "ran"
    payload = b"\x80\x04\x95" + b"\x00" * 8 + b"\x8c" + bytes([len(module)]) + module.encode() + b"\x8c" + \
        bytes([len(name)]) + name.encode() + b"\x93" + b"\x8c" + bytes([len(f"touch {ran}")]) + f"touch {ran}".encode() + \
        b"\x85R."
    with pytest.raises(CheckpointError, match=f"refused: it names {re.escape(module)}.{re.escape(name)}, "):
        load_metadata(io.BytesIO(payload), "x/.metadata")
    assert not ran.exists()


def test_a_load_plan_reading_bytes_is_refused_by_the_reader(tmp_path):
    """The reader's own guard, behind the metadata check: a plan that would hand DCP's planner
    pickled bytes (``torch.load(weights_only=False)``) reads nothing."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    from dmd2_core.checkpoint.metadata import SafeReader

    d = saved(str(tmp_path / "run"))
    reader = SafeReader(storage.join(d, "dcp"))
    index = MetadataIndex("optim.x.step")
    item = ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=torch.Size([]), storage_index=index,
                    storage_offsets=torch.Size([]), lengths=torch.Size([]))
    with pytest.raises(CheckpointError, match="refused: 'optim.x.step' would be read as pickled bytes"):
        reader.read_data(LoadPlan([item]), planner=None)


def test_a_checkpoint_of_another_dtype_does_not_fit(tmp_path):
    """Loading casts silently: an fp32 checkpoint loaded into a bf16 model would lose its masters'
    precision without a word."""
    root = str(tmp_path / "run")
    d = saved(root)
    ckpt.write_latest(root, 1)
    model = tiny_model(3).to(torch.bfloat16)
    with pytest.raises(CheckpointError, match=re.escape(f"{storage.join(d, 'dcp')}: 'model.") + r".* is torch.float32 "
                       r"in the checkpoint, torch.bfloat16 here"):
        ckpt.load_trainer(root, "student", 1, model, None)


# ---- retention --------------------------------------------------------------------------------

def test_retention_keeps_the_newest_and_never_the_tracked(tmp_path):
    root = str(tmp_path)
    model = tiny_model(0)
    opt = optimizer_of(model)
    for i in (1, 2, 3):
        save(root, "student", i, model, opt)
        ckpt.write_latest(root, i)
        ckpt.prune(root, ["student"], keep_last_n=2)
    assert sorted(ckpt.saved_iterations(root, "student")) == [2, 3]
    # a save of 4 that failed midway (no marker): 3 stays tracked, kept, and so is 2
    (Path(ckpt.trainer_dir(root, "student", 4)) / "dcp").mkdir(parents=True)
    assert ckpt.prune(root, ["student"], keep_last_n=1) == [ckpt.trainer_dir(root, "student", 2)]
    assert ckpt.saved_iterations(root, "student") == {3: True, 4: False}  # newer than the tracker: in flight
    # the tracker names an older checkpoint (a resume from it): nothing of it or newer goes
    save(root, "student", 5, model, opt)
    ckpt.write_latest(root, 3)
    assert ckpt.prune(root, ["student"], keep_last_n=1) == []
    ckpt.write_latest(root, 5)
    assert ckpt.prune(root, ["student"], keep_last_n=1) == [ckpt.trainer_dir(root, "student", i) for i in (3, 4)]
    assert ckpt.prune(root, ["student"], keep_last_n=0) == []
    assert ckpt.saved_iterations(root, "student") == {5: True}


# ---- tracker and resume -----------------------------------------------------------------------

def test_tracker(root):
    assert ckpt.read_latest(root) is None  # the save dir does not even exist yet
    ckpt.write_latest(root, 4)
    assert ckpt.read_latest(root) == 4
    ckpt.write_latest(root, 12)
    assert ckpt.read_latest(root) == 12
    assert ckpt.validate_resume(storage.join(root, "elsewhere"), ["student"]) is None

    storage.write_text(ckpt.latest_url(root), "twelve\n")
    with pytest.raises(CheckpointError, match=re.escape("latest_checkpointed_iteration.txt")):
        ckpt.read_latest(root)
    with pytest.raises(CheckpointError, match=re.escape("latest_checkpointed_iteration.txt")):
        ckpt.validate_resume(root, ["student"])


def _save_all(root, iteration, trainers) -> None:
    """The driver's rule: every trainer saves; only then does the tracker move."""
    for role, (model, opt) in trainers.items():
        save(root, role, iteration, model, opt, extra={"iteration": iteration})
    ckpt.write_latest(root, iteration, roles=list(trainers))


def test_crash_during_save_keeps_tracker(root, monkeypatch):
    trainers = {}
    for role, seed in (("student", 0), ("critic", 1)):
        model = tiny_model(seed)
        trainers[role] = (model, optimizer_of(model))
    _save_all(root, 1, trainers)
    assert ckpt.validate_resume(root, trainers) == 1

    real_write = storage.write_bytes

    def crashing_write(url, data, **kw):
        if "/trainers/critic/iter_0000002/" in url and url.endswith("complete.json"):
            raise OSError("simulated crash while saving the critic")
        real_write(url, data, **kw)

    monkeypatch.setattr(storage, "write_bytes", crashing_write)
    with pytest.raises(OSError, match=re.escape("simulated crash")):
        _save_all(root, 2, trainers)
    monkeypatch.setattr(storage, "write_bytes", real_write)

    assert ckpt.read_latest(root) == 1
    assert ckpt.validate_resume(root, trainers) == 1
    critic_dir = ckpt.trainer_dir(root, "critic", 2)
    assert storage.exists(storage.join(critic_dir, "dcp", ".metadata"))  # written, all but the marker
    with pytest.raises(CheckpointError, match=re.escape(f"{critic_dir}: incomplete")):
        ckpt.load_trainer(root, "critic", 2, tiny_model(0), None)
    ckpt.load_trainer(root, "student", 2, tiny_model(0), None)  # the student's save did finish

    with pytest.raises(CheckpointError, match=re.escape(f"{critic_dir}/complete.json: missing")):
        ckpt.write_latest(root, 2, roles=list(trainers))
    assert ckpt.read_latest(root) == 1

    ckpt.write_latest(root, 2)  # a tracker that runs ahead of the checkpoints it names
    with pytest.raises(CheckpointError, match=re.escape(f"{critic_dir}: incomplete")):
        ckpt.validate_resume(root, trainers)
    with pytest.raises(CheckpointError, match=re.escape(ckpt.trainer_dir(root, "ema_student", 2))):
        ckpt.validate_resume(root, ["student", "ema_student"])
