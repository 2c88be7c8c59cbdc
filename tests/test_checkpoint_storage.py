"""Model and trainer checkpoints through local paths and S3 (moto), the run tracker, and errors."""

from __future__ import annotations

import copy
import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dmd2_core import checkpoint as ckpt
from dmd2_core import storage
from dmd2_core.checkpoint import CheckpointLoadError
from dmd2_core.models import CheckpointError, describe_checkpoint, load_checkpoint, save_checkpoint
from dmd2_core.models.sd3 import SD3ImageFamily, tiny_digits_config

FAMILY = SD3ImageFamily()
SHIFT = 2.5


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path) -> str:
    """A storage root: a local directory, or a fresh bucket on the moto server."""
    if request.param == "local":
        return str(tmp_path / "store")
    return request.getfixturevalue("s3_bucket") + "/run"


def _model(seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    return FAMILY.build({**tiny_digits_config(), **overrides})


def _batch(seed: int = 1, n: int = 4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    cond = {"prompt_embeds": torch.randn(n, 5, 32, generator=g), "pooled_prompt_embeds": torch.randn(n, 32, generator=g)}
    sigma = torch.rand(n, generator=g)
    return x, sigma, cond


def _out(model, seed: int = 1) -> torch.Tensor:
    x, sigma, cond = _batch(seed)
    with torch.no_grad():
        return FAMILY.predict_velocity(model, x, sigma, cond)


def _optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.0, 0.999), weight_decay=0.01)


def _step(model, optimizer, seed: int) -> None:
    x, sigma, cond = _batch(seed)
    optimizer.zero_grad(set_to_none=True)
    loss = FAMILY.predict_velocity(model, x, sigma, cond).square().mean()
    loss.backward()
    optimizer.step()


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _assert_same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys() and len(sa["state"]) > 0
    for idx in sa["state"]:
        assert sa["state"][idx].keys() == sb["state"][idx].keys()
        for k, v in sa["state"][idx].items():
            assert torch.equal(v, sb["state"][idx][k]), (idx, k)


def _local_path(url: str) -> Path:
    return Path(storage.filesystem(url)[1])


# ---- model checkpoints ------------------------------------------------------------------------

def test_model_round_trip(root):
    model = _model()
    url = storage.join(root, "teacher")
    save_checkpoint(model, url, shift=SHIFT)

    info = describe_checkpoint(url)
    assert info["family"] == "SD3Transformer2DModel"
    assert info["shift"] == SHIFT
    assert info["transformer_url"] == storage.join(url, "transformer")
    assert info["vae_url"] is None

    loaded = load_checkpoint(url)
    assert loaded.shift == SHIFT and loaded.family.class_name == "SD3Transformer2DModel"
    _assert_same_state(model.state_dict(), loaded.model.state_dict())
    assert torch.equal(_out(model), _out(loaded.model))


def test_describe_checkpoint_errors(tmp_path, s3_bucket):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path))):
        describe_checkpoint(str(tmp_path))
    missing = s3_bucket + "/nothing/here"
    with pytest.raises(CheckpointError, match=re.escape(missing)):
        describe_checkpoint(missing)
    with pytest.raises(CheckpointError, match=re.escape("hf_checkpoint")):
        describe_checkpoint("")
    # a typo in the path: the nearest existing entry beside it is named, locally and on S3
    (tmp_path / "teacher").mkdir()
    with pytest.raises(CheckpointError, match=re.escape(f"did you mean '{tmp_path}/teacher'?")):
        describe_checkpoint(str(tmp_path / "teachr"))
    storage.write_text(s3_bucket + "/models/teacher/config.json", "{}")
    with pytest.raises(CheckpointError, match=re.escape(f"did you mean '{s3_bucket}/models/teacher'?")):
        describe_checkpoint(s3_bucket + "/models/teacher2")


def test_child_process_inherits_s3_endpoint(s3_bucket):
    """Ray workers are child processes: the AWS_* environment alone must reach the same store."""
    url = s3_bucket + "/hello.txt"
    storage.write_text(url, "from the parent")
    code = f"from dmd2_core import storage; print(storage.read_text({url!r}))"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "from the parent"


# ---- trainer checkpoints ----------------------------------------------------------------------

