"""Every bad input fails in preflight, in one line naming the key or path, before any actor
starts and before anything is written (the CLI exits 2)."""

from __future__ import annotations

import re

import pytest
import torch

from dmd2_core.run.distill_run import DistillRun
from tests.helpers import tiny_args


def _broken_scheduler(teacher: str, tmp_path) -> str:
    import shutil

    root = tmp_path / "teacher"
    shutil.copytree(teacher, root)
    (root / "scheduler" / "scheduler_config.json").write_text('{"shift": 3.0,')
    return str(root)


def _beside(teacher: str, tmp_path, name: str, typo: str) -> str:
    """A missing model directory ``typo`` beside a copy of the teacher named ``name``."""
    import shutil

    shutil.copytree(teacher, tmp_path / name)
    return str(tmp_path / typo)


def _bin_only(teacher: str, tmp_path) -> str:
    """The teacher with its transformer's weights as a ``.bin`` file alone (a pickle; never read)."""
    import shutil

    root = tmp_path / "teacher"
    shutil.copytree(teacher, root)
    weights = root / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.rename(weights.with_suffix(".bin"))
    return str(root)


def _prompt_file(tmp_path, content: bytes) -> str:
    path = tmp_path / "prompts.safetensors"
    path.write_bytes(content)
    return str(path)


PREFLIGHT_CASES = {
    # name: (overrides built from (teacher, tmp_path), exception class name, message pattern)
    "save under a file": (lambda t, p: {"save": str(p / "afile" / "run")}, "ArgsError",
                          r"^save: cannot write to .*/afile/run \(NotADirectoryError"),
    "save in a missing bucket": (lambda t, p: {"save": "s3://no-such-bucket-dmd2/run"}, "ArgsError",
                                 r"^save: cannot write to s3://no-such-bucket-dmd2/run \(FileNotFoundError"),
    "prompts not safetensors": (lambda t, p: {"prompts": _prompt_file(p, b"a cat\na dog\n" * 100)}, "ArgsError",
                                r"^prompts: .* is not a safetensors prompt set \(header length \d+ does not fit"),
    "prompts empty": (lambda t, p: {"prompts": _prompt_file(p, b"")}, "ArgsError",
                      r"^prompts: .* is not a safetensors prompt set \(0 bytes"),
    "prompts header not json": (lambda t, p: {"prompts": _prompt_file(p, (4).to_bytes(8, "little") + b"{{{{")},
                                "ArgsError", r"^prompts: .* \(unreadable header: JSONDecodeError"),
    "scheduler config broken": (lambda t, p: {"hf_checkpoint": _broken_scheduler(t, p)}, "ModelDirError",
                                r"^.*/teacher/scheduler/scheduler_config.json: unreadable scheduler config \(JSONDecodeError"),
    "teacher missing": (lambda t, p: {"hf_checkpoint": _beside(t, p, "teacher", "teachr")}, "ModelDirError",
                        r"^hf_checkpoint: .*/teachr: no such checkpoint; did you mean '.*/teacher'\?$"),
    "critic missing": (lambda t, p: {"critic_hf_checkpoint": _beside(t, p, "critic", "critc")}, "ModelDirError",
                       r"^critic_hf_checkpoint: .*/critc: no such checkpoint; did you mean '.*/critic'\?$"),
    "real score missing": (lambda t, p: {"teacher_checkpoint": _beside(t, p, "real", "reel")}, "ModelDirError",
                           r"^teacher_checkpoint: .*/reel: no such checkpoint; did you mean '.*/real'\?$"),
    "teacher of .bin files alone": (lambda t, p: {"hf_checkpoint": _bin_only(t, p)}, "ModelDirError",
                                    r"^hf_checkpoint: .*/teacher/transformer: only \.bin weight files, which dmd2 never loads \(pickles\); "
                                    r"it needs \*\.safetensors"),
    "hook raises on import": (lambda t, p: {"train_input_hook_path": "tests.hooks_raising.hook"}, "ArgsError",
                              r"^train_input_hook_path: importing module 'tests.hooks_raising' of .* raised "
                              r"RuntimeError: hook module broken at import time$"),
    "cuda without GPUs": (lambda t, p: {"device": "cuda"}, "ArgsError",
                          r"^device: cuda needs 1 GPU\(s\) for num_devices=1, this machine has 0"),
    "unreachable ray_address": (lambda t, p: {"ray_address": "127.0.0.1:9"}, "ArgsError",
                                r"^ray_address: cannot reach 127.0.0.1:9 within 5 s \(ConnectionRefusedError"),
    "latent_shape channels": (lambda t, p: {"latent_shape": [4, 8, 8]}, "ArgsError",
                              r"^latent_shape: \[4, 8, 8\]: 4 channels, the model .* takes in_channels=1$"),
    "latent_shape patch": (lambda t, p: {"latent_shape": [1, 7, 8]}, "ArgsError",
                           r"^latent_shape: \[1, 7, 8\]: H=7 is not a multiple of the model's patch size 2; nearest: 6 or 8$"),
    "latent_shape rank": (lambda t, p: {"latent_shape": [1, 2, 8, 8]}, "ArgsError",
                          r"^latent_shape: \[1, 2, 8, 8\] does not fit SD3Transformer2DModel: expected \[C, H, W\]"),
}


