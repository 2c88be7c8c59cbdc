"""What the tests share: plain functions and constants (the fixtures and hooks are in conftest.py).

No test file imports another test file; what two of them need lives here (the tiny-model
checkpoint helpers of the checkpoint tests: tests/checkpoint/helpers.py)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from dmd2_core.data import PromptSet
from flows.environment import free_port  # noqa: F401 - the one free-port helper of the tests

REPO = Path(__file__).resolve().parent.parent

# ---- runs ---------------------------------------------------------------------------------------

# The flow's overrides of the tiny recipe for short runs that evaluate and save every iteration.
FAST = {
    "global_batch_size": 8,
    "micro_batch_size": 8,
    "eval_interval": 1,
    "eval_num_samples": 50,
    "eval_samples_per_prompt": 2,
    "save_interval": 1,
    "dmd2_guidance_scale": 1.5,
    "sleep_after_train": True,  # the sleep tasks and their recovery (off by default on cpu)
}

# The wan-video recipe on the CPU stand-ins.
CPU_OVERRIDES = dict(device="cpu", num_devices=1, dtype="float32", global_batch_size=4, micro_batch_size=2,
                     num_iterations=2, eval_interval=1, save_interval=2, eval_prompts=[0, 1],
                     eval_samples_per_prompt=2, torch_threads=1, eval_num_samples=4, eval_reference_steps=2)

SHORT_TEACHER_STEPS = 500  # the training steps of the session's short digits teacher (conftest)


def tiny_args(teacher: str, save: str, **overrides):
    from dmd2_core.args import load_args

    values = dict(hf_checkpoint=teacher, prompts="digits", save=save, global_batch_size=8,
                  micro_batch_size=8, num_devices=1, dmd2_update_ratio=2, seed=3, dmd2_guidance_scale=2.0)
    values.update(overrides)
    return load_args(None, values)


def flow_cli_refusal(capsys, monkeypatch, *argv) -> str:
    """flows.dmd2's CLI in process: its exit code must be 2, with one line on stderr and no Ray
    started; returns that line."""
    from flows.dmd2 import main

    started = []
    monkeypatch.setattr("dmd2_core.run.groups.init_ray", lambda *a, **k: started.append(1))
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert not started
    return err


def in_process_trainers(args) -> dict:
    """The run's trainers (actor and critic), one rank each, in this process."""
    from dmd2_core.run.distill_run import preflight
    from dmd2_core.train.trainer import Trainer

    return {role: Trainer(a, role) for role, a in preflight(args).items()}


def iterate_in_process(trainers: dict, iteration: int) -> None:
    """One DMD2 iteration of in-process trainers: rollout, the critic's train, the actor's train."""
    pairs, _ = trainers["actor"].rollout(iteration)
    scores, _ = trainers["critic"].train(iteration, pairs)
    trainers["actor"].train(iteration, pairs, scores)


def resume_in_process(args, trainers: dict, iteration: int) -> dict:
    """Save ``trainers`` at ``iteration``, load fresh ones from that checkpoint and check they hold
    the same state bit for bit, then take one more iteration on both and check again; returns the
    resumed trainers."""
    for t in trainers.values():
        t.save(iteration)
    resumed = in_process_trainers(args)
    for role, t in resumed.items():
        t.load(iteration)
        assert t.state_digest() == trainers[role].state_digest(), role
    iterate_in_process(trainers, iteration + 1)
    iterate_in_process(resumed, iteration + 1)
    assert {r: t.state_digest() for r, t in resumed.items()} == {r: t.state_digest() for r, t in trainers.items()}
    return resumed


class DecodedRun:
    """What the eval media ask of a run: its args, and decoded clips of the prompts asked for
    (each prompt's own random frames, so a cell is known to be the clip's)."""

    def __init__(self, args, frames=12):
        self.args, self.frames = args, frames

    def sample(self, order, seed, num_steps=None):
        video = torch.stack([torch.rand(3, self.frames, 32, 32, generator=torch.Generator().manual_seed(100 + p))
                             for p in order]) * 2 - 1
        return {"video": video, "audio": torch.zeros(len(order), 2, 2000), "sample_rate": 16000, "fps": 24.0}


