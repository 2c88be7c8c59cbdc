"""Faults injected into tiny runs: nothing lost, nothing silent.

Non-finite values (through train-input hooks), two runs on one save URL, storage outages (the
moto server stopped and restarted on its port), and no processes left behind when the flow process
dies. Bad input caught before any actor: test_preflight.py; damaged checkpoints:
checkpoint/test_broken_checkpoints.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dmd2_core import checkpoint as ckpt
from dmd2_core import storage
from dmd2_core.run.distill_run import DistillRun
from dmd2_core.errors import LeaseHeldError, LeaseLostError, NonFiniteError
from tests.helpers import in_process_trainers, iterate_in_process, tiny_args

HOOKS = "tests.hooks_fixture"


def _weights(save: str, role: str, iteration: int, sub: str = "model") -> dict[str, torch.Tensor]:
    return ckpt.read_weights(save, role, iteration, sub)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _all_finite(w: dict) -> bool:
    return all(torch.isfinite(v).all() for v in w.values())


# ---- non-finite steps -------------------------------------------------------------------------

def test_nonfinite_steps_are_skipped_counted_and_never_saved(ray_session, tiny_teacher, tmp_path):
    """NaN in the DMD gradient (iteration 2), in the student's inputs (3) and in the critic's
    inputs (4): each step that sees it is skipped (weights, EMA and optimizer untouched), counted
    in the metrics, and every checkpoint holds finite weights; iteration 5 trains normally."""
    save = str(tmp_path / "run")
    args = tiny_args(tiny_teacher, save, ema_decay=0.5, run_name="dmd2-nan",
                     train_input_hook_path=f"{HOOKS}.nan_into_actor_inputs",
                     critic_train_input_hook_path=f"{HOOKS}.nan_into_critic_inputs")
    rows = {}
    with DistillRun(args) as run:
        for i in range(1, 6):
            rows[i] = run.iterate(i)
            run.checkpoint(i)
    assert [rows[i]["actor_nonfinite_steps"] for i in rows] == [0, 1, 1, 1, 0]
    assert [rows[i]["critic_nonfinite_steps"] for i in rows] == [0, 0, 0, args.dmd2_update_ratio, 0]
    assert [rows[i]["actor_dmd2_grad_nonfinite"] for i in rows] == [0, 1, 0, 1, 0]
    assert [rows[i]["dmd2_grad_nonfinite"] for i in rows] == [0, 0, 0, 1, 0]  # counted, not zeroed

    for sub in ("model", "ema"):
        actor = {i: _weights(save, "actor", i, sub) for i in rows}
        assert all(_all_finite(w) for w in actor.values())
        assert _same(actor[1], actor[2]) and _same(actor[2], actor[3]) and _same(actor[3], actor[4])
        assert not _same(actor[4], actor[5])
    critic = {i: _weights(save, "critic", i) for i in rows}
    assert all(_all_finite(w) for w in critic.values())
    assert not _same(critic[2], critic[3]) and _same(critic[3], critic[4]) and not _same(critic[4], critic[5])
    state = torch.load(Path(ckpt.trainer_dir(save, "actor", 5)) / "trainer_state.pt", weights_only=True)
    assert state["extra"]["nonfinite_steps"] == 3 and state["extra"]["step"] == 2


def test_too_many_nonfinite_steps_in_a_row_fail_in_one_line(tiny_teacher, tmp_path):
    import ray

    from dmd2_core.run.distill_run import _as_ray_error, preflight
    from dmd2_core.train.trainer import Trainer

    args = tiny_args(tiny_teacher, str(tmp_path / "run"), max_nonfinite_steps=2,
                     train_input_hook_path=f"{HOOKS}.nan_dmd2_gradient_always")
    actor = Trainer(preflight(args)["actor"], "actor")
    before = actor.state_digest()
    pairs, _ = actor.rollout(1)
    grad = {"dmd2_grad": torch.zeros_like(pairs["x0"])}
    assert actor.train(1, pairs, grad)[1]["actor_nonfinite_steps"] == 1
    with pytest.raises(NonFiniteError) as info:
        actor.train(2, pairs, grad)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("actor: 2 non-finite steps in a row at iteration 2"), msg
    assert actor.state_digest() == before  # neither step touched weights or optimizer state
    # from a Ray actor it reaches the driver as itself: one line, not the remote traceback
    remote = ray.exceptions.RayTaskError("train", "Traceback (most recent call last):\n  ...", info.value)
    assert _as_ray_error(remote) is info.value


def test_a_nonfinite_weight_is_never_written(tiny_teacher, tmp_path):
    from dmd2_core.models import load_model_dir

    model = load_model_dir(tiny_teacher).model
    opt = torch.optim.AdamW(model.parameters())
    with torch.no_grad():
        next(model.parameters()).view(-1)[3] = float("inf")
    with pytest.raises(NonFiniteError, match=r"critic: not saving iteration 7: 'model\.\S+' holds 1 non-finite"):
        ckpt.save_trainer(str(tmp_path), "critic", 7, model, opt)
    assert not Path(ckpt.trainer_dir(str(tmp_path), "critic", 7)).exists()


# ---- one run per save URL ---------------------------------------------------------------------

def test_lease_one_owner_at_a_time(root):
    import json
    import subprocess
    import sys

    from dmd2_core.run import lease

    a = lease.Lease.acquire(root, "run-a", timeout_s=2)  # renewed every 0.5 s: a waiter sees it renew
    with pytest.raises(LeaseHeldError, match=r"save: .* is in use by run 'run-a' \(host .*, pid \d+, holder \w+\), "
                                             r"renewal \d+ at .* by its clock, which renewed its lease while this run"):
        lease.Lease.acquire(root, "run-b", timeout_s=60)
    with pytest.raises(LeaseHeldError):
        lease.check_free(root, None, 60)
    lease.check_free(root, "run-a", 60)  # its own preflight passes (acquiring decides)
    a.release()
    assert lease.read(root) is None

    # a crashed owner on this host (its process is gone): taken over at once
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record = {**lease._record("crashed"), "pid": int(dead.stdout), "pid_start": None}
    storage.write_text(lease.lease_url(root), json.dumps(record))
    b = lease.Lease.acquire(root, "run-b", timeout_s=60)
    assert lease.read(root)["owner"] == "run-b"
    b.release()

    # the same flow run's process killed and not yet reaped (a zombie): gone, taken over at once
    import time

    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    while lease._pid_stat(zombie.pid)[:1] != ["Z"]:
        time.sleep(0.05)
    record = {**lease._record("flow-run-z"), "pid": zombie.pid, "pid_start": lease._pid_start(zombie.pid)}
    storage.write_text(lease.lease_url(root), json.dumps(record))
    start = time.monotonic()
    rerun = lease.Lease.acquire(root, "flow-run-z", timeout_s=60)
    assert time.monotonic() - start < 5 and lease.read(root)["holder"] == rerun.holder
    rerun.release()
    zombie.wait()
    b = lease.Lease.acquire(root, "run-b", timeout_s=60)

    # an owner elsewhere whose renewals stopped: stale once unrenewed for the timeout
    record = {**lease._record("run-b"), "host": "elsewhere", "pid_space": "elsewhere"}
    storage.write_text(lease.lease_url(root), json.dumps(record))
    c = lease.Lease.acquire(root, "run-c", timeout_s=1.5)
    assert lease.read(root)["owner"] == "run-c"
    assert b.backend.renew(b.next_record()) is None  # b finds it lost on its next renewal
    c.release()
    b.release()

    # a run whose lease was taken over stops writing: its heartbeat notices, ensure() raises
    d = lease.Lease.acquire(root, "run-d", timeout_s=1.0)
    storage.write_text(lease.lease_url(root), json.dumps(lease._record("run-e")))
    deadline = time.monotonic() + 10
    while d.lost is None and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(LeaseLostError, match="this run's lease was taken over by run 'run-e'"):
        d.ensure()
    d.release()
    assert lease.read(root)["owner"] == "run-e"  # the new owner's lease is left alone


# A process holding the lease for a flow run (argv: save URL, run id, timeout), as the first
# process of a flow run that Prefect marked Crashed while it still runs: it prints "held", then,
# once its heartbeat finds another holder, what ensure() (before any write) raises, and exits 3.
HOLD_LEASE = """
import sys, time
from dmd2_core.run import lease
from dmd2_core.errors import LeaseLostError, one_line
held = lease.Lease.acquire(sys.argv[1], sys.argv[2], timeout_s=float(sys.argv[3]))
print("held", flush=True)
while held.lost is None:
    time.sleep(0.05)