def _save(root, role, iteration, model, opt, **kw) -> str:
    return ckpt.save_trainer(root, role, iteration, model, opt, **kw).result()["url"]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_trainer_round_trip_is_exact(root, asynchronous):
    model, ema = _model(0), _model(0)
    opt = _optimizer(model)
    for i in range(2):
        _step(model, opt, seed=10 + i)
    with torch.no_grad():
        for pe, p in zip(ema.parameters(), model.parameters()):
            pe.lerp_(p, 0.1)
    extra = {"iteration": 7, "student_steps": 2, "rng": torch.get_rng_state(), "note": "x"}
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = _optimizer(_model(0))
    saved_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # the optimizer as saved

    pending = ckpt.save_trainer(root, "student", 7, model, opt, ema=list(ema.parameters()), extra=extra,
                                asynchronous=asynchronous)
    if asynchronous:  # the state was staged: training on while it is written changes nothing saved
        _step(model, opt, seed=55)
    d = pending.result()["url"]
    assert d == ckpt.trainer_dir(root, "student", 7)
    assert d.endswith("trainers/student/iter_0000007")
    marker = json.loads(storage.read_text(storage.join(d, "complete.json")))
    assert marker["format"] == 3 and marker["has_ema"] and marker["world_size"] == 1
    assert {"trainer_state.pt", "dcp/.metadata", "dcp/__0_0.distcp"} <= set(marker["files"]) == set(marker["sha256"])
    assert all(marker["sha256"][rel] == storage.sha256(storage.join(d, rel)) for rel in marker["files"])

    model2, ema2 = _model(123), _model(456)  # different initial weights
    opt2 = _optimizer(model2)
    opt2.param_groups[0]["lr"] = 5.0  # the saved value must win
    got = ckpt.load_trainer(root, "student", 7, model2, opt2, ema=list(ema2.parameters()))

    assert got["iteration"] == 7 and got["student_steps"] == 2 and got["note"] == "x"
    assert torch.equal(got["rng"], extra["rng"])
    _assert_same_state(saved, model2.state_dict())
    _assert_same_state(ema.state_dict(), ema2.state_dict())
    assert opt2.param_groups[0]["lr"] == 1e-3
    _assert_same_optimizer(saved_opt, opt2)
    if not asynchronous:
        _step(model, opt, seed=99)
        _step(model2, opt2, seed=99)
        _assert_same_state(model.state_dict(), model2.state_dict())
        _assert_same_optimizer(opt, opt2)


def test_save_over_existing_iteration_replaces_it(tmp_path):
    root = str(tmp_path)
    first = _model(0)
    d = _save(root, "critic", 3, first, _optimizer(first), ema=list(_model(1).parameters()))
    stale = _local_path(d) / "dcp" / "stale.bin"
    stale.write_bytes(b"old")

    second = _model(5)
    opt = _optimizer(second)
    _step(second, opt, seed=3)
    _save(root, "critic", 3, second, opt, extra={"iteration": 3})
    assert not stale.exists()
    marker = json.loads((_local_path(d) / "complete.json").read_text())
    assert not marker["has_ema"]

    fresh = _model(9)
    fresh_opt = _optimizer(fresh)
    assert ckpt.load_trainer(root, "critic", 3, fresh, fresh_opt) == {"iteration": 3}
    _assert_same_state(second.state_dict(), fresh.state_dict())
    _assert_same_optimizer(opt, fresh_opt)
    with pytest.raises(CheckpointLoadError, match=re.escape("no ema")):
        ckpt.load_trainer(root, "critic", 3, _model(9), None, ema=list(_model(9).parameters()))


def test_extra_must_survive_weights_only_load(tmp_path):
    model = _model()
    with pytest.raises(ValueError, match=re.escape("extra")):
        ckpt.save_trainer(str(tmp_path), "student", 1, model, _optimizer(model), extra={"bad": object()})
    assert not (tmp_path / "trainers").exists()


