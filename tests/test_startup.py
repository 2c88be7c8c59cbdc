"""A trainer's start (dmd2_core.train.trainer_models): models built on the meta device, sharded, each rank reading
only its own rows of each tensor. The shards equal the old whole-load-then-shard path's bit for bit
(1 and 2 ranks, fp32 and bf16 compute, a frozen bf16 teacher, kept-fp32 modules, rotary tables,
sharded safetensors); a rank's peak host memory is its shards plus a block; an s3:// checkpoint is
read in ranges, never copied whole; a resume reads no weight of the diffusers checkpoint."""

from __future__ import annotations

import shutil

import pytest
import torch

from dmd2_core import parallel, storage
from dmd2_core.models import FAMILIES, describe_model_dir, load_model_dir, write_transformer
from dmd2_core.toys.standins import build_h3_standin, build_standin
from tests.helpers import spawn_ranks

WAN_60M = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=64, in_channels=4, out_channels=4,
               text_dim=64, freq_dim=64, ffn_dim=3072, num_layers=6, rope_max_seq_len=64)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """The three families' stand-ins, and the SD3 one with its transformer in several files."""
    root = tmp_path_factory.mktemp("startup")
    urls = {"sd3": build_standin(str(root / "sd3"), "sd3"), "wan": build_standin(str(root / "wan"), "wan"),
            "h3": build_h3_standin(str(root / "h3"))}
    sharded = root / "sd3-sharded"
    shutil.copytree(urls["sd3"], sharded)
    for f in (sharded / "transformer").glob("*.safetensors"):
        f.unlink()
    model = load_model_dir(urls["sd3"]).model
    write_transformer(FAMILIES["SD3Transformer2DModel"], model.config, model.state_dict(), sharded / "transformer",
                      max_shard_size="100KB")
    assert len(list((sharded / "transformer").glob("*.safetensors"))) > 2
    urls["sd3-sharded"] = str(sharded)
    return urls


def _args(url: str, save: str, **overrides):
    from tests.helpers import tiny_args

    return tiny_args(url, save, **overrides)


def _mesh(world: int):
    return parallel.build_mesh(torch.device("cpu"), world, None)


def _shards(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: parallel.local(v).detach() for k, v in [*model.named_parameters(), *model.named_buffers()]}


def _assert_bitwise(new: torch.nn.Module, old: torch.nn.Module, what: str) -> None:
    a, b = _shards(new), _shards(old)
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (what, k, a[k].dtype, b[k].dtype)
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), (what, k)


def _old_start(url: str, mesh, dtype: torch.dtype, gradient_checkpointing: bool):
    """The path before dmd2_core.train.trainer_models: every rank loads both models whole, then shards them."""
    family = FAMILIES[describe_model_dir(url)["family"]]
    model = load_model_dir(url, "cpu", parallel.MASTER_DTYPE).model
    parallel.shard_model(model, mesh, dtype, trainable=True, keep_fp32=family.keep_fp32_modules,
                         gradient_checkpointing=gradient_checkpointing)
    teacher = load_model_dir(url, "cpu", dtype).model
    parallel.shard_model(teacher, mesh, dtype, trainable=False, keep_fp32=family.keep_fp32_modules)
    return model, teacher


def _equal_to_old_start(rank: int, world: int, cases: list) -> None:
    from dmd2_core.train.trainer_models import TrainerModels

    mesh = _mesh(world)
    for args, dtype in cases:
        what = f"{args.hf_checkpoint} {dtype} rank {rank}/{world}"
        new = TrainerModels(args, dtype, teacher_url=args.hf_checkpoint, resume=False)
        new.shard(mesh)
        old_model, old_teacher = _old_start(args.hf_checkpoint, mesh, dtype, args.gradient_checkpointing)
        _assert_bitwise(new.model, old_model, what)
        _assert_bitwise(new.teacher, old_teacher, what)
        # the fake score and the teacher came from one read of this rank's rows
        expected = sum(parallel.local(v).numel() * 4 for v in new.model.state_dict().values())  # stored fp32
        assert new.bytes_read == expected, what