try:
    held.ensure()
except LeaseLostError as exc:
    print(one_line(exc), flush=True)
    sys.exit(3)
"""


def test_a_rerun_of_a_flow_run_whose_first_process_lives_never_writes_beside_it(root):
    """Prefect reran a flow run whose first process still runs (its API calls stopped, its
    storage did not): the rerun, same flow-run id, refuses in one line while that process renews;
    once it stops renewing (frozen), the rerun takes over and the first, woken, stops writing."""
    import os
    import signal
    import subprocess
    import sys

    from dmd2_core.run import lease

    first = subprocess.Popen([sys.executable, "-c", HOLD_LEASE, root, "flow-run-x", "4"], stdout=subprocess.PIPE,
                             text=True, cwd=Path(__file__).resolve().parent.parent)
    try:
        assert first.stdout.readline().strip() == "held"
        with pytest.raises(LeaseHeldError) as info:
            lease.Lease.acquire(root, "flow-run-x", timeout_s=4)
        msg = str(info.value)
        assert "\n" not in msg and "in use by another process of this flow run" in msg and f"pid {first.pid}," in msg
        assert lease.read(root)["pid"] == first.pid  # untouched: one writer

        os.kill(first.pid, signal.SIGSTOP)  # frozen: its heartbeat stops
        rerun = lease.Lease.acquire(root, "flow-run-x", timeout_s=4)
        assert lease.read(root)["holder"] == rerun.holder
        os.kill(first.pid, signal.SIGCONT)
        out, _ = first.communicate(timeout=30)
        assert first.returncode == 3 and out.count("\n") == 1, out
        assert out.startswith("LeaseLostError: ") and "flow-run-x" in out, out
        rerun.ensure()
        assert lease.read(root)["holder"] == rerun.holder  # the woken process wrote nothing
        rerun.release()
    finally:
        if first.poll() is None:
            os.kill(first.pid, signal.SIGCONT)
            first.kill()


def _storage_outage(*_):
    raise ConnectionRefusedError("storage unreachable")


def test_a_lease_whose_renewals_lapsed_is_verified_before_the_run_stops_writing(tmp_path, monkeypatch):
    """Storage retries outlast the lease timeout. Renewals that lapsed are checked against the
    lease before a write: still ours (nobody took it during the outage) -> renewed and the run goes
    on at once; unreadable past the timeout -> no write, in one line; taken by another run -> no
    write, a retried error naming that run."""
    import time

    from prefect.states import Failed

    from dmd2_core.run import lease
    from tasks.common import retry_runtime_failures

    root = str(tmp_path)
    held = lease.Lease.acquire(root, "run-a", timeout_s=1.0)
    renew = held.backend.renew
    monkeypatch.setattr(held.backend, "renew", _storage_outage)
    held.ensure()
    time.sleep(1.3)
    with pytest.raises(LeaseLostError, match=r"last renewed \d+ s ago \(timeout 1 s\) and cannot be read now") as info:
        held.ensure()
    assert "\n" not in str(info.value)
    monkeypatch.setattr(held.backend, "renew", renew)  # storage is back, nobody took the lease:
    held.ensure()  # verified and renewed here, not by the next heartbeat
    assert lease.read(root)["holder"] == held.holder

    monkeypatch.setattr(held.backend, "renew", _storage_outage)  # out again, and this time
    time.sleep(1.3)
    other = lease.Lease.acquire(root, "run-b", timeout_s=1.0)  # another run takes the stale lease over
    monkeypatch.setattr(held.backend, "renew", renew)
    with pytest.raises(LeaseLostError) as info:
        held.ensure()
    msg = str(info.value)
    assert "\n" not in msg and "this run's lease was taken over by run 'run-b'" in msg, msg
    assert retry_runtime_failures(None, None, Failed(data=info.value))  # the retry re-acquires (refused while run-b lives)
    held.release()
    assert lease.read(root)["holder"] == other.holder  # left alone
    other.release()


def test_the_tracker_write_after_the_fence_never_outlasts_the_lease(tmp_path, monkeypatch):
    """The tracker write passes the fence, then meets a storage outage: it stops retrying when the
    lease could go stale (another run may own the URL by then), not after the 300 s budget."""
    import time
    from types import SimpleNamespace

    from dmd2_core.errors import StorageUnavailableError
    from dmd2_core.run import lease
    from dmd2_core.run.checkpoint_commits import CheckpointCommits

    held = lease.Lease.acquire(str(tmp_path), "run-a", timeout_s=2.0)
    monkeypatch.setattr(held.backend, "renew", _storage_outage)  # its heartbeat cannot land either

    class Unreachable:  # an object store whose writes are refused from now on
        def exists(self, path):
            return True  # the roles' markers, read before the outage

        def pipe_file(self, path, data, **kw):
            raise ConnectionRefusedError("connection refused")

    monkeypatch.setattr(storage, "filesystem", lambda url: (Unreachable(), url.split("://", 1)[-1]))
    monkeypatch.setattr(storage, "RETRY_S", 30.0)
    tracker = CheckpointCommits(SimpleNamespace(save="s3://bucket/run", keep_last_n=2, keep_exports=1))
    start = time.monotonic()
    with pytest.raises(StorageUnavailableError, match=r"latest_checkpointed_iteration.txt: storage unavailable for [0-2] s") as info:
        tracker.track(held, 1, {"actor": [{"url": "s3://bucket/run/actor", "save_s": 0.0, "bytes": 0}]})
    assert time.monotonic() - start < held.timeout_s + 1.0 and "\n" not in str(info.value)
    assert tracker.pending is None and tracker.tracked is None
    held.release()


def test_a_rerun_takes_over_from_a_frozen_first_process_and_ends_as_an_uninterrupted_run(
        ray_session, tiny_teacher, tmp_path, monkeypatch):
    """The first process of flow run X checkpoints iteration 1, then its heartbeats stop landing
    (frozen); Prefect starts X again: the rerun waits for the lease to go stale, takes it over and
    resumes. The first, woken, stops at its next write in one line (retried: its retry is refused
    while the rerun lives), and the rerun ends with an uninterrupted run's weights."""
    from prefect.states import Failed

    from dmd2_core.run import lease
    from tasks.common import retry_runtime_failures

    save = str(tmp_path / "run")
    args = tiny_args(tiny_teacher, save, run_name="dmd2-rerun", lease_timeout_s=3.0)  # margin for a loaded machine
    first, rerun = DistillRun(args, owner="flow-run-x"), None
    try:
        first.start()
        first.iterate(1)
        first.checkpoint(1, wait=True)
        renew = first.lease.backend.renew
        monkeypatch.setattr(first.lease.backend, "renew", _storage_outage)  # frozen
        rerun = DistillRun(args, owner="flow-run-x")
        assert rerun.start() == 1
        assert lease.read(save)["holder"] == rerun.lease.holder
        monkeypatch.setattr(first.lease.backend, "renew", renew)  # woken
        with pytest.raises(LeaseLostError) as info:
            first.checkpoint(2, wait=True)
        msg = str(info.value)
        assert "\n" not in msg and "lease was taken over by run 'flow-run-x'" in msg, msg
        assert retry_runtime_failures(None, None, Failed(data=info.value))
        with pytest.raises(LeaseHeldError, match="in use by another process of this flow run"):
            first.checkpoint(2, wait=True)  # the retry
        assert ckpt.read_latest(save) == 1
        rerun.iterate(2)
        rerun.checkpoint(2, wait=True)
        digests = {role: rerun.group_call(role, "state_digest")[0] for role in rerun.groups}
    finally:
        first.shutdown()
        if rerun is not None:
            rerun.shutdown()
    assert ckpt.read_latest(save) == 2 and lease.read(save) is None
    uninterrupted = in_process_trainers(tiny_args(tiny_teacher, str(tmp_path / "uninterrupted"), run_name="dmd2-rerun"))
    for i in (1, 2):
        iterate_in_process(uninterrupted, i)
    assert digests == {role: t.state_digest() for role, t in uninterrupted.items()}


