"""Broken inputs as users really get them (a download cut off half-way, a file damaged on disk),
through the CLI a user runs: exit 2 and one line on stderr naming the file. Structural damage is
found before any actor starts and nothing under ``save`` is touched; a corrupt weight shard, found
by the ranks' hashes once they start, ends the run the same way, its traceback in the log file."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dmd2_core import checkpoint as ckpt
from dmd2_core.toys.digits import digits_prompt_set
from dmd2_core.errors import CheckpointError
from dmd2_core.run.distill_run import DistillRun
from tests.helpers import flow_cli_refusal, tiny_args

ROOT = Path(__file__).resolve().parents[2]


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _cli(capsys, monkeypatch, *argv) -> str:
    return flow_cli_refusal(capsys, monkeypatch, "--recipe", "tiny", *argv)


def _files(root: Path) -> dict:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and p.name != ".lease.lock"} if root.exists() else {}


def test_a_teacher_cut_off_half_way_is_named_before_any_actor(tiny_teacher, tmp_path, capsys, monkeypatch):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_teacher, teacher)
    (weights,) = teacher.rglob("*.safetensors")
    _truncate(weights)
    save = tmp_path / "run"
    err = _cli(capsys, monkeypatch, "--hf-checkpoint", str(teacher), "--save", str(save))
    assert f"{weights}: not a whole safetensors file (truncated: tensor" in err and "download it again" in err
    assert not save.exists()


def test_a_teacher_whose_header_outgrows_its_bytes_is_named_before_any_actor(tiny_teacher, tmp_path, capsys, monkeypatch):
    """A header whose shape x dtype is larger than the tensor's byte span would have the ranks
    read the next tensor's bytes as this one's: refused, naming the file and the tensor."""
    import json

    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_teacher, teacher)
    (weights,) = teacher.rglob("*.safetensors")
    data = weights.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    key = next(k for k, v in header.items() if k != "__metadata__" and v["shape"])
    header[key]["shape"][0] *= 2  # offsets and file size unchanged
    encoded = json.dumps(header).encode()
    weights.write_bytes(len(encoded).to_bytes(8, "little") + encoded + data[8 + n:])
    save = tmp_path / "run"
    err = _cli(capsys, monkeypatch, "--hf-checkpoint", str(teacher), "--save", str(save))
    assert f"{weights}: not a whole safetensors file (tensor '{key}' " in err and "its data_offsets span" in err
    assert len(err.strip().splitlines()) == 1
    assert not save.exists()


@pytest.mark.parametrize("which", ["prompts", "real_data"])
def test_a_truncated_prompt_set_or_real_set_is_named_before_any_actor(tiny_teacher, tmp_path, capsys, monkeypatch, which):
    path = tmp_path / f"{which}.safetensors"
    if which == "prompts":
        digits_prompt_set().save(str(path))
        flags = ["--prompts", str(path)]
    else:
        from safetensors.torch import save_file

        from dmd2_core.data import REAL_LATENTS, load_real_set

        real = load_real_set("digits")
        save_file({REAL_LATENTS: real.latents[:64].contiguous(), **{k: v[:64].contiguous() for k, v in real.cond.items()}},
                  str(path))
        flags = ["--set", f"real_data={path}"]
    _truncate(path)
    save = tmp_path / "run"
    err = _cli(capsys, monkeypatch, "--hf-checkpoint", tiny_teacher, "--save", str(save), *flags)
    assert f"{which}: {path}" in err and "truncated: tensor" in err
    assert not save.exists()


@pytest.fixture(scope="module")
def saved_at_1(ray_session, tiny_teacher, tmp_path_factory) -> Path:
    """One run of the tiny recipe that checkpointed iteration 1; each test damages its own copy."""
    save = tmp_path_factory.mktemp("broken") / "run"
    with DistillRun(tiny_args(tiny_teacher, str(save), run_name="broken-first")) as run:
        run.iterate(1)
        run.checkpoint(1)
    return save


def _copy_of(saved: Path, tmp_path: Path) -> Path:
    save = tmp_path / "run"
    shutil.copytree(saved, save, ignore=shutil.ignore_patterns(".lease.lock"))
    return save


def test_a_corrupt_trainer_state_is_named_before_any_actor(saved_at_1, tiny_teacher, tmp_path, capsys, monkeypatch):
    save = _copy_of(saved_at_1, tmp_path)
    state = Path(ckpt.trainer_dir(str(save), "critic", 1)) / "trainer_state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: the listing agrees, the content does not
    state.write_bytes(bytes(data))
    before = _files(save)
    err = _cli(capsys, monkeypatch, "--hf-checkpoint", tiny_teacher, "--save", str(save), "--seed", "3",
               "--set", "global_batch_size=8", "--set", "micro_batch_size=8", "--set", "dmd2_update_ratio=2",
               "--set", "dmd2_guidance_scale=2.0")
    assert err.strip() == f"error: {state}: corrupt (sha256 differs from the one recorded at save)"
    assert _files(save) == before


def test_a_corrupt_weight_shard_found_at_load_ends_the_run_in_one_line(saved_at_1, tiny_teacher, tmp_path):
    """The shards' hashes are the ranks' to check (in parallel, at any size): once they find a
    flipped bit the run still ends with exit 2 and one line naming the file; the traceback goes
    to the log file that line names, what the run started is stopped, nothing is touched."""
    import psutil

    save = _copy_of(saved_at_1, tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update({"PREFECT_HOME": str(tmp_path / "prefect-home"), "RAY_ADDRESS": "local", "PYTHONPATH": str(ROOT)})

    def flow(iterations: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "flows.dmd2", "--recipe", "tiny", "--hf-checkpoint", tiny_teacher, "--save", str(save),
             "--num-iterations", str(iterations), "--set", "save_interval=1", "--set", "eval_interval=0",
             "--set", "global_batch_size=8", "--set", "micro_batch_size=8", "--set", "dmd2_update_ratio=1",
             "--set", "gan_weight=0", "--set", "gan_critic_weight=0", "--set", "run_name=broken-shard"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)

    shard = Path(ckpt.trainer_dir(str(save), "actor", 1)) / "dcp" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    before = _files(save)
    second = flow(2)
    out, err = second.communicate(timeout=600)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]  # among the run's own log lines
    assert second.returncode == 2 and len(errors) == 1, err[-4000:]
    last = errors[0]
    assert last.startswith(f"error: {shard}: corrupt (sha256 differs from the one recorded at save) (traceback in "), last
    log = Path(last.rsplit("traceback in ", 1)[1].rstrip(")"))
    assert "Traceback" in log.read_text() and "CheckpointError" in log.read_text()
    assert "Traceback" not in out + err
    assert _files(save) == before and ckpt.read_latest(str(save)) == 1
    left = [p for p in psutil.process_iter(["pid"]) if _session(p.pid) == second.pid]
    psutil.wait_procs(left, timeout=10)
    assert not [p for p in left if p.is_running()], left


def _session(pid: int):
    try:
        return os.getsid(pid)
    except OSError:
        return None


def test_a_truncated_shard_and_a_load_url_without_a_checkpoint_fail_before_any_actor(saved_at_1, tiny_teacher, tmp_path,
                                                                                      monkeypatch):
    """Pre-flight checks the listing and the sizes (cheap at any size); an explicit load URL
    that holds no checkpoint is an error, not a fresh start."""
    save = _copy_of(saved_at_1, tmp_path)
    shard = Path(ckpt.trainer_dir(str(save), "actor", 1)) / "dcp" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    before = _files(save)
    started = []  # the run is entered (DistillRun.start): the refusal comes before it starts Ray
    monkeypatch.setattr("dmd2_core.run.groups.init_ray", lambda *a, **k: started.append(1) or _stop())
    with pytest.raises(CheckpointError, match=re.escape(f"{shard}: corrupt (100 bytes")), \
            DistillRun(tiny_args(tiny_teacher, str(save), run_name="broken-truncated")):
        pass
    fresh = tiny_args(tiny_teacher, str(tmp_path / "fresh"), load=str(tmp_path / "rnu"))
    with pytest.raises(CheckpointError, match=re.escape(f"load: no checkpoint at {tmp_path / 'rnu'} "
                                                              f"(no latest_checkpointed_iteration.txt); did you mean")), \
            DistillRun(fresh):
        pass
    assert not started and _files(save) == before


def _stop():
    raise RuntimeError("DistillRun.start reached init_ray: Ray and the actors would start now")