@pytest.mark.multi_rank
@pytest.mark.parametrize("world", [1, 2])
def test_start_equals_whole_load_then_shard(checkpoints, tmp_path, world):
    """Every family, fp32 and bf16 compute (fp32 masters, frozen bf16 teacher), gradient
    checkpointing, sharded safetensors: the same shards, dtypes and buffers as before."""
    cases = [(_args(checkpoints["sd3"], str(tmp_path / "sd3")), torch.float32)]  # 1 rank: plain modules
    cases += [(_args(checkpoints[kind], str(tmp_path / kind), gradient_checkpointing=kind == "wan"), torch.bfloat16)
              for kind in ("sd3", "wan", "h3", "sd3-sharded")]
    spawn_ranks(world, _equal_to_old_start, cases)


def test_kept_fp32_modules_of_a_bf16_teacher_hold_the_checkpoint_values(checkpoints, tmp_path):
    """MiniMax-H3's _keep_in_fp32_modules stay fp32 in the bf16 teacher, with the checkpoint's fp32
    values (never rounded through bf16 on the way)."""
    from dmd2_core.train.trainer_models import TrainerModels

    parallel.ensure_process_group(0, 1, torch.device("cpu"))
    url = checkpoints["h3"]
    models = TrainerModels(_args(url, str(tmp_path)), torch.bfloat16, teacher_url=url, resume=False)
    models.shard(_mesh(1))
    kept = {n for n, p in models.teacher.named_parameters() if p.dtype == torch.float32}
    assert kept and any(p.dtype == torch.bfloat16 for p in models.teacher.parameters())
    whole = load_model_dir(url).model.state_dict()
    teacher = dict(models.teacher.named_parameters())
    assert all(torch.equal(parallel.local(teacher[n]), whole[n]) for n in kept)
    assert any(not torch.equal(whole[n].bfloat16().float(), whole[n]) for n in kept)  # bf16 would differ


def _peak_rss(rank: int, world: int, args) -> None:
    from dmd2_core.models.loading import build_empty
    from dmd2_core.train.trainer_models import TrainerModels

    mesh = _mesh(world)
    build_empty(args.hf_checkpoint)  # the runtime's baseline: diffusers and the model class imported

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    baseline = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak resident set, to the current one
    models = TrainerModels(args, torch.float32, resume=False)
    models.shard(mesh)
    peak = status("VmHWM:")
    shard_bytes = sum(parallel.local(t).nbytes for t in [*models.model.parameters(), *models.model.buffers()])
    block_bytes = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in parallel.blocks(models.model))
    whole = sum(p.numel() * p.element_size() for p in models.model.parameters())
    assert shard_bytes < 0.6 * whole and 1.1 * (shard_bytes + block_bytes) < whole  # the bound means something
    grew = peak - baseline
    assert grew <= 1.1 * (shard_bytes + block_bytes), (
        f"rank {rank}: peak RSS grew {grew / 2**20:.0f} MiB during start; shards {shard_bytes / 2**20:.0f} MiB, "
        f"largest block {block_bytes / 2**20:.0f} MiB, whole model {whole / 2**20:.0f} MiB")


@pytest.mark.multi_rank
def test_two_rank_start_holds_its_shards_not_the_model(tmp_path):
    """A ~60 M-parameter Wan (~240 MB in fp32) on 2 ranks: each rank's peak host memory grows by at
    most its shards and one block (+10%) while it starts, never by the whole model."""
    from dmd2_core.models import save_model_dir

    torch.manual_seed(0)
    model = FAMILIES["WanTransformer3DModel"].build(WAN_60M)
    url = str(tmp_path / "wan60m")
    save_model_dir(model, url, shift=5.0)
    del model
    spawn_ranks(2, _peak_rss, _args(url, str(tmp_path / "run"), dtype="bfloat16"))