@pytest.mark.parametrize("found, verdict", [(ckpt.FORMAT + 1, "newer"), (2, "older"), (None, "older")])
def test_a_checkpoint_in_another_format_fails_in_one_line(tmp_path, found, verdict):
    """Only the current format is read; formats 1 and 2 (whole weights, before DCP) never left
    the repository. A marker without a format is format 1."""
    root = str(tmp_path)
    d = _saved(root)
    marker_url = storage.join(d, "complete.json")
    marker = json.loads(storage.read_text(marker_url))
    marker.pop("format")
    storage.write_text(marker_url, json.dumps(marker if found is None else {**marker, "format": found}))
    before = {p: p.read_bytes() for p in Path(root).rglob("*") if p.is_file()}
    ckpt.write_tracker(root, 1)
    calls = (lambda: ckpt.validate_resume(root, ["student"]), lambda: ckpt.load_trainer(root, "student", 1, *_fresh()),
             lambda: ckpt.read_weights(root, "student", 1))
    for call in calls:
        with pytest.raises(CheckpointLoadError, match=re.escape(f"{d}: checkpoint format {found or 1} is {verdict}")) as info:
            call()
        assert "\n" not in str(info.value)
    assert {p: p.read_bytes() for p in Path(root).rglob("*") if p.is_file() and p.name != "latest_checkpointed_iteration.txt"} == \
        {p: b for p, b in before.items()}


# ---- retention --------------------------------------------------------------------------------

def test_retention_keeps_the_newest_and_never_the_tracked(tmp_path):
    root = str(tmp_path)
    model = _model(0)
    opt = _optimizer(model)
    for i in (1, 2, 3):
        _save(root, "student", i, model, opt)
        ckpt.write_tracker(root, i)
        ckpt.prune(root, ["student"], keep_last_n=2)
    assert sorted(ckpt.saved_iterations(root, "student")) == [2, 3]
    # a save of 4 that failed midway (no marker): 3 stays tracked, kept, and so is 2
    (Path(ckpt.trainer_dir(root, "student", 4)) / "dcp").mkdir(parents=True)
    assert ckpt.prune(root, ["student"], keep_last_n=1) == [ckpt.trainer_dir(root, "student", 2)]
    assert ckpt.saved_iterations(root, "student") == {3: True, 4: False}  # newer than the tracker: in flight
    # the tracker names an older checkpoint (a resume from it): nothing of it or newer goes
    _save(root, "student", 5, model, opt)
    ckpt.write_tracker(root, 3)
    assert ckpt.prune(root, ["student"], keep_last_n=1) == []
    ckpt.write_tracker(root, 5)
    assert ckpt.prune(root, ["student"], keep_last_n=1) == [ckpt.trainer_dir(root, "student", i) for i in (3, 4)]
    assert ckpt.prune(root, ["student"], keep_last_n=0) == []
    assert ckpt.saved_iterations(root, "student") == {5: True}


# ---- tracker and resume -----------------------------------------------------------------------

def test_tracker(root):
    assert ckpt.read_tracker(root) is None  # the save dir does not even exist yet
    ckpt.write_tracker(root, 4)
    assert ckpt.read_tracker(root) == 4
    ckpt.write_tracker(root, 12)
    assert ckpt.read_tracker(root) == 12
    assert ckpt.validate_resume(storage.join(root, "elsewhere"), ["student"]) is None

    storage.write_text(ckpt.tracker_url(root), "twelve\n")
    with pytest.raises(CheckpointLoadError, match=re.escape("latest_checkpointed_iteration.txt")):
        ckpt.read_tracker(root)
    with pytest.raises(CheckpointLoadError, match=re.escape("latest_checkpointed_iteration.txt")):
        ckpt.validate_resume(root, ["student"])


def _save_all(root, iteration, trainers) -> None:
    """The driver's rule: every trainer saves; only then does the tracker move."""
    for role, (model, opt) in trainers.items():
        _save(root, role, iteration, model, opt, extra={"iteration": iteration})
    ckpt.write_tracker(root, iteration, roles=list(trainers))


