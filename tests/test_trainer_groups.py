"""Trainer groups on Ray: colocation, external data, the train-input hook, micro-batching,
data parallelism, sleep/wake and a crash between two saves (resume bitwise: test_sharding.py and
checkpoint/test_checkpoints_at_scale.py, local and S3)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dmd2_core import checkpoint, parallel
from dmd2_core.errors import ArgsError
from dmd2_core.run.distill_run import DistillRun, preflight
from dmd2_core.run.checkpoint_commits import CheckpointCommits
from dmd2_core.train.trainer import Trainer
from dmd2_core.train.trainer_config import TrainerConfig, compute_trainer_args
from tests.helpers import in_process_trainers, iterate_in_process, tiny_args


def test_micro_batches_give_the_same_update_as_one_batch(tiny_teacher, tmp_path):
    whole = in_process_trainers(tiny_args(tiny_teacher, str(tmp_path / "a")))
    micro = in_process_trainers(tiny_args(tiny_teacher, str(tmp_path / "b"), micro_batch_size=3))
    for i in (1, 2):
        iterate_in_process(whole, i)
        iterate_in_process(micro, i)
    for role in ("actor", "critic"):
        a, b = whole[role].weights(), micro[role].weights()
        assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    # and training moved the weights at all (the comparison above is not vacuous)
    fresh = in_process_trainers(tiny_args(tiny_teacher, str(tmp_path / "c")))["actor"].weights()
    assert max((fresh[k] - whole["actor"].weights()[k]).abs().max().item() for k in fresh) > 1e-6


def test_sleep_and_wake_restore_state_bitwise(tiny_teacher, tmp_path):
    trainers = in_process_trainers(tiny_args(tiny_teacher, str(tmp_path), ema_decay=0.9))
    iterate_in_process(trainers, 1)
    for trainer in trainers.values():
        digest = trainer.state_digest()
        assert trainer.device_bytes() > 0
        out = trainer.sleep()
        assert trainer.sleep()["sleep_s"] == 0.0  # idempotent
        assert trainer.asleep and trainer.device_bytes() == 0
        assert out["bytes_freed"] > 0
        assert all(parallel.local(p).untyped_storage().nbytes() == 0 for p in trainer.model.parameters())
        trainer.wake_up()
        trainer.wake_up()
        assert trainer.state_digest() == digest
    # a woken group trains on exactly as one that never slept
    awake = in_process_trainers(tiny_args(tiny_teacher, str(tmp_path / "awake"), ema_decay=0.9))
    iterate_in_process(awake, 1)
    for t in trainers.values():
        t.sleep()
    iterate_in_process(trainers, 2)
    iterate_in_process(awake, 2)
    assert trainers["actor"].state_digest() == awake["actor"].state_digest()


def test_hook_runs_before_micro_batching_and_shapes_the_update(tiny_teacher, tmp_path):
    hooked = in_process_trainers(tiny_args(tiny_teacher, str(tmp_path / "a"), global_batch_size=4, micro_batch_size=1,
                                 train_input_hook_path="tests.hooks_fixture.require_whole_local_batch"))
    iterate_in_process(hooked, 1)  # the hook raises if it saw a micro-batch
    zeroed = in_process_trainers(tiny_args(tiny_teacher, str(tmp_path / "b"), global_batch_size=4, micro_batch_size=4, clip_grad=0,
                                 train_input_hook_path="tests.hooks_fixture.zero_dmd2_gradient",
                                 adam_beta1=0.9, weight_decay=0.0))
    before = zeroed["actor"].weights()
    iterate_in_process(zeroed, 1)
    after = zeroed["actor"].weights()
    assert all(torch.equal(before[k], after[k]) for k in before), "a zero DMD gradient must not move the student"


@pytest.mark.parametrize("path, needle", [
    ("tests.hooks_fixture.zero_dmd2_gradiant", "did you mean 'zero_dmd2_gradient'"),
    ("tests.hooks_fixture.wrong_signature", "must take (args, pairs, external_data)"),
    ("no_such_module.hook", "cannot import module 'no_such_module'"),
])
def test_bad_hook_fails_in_preflight_with_the_path(tiny_teacher, tmp_path, path, needle):
    with pytest.raises(ArgsError) as err:
        DistillRun(tiny_args(tiny_teacher, str(tmp_path), train_input_hook_path=path))
    assert "train_input_hook_path" in str(err.value) and needle in str(err.value)


@pytest.mark.multi_rank
def test_two_colocated_groups_of_two_ranks(ray_session, tiny_teacher, tmp_path):
    args = tiny_args(tiny_teacher, str(tmp_path), num_devices=2, run_name="dmd2-coloc")
    with DistillRun(args) as run:
        placements = []
        for role, group in run.groups.items():
            assert group.bundle_indices == [0, 1], role
            placements += group.get([r.placement.remote() for r in group.ranks])
        assert len(placements) == 4 and all(p["share"] == 0.5 for p in placements)
        assert {p["placement_group"] for p in placements} == {run.pg.id.hex()}
        metrics = run.iterate(1)
        assert metrics["stop_step"] in range(4) and metrics["graded_x0_drift"] < 1e-5
        # sharded: each rank holds half of the state, and both gather the same whole weights
        held = run.group_call("actor", "state_bytes")
        whole = run.group_call("actor", "weights")
        total = sum(v.numel() * v.element_size() for k, v in whole[0].items() if "pos_embed" not in k)
        assert all(abs(h["params"] - total / 2) <= 0.05 * total for h in held), (held, total)
        assert all(torch.equal(whole[0][k], whole[1][k]) for k in whole[0])


@pytest.mark.multi_rank
def test_external_data_reaches_each_rank(ray_session, tiny_teacher, tmp_path):
    from dmd2_core.run.groups import TrainerGroup, create_placement_group

    args = tiny_args(tiny_teacher, str(tmp_path), num_devices=2, loss_type="flow_matching",
                     train_input_hook_path="tests.hooks_fixture.record_external_data")
    pg = create_placement_group(args, num_groups=1)
    group = TrainerGroup(args, "actor", pg, share=1.0).connect()
    try:
        pairs = [group.ranks[r].rollout.options(num_returns=2).remote(1)[0] for r in range(2)]
        per_rank = [{"tag": torch.full((4,), 10 + r)} for r in range(2)]
        group.get([m for _, m in group.train_async(1, pairs, per_rank)])
        seen = sorted(p.name.split("-")[1] for p in (Path(args.save) / "seen").iterdir())
        assert seen == ["10", "11"]
        group.get([m for _, m in group.train_async(2, pairs, {"tag": torch.full((4,), 7)})])
        assert sorted(p.name.split("-")[1] for p in (Path(args.save) / "seen").iterdir()).count("7") == 2
        with pytest.raises(ValueError, match="3 external-data payloads for 2 ranks"):
            group.train_async(3, pairs, [None] * 3)
        with pytest.raises(ValueError, match="has 3 rows for 4 train pairs"):
            group.get([m for _, m in group.train_async(3, pairs, {"tag": torch.full((3,), 7)})])
    finally:
        group.kill()
        from dmd2_core.run.groups import shutdown_placement_group

        shutdown_placement_group(pg)


def test_crash_between_two_trainers_saves_keeps_the_tracker(ray_session, tiny_teacher, tmp_path):
    import ray

    from dmd2_core.errors import RayWorkError

    save = str(tmp_path / "run")
    with DistillRun(tiny_args(tiny_teacher, save, run_name="dmd2-crash")) as run:
        run.iterate(1)
        run.checkpoint(1)
        run.iterate(2)
        ray.kill(run.groups["actor"].ranks[0])  # the critic saves first, then the actor is gone
        with pytest.raises(RayWorkError):
            run.checkpoint(2)
    assert checkpoint.read_latest(save) == 1
    assert (Path(checkpoint.trainer_dir(save, "critic", 2)) / "complete.json").exists()
    assert not (Path(checkpoint.trainer_dir(save, "actor", 2)) / "complete.json").exists()


def test_trainer_args_stay_role_agnostic(tiny_teacher, tmp_path):
    args = tiny_args(tiny_teacher, str(tmp_path), critic_lr=3e-4)
    critic = compute_trainer_args(args, TrainerConfig("critic", {"lr": 3e-4, "loss_type": "dmd2_critic"}))
    trainer = Trainer(critic, "critic")
    assert trainer.optimizer.param_groups[0]["lr"] == 3e-4 and trainer.teacher is not None


class _RecordingGroup:
    """A trainer group without Ray: records what is submitted, in order, into a shared log; a
    'ref' is the value itself, and ``fail`` makes the named method's metrics raise when fetched."""

    def __init__(self, role: str, log: list, fail: str = ""):
        self.role, self.log, self.fail = role, log, fail

    def _submit(self, method: str, iteration, *inputs) -> list:
        self.log.append((self.role, method, iteration, inputs))
        metrics = RuntimeError(f"{self.role}.{method} died") if method == self.fail else {f"{self.role}_{method}_s": 0.1}
        return [((self.role, method, iteration), metrics)]

    def call_per_rank(self, method, per_rank, num_returns=1):
        return self._submit(method, per_rank[0][0])

    def train_async(self, iteration, pairs, external_data=None):
        return self._submit("train", iteration, *pairs, *([external_data] if external_data else []))

    def call_async(self, method):
        self.log.append((self.role, method, None, ()))
        return [{"sleep_s": 0.0, "device_bytes_awake": 0, "bytes_freed": 1}]

    def get(self, refs):
        self.log.append((self.role, "get", None, ()))
        for value in refs:
            if isinstance(value, Exception):
                raise value
        return refs