def test_second_run_on_one_url_refuses_before_any_actor(ray_session, tiny_teacher, tmp_path, capsys):
    save = str(tmp_path / "run")
    args = tiny_args(tiny_teacher, save, run_name="dmd2-lease-a", num_iterations=1, lease_timeout_s=2.0)  # renews often
    with DistillRun(args, owner="flow-run-a") as first:
        from dmd2_core.run import lease

        with pytest.raises(LeaseHeldError, match="run 'flow-run-a'"):
            DistillRun(tiny_args(tiny_teacher, save, run_name="dmd2-lease-b", seed=1), owner="flow-run-b")
        from flows.dmd2 import main  # the CLI: one line, exit 2, before Prefect or Ray start

        code = main(["--recipe", "tiny", "--hf-checkpoint", tiny_teacher, "--save", save, "--seed", "1"])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, err
        assert "is in use by run 'flow-run-a'" in err and "renewed its lease while this run watched it" in err
        first.iterate(1)
        first.checkpoint(1)
    assert ckpt.read_latest(save) == 1
    assert lease.read(save) is None  # released at the end


# ---- storage outages --------------------------------------------------------------------------

OUTAGE_S = 10.0  # longer than one retry (a refused attempt takes ~8 s inside botocore and s3fs)


def test_a_run_rides_out_an_s3_outage_during_a_checkpoint(ray_session, tiny_teacher, s3_bucket, s3_outage, tmp_path):
    """The S3 endpoint goes down as checkpoint 1 starts (the trainers' saves and the tracker write
    hit refused connections) and comes back OUTAGE_S later: the checkpoint completes, the run goes
    on, and it ends bitwise equal to an uninterrupted run (the same Trainer code in this process);
    every file written during the outage passes its sha256 check. The outage outlasts the lease
    timeout (its renewals lapse): nobody took the lease, so the tracker write verifies it, renews it
    and goes on."""
    import time

    save = f"{s3_bucket}/run"
    args = tiny_args(tiny_teacher, save, run_name="dmd2-outage", lease_timeout_s=OUTAGE_S / 2)
    with DistillRun(args) as run:
        run.iterate(1)
        start = time.monotonic()
        restarted = s3_outage(OUTAGE_S)
        run.checkpoint(1)
        took = time.monotonic() - start
        restarted.join()
        run.iterate(2)
        digests = {role: run.group_call(role, "state_digest")[0] for role in run.groups}
    assert took >= OUTAGE_S  # the checkpoint waited the outage out
    assert ckpt.validate_resume(save, ["actor", "critic"]) == 1  # listing, sizes and sha256 of every file

    fresh = tiny_args(tiny_teacher, f"{s3_bucket}/uninterrupted", run_name="dmd2-outage")  # no tracker: not a resume
    uninterrupted = in_process_trainers(fresh)
    for i in (1, 2):
        iterate_in_process(uninterrupted, i)
    assert digests == {role: t.state_digest() for role, t in uninterrupted.items()}


