"""The time plan under the memory plan (``python -m dmd2_core plan``): FLOPs of one iteration counted
on the meta device, seconds at an assumed MFU of a device's peak, and a previous run's measured pace
in its place. The tiny recipe's configs only: no weights trained, no device."""

from __future__ import annotations

import json

import pytest

from dmd2_core import cli
from dmd2_core.memory import time_plan


def _plan(capsys, teacher: str, save: str, *flags) -> tuple[int, str, str]:
    code = cli.main(["plan", "--recipe", "tiny", "--hf-checkpoint", teacher, "--save", save, *flags])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_prices_an_iteration_from_its_flops_at_the_assumed_mfu_of_the_devices_peak(tiny_teacher, tmp_path, capsys):
    code, out, _ = _plan(capsys, tiny_teacher, str(tmp_path / "run"), "--json", "--assumed-mfu", "0.25",
                         "--peak-tflops", "2", "--num-devices", "2")
    assert code == 0
    timing = json.loads(out)["time"]
    flops = sum(timing["iteration_flops"].values())
    assert flops > 0 and set(timing["iteration_flops"]) == {"rollout", "actor", "critic", "scores"}
    assert timing["pace"] == "assumed" and timing["num_devices"] == 2
    assert timing["iteration_s"] == flops / (0.25 * 2e12 * 2)
    assert timing["eval_flops"] > 0 and timing["checkpoint_bytes"] > 0 and timing["export_bytes"] > 0
    assert timing["iterations_per_night"] > 0 and timing["nights"] == 1  # 200 iterations of the tiny recipe
    code, table, _ = _plan(capsys, tiny_teacher, str(tmp_path / "run"), "--set", "assumed_mfu=0.25")
    assert code == 0 and "time plan (1 devices; assumed MFU 0.25 of 989.4 TFLOP/s" in table


def test_a_previous_runs_measured_pace_replaces_the_assumed_mfu(tiny_teacher, tmp_path, capsys):
    """The median ``iteration_s`` of the save's metrics log, its first (warm-up) iteration left out."""
    save = tmp_path / "run"
    save.mkdir()
    rows = [{"iteration": i, "iteration_s": s} for i, s in enumerate([9.0, 0.5, 0.7, 0.6], start=1)]
    (save / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, _ = _plan(capsys, tiny_teacher, str(save), "--json", "--peak-tflops", "2")
    timing = json.loads(out)["time"]
    assert code == 0 and timing["pace"] == "measured" and timing["iteration_s"] == 0.6
    flops = sum(timing["iteration_flops"].values())
    assert timing["implied_mfu"] == pytest.approx(flops / (0.6 * 2e12))
    assert timing["eval_s"] == pytest.approx(timing["eval_flops"] / (timing["implied_mfu"] * 2e12))
    _, table, _ = _plan(capsys, tiny_teacher, str(save), "--peak-tflops", "2")
    assert "measured 0.600 s an iteration over 3 iterations" in table


def test_the_gan_head_is_counted(tiny_teacher):
    from dmd2_core.args import load_args
    from dmd2_core.train.trainer_config import compute_trainer_args, compute_trainer_configs

    def critic_flops(**overrides) -> float:
        args = load_args("tiny", {"hf_checkpoint": tiny_teacher, "save": "/tmp/unused", **overrides})
        trainers = {c.role: compute_trainer_args(args, c) for c in compute_trainer_configs(args)}
        return time_plan.iteration_flops(trainers)["critic"]

    head = time_plan.model_flops(tiny_teacher, None, None).head
    trained = 3 * time_plan.model_flops(tiny_teacher, None, None).forward
    with_head, without = critic_flops(), critic_flops(gan_critic_weight=0.0, gan_weight=0.0)
    # per critic step: the real rows' trained forward and the head on both sides; the generator's own forward
    assert head > 0 and with_head - without == 64 * (5 * (trained + 6 * head) + trained + 3 * head)


def test_an_unknown_device_kind_fails_in_one_line_naming_the_nearest(tiny_teacher, tmp_path, capsys):
    code, _, err = _plan(capsys, tiny_teacher, str(tmp_path / "run"), "--device-kind", "H10")
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("error: invalid value for 'device_kind' in recipe tiny with overrides: Input should be "
                          "'H100' or 'H200'; did you mean 'H100'?")


def test_a_measured_pace_under_a_size_schedule_is_the_full_size_stages():
    """A run whose first iterations ran at a smaller sample: its pace for the plan is that of its
    full-size iterations alone (the last stage), not a median over both sizes."""
    rows = [{"iteration": i, "iteration_s": 1.0, "size_stage": 1} for i in range(1, 8)]
    rows += [{"iteration": i, "iteration_s": 6.0, "size_stage": 2} for i in range(8, 11)]
    assert time_plan.measured_pace(rows, "u", full_size_stage=2)["iteration_s"] == 6.0
    assert time_plan.measured_pace(rows[:7], "u", full_size_stage=2) is None  # never reached full size
    assert time_plan.measured_pace(rows, "u")["iteration_s"] == 1.0  # no schedule: every iteration