def _recording_run(sleeping: bool, fail: str = "") -> tuple[DistillRun, list]:
    log: list = []
    run = DistillRun.__new__(DistillRun)  # no preflight, no Ray: the phase scheduling alone
    run.args = tiny_args("unused", "unused").model_copy(update={"sleep_after_train": sleeping})
    run.trainer_args = {"actor": run.args, "critic": run.args}
    run.groups = {"actor": _RecordingGroup("actor", log), "critic": _RecordingGroup("critic", log, fail)}
    run.handoff, run.started, run.broken, run.lease, run.checkpoint_commits = {}, {}, False, None, CheckpointCommits(run.args)
    run.done = (0, 5)
    run.rollout_ahead = lambda iteration: iteration < 2
    return run, log


def _submitted(log: list) -> list:
    return [(role, method, it) for role, method, it, _ in log if method != "get"]


def test_phases_start_ahead_only_where_ray_orders_them():
    """Each phase submits the phases after it that Ray orders by itself (the critic's train takes
    the rollout's outputs, the student's train the critic's scores), so the trainers never wait
    for the orchestrator between tasks; the next iteration starts only where the orchestrator
    says nothing runs between them; inputs are handed on unchanged."""
    run, log = _recording_run(sleeping=False)
    run.rollout(1)
    assert _submitted(log) == [("actor", "rollout", 1), ("critic", "train", 1), ("actor", "train", 1)]
    critic_inputs = next(inputs for role, method, _, inputs in log if (role, method) == ("critic", "train"))
    actor_inputs = next(inputs for role, method, _, inputs in log if (role, method) == ("actor", "train"))
    assert critic_inputs == (("actor", "rollout", 1),)
    assert actor_inputs == (("actor", "rollout", 1), [("critic", "train", 1)])
    run.critic_train_and_score(1)
    assert len(_submitted(log)) == 3
    run.student_train(1)  # rollout_ahead(1): iteration 2 starts at once
    assert _submitted(log)[3:] == [("actor", "rollout", 2), ("critic", "train", 2), ("actor", "train", 2)]
    for phase in ("rollout", "critic_train_and_score", "student_train"):
        getattr(run, phase)(2)
    assert len(_submitted(log)) == 6 and run.started == {} and run.done == (2, 4)  # rollout_ahead(2) is False


