"""The time plan calibrated from one measured iteration (``time_plan.calibrate``, ``python -m
dmd2_core plan --calibrate-from SAVE``): recorded metrics rows of a previous run, the tiny
recipe's configs; no run, no device. bench/plan_calibration.py measures it on the MiniMax-H3
stand-in."""

from __future__ import annotations

import json

import pytest

from dmd2_core import cli
from dmd2_core.memory import time_plan

# a previous run's metrics log: the start's eval (with its reference), then iterations; only the
# first timed iteration (its drawn stop step) sets the rate; the saves after the first their price
ROWS = [{"iteration": 0, "eval_s": 30.0, "eval_reference_s": 20.0},
        {"iteration": 1, "iteration_s": 2.5, "stop_step": 1.0},
        {"iteration": 2, "iteration_s": 9.0, "stop_step": 3.0, "checkpoint_save_s": 0.4, "export_s": 1.0},
        {"iteration": 4, "iteration_s": 1.0, "stop_step": 0.0, "checkpoint_save_s": 0.3}]


def _trainers(tiny_teacher, **overrides):
    from dmd2_core.args import load_args
    from dmd2_core.train.trainer_config import compute_trainer_args, compute_trainer_configs

    args = load_args("tiny", {"hf_checkpoint": tiny_teacher, "save": "/tmp/unused", **overrides})
    return {c.role: compute_trainer_args(args, c) for c in compute_trainer_configs(args)}


def test_one_measured_iteration_sets_the_rate_and_reproduces_its_own_time(tiny_teacher):
    from dmd2_core.memory import planner

    trainers = _trainers(tiny_teacher, dmd2_backward_simulation=True, num_devices=2)
    assumed = time_plan.time_plan(trainers, planner.plan(trainers), "digits", peak_flops=2e12)
    plan = time_plan.calibrate(assumed, trainers, ROWS, "metrics.jsonl")
    at_stop_1 = sum(time_plan.iteration_flops(trainers, 1).values())
    # a rollout that stopped at step 1 ran 2 student forwards, not the expected (K + 1) / 2
    assert at_stop_1 < sum(time_plan.iteration_flops(trainers, 3).values())
    assert plan.calibrated["flops_per_s"] == at_stop_1 / (2.5 * 2)  # per device, over both
    assert plan.mfu == plan.calibrated["flops_per_s"] / 2e12 and plan.as_dict()["pace"] == "calibrated"
    rate = plan.calibrated["flops_per_s"] * 2
    assert at_stop_1 / rate == 2.5  # the calibrating iteration, exactly
    assert plan.iteration_s == pytest.approx(sum(plan.iteration_flops.values()) / rate)  # the expected one
    # an eval scales as its FLOPs do (every rank samples all of it, cp 1)
    assert plan.eval_s == pytest.approx(plan.eval_flops / (rate / 2))
    assert plan.eval_s / plan.iteration_s == pytest.approx(2 * plan.eval_flops / sum(plan.iteration_flops.values()))
    # a checkpoint at what the one after the first took (0.3 s: the first ran cold), an export at
    # what its only one took (1.0 s): fixed parts (tests/test_plan_calibration_terms.py), at the storage's bandwidth
    assert plan.checkpoint_s == pytest.approx(0.3)
    assert plan.export_s == pytest.approx(1.0)
    assert plan.storage_gbps == assumed.storage_gbps


def test_plan_calibrate_from_a_save_and_its_refusals(tiny_teacher, tmp_path, capsys):
    save = tmp_path / "previous"
    save.mkdir()
    (save / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    base = ["plan", "--recipe", "tiny", "--hf-checkpoint", tiny_teacher, "--save", str(tmp_path / "run")]
    assert cli.main([*base, "--json", "--calibrate-from", str(save)]) == 0
    timing = json.loads(capsys.readouterr().out)["time"]
    assert timing["pace"] == "calibrated" and timing["calibrated"]["iteration"] == 1
    assert timing["checkpoint_s"] == pytest.approx(0.3)
    assert cli.main([*base, "--set", f"calibrate_from={save}"]) == 0
    assert f"calibrated from iteration 1 of {save}/metrics.jsonl: 2.500 s at stop step 1" in capsys.readouterr().out
    # a save without a metrics log, or whose log timed no iteration: one line, exit 2
    assert cli.main([*base, "--calibrate-from", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: calibrate_from: no metrics log in {tmp_path / 'nothing'}")
    (save / "metrics.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    assert cli.main([*base, "--calibrate-from", str(save)]) == 2
    assert capsys.readouterr().err.startswith("error: calibrate_from: no measured iteration (iteration_s) in")