def world_teacher(tmp_path_factory, fixture: Path) -> str:
    """A copy of a committed sounding-digits world's teacher (``fixture``) with its prompt and real
    sets rebuilt beside it (not committed: ``ensure_conditions`` makes them to the bit)."""
    import shutil

    from dmd2_core.toys import sounding_digits_teacher

    url = tmp_path_factory.mktemp(fixture.name) / "teacher"
    shutil.copytree(fixture, url)
    sounding_digits_teacher.ensure_conditions(str(url))
    return str(url)


def assert_same_prompt_set(url: str, expected: PromptSet) -> None:
    """The prompt set at ``url`` holds ``expected``'s tensors to the bit."""
    from dmd2_core.data import load_prompt_set

    stored = load_prompt_set(url)
    assert stored.embeds.keys() == expected.embeds.keys()
    assert all(torch.equal(stored.embeds[k], expected.embeds[k]) for k in expected.embeds)


def h3_prompts(lengths: list[int]) -> PromptSet:
    """The MiniMax-H3 stand-in's prompt set with the given text lengths (its packed sequence is 451
    video and audio rows plus the text: odd lengths make it split over 2 ranks)."""
    from dmd2_core.toys.standins import h3_prompt_set

    base = h3_prompt_set(len(lengths))
    lengths_t = torch.tensor(lengths)
    embeds = base.embeds["prompt_embeds"] * (torch.arange(base.embeds["prompt_embeds"].shape[1])[None, :, None]
                                             < lengths_t[:, None, None])
    return PromptSet(base.prompts, {"prompt_embeds": embeds, "prompt_lengths": lengths_t}, {})


# ---- saved checkpoints --------------------------------------------------------------------------

def saved_state(save: Path, role: str, iteration: int) -> dict[str, torch.Tensor]:
    """The trained state a checkpoint holds, read back: weights, EMA (when kept) and optimizer
    state, keyed '<section>.<name>'. Fails when it finds no weights or no optimizer state."""
    from dmd2_core import checkpoint as ckpt

    state = {f"{section}.{k}": v for section in ("model", "ema", "optim")
             for k, v in ckpt.read_weights(str(save), role, iteration, section).items()}
    assert any(k.startswith("model.") for k in state) and any(k.startswith("optim.") for k in state), \
        f"{save}: no weights or optimizer state in the {role} checkpoint of iteration {iteration}"
    return state


def assert_same_saved_state(save: Path, reference: Path, iteration: int) -> None:
    for role in ("actor", "critic"):
        got, want = saved_state(save, role, iteration), saved_state(reference, role, iteration)
        assert got.keys() == want.keys(), role
        assert all(torch.equal(got[k], want[k]) for k in got), (role, [k for k in got if not torch.equal(got[k], want[k])][:3])


# ---- the session -------------------------------------------------------------------------------