def test_a_sleeping_critic_is_asleep_before_the_student_is_submitted():
    run, log = _recording_run(sleeping=True)
    run.rollout(1)
    assert _submitted(log) == [("actor", "rollout", 1), ("critic", "train", 1), ("critic", "sleep", None)]
    run.critic_train_and_score(1)
    run.sleep_critic(1)
    assert ("actor", "train", 1) not in _submitted(log)
    slept = len(log)
    run.student_train(1)
    assert _submitted(log[slept:]) == [("actor", "train", 1), ("actor", "sleep", None)]
    run.sleep_actor(1)
    assert _submitted(log)[-3:] == [("actor", "rollout", 2), ("critic", "train", 2), ("critic", "sleep", None)]


def test_a_phase_failing_after_others_started_ahead_breaks_the_run():
    """The critic's train dies after the student's was submitted behind it: the critic's task
    fails, the run is marked for recovery and nothing started ahead is collected later."""
    run, log = _recording_run(sleeping=False, fail="train")
    run.rollout(1)
    assert run.started and not run.broken
    with pytest.raises(RuntimeError, match="critic.train died"):
        run.critic_train_and_score(1)
    assert run.broken and run.started == {} and run.done == (1, 1)


def test_metrics_merged_over_ranks_keep_their_meaning():
    """Two ranks' metrics as a group reports them: bad rows add up, times and maxima are the
    slowest / largest rank's, minima the smallest's, losses the mean."""
    from dmd2_core.run.distill_run import _merge

    ranks = [{"dmd2_grad_nonfinite": 1, "actor_dmd2_grad_nonfinite": 0, "critic_nonfinite_steps": 1,
              "graded_x0_drift": 0.5, "critic_train_s": 2.0, "critic_sigma_max": 0.9, "critic_sigma_min": 0.2,
              "dmd2_loss": 1.0, "stop_step": 2},
             {"dmd2_grad_nonfinite": 2, "actor_dmd2_grad_nonfinite": 3, "critic_nonfinite_steps": 1,
              "graded_x0_drift": 0.1, "critic_train_s": 5.0, "critic_sigma_max": 0.7, "critic_sigma_min": 0.1,
              "dmd2_loss": 3.0, "stop_step": 2}]
    assert _merge(ranks) == {"dmd2_grad_nonfinite": 3, "actor_dmd2_grad_nonfinite": 3, "critic_nonfinite_steps": 1,
                             "graded_x0_drift": 0.5, "critic_train_s": 5.0, "critic_sigma_max": 0.9,
                             "critic_sigma_min": 0.1, "dmd2_loss": 2.0, "stop_step": 2}