def test_crash_during_save_keeps_tracker(root, monkeypatch):
    trainers = {}
    for role, seed in (("student", 0), ("critic", 1)):
        model = _model(seed)
        trainers[role] = (model, _optimizer(model))
    _save_all(root, 1, trainers)
    assert ckpt.validate_resume(root, trainers) == 1

    real_write = storage.write_bytes

    def crashing_write(url, data):
        if "/trainers/critic/iter_0000002/" in url and url.endswith("complete.json"):
            raise OSError("simulated crash while saving the critic")
        real_write(url, data)

    monkeypatch.setattr(storage, "write_bytes", crashing_write)
    with pytest.raises(OSError, match=re.escape("simulated crash")):
        _save_all(root, 2, trainers)
    monkeypatch.setattr(storage, "write_bytes", real_write)

    assert ckpt.read_tracker(root) == 1
    assert ckpt.validate_resume(root, trainers) == 1
    critic_dir = ckpt.trainer_dir(root, "critic", 2)
    assert storage.exists(storage.join(critic_dir, "dcp", ".metadata"))  # written, all but the marker
    with pytest.raises(CheckpointLoadError, match=re.escape(f"{critic_dir}: incomplete")):
        ckpt.load_trainer(root, "critic", 2, _model(0), None)
    ckpt.load_trainer(root, "student", 2, _model(0), None)  # the student's save did finish

    with pytest.raises(CheckpointLoadError, match=re.escape(f"{critic_dir}/complete.json: missing")):
        ckpt.write_tracker(root, 2, roles=list(trainers))
    assert ckpt.read_tracker(root) == 1

    ckpt.write_tracker(root, 2)  # a tracker that runs ahead of the checkpoints it names
    with pytest.raises(CheckpointLoadError, match=re.escape(f"{critic_dir}: incomplete")):
        ckpt.validate_resume(root, trainers)
    with pytest.raises(CheckpointLoadError, match=re.escape(ckpt.trainer_dir(root, "ema_student", 2))):
        ckpt.validate_resume(root, ["student", "ema_student"])


# ---- corrupt and missing checkpoints ----------------------------------------------------------

def _saved(root, role="student", iteration=1):
    model = _model(0)
    opt = _optimizer(model)
    _step(model, opt, seed=4)
    return _save(root, role, iteration, model, opt)


def _weights_url(d: str) -> str:
    return storage.join(d, "dcp", "__0_0.distcp")


def _fresh():
    model = _model(3)
    return model, _optimizer(model)


def test_missing_checkpoint(root):
    d = ckpt.trainer_dir(root, "student", 5)
    with pytest.raises(CheckpointLoadError, match=re.escape(f"{d}: checkpoint directory does not exist")):
        ckpt.load_trainer(root, "student", 5, *_fresh())


@pytest.mark.parametrize("damage", ["truncate", "garble"])
@pytest.mark.parametrize("target", ["weights", "state"])
def test_corrupt_checkpoint(tmp_path, damage, target):
    root = str(tmp_path)
    d = _saved(root)
    url = _weights_url(d) if target == "weights" else storage.join(d, "trainer_state.pt")
    data = storage.read_bytes(url)
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:  # same size: the listing's sizes agree, the content does not
        data = b"\xff" * 64 + data[64:]
    storage.write_bytes(url, data)
    with pytest.raises(CheckpointLoadError, match=re.escape(url)) as info:
        ckpt.load_trainer(root, "student", 1, *_fresh())
    assert "corrupt" in str(info.value) and "\n" not in str(info.value)


def test_corrupt_checkpoint_on_s3(s3_bucket):
    root = s3_bucket + "/run"
    d = _saved(root)
    url = _weights_url(d)
    storage.write_bytes(url, storage.read_bytes(url)[:100])
    with pytest.raises(CheckpointLoadError, match=re.escape(f"{url}: corrupt")):
        ckpt.load_trainer(root, "student", 1, *_fresh())
    storage.remove(url)
    with pytest.raises(CheckpointLoadError, match=re.escape(f"{url}: missing")):
        ckpt.load_trainer(root, "student", 1, *_fresh())


def test_unreadable_marker_and_mismatched_model(tmp_path):
    root = str(tmp_path)
    d = _saved(root)
    with pytest.raises(CheckpointLoadError, match=re.escape(f"{d}/dcp: weights do not fit")):
        ckpt.load_trainer(root, "student", 1, _model(0, num_layers=2), None)
    other = _model(0, num_layers=2)
    with pytest.raises(CheckpointLoadError, match=re.escape("trainer_state.pt: optimizer state does not fit")):
        ckpt.load_trainer(root, "student", 1, _model(0), _optimizer(other))

    storage.write_text(storage.join(d, "complete.json"), "{not json")
    with pytest.raises(CheckpointLoadError, match=re.escape(f"{d}/complete.json: unreadable")):
        ckpt.load_trainer(root, "student", 1, *_fresh())
    ckpt.write_tracker(root, 1)
    with pytest.raises(CheckpointLoadError, match=re.escape(f"{d}/complete.json: unreadable")):
        ckpt.validate_resume(root, ["student"])


