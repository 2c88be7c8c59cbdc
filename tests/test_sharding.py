"""Trainers at real scale: FSDP2 sharding (1 rank == N ranks, HSDP), fp32 master weights with
bf16 compute, activation checkpointing, the memory plan (against the bytes ranks really hold) and
rank placement across nodes. Sleep/wake of shards and resume: tests/checkpoint/test_checkpoints_at_scale.py."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from dmd2_core import checkpoint as ckpt
from dmd2_core import parallel
from dmd2_core.memory import planner
from dmd2_core.args import load_args
from dmd2_core.errors import ArgsError
from dmd2_core.run.distill_run import DistillRun, preflight
from dmd2_core.toys.standins import build_standin, standin_prompt_set
from tests.helpers import flow_cli_refusal, free_port, in_process_trainers, iterate_in_process, tiny_args

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "deployments" / "model_configs"
H3_CPU = dict(device="cpu", num_devices=1, global_batch_size=4, micro_batch_size=2, torch_threads=1,
              eval_interval=0, save_interval=0)


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    root = tmp_path_factory.mktemp("sd3")
    url = build_standin(str(root / "sd3"), "sd3")
    prompts = str(root / "prompts.safetensors")
    standin_prompt_set("sd3").save(prompts)
    return url, prompts


# ---- precision ---------------------------------------------------------------------------------

def test_bf16_recipe_moves_the_fp32_master_weights(sd3, tmp_path):
    """minimax-h3 as shipped (bf16, lr 2e-6), CPU-sized: the student's fp32 master weights move;
    the teacher is stored in bf16 and the blocks compute in bf16."""
    url, prompts = sd3
    args = load_args("wan-video", dict(H3_CPU, hf_checkpoint=url, prompts=prompts, save=str(tmp_path)))
    assert args.dtype == "bfloat16" and args.lr == 2e-6 and args.gradient_checkpointing
    trainers = in_process_trainers(args)
    actor, critic = trainers["actor"], trainers["critic"]
    assert {p.dtype for p in actor.model.parameters()} == {torch.float32}
    assert {p.dtype for p in critic.teacher.parameters()} == {torch.bfloat16}
    assert all(parallel.local(v).dtype == torch.float32 for st in actor.optimizer.state.values() for v in st.values()
               if v.dim() > 0)
    seen = []
    block = parallel.blocks(actor.model)[0]
    handle = block.register_forward_pre_hook(lambda m, a, kw: seen.append((a[0] if a else kw["hidden_states"]).dtype), with_kwargs=True)
    before = actor.weights()
    for i in range(1, 6):
        iterate_in_process(trainers, i)
    handle.remove()
    after = actor.weights()
    moved = sum((before[k] != after[k]).sum().item() for k in before)
    total = sum(v.numel() for v in before.values())
    assert moved / total >= 0.9, f"{moved / total:.1%} of the master weights moved"
    assert seen and set(seen) == {torch.bfloat16}
    assert all(v.dtype == torch.float32 for v in after.values())


def test_gradient_checkpointing_gives_the_same_update(tiny_teacher, tmp_path):
    weights = {}
    for on in (False, True):
        trainers = in_process_trainers(tiny_args(tiny_teacher, str(tmp_path / str(on)), gradient_checkpointing=on))
        assert trainers["actor"].model.is_gradient_checkpointing == on
        for i in (1, 2):
            iterate_in_process(trainers, i)
        weights[on] = {role: t.weights() for role, t in trainers.items()}
    for role in ("actor", "critic"):
        a, b = weights[False][role], weights[True][role]
        assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6


def test_fsdp_only_where_it_has_work(tiny_teacher, tmp_path):
    """One fp32 rank has nothing to shard, gather or cast: plain modules (FSDP's per-block copies
    and hooks cost 2-8% of the tiny iteration: bench/one_rank.py); a bf16 rank keeps FSDP for the
    cast."""
    from torch.distributed.fsdp import FSDPModule

    for dtype, sharded in (("float32", False), ("bfloat16", True)):
        trainers = in_process_trainers(tiny_args(tiny_teacher, str(tmp_path / dtype), dtype=dtype))
        assert isinstance(trainers["actor"].model, FSDPModule) == sharded, dtype
        assert isinstance(trainers["critic"].model, FSDPModule) == sharded, dtype
        assert not isinstance(trainers["critic"].teacher, FSDPModule), dtype  # frozen: stored in the compute dtype
        iterate_in_process(trainers, 1)
        assert any(isinstance(p, torch.distributed.tensor.DTensor) for p in trainers["actor"].model.parameters()) == sharded


# ---- sharding over ranks (Ray, gloo) -------------------------------------------------------------

def _run(tiny_teacher, save, n, iterations, **kw):
    args = tiny_args(tiny_teacher, save, num_devices=n, run_name=f"shard-{n}-{secrets.token_hex(3)}", **kw)
    with DistillRun(args) as run:
        for i in iterations:
            run.iterate(i)
        return {role: run.group_call(role, "weights")[0] for role in run.groups}, run


@pytest.fixture(scope="module")
def one_rank(tiny_teacher, tmp_path_factory):
    """The 1-rank reference, in this process: the actor's initial weights, and both roles' weights
    after 3 iterations."""
    trainers = in_process_trainers(tiny_args(tiny_teacher, str(tmp_path_factory.mktemp("one-rank"))))
    fresh = trainers["actor"].weights()
    for i in (1, 2, 3):
        iterate_in_process(trainers, i)
    return fresh, {role: t.weights() for role, t in trainers.items()}


@pytest.mark.multi_rank
def test_two_replicas_equal_one_rank(ray_session, one_rank, tiny_teacher, tmp_path):
    """HSDP with a shard group of 1 (two replicas): the same weights as 1 rank after 3 iterations,
    actor and critic; a gradient summed instead of averaged over ranks (gloo under FSDP2, pytorch
    issue 162338) would double every update. Two FSDP shards: test_a_group_across_two_ray_nodes."""
    fresh, one = one_rank
    two, _ = _run(tiny_teacher, str(tmp_path / "2"), 2, (1, 2, 3), fsdp_shard_size=1)
    for role in ("actor", "critic"):
        diff = max((one[role][k] - two[role][k]).abs().max().item() for k in one[role])
        assert diff < 2e-6, (role, diff)
    moved = max((fresh[k] - one["actor"][k]).abs().max().item() for k in fresh)
    assert moved > 1e-4  # and training did move them, well beyond the tolerance


# ---- the memory plan ---------------------------------------------------------------------------

def _planned(args):
    roles = preflight(args)
    return {g.role: g for g in planner.plan(roles).groups}


@pytest.mark.multi_rank
@pytest.mark.parametrize("n", [1, 2])
def test_plan_matches_the_bytes_ranks_hold(ray_session, sd3, tmp_path, n):
    url, prompts = sd3
    args = load_args("wan-video", dict(H3_CPU, hf_checkpoint=url, prompts=prompts, save=str(tmp_path),
                                        num_devices=n, run_name=f"plan-{n}"))
    planned = _planned(args)
    with DistillRun(args) as run:
        run.iterate(1)  # the optimizer state exists after a step
        held = {role: run.group_call(role, "state_bytes") for role in run.groups}
    for role, per_rank in held.items():
        plan = planned[role]
        for rank_bytes in per_rank:
            for kind, figure in (("params", plan.params), ("optimizer", plan.optimizer), ("ema", plan.ema),
                                 ("teacher", plan.teacher)):
                assert abs(rank_bytes[kind] - figure) <= 0.1 * max(figure, 1), (role, kind, rank_bytes[kind], figure)


def test_plan_refuses_a_model_that_does_not_fit_before_any_actor(tmp_path, capsys, monkeypatch):
    from dmd2_core.cli import main as dmd2_main

    save = tmp_path / "run"
    line = flow_cli_refusal(capsys, monkeypatch, "--recipe", "wan-video", "--hf-checkpoint", str(CONFIGS / "wan2.1-t2v-14b"),
                            "--prompts", "digits", "--save", str(save), "--set", "num_devices=1",
                            "--set", "device_memory_gib=80", "--set", "latent_shape=[16,21,60,104]")
    assert "memory plan: the" in line and "group" in line and "GiB per device" in line
    assert "cp_size" in line and "num_devices" in line and "micro_batch_size" in line
    assert not save.exists()
    # the same configuration on 8 devices with the plan's own advice fits
    code = dmd2_main(["plan", "--recipe", "wan-video", "--set", f"hf_checkpoint={CONFIGS / 'wan2.1-t2v-14b'}",
                      "--set", "latent_shape=[16,21,60,104]", "--set", "device_memory_gib=80", "--set", "micro_batch_size=1",
                      "--set", "cp_size=4", "--set", "global_batch_size=16", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    out = json.loads(out.out)
    assert out["num_devices"] == 8 and out["device_peak"] <= 0.9 * 80 * planner.GIB and out["fits"]
    actor = next(g for g in out["groups"] if g["role"] == "actor")
    assert 14e9 * 4 / 8 <= actor["params"] <= 14.6e9 * 4 / 8  # 14.3 B fp32 master weights, 1/8 per rank


@pytest.mark.parametrize("overrides, needle", [
    (dict(num_devices=4, fsdp_shard_size=3), "fsdp_shard_size"),
    (dict(fsdp_cpu_offload=True), "fsdp_cpu_offload"),
    (dict(critic_fsdp_cpu_offload=True), "critic_fsdp_cpu_offload"),
])
def test_bad_parallel_settings_fail_in_one_line(tiny_teacher, tmp_path, overrides, needle):
    with pytest.raises(ArgsError, match=needle) as info:
        tiny_args(tiny_teacher, str(tmp_path), **overrides)
    assert "\n" not in str(info.value)
    assert not any(tmp_path.iterdir())


# ---- placement across nodes --------------------------------------------------------------------

def test_ranks_are_ordered_by_node_then_device():
    assert parallel.bundles_in_node_order(["a", "b", "a", "b"]) == [0, 2, 1, 3]
    assert parallel.bundles_in_node_order(["n1", "n1", "n0", "n0"]) == [0, 1, 2, 3]
    assert parallel.bundles_in_node_order(["x"]) == [0]


def _wait_for_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on {port} after {timeout_s} s"
            time.sleep(0.2)


@pytest.mark.multi_rank
def test_a_group_across_two_ray_nodes(one_rank, tiny_teacher, tmp_path):
    """A real two-node Ray cluster on this machine that the run did not start (a head and a worker
    node started with the CLI, one device each, token auth; joined through ray_address): the
    2-rank group spans both nodes, ordered by node, its two FSDP shards give the weights of 1 rank
    after 3 iterations (a gradient summed instead of averaged over ranks would double every
    update), and each node's rank writes its own shards of the checkpoint."""
    ray_bin = Path(sys.executable).parent / "ray"
    port = free_port()
    dirs = [tempfile.mkdtemp(prefix="ray-", dir="/tmp") for _ in range(2)]  # short socket paths
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_ADDRESS": ""}
    common = ["--block", "--num-cpus=1", '--resources={"dmd2_device": 1}', "--disable-usage-stats"]
    head = subprocess.Popen([str(ray_bin), "start", "--head", f"--port={port}", "--include-dashboard=false",
                             f"--temp-dir={dirs[0]}", *common],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    procs = [head]
    script = f"""
import json, socket, time, ray, torch
from tests.helpers import tiny_args
from dmd2_core.run.distill_run import DistillRun
deadline = time.monotonic() + 180
while True:  # started beside the head (its imports overlap the head's start): until its GCS listens
    try:
        socket.create_connection(("127.0.0.1", {port}), timeout=1).close()
        break
    except OSError:
        assert time.monotonic() < deadline, "nothing listens on {port}"
        time.sleep(0.2)
ray.init(address="127.0.0.1:{port}", namespace="two-nodes")  # the run joins this connection
while ray.cluster_resources().get("dmd2_device", 0) < 2:  # until the worker node has joined
    assert time.monotonic() < deadline, ray.cluster_resources()
    time.sleep(0.5)
args = tiny_args({tiny_teacher!r}, {str(tmp_path / 'run')!r}, ray_address="127.0.0.1:{port}", num_devices=2,
                 run_name="two-nodes")
with DistillRun(args) as run:
    for i in (1, 2, 3):
        m = run.iterate(i)
    saved = run.checkpoint(3)
    torch.save({{role: run.group_call(role, "weights")[0] for role in run.groups}}, {str(tmp_path / 'weights.pt')!r})
    group = run.groups["actor"]
    nodes = ray.util.placement_group_table(run.pg)["bundles_to_node_id"]
    print(json.dumps({{"nodes": [nodes[b] for b in group.bundle_indices], "alive": len(ray.nodes()),
                      "where": group.get([r.placement.remote() for r in group.ranks]),
                      "dmd2_loss": m["dmd2_loss"], "gcs": ray.get_runtime_context().gcs_address,
                      "tracked": saved["checkpoint_iteration"]}}))
"""
    try:
        driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, cwd=ROOT, env=env, start_new_session=True)
        procs.append(driver)
        _wait_for_port(port, 120)  # the head's GCS listens
        worker = subprocess.Popen([str(ray_bin), "start", f"--address=127.0.0.1:{port}", f"--temp-dir={dirs[1]}",
                                   *common], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True, env=env)
        procs.append(worker)
        stdout, stderr = driver.communicate(timeout=240)
        assert driver.returncode == 0, stderr[-3000:]
        out = json.loads(stdout.strip().splitlines()[-1])
        assert out["alive"] == 2 and len(set(out["nodes"])) == 2  # one rank on each node
        assert all(w["share"] == 0.5 for w in out["where"])
        two = torch.load(tmp_path / "weights.pt", weights_only=True)
        for role in ("actor", "critic"):  # the same 3 iterations on one rank
            want = one_rank[1][role]
            assert max((two[role][k] - want[k]).abs().max().item() for k in want) < 2e-6, role
        assert out["gcs"].endswith(f":{port}") and out["tracked"] == 3
        marker = json.loads((Path(ckpt.trainer_dir(str(tmp_path / "run"), "actor", 3)) / "complete.json").read_text())
        assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(marker["sha256"])
    finally:
        for proc in reversed(procs):
            with contextlib.suppress(ProcessLookupError):  # the driver's group is gone once it has ended
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
