"""Experiment trackers (dmd2_core/trackers): TensorBoard, MLflow and W&B (offline) get the run's
configuration once, every iteration's metrics and the eval media, and a rerun continues the same
tracker runs without writing a step twice. Everything is read back with each tracker's own reader:
TensorBoard's EventAccumulator, MlflowClient, and W&B's run records (its protobuf Record) from
the offline run files."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from dmd2_core.errors import NonFiniteError
from dmd2_core.trackers.tensorboard_sink import scalar_tag
from tests.helpers import FAST, REPO, flow_cli_refusal

ALL = ["tensorboard", "mlflow", "wandb"]


@pytest.fixture(autouse=True)
def _wandb_offline(monkeypatch):
    """W&B never reaches a server: offline, silent, no login."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


@pytest.fixture(scope="module")
def mlflow_tables(tmp_path_factory) -> Path:
    """An empty MLflow SQLite store, made once (MLflow builds a new store's tables in ~7 s): each
    test copies it to where the run's default store is, ``{save}/mlflow.db``."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


def with_mlflow_tables(save: Path, tables: Path) -> Path:
    save.mkdir(parents=True)
    shutil.copy(tables, save / "mlflow.db")
    return save


# ---- each tracker's own reader ----------------------------------------------------------------

def tensorboard_read(log_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import AUDIO, IMAGES, SCALARS, TENSORS, EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0, IMAGES: 0, AUDIO: 0, TENSORS: 0})
    acc.Reload()
    return acc


def tensorboard_curve(acc, key: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(key)]


def mlflow_run(save: Path, run_id: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{save.resolve() / 'mlflow.db'}")
    return client, client.get_run(run_id)


def mlflow_image_steps(client, run_id: str, key: str) -> list[int]:
    """The steps of MLflow's logged images of ``key`` (``images/{key}+step+{step}+timestamp+...png``,
    '/' spelt '~')."""
    prefix = key.replace("/", "~") + "+step+"
    names = [f.path.rpartition("/")[2] for f in client.list_artifacts(run_id, "images")]
    return sorted(int(n[len(prefix):].partition("+")[0]) for n in names
                  if n.startswith(prefix) and n.endswith(".png") and "compressed" not in n)


def wandb_records(run_file: Path) -> list:
    """The records of a W&B run file (``run-<id>.wandb``: a leveldb-style log of 32 KiB blocks
    holding crc-framed chunks), each parsed with W&B's own protobuf ``Record``. wandb 0.31 keeps
    its reader in its Go service (``wandb.sdk.internal.datastore`` is gone), so the framing is read
    here and nothing else."""
    from wandb.proto import wandb_internal_pb2

    data, records, pos, pending = run_file.read_bytes(), [], 7, b""
    assert data[:4] == b":W&B", run_file
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        chunk = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"{run_file}: bad chunk at {pos}"
        pos, pending = pos + 7 + length, pending + chunk
        if kind in (1, 4):  # FULL or LAST: a record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(save: Path, run_id: str) -> tuple[list[dict], list[dict], list[Path]]:
    """(history rows in the order ``wandb sync`` sends them: run directories oldest first, the
    run's config updates, its run directories) of the W&B run ``run_id`` under ``save/wandb``."""
    dirs = sorted((save / "wandb").glob(f"offline-run-*-{run_id}"))
    rows, configs = [], []
    for run_dir in dirs:
        for record in wandb_records(run_dir / f"run-{run_id}.wandb"):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
            elif kind == "run" and record.run.config.update:
                configs.append({item.key: json.loads(item.value_json) for item in record.run.config.update})
            elif kind == "config":
                configs.append({item.key: json.loads(item.value_json) for item in record.config.update})
    return rows, configs, dirs


# ---- bad input --------------------------------------------------------------------------------

def test_an_unknown_tracker_or_a_missing_package_is_refused_before_any_actor(tiny_teacher, tmp_path, capsys, monkeypatch):
    save = tmp_path / "run"
    base = ("--recipe", "tiny", "--hf-checkpoint", tiny_teacher, "--save", str(save))
    err = flow_cli_refusal(capsys, monkeypatch, *base, "--set", "trackers=[mlflow, tensorbord]")
    assert "trackers: unknown tracker 'tensorbord'; did you mean 'tensorboard'?" in err, err
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    err = flow_cli_refusal(capsys, monkeypatch, *base, "--trackers", "tensorboard", "wandb")
    assert "trackers: wandb needs the 'wandb' package" in err and "pip install 'dmd2[wandb]'" in err, err
    assert not save.exists()


# ---- the sinks on their own (no Ray) ----------------------------------------------------------

def _eval_media(save: Path, step: int) -> list[dict]:
    """What an eval of a sounding-video run hands the driver: per prompt a frame strip (linked to
    its MP4 with sound) and a spectrogram, written under the save by the eval's own code."""
    from dmd2_core.media.eval_files import av_media_of
    from dmd2_core.save_layout import media_stem

    g = torch.Generator().manual_seed(step)
    samples = {"video": torch.rand(1, 3, 5, 32, 32, generator=g) * 2 - 1,
               "audio": torch.rand(1, 2, 3200, generator=g) * 0.2 - 0.1, "sample_rate": 16000, "fps": 24}
    return av_media_of(samples, 0, f"{media_stem(str(save), step)}_p0", "a dog barking", 512 * 1024)


def first_attempt_then_killed(save: str) -> None:
    """Attempt 1 of the sinks alone: steps 0..4 (an eval's media at 0 and 4), then SIGKILL: no
    tracker is closed or flushed by it."""
    from dmd2_core.args import load_args
    from dmd2_core.trackers.sinks import Trackers

    args = load_args(None, {"save": save, "trackers": ALL, "run_name": "dmd2-sinks", "lr": 3e-5})
    first = Trackers.open(args, "attempt", args.model_dump(mode="json"), start=0, logged=-1)
    for i in range(5):
        first.write(i, {"iteration": i, "dmd2_loss": 1.0 / (i + 1), "iteration_s": 0.5, "note": "x", "skipped": False},
                    _eval_media(Path(save), i) if i in (0, 4) else None)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_rerun_continues_each_tracker_run_and_never_writes_a_step_twice(tmp_path, mlflow_tables):
    """Attempt 1 gives steps 0..4 (media at 0 and 4) and is killed; the metrics log held them all.
    The rerun resumes from iteration 2 and replays 2..4 (other timings) before 5 and 6: each
    tracker keeps one run, one value per step and the media of every eval. TensorBoard and MLflow
    held all five steps (their first values stay); W&B's killed process had written none of them
    (it writes its run file every 15 s), so W&B is given 0..2 from the metrics log (media from the
    save) and 3..4 by the replay."""
    from dmd2_core.args import load_args
    from dmd2_core.trackers.sinks import Trackers

    save = with_mlflow_tables(tmp_path / "run", mlflow_tables)
    killed = subprocess.run([sys.executable, "-c", f"from tests.test_trackers import first_attempt_then_killed as f; f({str(save)!r})"],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    state = json.loads((save / "trackers.json").read_text())
    args = load_args(None, {"save": str(save), "trackers": ALL, "run_name": "dmd2-sinks", "lr": 3e-5})
    kept = {i: {"iteration": i, "dmd2_loss": 1.0 / (i + 1), "iteration_s": 0.5} for i in range(3)}  # the log's, up to 2
    rerun = Trackers.open(args, "rerun", args.model_dump(mode="json"), start=2, logged=4, rows=kept)
    for i in range(2, 7):
        rerun.write(i, {"iteration": i, "dmd2_loss": 1.0 / (i + 1), "iteration_s": 9.0},
                    _eval_media(save, i) if i in (2, 4, 6) else None)
    rerun.close()
    assert json.loads((save / "trackers.json").read_text())["runs"] == state["runs"]  # the same tracker runs

    acc = tensorboard_read(save / "tensorboard" / "dmd2-sinks")
    assert tensorboard_curve(acc, "losses/dmd2_loss") == [(i, pytest.approx(1.0 / (i + 1))) for i in range(7)]
    assert tensorboard_curve(acc, "timing/iteration_s") == [(i, 0.5 if i < 5 else 9.0) for i in range(7)]
    assert not any(t.endswith(("note", "skipped")) for t in acc.Tags()["scalars"])
    assert [e.step for e in acc.Images("eval/p0_frames")] == [0, 4, 6]
    assert [e.step for e in acc.Images("eval/p0_spectrogram")] == [0, 4, 6]
    sound = acc.Audio("eval/p0_sound")
    assert [e.step for e in sound] == [0, 4, 6] and sound[0].sample_rate == 16000
    assert sound[0].encoded_audio_string[:4] == b"RIFF"
    assert [t.tensor_proto.string_val[0].decode().count('"lr": 3e-05') for t in acc.Tensors("config/text_summary")] == [1]

    client, run = mlflow_run(save, state["runs"]["mlflow"]["run_id"])
    assert run.info.status == "FINISHED" and run.data.params["lr"] == "3e-05"
    history = client.get_metric_history(run.info.run_id, "dmd2_loss")
    assert [m.step for m in history] == list(range(7))
    assert [m.value for m in client.get_metric_history(run.info.run_id, "iteration_s")] == [0.5] * 5 + [9.0] * 2
    assert len(client.search_runs([run.info.experiment_id])) == 1
    artifacts = {f.path for step in (0, 4, 6) for f in client.list_artifacts(run.info.run_id, f"eval/iter_{step:07d}")}
    assert {"eval/iter_0000004/p0.mp4", "eval/iter_0000004/p0_sound.wav", "eval/iter_0000006/p0_frames.png"} <= artifacts
    assert mlflow_image_steps(client, run.info.run_id, "eval/p0_frames") == [0, 4, 6]

    rows, configs, dirs = wandb_history(save, state["runs"]["wandb"]["run_id"])
    assert len(dirs) == 2  # one run, written by two processes: `wandb sync` appends the second
    assert [r["_step"] for r in rows] == list(range(7))
    assert [r["iteration_s"] for r in rows] == [0.5] * 3 + [9.0] * 4
    assert [r["_step"] for r in rows if "eval/p0/_type" in r] == [0, 4, 6]
    assert {r["eval/p0/_type"] for r in rows if "eval/p0/_type" in r} == {"video-file"}
    assert {r["eval/p0_sound/_type"] for r in rows if "eval/p0_sound/_type" in r} == {"audio-file"}
    assert {r["eval/p0_frames/_type"] for r in rows if "eval/p0_frames/_type" in r} == {"image-file"}
    assert [c["lr"] for c in configs if "lr" in c] == [3e-05]  # the killed attempt's never reached the file
    for r in rows:
        if "eval/p0_sound/path" in r:
            assert (dirs[r["_step"] > 4] / "files" / r["eval/p0_sound/path"]).is_file()


# ---- a run with all three, killed and rerun ---------------------------------------------------

def test_a_killed_and_rerun_run_shows_one_curve_per_metric_in_each_tracker(harness, tiny_teacher, tmp_path, monkeypatch,
                                                                          mlflow_tables):
    """A tiny flow run with all three trackers dies at iteration 4 (after its checkpoint at 2 and
    iteration 3's row); the same command again resumes at 2 and replays 3 and 4. Each tracker
    holds one run with one rising curve per metric and the media of every eval (0, 2, 4)."""
    from dmd2_core import report
    from dmd2_core.run.distill_run import DistillRun
    from flows.dmd2 import dmd2

    save = with_mlflow_tables(tmp_path / "run", mlflow_tables)
    overrides = {**FAST, "save_interval": 2, "eval_interval": 2, "sleep_after_train": False, "trackers": ALL}
    original = DistillRun.rollout

    def dies_at_4(self, iteration):
        if iteration == 4:
            raise NonFiniteError("killed at iteration 4 (the test)")
        return original(self, iteration)

    monkeypatch.setattr(DistillRun, "rollout", dies_at_4)
    state = dmd2(recipe="tiny", overrides=overrides, num_iterations=4, hf_checkpoint=tiny_teacher,
                 save=str(save), return_state=True)
    assert state.is_failed()
    monkeypatch.setattr(DistillRun, "rollout", original)
    state = dmd2(recipe="tiny", overrides=overrides, num_iterations=4, hf_checkpoint=tiny_teacher,
                 save=str(save), return_state=True)
    assert state.is_completed(), state.message
    assert state.result()["start_iteration"] == 2
    logged = {r["iteration"]: r for r in report.read_metrics(str(save))}
    runs = json.loads((save / "trackers.json").read_text())["runs"]

    acc = tensorboard_read(save / "tensorboard" / "dmd2-tiny")
    client, run = mlflow_run(save, runs["mlflow"]["run_id"])
    rows, configs, dirs = wandb_history(save, runs["wandb"]["run_id"])
    assert len(dirs) == 2 and run.info.status == "FINISHED"
    for key, want in (("dmd2_loss", [1, 2, 3, 4]), ("critic_loss", [1, 2, 3, 4]), ("fd", [0, 2, 4])):
        steps = sorted(i for i, r in logged.items() if isinstance(r.get(key), (int, float)))
        assert steps == want, (key, steps)
        assert [s for s, _ in tensorboard_curve(acc, scalar_tag(key, ("fd",)))] == steps, key
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == steps, key
        assert [r["_step"] for r in rows if key in r] == steps, key
        # a replay is bitwise: the first attempt's value (the tracker's) is the metrics log's
        assert [v for _, v in tensorboard_curve(acc, scalar_tag(key, ("fd",)))] == \
            pytest.approx([logged[s][key] for s in steps])
    assert [e.step for e in acc.Images("eval/samples")] == [0, 2, 4]
    assert [r["_step"] for r in rows if r.get("eval/samples/_type") == "image-file"] == [0, 2, 4]
    assert mlflow_image_steps(client, run.info.run_id, "eval/samples") == [0, 2, 4]
    assert [c["trackers"] for c in configs if "trackers" in c] == [ALL, ALL]  # W&B's config: set at each start
    assert run.data.params["trackers"] == str(ALL)  # MLflow's parameters: once


def test_an_s3_save_keeps_its_tracker_runs_in_the_bucket(s3_bucket, tmp_path, monkeypatch):
    """On an s3:// save, trackers.json goes through the storage layer into the bucket, and a rerun
    (another machine: another working directory) finds its TensorBoard run there and continues it."""
    from dmd2_core import storage
    from dmd2_core.args import load_args
    from dmd2_core.trackers.sinks import Trackers

    save = f"{s3_bucket}/runs/sinks"
    args = load_args(None, {"save": save, "trackers": ["tensorboard"], "run_name": "dmd2-s3"})
    monkeypatch.chdir(tmp_path)
    first = Trackers.open(args, "attempt", {}, start=0, logged=-1)
    for i in range(3):
        first.write(i, {"iteration": i, "dmd2_loss": float(i)})
    first.close()
    stored = json.loads(storage.read_text(f"{save}/trackers.json"))
    assert stored["runs"]["tensorboard"]["log_dir"] == str(tmp_path / "tensorboard" / "dmd2-s3")
    monkeypatch.chdir(tmp_path.parent)
    rerun = Trackers.open(args, "rerun", {}, start=1, logged=2)
    for i in range(1, 5):
        rerun.write(i, {"iteration": i, "dmd2_loss": float(i)})
    rerun.close()
    acc = tensorboard_read(tmp_path / "tensorboard" / "dmd2-s3")
    assert tensorboard_curve(acc, "losses/dmd2_loss") == [(i, float(i)) for i in range(5)]


def test_tensorboard_groups_its_scalars_and_names_its_run(tmp_path):
    """TensorBoard's scalars sit in sections by what they measure (losses, quality, grad norms,
    timing, the rest under train), and the run's log directory is named by the run, so
    ``tensorboard --logdir {save}/tensorboard`` lists the run by its name (not '.')."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    from dmd2_core.args import load_args
    from dmd2_core.trackers.sinks import Trackers

    save = tmp_path / "run"
    args = load_args(None, {"save": str(save), "trackers": ["tensorboard"], "run_name": "dmd2-tags", "prompts": "digits"})
    row = {"iteration": 0, "dmd2_loss": 1.0, "critic_loss": 2.0, "gan_d_loss_real": 0.5, "teacher_kid": 0.1,
           "teacher_kid@4": 0.2, "fd": 3.0, "drift_flicker": 0.3, "diversity_lpips": 0.4, "dmd2_grad_norm": 1.5,
           "actor_grad_norm": 2.5, "gan_dmd_grad_ratio": 0.7, "iteration_s": 9.0, "checkpoint_save_s": 1.0,
           "wall_time": 1.7e9, "actor_lr": 1e-5}
    trackers = Trackers.open(args, "tags", {}, start=0, logged=-1)
    trackers.write(0, row)
    trackers.close()
    runs = EventMultiplexer().AddRunsFromDirectory(str(save / "tensorboard"))
    runs.Reload()
    assert list(runs.Runs()) == ["dmd2-tags"]
    assert sorted(runs.Runs()["dmd2-tags"]["scalars"]) == sorted([
        "losses/dmd2_loss", "losses/critic_loss", "losses/gan_d_loss_real", "quality/teacher_kid",
        "quality/teacher_kid@4", "quality/fd", "quality/drift_flicker", "quality/diversity_lpips",
        "grad_norm/dmd2_grad_norm", "grad_norm/actor_grad_norm", "grad_norm/gan_dmd_grad_ratio",
        "timing/iteration_s", "timing/checkpoint_save_s", "timing/wall_time", "train/actor_lr"])


# ---- a tracker is best effort -----------------------------------------------------------------

class FlakySink:
    """A tracker that records what it is given (``GIVEN``: step -> times given, over every run of
    the test) and fails where the test says: ``fail_open``, ``fail_at`` (a step's write),
    ``fail_close``; ``CLOSED``: each close."""
    name = "flaky"
    config_every_open = False
    GIVEN: dict[int, int] = {}
    CONFIGS: list[dict] = []
    CLOSED: list[bool] = []
    fail_open: BaseException | None = None
    fail_at: int | None = None
    fail_close = False

    def __init__(self, args, run_name, state, written):
        if FlakySink.fail_open is not None:
            raise FlakySink.fail_open
        self.state, self.held, self.new_run = {"id": "flaky-run"}, None, False

    def log_config(self, config):
        FlakySink.CONFIGS.append(config)

    def write(self, step, scalars, media):
        if step == FlakySink.fail_at:
            raise ConnectionError(f"flaky server down at {step}\n(a second line of the error)")
        FlakySink.GIVEN[step] = FlakySink.GIVEN.get(step, 0) + 1

    def close(self, failed=False):
        FlakySink.CLOSED.append(failed)
        if FlakySink.fail_close:
            raise OSError("No space left on device")


@pytest.fixture
def flaky(monkeypatch):
    from dmd2_core.trackers import sinks

    monkeypatch.setitem(sinks.SINKS, "flaky", ("tests.test_trackers", "FlakySink", "pytest"))
    for key, value in dict(GIVEN={}, CONFIGS=[], CLOSED=[], fail_open=None, fail_at=None, fail_close=False).items():
        monkeypatch.setattr(FlakySink, key, value)
    return FlakySink


def tracker_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "dmd2" and r.levelname == "WARNING"]


def test_a_tracker_that_fails_mid_run_is_one_warning_and_the_next_run_gives_it_what_it_missed(tmp_path, flaky, caplog):
    """Run 1 gives steps 0..5; the flaky tracker's server goes down at step 3: one warning naming
    it, it gets nothing more, TensorBoard gets every step, nothing raises. The rerun resumes from
    4 (the log held 0..5): the flaky tracker gets 3 and 4 from the metrics log at once, then 5 and
    6 from the replay; TensorBoard only 6. Each step once in each; a close that fails is a warning."""
    from dmd2_core.args import load_args
    from dmd2_core.trackers.sinks import Trackers

    save = tmp_path / "run"
    args = load_args(None, {"save": str(save), "trackers": ["tensorboard", "flaky"], "run_name": "dmd2-flaky"})
    row = lambda i: {"iteration": i, "dmd2_loss": float(i)}  # noqa: E731
    flaky.fail_at = 3
    first = Trackers.open(args, "attempt", {"lr": 1}, start=0, logged=-1)
    for i in range(6):
        first.write(i, row(i))
    first.close()
    warnings = tracker_warnings(caplog)
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert warnings[0].startswith("tracker flaky failed to write iteration 3 (ConnectionError: flaky server down at 3)")
    assert "next run gives it iterations 3 on" in warnings[0]
    assert flaky.GIVEN == {0: 1, 1: 1, 2: 1} and flaky.CLOSED == [True]  # closed as failed when it stopped
    assert json.loads((save / "trackers.json").read_text())["behind"] == {"flaky": 2}
    without = load_args(None, {"save": str(save), "trackers": ["tensorboard"], "run_name": "dmd2-flaky"})
    Trackers.open(without, "without it", {"lr": 1}, start=4, logged=5).close()  # a run that leaves it out
    assert json.loads((save / "trackers.json").read_text())["behind"] == {"flaky": 2}

    caplog.clear()
    flaky.fail_at, flaky.fail_close = None, True
    rerun = Trackers.open(args, "rerun", {"lr": 1}, start=4, logged=5, rows={i: row(i) for i in range(5)})
    assert flaky.GIVEN == {i: 1 for i in range(5)}
    for i in range(4, 7):
        rerun.write(i, row(i))
    rerun.close()
    assert flaky.GIVEN == {i: 1 for i in range(7)} and flaky.CONFIGS == [{"lr": 1}]
    assert "behind" not in json.loads((save / "trackers.json").read_text())
    assert tracker_warnings(caplog) == ["tracker flaky failed to close (OSError: No space left on device)"]
    acc = tensorboard_read(save / "tensorboard" / "dmd2-flaky")
    assert [s for s, _ in tensorboard_curve(acc, "losses/dmd2_loss")] == list(range(7))


def test_an_mlflow_server_that_is_down_is_a_warning_and_the_next_run_gives_mlflow_every_row(tmp_path, monkeypatch,
                                                                                          caplog, mlflow_tables):
    """MLflow at a closed loopback port: opening it fails, one warning names mlflow, TensorBoard
    gets the run. The next run (resumed at 3, MLflow reachable) makes MLflow's run and gives it
    rows 0..3 from the metrics log, then the replay: one value per step, the configuration once."""
    import socket

    from dmd2_core.args import load_args
    from dmd2_core.trackers.sinks import Trackers

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    save = with_mlflow_tables(tmp_path / "run", mlflow_tables)
    base = {"save": str(save), "trackers": ["tensorboard", "mlflow"], "run_name": "dmd2-down", "lr": 3e-5}
    args = load_args(None, {**base, "mlflow_tracking_uri": f"http://127.0.0.1:{closed}"})
    row = lambda i: {"iteration": i, "dmd2_loss": float(i)}  # noqa: E731
    first = Trackers.open(args, "attempt", args.model_dump(mode="json"), start=0, logged=-1)
    for i in range(5):
        first.write(i, row(i))
    first.close()
    warnings = tracker_warnings(caplog)
    assert len(warnings) == 1 and warnings[0].startswith("tracker mlflow failed to open ("), warnings
    assert "next run gives it iterations 0 on" in warnings[0]
    assert json.loads((save / "trackers.json").read_text())["behind"] == {"mlflow": -1}

    caplog.clear()
    args = load_args(None, base)  # the default store, in the save
    rerun = Trackers.open(args, "rerun", args.model_dump(mode="json"), start=3, logged=4,
                          rows={i: row(i) for i in range(4)})
    for i in range(3, 6):
        rerun.write(i, row(i))
    rerun.close()
    assert tracker_warnings(caplog) == []
    state = json.loads((save / "trackers.json").read_text())
    assert "behind" not in state and state["runs"]["mlflow"]["tracking_uri"] == f"sqlite:///{save.resolve()}/mlflow.db"
    client, run = mlflow_run(save, state["runs"]["mlflow"]["run_id"])
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "dmd2_loss")] == \
        [(i, float(i)) for i in range(6)]
    assert run.data.params["lr"] == "3e-05" and run.info.status == "FINISHED"
    # two event files begun in one second are read in the order of their names' pids: compare as a set of steps
    assert sorted(s for s, _ in tensorboard_curve(tensorboard_read(save / "tensorboard" / "dmd2-down"), "losses/dmd2_loss")) \
        == list(range(6))


class InterruptedSink(FlakySink):
    """A tracker whose opening is interrupted (Ctrl-C): not an error of its own to warn about."""
    name = "interrupted"

    def __init__(self, *args):
        raise KeyboardInterrupt


def test_trackers_already_open_are_closed_when_the_opening_stops(tmp_path, flaky, monkeypatch):
    """The second tracker's opening is interrupted, or trackers.json cannot be written: the
    opening stops with that, and the tracker already open is closed (as failed), not left running."""
    from dmd2_core import storage
    from dmd2_core.args import load_args
    from dmd2_core.trackers import sinks

    monkeypatch.setitem(sinks.SINKS, "interrupted", ("tests.test_trackers", "InterruptedSink", "pytest"))
    args = load_args(None, {"save": str(tmp_path / "run"), "trackers": ["flaky", "interrupted"],
                            "run_name": "dmd2-half"})
    with pytest.raises(KeyboardInterrupt):
        sinks.Trackers.open(args, "attempt", {}, start=0, logged=-1)
    assert flaky.CLOSED == [True]

    def disk_full(url, text):
        raise OSError(f"{url}: No space left on device")

    monkeypatch.setattr(storage, "write_text", disk_full)
    args = load_args(None, {"save": str(tmp_path / "run"), "trackers": ["flaky"], "run_name": "dmd2-half"})
    with pytest.raises(OSError, match="trackers.json: No space left on device"):
        sinks.Trackers.open(args, "attempt", {}, start=0, logged=-1)
    assert flaky.CLOSED == [True, True]


def test_an_mlflow_run_on_an_s3_save_is_found_from_another_directory_and_a_deleted_one_is_replaced(
        s3_bucket, tmp_path, monkeypatch, caplog, mlflow_tables):
    """An s3:// save without a tracking URI uses MLflow's default store in the working directory;
    trackers.json keeps its absolute URI (never null), so a rerun started elsewhere continues the
    same MLflow run. A run deleted meanwhile is a warning, and a new run gets the configuration and
    the metrics log's rows instead of failing."""
    from mlflow.tracking import MlflowClient

    from dmd2_core import storage
    from dmd2_core.args import load_args
    from dmd2_core.trackers.sinks import Trackers

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    save = f"{s3_bucket}/runs/mlflow"
    args = load_args(None, {"save": save, "trackers": ["mlflow"], "run_name": "dmd2-elsewhere", "lr": 3e-5})
    row = lambda i: {"iteration": i, "dmd2_loss": float(i)}  # noqa: E731
    first_dir = with_mlflow_tables(tmp_path / "first", mlflow_tables)
    monkeypatch.chdir(first_dir)
    first = Trackers.open(args, "attempt", args.model_dump(mode="json"), start=0, logged=-1)
    for i in range(3):
        first.write(i, row(i))
    first.close()
    stored = json.loads(storage.read_text(f"{save}/trackers.json"))["runs"]["mlflow"]
    assert stored["tracking_uri"] == f"sqlite:///{first_dir.resolve()}/mlflow.db"

    monkeypatch.chdir(tmp_path)  # another directory
    rerun = Trackers.open(args, "rerun", args.model_dump(mode="json"), start=2, logged=2,
                          rows={i: row(i) for i in range(3)})
    for i in range(2, 5):
        rerun.write(i, row(i))
    rerun.close()
    client = MlflowClient(stored["tracking_uri"])
    assert json.loads(storage.read_text(f"{save}/trackers.json"))["runs"]["mlflow"] == stored
    assert [m.step for m in client.get_metric_history(stored["run_id"], "dmd2_loss")] == list(range(5))
    assert tracker_warnings(caplog) == []

    client.delete_run(stored["run_id"])
    again = Trackers.open(args, "again", args.model_dump(mode="json"), start=4, logged=4,
                          rows={i: row(i) for i in range(5)})
    again.close()
    warnings = tracker_warnings(caplog)
    assert len(warnings) == 1 and warnings[0].startswith(f"mlflow: run {stored['run_id']} is not in "), warnings
    new_id = json.loads(storage.read_text(f"{save}/trackers.json"))["runs"]["mlflow"]["run_id"]
    assert new_id != stored["run_id"]
    run = client.get_run(new_id)
    assert run.data.params["lr"] == "3e-05" and run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(new_id, "dmd2_loss")] == list(range(5))

    # an older save kept `tracking_uri: null`: the rerun's directory's default store lacks the run
    kept = json.loads(storage.read_text(f"{save}/trackers.json"))
    kept["runs"]["mlflow"]["tracking_uri"] = None
    storage.write_text(f"{save}/trackers.json", json.dumps(kept))
    monkeypatch.chdir(with_mlflow_tables(tmp_path / "third", mlflow_tables))
    caplog.clear()
    Trackers.open(args, "older", args.model_dump(mode="json"), start=4, logged=4,
                  rows={i: row(i) for i in range(5)}).close()
    third = f"sqlite:///{(tmp_path / 'third').resolve()}/mlflow.db"
    assert tracker_warnings(caplog) == [f"mlflow: run {new_id} is not in {third} any more; a new run replaces it "
                                        f"and is given the metrics log's rows"]
    state = json.loads(storage.read_text(f"{save}/trackers.json"))["runs"]["mlflow"]
    assert state["tracking_uri"] == third
    assert [m.step for m in MlflowClient(third).get_metric_history(state["run_id"], "dmd2_loss")] == list(range(5))


def test_the_readme_s_mlflow_ui_command_follows_an_extra_that_installs_the_ui():
    """`mlflow ui` needs the full mlflow package (the skinny client's server answers "index.html not
    found"): the README installs the extra that pins it, at the skinny client's version, first."""
    import re
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    skinny = next(r for r in extras["mlflow"] if r.startswith("mlflow-skinny=="))
    readme = (REPO / "README.md").read_text()
    before_ui = readme[:readme.index("mlflow ui")]
    installs = re.findall(r"pip install 'dmd2\[([a-z-]+)\]'", before_ui)
    assert installs, before_ui[-400:]
    assert f"mlflow=={skinny.partition('==')[2]}" in extras[installs[-1]]  # the last install before the command
