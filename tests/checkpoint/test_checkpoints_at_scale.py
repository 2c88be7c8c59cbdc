"""Checkpoints at real scale: sharded (DCP) saves written by every rank (of shards that survive
sleep/wake bitwise), asynchronous saves that training does not wait for, resume bitwise on the same number of ranks and across rank counts,
retention in a run, and an S3 outage in the middle of an asynchronous save."""

from __future__ import annotations

import json
import os
import time

import psutil
import pytest
import ray

from dmd2_core import checkpoint as ckpt
from dmd2_core import storage
from dmd2_core.run.distill_run import DistillRun
from tests.helpers import tiny_args


def _digests(run) -> dict:
    return {role: run.group_call(role, "state_digest") for role in run.groups}


@pytest.mark.multi_rank
@pytest.mark.parametrize("where", ["s3"])  # local: test_resume_on_another_number_of_ranks_continues_smoothly
def test_async_save_at_2_kill_resume_to_4_equals_4_straight(ray_session, tiny_teacher, tmp_path, request, where):
    """2 sharded ranks, actor and critic: every shard survives sleep/wake bitwise; an asynchronous
    save at 2 while training goes on to 4; new actors resume from it with the saved bytes and reach
    the same bytes at 4 (weights, EMA, AdamW state)."""
    save = str(tmp_path / "run") if where == "local" else request.getfixturevalue("s3_bucket") + "/run"
    args = tiny_args(tiny_teacher, save, num_devices=2, ema_decay=0.9, async_save=True, run_name=f"async-{where}")
    with DistillRun(args) as run:
        run.iterate(1)
        run.iterate(2)
        saved = _digests(run)
        assert saved["actor"][0] != saved["actor"][1]  # each rank holds its own shard
        assert all(f["bytes_freed"] > 0 for f in run.group_call("actor", "sleep"))
        assert _digests(run) == saved  # woke bitwise
        out = run.checkpoint(2)
        if "checkpoint_save_s" not in out:  # returned before the save was durable: not tracked yet
            assert run.pending_save == 2 and ckpt.read_latest(save) is None
        rows = [run.iterate(3), run.iterate(4)]
        deadline = time.monotonic() + 120
        while run.pending_save is not None and time.monotonic() < deadline:  # written meanwhile, or soon
            rows.append(run.poll_saves())
            time.sleep(0.2)
        tracked = out if "checkpoint_save_s" in out else next(r for r in rows if "checkpoint_save_s" in r)
        assert tracked["checkpoint_iteration"] == 2 and tracked["checkpoint_save_s"] > 0
        assert tracked["checkpoint_bytes_per_rank"] > 0
        straight = _digests(run)
    assert ckpt.read_latest(save) == 2
    for role in ("actor", "critic"):
        marker = json.loads(storage.read_text(storage.join(ckpt.trainer_dir(save, role, 2), "complete.json")))
        assert marker["world_size"] == 2
        assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(marker["sha256"])  # each rank wrote its shards
    with DistillRun(args) as again:
        assert again.start_iteration == 2
        assert _digests(again) == saved
        again.iterate(3)
        again.iterate(4)
        assert _digests(again) == straight