def test_transient_and_permanent_storage_errors(s3_bucket, s3_outage, monkeypatch):
    """Transient errors are retried and never become bad input; permanent ones fail at once."""
    import time

    from dmd2_core.storage import is_transient
    from dmd2_core.errors import StorageUnavailableError

    url = f"{s3_bucket}/x.txt"
    storage.write_text(url, "1")
    s3_outage(3.0)
    t = time.monotonic()
    assert ckpt.read_latest(f"{s3_bucket}/nothing-here") is None  # a tracker read rides it out
    assert storage.read_text(url) == "1" and time.monotonic() - t >= 3.0

    monkeypatch.setattr(storage, "RETRY_S", 1.0)  # an outage longer than the retry budget
    # it lasts until the read has failed: one refused attempt takes ~8 s inside botocore, longer
    # on a loaded machine, so a timed outage could end inside it and the read would succeed
    outage = s3_outage(600)
    try:
        with pytest.raises(StorageUnavailableError) as info:  # never a CheckpointLoadError (exit code 2)
            ckpt.read_latest(s3_bucket)
    finally:
        outage.end()
    assert not isinstance(info.value, ValueError) and "storage unavailable for 1 s" in str(info.value)
    assert "\n" not in str(info.value)
    from tasks.common import retry_runtime_failures
    from prefect.states import Failed

    assert retry_runtime_failures(None, None, Failed(data=info.value))  # the task is retried

    for permanent in (FileNotFoundError("no such key"), PermissionError("access denied"), ValueError("bad")):
        assert not is_transient(permanent)
    assert is_transient(ConnectionRefusedError()) and is_transient(TimeoutError())