# ---- saving again, and a failure on one rank of a group -----------------------------------------

def test_saving_the_tracked_iteration_again_never_destroys_it(tmp_path, monkeypatch):
    """A retried checkpoint task, or a finished run rerun, saves the tracked iteration again: a
    crash while doing so must leave the tracked checkpoint whole (the save keeps it: replay is
    bitwise)."""
    root = str(tmp_path)
    model, opt = _fresh()
    _step(model, opt, seed=4)
    d = _save(root, "student", 3, model, opt, extra={"iteration": 3})
    ckpt.write_tracker(root, 3)
    before = {p: p.read_bytes() for p in Path(root).rglob("*") if p.is_file()}

    def crash(*args, **kwargs):
        raise OSError("simulated crash while saving")

    for name in ("write_bytes", "write_text", "remove"):
        monkeypatch.setattr(storage, name, crash)
    assert ckpt.save_trainer(root, "student", 3, model, opt, extra={"iteration": 3}).result()["url"] == d
    monkeypatch.undo()
    assert {p: p.read_bytes() for p in Path(root).rglob("*") if p.is_file()} == before
    assert ckpt.validate_resume(root, ["student"]) == 3
    again, again_opt = _model(9), _optimizer(_model(9))
    again_opt = _optimizer(again)
    assert ckpt.load_trainer(root, "student", 3, again, again_opt) == {"iteration": 3}
    _assert_same_state(model.state_dict(), again.state_dict())
    _assert_same_optimizer(opt, again_opt)


def _rank_main(rank: int, store: str, scenario: str, root: str, outcome: Path) -> None:
    """One rank of a 2-rank gloo group (a process of its own) running ``scenario``; reports its outcome."""
    import datetime
    import time

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    model, opt = _fresh()
    try:
        if scenario == "save" and rank == 0:  # rank 0 cannot write its part before the barrier
            storage.write_bytes = lambda url, data: (_ for _ in ()).throw(OSError("disk gone on rank 0"))
        if scenario == "load" and rank == 1:  # rank 1 cannot read the files it hashes
            storage.sha256 = lambda url: (_ for _ in ()).throw(storage.StorageUnavailableError(f"{url}: down"))
        if scenario == "save":
            ckpt.save_trainer(root, "student", 2, model, opt, process_group=dist.group.WORLD).result()
        else:
            ckpt.load_trainer(root, "student", 1, model, opt, process_group=dist.group.WORLD)
        outcome.write_text("ok")
    except Exception as exc:  # noqa: BLE001 - reported to the test
        outcome.write_text(ckpt.one_line(exc))
    other = outcome.with_name(f"rank{1 - rank}.txt")
    for _ in range(600):  # alive, as a trainer actor stays after its call failed
        if other.exists():
            break
        time.sleep(0.1)
    os._exit(0)  # no process-group teardown: the other rank may have left already


@pytest.mark.parametrize("scenario", ["save", "load"])
def test_a_failure_on_one_rank_reaches_every_rank_of_the_group(tmp_path, scenario):
    """Rank 0 fails before the save's first collective, or rank 1 while hashing at load: both
    ranks raise at once (none waits for the group's timeout), the other one naming the failure."""
    import multiprocessing
    import time

    root = str(tmp_path / "run")
    _saved(root)
    files = [tmp_path / f"rank{r}.txt" for r in (0, 1)]
    ctx = multiprocessing.get_context("spawn")  # not fork: Ray's and moto's threads may live in this process
    procs = [ctx.Process(target=_rank_main, args=(r, str(tmp_path / "store"), scenario, root, files[r])) for r in (0, 1)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 60
    try:
        while not all(f.exists() for f in files) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        for p in procs:
            p.kill()
            p.join()
    outcomes = {r: f.read_text() for r, f in enumerate(files) if f.exists()}
    assert len(outcomes) == 2, f"a rank hung in a collective: {outcomes}"
    failing, other = (0, 1) if scenario == "save" else (1, 0)
    assert outcomes[failing].startswith("OSError: disk gone" if scenario == "save" else "StorageUnavailableError")
    assert outcomes[other].startswith("CheckpointError") and f"rank {failing}" in outcomes[other], outcomes[other]