def test_s3_checkpoint_is_read_in_ranges_never_copied(checkpoints, tmp_path, s3_bucket, monkeypatch):
    """An s3:// checkpoint starts without any local copy: the shards equal the local start's and
    the rows were read once for the fake score and the teacher."""
    from dmd2_core.train.trainer_models import TrainerModels

    parallel.ensure_process_group(0, 1, torch.device("cpu"))
    url = storage.join(s3_bucket, "sd3")
    storage.upload_dir(checkpoints["sd3"], url)
    local = TrainerModels(_args(checkpoints["sd3"], str(tmp_path / "a")), torch.bfloat16,
                          teacher_url=checkpoints["sd3"], resume=False)
    local.shard(_mesh(1))

    def no_copy(*a, **k):
        raise AssertionError("a whole local copy of the checkpoint")
    monkeypatch.setattr(storage, "local_copy", no_copy)
    monkeypatch.setattr(storage, "download_dir", no_copy)
    remote = TrainerModels(_args(url, str(tmp_path / "b")), torch.bfloat16, teacher_url=url, resume=False)
    remote.shard(_mesh(1))
    _assert_bitwise(remote.model, local.model, "fake score")
    _assert_bitwise(remote.teacher, local.teacher, "teacher")
    assert remote.bytes_read == local.bytes_read == sum(v.numel() * 4 for v in remote.model.state_dict().values())


def test_resume_reads_no_weight_of_the_diffusers_checkpoint(tiny_teacher, tmp_path, monkeypatch):
    """With a tracked checkpoint under the run's URL the trained model is left to DCP: not one
    byte of the diffusers weights is read, the trainer refuses to run until it is loaded, and the
    loaded state is the saved one."""
    from dmd2_core import checkpoint
    from dmd2_core.run.distill_run import preflight
    from dmd2_core.train.trainer import Trainer

    args = preflight(_args(tiny_teacher, str(tmp_path / "run")))["actor"]
    first = Trainer(args, "actor")
    for p in first.model.parameters():  # one optimizer step: weights no longer the diffusers checkpoint's
        p.grad = torch.ones_like(p)
    first.optimizer.step()
    first.optimizer.zero_grad(set_to_none=True)
    first.save(1)
    first.save_status(wait=True)
    checkpoint.write_latest(args.save, 1)
    reads = []
    real = storage.read_ranges
    monkeypatch.setattr(storage, "read_ranges", lambda ranges: (reads.extend(ranges), real(ranges))[1])

    resumed = Trainer(args, "actor")
    assert resumed.models.resume and reads == [] and resumed.models.bytes_read == 0
    with pytest.raises(RuntimeError, match="no checkpoint was loaded"):
        resumed.rollout(1)
    resumed.load(1)
    assert reads == []
    saved, loaded = first.weights(), resumed.weights()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    fresh = load_model_dir(tiny_teacher).model.state_dict()
    assert all(not torch.equal(saved[k], fresh[k]) for k, _ in first.model.named_parameters())


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_broken_weights_file_fails_in_one_line_naming_it(checkpoints, tmp_path, damage):
    from dmd2_core.errors import ModelDirError
    from dmd2_core.train.trainer_models import TrainerModels

    parallel.ensure_process_group(0, 1, torch.device("cpu"))
    broken = tmp_path / "broken"
    shutil.copytree(checkpoints["sd3"], broken)
    weights = broken / "transformer" / "diffusion_pytorch_model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:
        weights.unlink()
    models = TrainerModels(_args(str(broken), str(tmp_path / "run")), torch.float32, resume=False)
    with pytest.raises(ModelDirError) as err:
        models.shard(_mesh(1))
    message = str(err.value)
    assert "\n" not in message and str(weights if damage == "truncated" else weights.parent) in message


def test_a_model_left_unsharded_goes_to_the_ranks_device(checkpoints, monkeypatch):
    """One rank's frozen teacher needs no FSDP and stays a plain module; it still goes where FSDP
    would put its shards (the rank's device): on an H100 the teacher stayed on the host, and the
    critic's first scoring failed with 'weight type CPUBFloat16Type' (meta stands in for the GPU)."""
    parallel.ensure_process_group(0, 1, torch.device("cpu"))
    monkeypatch.setattr(parallel, "_shard_device", lambda mesh, cpu_offload: torch.device("meta"))
    url = checkpoints["wan"]
    family = FAMILIES[describe_model_dir(url)["family"]]
    teacher = load_model_dir(url, "cpu", torch.bfloat16).model
    assert not parallel.needs_fsdp(_mesh(1), torch.bfloat16, trainable=False, cpu_offload=False)
    parallel.shard_model(teacher, _mesh(1), torch.bfloat16, trainable=False, keep_fp32=family.keep_fp32_modules)
    placed = {t.device.type for t in [*teacher.parameters(), *teacher.buffers()]}
    assert placed == {"meta"}