# ---- no orphans -------------------------------------------------------------------------------

def test_no_orphans_after_sigkill_of_the_flow_process(tiny_teacher, tmp_path):
    """The flow run as `python -m flows.dmd2` (a subprocess with its own Prefect temporary server
    and local Ray) is SIGKILLed while its trainer groups start: every process it started is gone
    within seconds, and a rerun is not refused by the dead run's lease."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from dmd2_core.run import lease
    from dmd2_core.run.reaper import _alive, descendants

    save = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update({"PREFECT_HOME": str(tmp_path / "prefect-home"), "RAY_ADDRESS": "local", "PYTHONUNBUFFERED": "1"})
    err = tmp_path / "flow.err"
    with open(err, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.dmd2", "--recipe", "tiny", "--hf-checkpoint", tiny_teacher,
             "--save", str(save), "--num-iterations", "500", "--set", "global_batch_size=8",
             "--set", "micro_batch_size=8", "--set", "eval_interval=0", "--set", "save_interval=1"],
            cwd=Path(__file__).resolve().parent.parent, env=env, stdout=subprocess.DEVNULL, stderr=out,
            start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (save / "lease.json").exists():  # Prefect's server and Ray are up, actors starting
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.5)
        time.sleep(1)
        started = descendants({proc.pid})
        names = {p: Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:300] for p in started}
        assert any(b"raylet" in n for n in names.values()) and any(b"uvicorn" in n or b"prefect" in n
                                                                 for n in names.values()), names
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        gone_by = time.monotonic() + 10
        while any(_alive(p, s) for p, s in started.items()) and time.monotonic() < gone_by:
            time.sleep(0.2)
        left = {p: names[p] for p, s in started.items() if _alive(p, s)}
        assert not left, left
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert lease.read(str(save))["pid"] == proc.pid  # the crashed run's lease is still there,
    args = tiny_args(tiny_teacher, str(save), num_iterations=500)
    DistillRun(args)  # but its process is gone: a rerun passes preflight and would take it over