@pytest.mark.parametrize("case", list(PREFLIGHT_CASES))
def test_bad_input_fails_in_preflight_in_one_line(case, tiny_teacher, tmp_path, monkeypatch, request):
    import time

    make, exc_name, pattern = PREFLIGHT_CASES[case]
    if "bucket" in case:
        request.getfixturevalue("s3_server")
    (tmp_path / "afile").write_text("not a directory")
    started = []  # the run is entered (DistillRun.start): the refusal comes before it starts Ray
    monkeypatch.setattr("dmd2_core.run.groups.init_ray", lambda *a, **k: started.append(1) or _stop())
    values = {"save": str(tmp_path / "run"), **make(tiny_teacher, tmp_path)}
    args = tiny_args(tiny_teacher, values.pop("save"), **values)
    t = time.monotonic()
    with pytest.raises(Exception) as info, DistillRun(args):
        pass
    assert type(info.value).__name__ == exc_name and isinstance(info.value, ValueError)  # exit code 2
    assert re.search(pattern, str(info.value)), str(info.value)
    assert "\n" not in str(info.value)
    assert not started and time.monotonic() - t < 10
    assert not (tmp_path / "run").exists()  # nothing written


def test_the_flow_cli_reports_bad_input_in_one_line_with_exit_2(tiny_teacher, tmp_path, capsys):
    from flows.dmd2 import main

    (tmp_path / "afile").write_text("")
    code = main(["--recipe", "tiny", "--hf-checkpoint", tiny_teacher, "--save", str(tmp_path / "afile" / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: save: cannot write to") and err.count("\n") == 1, err


@pytest.mark.parametrize("key", ["save", "load"])
def test_an_unreachable_storage_endpoint_fails_preflight_at_once(key, tiny_teacher, tmp_path, capsys, monkeypatch):
    """An S3 endpoint that never answered (a wrong AWS_ENDPOINT_URL) is named in one line within
    seconds, exit 2; the storage retry budget is for outages of a store that answered before."""
    import time

    from dmd2_core import storage
    from dmd2_core.run import preflight_checks
    from tests.helpers import flow_cli_refusal, free_port

    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    for name, value in (("AWS_ENDPOINT_URL", endpoint), ("AWS_ACCESS_KEY_ID", "x"), ("AWS_SECRET_ACCESS_KEY", "x"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setattr(preflight_checks, "REACH_S", 2.0)
    monkeypatch.setattr(storage, "RETRY_S", 20.0)  # what a run rides out once the store answered
    url = "s3://dmd2-unreachable/run"
    flags = ["--save", url] if key == "save" else ["--save", str(tmp_path / "run"), "--load", url]
    start = time.monotonic()
    err = flow_cli_refusal(capsys, monkeypatch, "--recipe", "tiny", "--hf-checkpoint", tiny_teacher, *flags)
    assert time.monotonic() - start < 12
    assert err.startswith(f"error: {key}: {url}: the storage endpoint did not answer for 2 s ("), err
    assert not (tmp_path / "run").exists()


def test_duplicate_recipe_keys_are_rejected(tmp_path):
    from dmd2_core.args import load_args
    from dmd2_core.errors import ArgsError

    recipe = tmp_path / "dup.yaml"
    recipe.write_text("seed: 0\nlr: 1.0e-4\nnum_iterations: 5\nlr: 1.0e-3\n")
    with pytest.raises(ArgsError, match=r"^recipe .*dup.yaml is not valid YAML: duplicate key 'lr' \(lines 2 and 4\)$"):
        load_args(recipe)


def test_missing_device_resource_fails_before_a_placement_group(ray_session, tiny_teacher, tmp_path, monkeypatch):
    from dmd2_core.run import lease
    from dmd2_core.errors import ArgsError

    requested = []
    monkeypatch.setattr("dmd2_core.run.groups.placement_group", lambda *a, **k: requested.append(1))
    save = str(tmp_path / "run")
    run = DistillRun(tiny_args(tiny_teacher, save, device_resource="dmd2_devcie", ray_timeout_s=600))
    with pytest.raises(ArgsError, match=r"^device_resource: the Ray cluster has 0 'dmd2_devcie' of the 1 needed "
                                        r"\(resources: .*\); did you mean 'dmd2_device'\?$"):
        run.start()
    run.shutdown()
    assert not requested and lease.read(save) is None


def test_the_flow_cli_checks_its_input_once(tiny_teacher, tmp_path, monkeypatch):
    """The CLI's preflight, run before Prefect starts, is the one its flow's run uses: the checks
    (every header read, the write probe) run once per command, and the flow's run still takes the
    lease as its own owner."""
    import flows.dmd2 as flow_cli
    from dmd2_core.run import preflight_checks

    probes, owners = [], []
    monkeypatch.setattr(preflight_checks, "probe_write", lambda url: probes.append(url))

    def flow(recipe, overrides=None, **flat):  # the flow's own first step, without Prefect
        run = DistillRun(flow_cli.resolve_args(recipe, overrides, **flat), owner="flow-run-1")
        owners.append(run.owner)
        return {"trainers": sorted(run.trainer_args)}

    monkeypatch.setattr(flow_cli, "dmd2", flow)
    save = str(tmp_path / "run")
    assert flow_cli.main(["--recipe", "tiny", "--hf-checkpoint", tiny_teacher, "--save", save]) == 0
    assert probes == [save] and owners == ["flow-run-1"]
    DistillRun(tiny_args(tiny_teacher, save))  # a later run in this process checks again
    assert probes == [save, save]


def _stop():
    raise RuntimeError("DistillRun.start reached init_ray: Ray and the actors would start now")


def test_no_loader_unpickles_a_bin_weights_file(tmp_path):
    """A VAE folder of a .bin file alone is not loaded (diffusers would fall back to unpickling
    it): every loader of dmd2 reads safetensors only, as its weight check says."""
    from dmd2_core.models import FAMILIES
    from dmd2_core.toys.standins import _sd3_vae

    _sd3_vae().save_pretrained(str(tmp_path / "vae"), safe_serialization=False)
    assert [p.suffix for p in (tmp_path / "vae").glob("diffusion_pytorch_model.*")] == [".bin"]
    with pytest.raises(OSError, match=r"diffusion_pytorch_model\.safetensors"):
        FAMILIES["SD3Transformer2DModel"].load_vae(str(tmp_path / "vae"), torch.float32)


def test_the_write_probe_removes_only_the_directories_it_created(tmp_path, monkeypatch):
    """The save's missing directories are made by the probe and removed after it, deepest first;
    one that another writer put a file into meanwhile stays, with the file and every directory
    above it. A probe that cannot write leaves none of its directories either."""
    from dmd2_core import storage
    from dmd2_core.errors import ArgsError
    from dmd2_core.run import preflight_checks

    top = tmp_path / "runs"
    write = storage.write_bytes

    def meanwhile(url, data, *a, **kw):
        write(url, data, *a, **kw)
        (top / "other-run.log").write_text("another writer")  # a sibling run, writing beside the probe

    monkeypatch.setattr(storage, "write_bytes", meanwhile)
    preflight_checks.probe_write(str(top / "night" / "run"))
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["runs", "runs/other-run.log"]

    def refused(url, data, *a, **kw):
        write(url, data, *a, **kw)
        raise PermissionError("quota exceeded")

    monkeypatch.setattr(storage, "write_bytes", refused)
    with pytest.raises(ArgsError, match=r"^save: cannot write to .*/fresh/run \(.*quota exceeded\)$"):
        preflight_checks.probe_write(str(tmp_path / "fresh" / "run"))
    assert not (tmp_path / "fresh").exists()
