"""A size schedule (``size_schedule``): the first iterations at a smaller sample, the last at the
full size; the eval at the full size throughout; a resume mid-schedule at the stage its iteration
is in; a bad schedule refused in one line before any actor."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import flow_cli_refusal, in_process_trainers, tiny_args

SMALL, FULL = [1, 4, 4], [1, 8, 8]  # the digits teacher's 8 x 8 pixels, and half of them
TWO_STAGES = [{"until_iteration": 2, "latent_shape": SMALL}, {"latent_shape": FULL}]


def _iterate(trainers: dict, iteration: int) -> dict:
    """One iteration of in-process trainers; the shapes each group trained on and the stage the
    rollout reports."""
    pairs, rollout = trainers["actor"].rollout(iteration)
    scores, _ = trainers["critic"].train(iteration, pairs)
    trainers["actor"].train(iteration, pairs, scores)
    return {"actor": list(pairs["x0"].shape[1:]), "critic": list(scores["dmd2_grad"].shape[1:]),
            "stage": rollout.get("size_stage")}


def test_a_two_stage_schedule_trains_small_then_full_and_resumes_mid_schedule(tiny_teacher, tmp_path):
    args = tiny_args(tiny_teacher, str(tmp_path / "run"), num_iterations=3, size_schedule=TWO_STAGES)
    trainers = in_process_trainers(args)
    first = _iterate(trainers, 1)
    assert first == {"actor": SMALL, "critic": SMALL, "stage": 1}
    for t in trainers.values():
        t.save(1)
    resumed = in_process_trainers(args)  # a rerun from the checkpoint of iteration 1, inside the small stage
    for t in resumed.values():
        t.load(1)
    for iteration, shape, stage in ((2, SMALL, 1), (3, FULL, 2)):
        want = {"actor": shape, "critic": shape, "stage": stage}
        assert _iterate(trainers, iteration) == want, iteration
        assert _iterate(resumed, iteration) == want, iteration
    assert {r: t.state_digest() for r, t in resumed.items()} == {r: t.state_digest() for r, t in trainers.items()}
    # the eval samples at the full size, whatever the stage
    assert list(trainers["actor"].sample([0, 1], seed=5, decode=False).shape) == [2, *FULL]


def test_without_a_schedule_every_iteration_is_the_full_size(tiny_teacher, tmp_path):
    trainers = in_process_trainers(tiny_args(tiny_teacher, str(tmp_path / "run")))
    assert _iterate(trainers, 1) == {"actor": FULL, "critic": FULL, "stage": None}


def test_the_reference_loop_follows_the_schedule_as_the_trainers(tiny_teacher, tmp_path):
    from dmd2_core.train.reference import ReferenceLoop

    args = tiny_args(tiny_teacher, str(tmp_path / "run"), num_iterations=3, size_schedule=TWO_STAGES)
    loop = ReferenceLoop(args)
    trainers = in_process_trainers(args)
    for iteration in (1, 2, 3):
        loop.iterate(iteration)
        _iterate(trainers, iteration)
    want = trainers["actor"].weights()
    got = loop.student.state_dict()
    assert all(torch.allclose(got[k], want[k], atol=1e-5, rtol=1e-4) for k in want)


@pytest.mark.parametrize("schedule, line", [
    ([{"until_iteration": 2, "latent_shape": FULL}, {"latent_shape": SMALL}],
     "error: size_schedule: its last stage (size_schedule[1]) trains at [1, 4, 4], not the run's full size [1, 8, 8]"),
    ([{"until_iteration": 2, "latent_shape": [1, 5, 5]}, {"latent_shape": FULL}],
     "error: size_schedule[0].latent_shape: [1, 5, 5]: H=5 is not a multiple of the model's patch size 2; nearest: 4 or 6"),
    ([{"until_iteration": 2, "latent_shape": [1, 4, 10]}, {"latent_shape": FULL}],
     "error: size_schedule[0].latent_shape: [1, 4, 10] is larger than the full size [1, 8, 8] in dimension 2"),
    ([{"until_iteration": 2, "num_frames": 124, "height": 4, "width": 4}, {"latent_shape": FULL}],
     "error: size_schedule[0].num_frames: clip geometry is for joint video + audio models"),
    ([{"until_iteration": 2, "latent_shape": SMALL, "heigth": 4}, {"latent_shape": FULL}],
     "error: invalid value for 'size_schedule' in recipe tiny with overrides: size_schedule[0]: unknown key "
     "'heigth'; did you mean 'height'?"),
])
def test_a_bad_schedule_fails_in_one_line_before_any_actor(tiny_teacher, tmp_path, capsys, monkeypatch, schedule, line):
    import yaml

    save = tmp_path / "run"
    err = flow_cli_refusal(capsys, monkeypatch, "--recipe", "tiny", "--hf-checkpoint", tiny_teacher, "--save", str(save),
                           "--set", "gan_weight=0", "--set", "gan_critic_weight=0",
                           "--set", f"size_schedule={yaml.safe_dump(schedule, default_flow_style=True).strip()}")
    assert err.startswith(line), err
    assert not save.exists()


def test_a_gan_heads_real_set_has_no_rows_for_a_smaller_stage(tiny_teacher, tmp_path, capsys, monkeypatch):
    """The tiny recipe's GAN head reads the digits at 8 x 8: a 4 x 4 stage is refused, not resampled."""
    import yaml

    err = flow_cli_refusal(capsys, monkeypatch, "--recipe", "tiny", "--hf-checkpoint", tiny_teacher,
                           "--save", str(tmp_path / "run"),
                           "--set", f"size_schedule={yaml.safe_dump(TWO_STAGES, default_flow_style=True).strip()}")
    assert err.startswith("error: size_schedule[0]: the GAN head's real set (real_data digits) holds samples of the "
                          "full size [1, 8, 8], none of this stage's [1, 4, 4]"), err


def test_the_plan_fits_and_prices_each_stage(tiny_teacher, tmp_path, capsys):
    """``plan`` lists the stages: the memory peak is the full-size stage's, a smaller stage's
    iteration costs less, and the nights to num_iterations come through the stages (fewer than
    with every iteration at the full size)."""
    import json

    import yaml

    from dmd2_core import cli

    schedule = yaml.safe_dump([{"until_iteration": 1000, "latent_shape": SMALL}, {"latent_shape": FULL}],
                              default_flow_style=True).strip()
    assert cli.main(["plan", "--recipe", "tiny", "--hf-checkpoint", tiny_teacher, "--save", str(tmp_path / "run"),
                     "--json", "--set", "gan_weight=0", "--set", "gan_critic_weight=0", "--set", "num_iterations=2000",
                     "--set", "night_hours=0.01", "--peak-tflops", "0.5", "--set", f"size_schedule={schedule}"]) == 0
    plan = json.loads(capsys.readouterr().out)
    small, full = plan["stages"]
    assert (small["first"], small["last"], small["latent_shape"]) == (1, 1000, SMALL)
    assert (full["first"], full["last"], full["latent_shape"]) == (1001, 2000, FULL)
    assert small["device_peak"] < full["device_peak"] == plan["device_peak"]
    timing = plan["time"]
    time_small, time_full = timing["stages"]
    assert time_full["iteration_s"] == timing["iteration_s"]
    assert time_small["iteration_s"] < time_full["iteration_s"]
    assert time_small["iterations_per_night"] > time_full["iterations_per_night"] == timing["iterations_per_night"]
    assert timing["nights"] < timing["nights_at_full_size"]