def test_eval_holds_no_second_copy_of_the_model_and_its_decoder_sleeps(tiny_teacher, tmp_path, monkeypatch):
    """Sampling with the EMA swaps it in tensor by tensor (never a whole second copy of the
    model on the device) and restores the trained weights bit for bit; the eval decoder goes to
    the host when the trainer sleeps, and back there after an eval that woke it."""
    import weakref

    args = tiny_args(tiny_teacher, str(tmp_path), loss_type="flow_matching", ema_decay=0.5)
    actor = Trainer(preflight(args)["actor"], "actor")
    pairs, _ = actor.rollout(1)
    actor.train(1, pairs)
    digest = actor.state_digest()
    params = [p.detach() for p in actor.model.parameters()]
    assert any(not torch.equal(p, e) for p, e in zip(params, actor.ema))  # the EMA differs: the swap has teeth

    clones, peak = [], [0]
    clone = torch.Tensor.clone

    def tracked_clone(self, *a, **kw):
        out = clone(self, *a, **kw)
        clones.append(weakref.ref(out))
        peak[0] = max(peak[0], sum(t.untyped_storage().nbytes() for t in (r() for r in clones) if t is not None))
        return out

    monkeypatch.setattr(torch.Tensor, "clone", tracked_clone)
    first = actor.sample([0, 1, 2], seed=5)
    monkeypatch.setattr(torch.Tensor, "clone", clone)
    model_bytes = sum(p.untyped_storage().nbytes() for p in params)
    assert peak[0] < model_bytes / 4, (peak[0], model_bytes)  # a tensor at a time (and the sampler's own)
    assert actor.state_digest() == digest

    class Decoder(torch.nn.Module):
        moves: list = []

        def to(self, device, *a, **kw):
            self.moves.append(torch.device(device).type)
            return self

    actor.vae = Decoder()
    monkeypatch.setattr(actor.family, "decode", lambda vae, latents: latents.float().clamp(-1, 1))
    actor.sleep()
    assert Decoder.moves == ["cpu"]
    assert torch.equal(actor.sample([0, 1, 2], seed=5), first)
    assert Decoder.moves == ["cpu", actor.device.type, "cpu"] and actor.asleep


def test_a_local_ray_that_times_out_starting_is_started_once_more(monkeypatch, tiny_teacher, tmp_path):
    """Ray gives a new node's raylet a fixed 30 s to register; on a loaded machine the start is
    retried once (after stopping what started), any other failure is raised at once."""
    from dmd2_core.run import groups

    calls = []

    def init(**kwargs):
        calls.append(kwargs["address"])
        if len(calls) == 1:
            raise Exception("The current node timed out during startup. This could happen because ...")

    monkeypatch.setattr(groups.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(groups.ray, "init", init)
    monkeypatch.setattr(groups.ray, "shutdown", lambda: calls.append("shutdown"))
    groups.init_ray(tiny_args(tiny_teacher, str(tmp_path / "run")))
    assert calls == ["local", "shutdown", "local"]

    def broken(**kwargs):
        raise ConnectionError("GCS unreachable")

    monkeypatch.setattr(groups.ray, "init", broken)
    with pytest.raises(ConnectionError):
        groups.init_ray(tiny_args(tiny_teacher, str(tmp_path / "run")))