def session_shared(tmp_path_factory) -> Path:
    """A directory shared by every pytest-xdist worker of this session (this process's own base
    temp without xdist): what is expensive to make is made once, under a file lock."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    shared.mkdir(exist_ok=True)
    return shared


# ---- groups of ranks -----------------------------------------------------------------------------

class RankFailure(Exception):
    """A rank of a spawned group failed (its traceback is the message), or the group hung."""


# What every rank imports, imported once by the fork server its ranks are forked from: a spawned
# rank paid ~5 s of CPU importing torch, torch.distributed's checkpoint and diffusers' models
RANK_PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.checkpoint", "diffusers", "diffusers.models",
                "dmd2_core.parallel", "dmd2_core.train.trainer", "tests.helpers"]


def spawn_ranks(world_size: int, fn, *args, timeout_s: float = 900.0) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` ranks, each a new process with one torch
    thread, all in one gloo process group on a free loopback port; returns what each rank's ``fn``
    returned, by rank. The ranks are forked from multiprocessing's fork server (never from this
    process: Ray's and moto's threads may live in it), which imported RANK_PRELOAD once; each rank
    takes this process's environment as it is at the call, as a spawned one would.

    A rank that raises fails the call at once with its traceback (RankFailure): it leaves without
    waiting for the others, which may be stuck in a collective it will never enter, and they are
    killed. When every rank returns, the ranks leave the group together (a barrier, then destroy:
    a rank that exits still holding its gloo group can abort at teardown, "terminate called without
    an active exception", seen once on a clean clone, and fail the test after its work was done).
    Ranks still running after ``timeout_s`` (also the group's collective timeout) are killed and
    fail the call too."""
    import multiprocessing.connection
    import tempfile
    import time

    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    port = free_port()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="ranks-") as out:
        procs = [ctx.Process(target=_rank_entry, args=(rank, world_size, port, timeout_s, fn, args, out, env),
                             name=f"rank-{rank}") for rank in range(world_size)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                failed = [rank for rank, proc in enumerate(procs) if proc.exitcode not in (None, 0)]
                running = [proc for proc in procs if proc.exitcode is None]
                if failed or not running or time.monotonic() >= deadline:
                    break
                multiprocessing.connection.wait([proc.sentinel for proc in running],
                                                timeout=max(0.0, deadline - time.monotonic()))
        finally:
            for proc in procs:
                if proc.exitcode is None:
                    proc.kill()
            for proc in procs:
                proc.join()
        if failed:
            raise RankFailure(_failure_report(failed, procs, Path(out)))
        if running:
            hung = [rank for rank, proc in enumerate(procs) if proc in running]
            raise RankFailure(f"rank(s) {hung} of {world_size} still running after {timeout_s:.0f} s (killed): "
                              "a collective that not every rank entered?")
        return [torch.load(Path(out) / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def _rank_entry(rank: int, world_size: int, port: int, timeout_s: float, fn, args: tuple, out: str,
                env: dict) -> None:
    """A rank of ``spawn_ranks``: join the group, ``fn``, its result to ``out``, then leave the group
    with the others; on any error, its traceback to ``out`` and exit at once."""
    import sys
    import traceback

    import torch.distributed as dist

    from dmd2_core import parallel

    os.environ.clear()
    os.environ.update(env)
    try:
        torch.set_num_threads(1)
        parallel.ensure_process_group(rank, world_size, torch.device("cpu"), "127.0.0.1", port, timeout_s)
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out) / f"rank{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the spawning side
        (Path(out) / f"rank{rank}.error.tmp").write_text(traceback.format_exc())
        os.replace(Path(out) / f"rank{rank}.error.tmp", Path(out) / f"rank{rank}.error")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # no barrier, no teardown: the others may wait in a collective this rank never enters


def _failure_report(failed: list[int], procs: list, out: Path) -> str:
    """The traceback of the rank that failed first (by when it wrote its error), then how the
    other failed ranks ended."""
    errors = {rank: out / f"rank{rank}.error" for rank in failed if (out / f"rank{rank}.error").exists()}
    order = sorted(errors, key=lambda rank: errors[rank].stat().st_mtime_ns) + [r for r in failed if r not in errors]
    first = order[0]
    world = len(procs)
    if first in errors:
        report = f"rank {first} of {world} failed:\n{errors[first].read_text()}"
    else:
        report = f"rank {first} of {world} exited with code {procs[first].exitcode} (no Python traceback)"
    for rank in order[1:]:
        how = (errors[rank].read_text().strip().splitlines()[-1] if rank in errors
               else f"exit code {procs[rank].exitcode}")
        report += f"\nthen rank {rank} of {world}: {how}"
    return report


def first_night_starts_late(monkeypatch) -> list:
    """Night 1's groups come up 10,000 s late in its time budget's window (the budget's clock
    jumps once the first run has started), so it stops after its first iteration; later nights
    start on time. Returns the list of group starts (one entry per ``DistillRun.start``)."""
    import time

    from dmd2_core.run import time_budget
    from dmd2_core.run.distill_run import DistillRun

    offset, starts = [0.0], []
    monkeypatch.setattr(time_budget, "clock", lambda: time.perf_counter() + offset[0])
    original_start = DistillRun.start

    def start(self):
        starts.append(1)
        out = original_start(self)
        offset[0] = 10_000.0 if len(starts) == 1 else 0.0
        return out

    monkeypatch.setattr(DistillRun, "start", start)
    return starts