@pytest.mark.multi_rank
def test_resume_on_another_number_of_ranks_continues_smoothly(ray_session, tiny_teacher, tmp_path):
    """Saved on 2 ranks, resumed on 1 (and saved on 1, resumed on 2): the weights load exactly
    (DCP reshards) and training continues with the losses of an uninterrupted run, up to the
    order of floating-point reductions. The 1-rank run keeps its newest two checkpoints."""
    save = str(tmp_path / "two")
    two = tiny_args(tiny_teacher, save, num_devices=2, ema_decay=0.9, run_name="reshard-two")
    with DistillRun(two) as run:
        run.iterate(1)
        run.iterate(2)
        run.checkpoint(2)
        whole = {role: run.group_call(role, "weights")[0] for role in run.groups}
        straight = [run.iterate(i) for i in (3, 4)]
    one = tiny_args(tiny_teacher, str(tmp_path / "one"), load=save, ema_decay=0.9, keep_last_n=2, run_name="reshard-one")
    with DistillRun(one) as run:
        assert run.start_iteration == 2
        for role in run.groups:
            got = run.group_call(role, "weights")[0]
            assert got.keys() == whole[role].keys() and all(got[k].equal(whole[role][k]) for k in got)
        resumed = []
        for i in (3, 4, 5):
            resumed.append(run.iterate(i))
            out = run.checkpoint(i)
        assert out["checkpoints_pruned"] == 2  # retention: iteration 3, actor and critic
        whole = {role: run.group_call(role, "weights")[0] for role in run.groups}
        sixth = run.iterate(6)
    for role in ("actor", "critic"):  # the newest two, the tracked one among them
        assert ckpt.saved_iterations(str(tmp_path / "one"), role) == {4: True, 5: True}
    for a, b in zip(straight, resumed):
        for key in ("dmd2_loss", "critic_loss"):
            assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(a[key])), (key, a[key], b[key])
    back = tiny_args(tiny_teacher, str(tmp_path / "one"), num_devices=2, ema_decay=0.9, run_name="reshard-back")
    with DistillRun(back) as run:
        assert run.start_iteration == 5
        for role in run.groups:
            got = run.group_call(role, "weights")[0]
            assert got.keys() == whole[role].keys() and all(got[k].equal(whole[role][k]) for k in got)
        metrics = run.iterate(6)
    for key in ("dmd2_loss", "critic_loss"):
        assert abs(metrics[key] - sixth[key]) <= 1e-4 * max(1.0, abs(sixth[key])), (key, metrics[key], sixth[key])


def _wait_gone(pids: list[int], timeout_s: float) -> None:
    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout_s
    while any(map(alive, pids)):
        assert time.monotonic() < deadline, f"ranks {pids} still alive {timeout_s:.0f} s after ray.kill"
        time.sleep(0.1)


def test_s3_stopped_in_the_middle_of_an_async_save(ray_session, tiny_teacher, s3_bucket, s3_outage):
    """The endpoint goes down as the asynchronous save of iteration 2 starts; the run dies while
    the save is still retrying. The tracker names iteration 1 (complete); once the endpoint is
    back, a rerun resumes from 1 and reaches the uninterrupted run's bytes."""
    save = f"{s3_bucket}/run"
    args = tiny_args(tiny_teacher, save, ema_decay=0.9, async_save=True, run_name="async-outage")
    run = DistillRun(args)
    run.start()
    restarted = None
    try:
        run.iterate(1)
        run.checkpoint(1, wait=True)
        run.iterate(2)
        restarted = s3_outage(600)  # down until every rank has died (ended below)
        t = time.monotonic()
        run.checkpoint(2)
        blocked = time.monotonic() - t
        run.iterate(3)
        assert run.pending_save == 2  # still being written: the tracker has not moved
        uninterrupted = _digests(run)
        pids = [pid for group in run.groups.values()
                for pid in ray.get([rank.__ray_call__.remote(lambda _: os.getpid()) for rank in group.ranks])]
        for group in run.groups.values():  # the run dies with its save in flight
            for rank in group.ranks:
                ray.kill(rank)
        _wait_gone(pids, 60)
    finally:
        if restarted is not None:
            restarted.end()  # the endpoint comes back, once no rank lives to finish the save
            restarted.join()
        run.shutdown()
    assert blocked < 10.0  # the save did not wait for the endpoint
    assert ckpt.read_latest(save) == 1
    assert not storage.exists(storage.join(ckpt.trainer_dir(save, "actor", 2), "complete.json"))
    with DistillRun(args) as again:
        assert again.start_iteration == 1
        again.iterate(2)
        again.checkpoint(2, wait=True)
        again.iterate(3)
        assert _digests(again) == uninterrupted
    assert ckpt.read_latest(save) == 2
