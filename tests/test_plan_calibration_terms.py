"""The time plan's eval decoder, host work and saves' fixed parts, calibrated from recorded metrics
rows of a previous run (``time_plan.calibrate``), and where the run measures them
(``eval_step.SampledOnce``): no run, no device. bench/plan_calibration.py measures them on the
MiniMax-H3 stand-in."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dmd2_core.evaluation.drift import TimedStats
from dmd2_core.evaluation.eval_step import SampledOnce
from dmd2_core.memory import time_plan

# the first eval (it made the reference: 72 decodes, 64 drifted) split its seconds; an iteration;
# the first checkpoint and export
ROWS = [{"iteration": 0, "eval_s": 43.0, "eval_decode_s": 18.0, "eval_decoded_clips": 72, "eval_drift_s": 2.0,
         "eval_drift_clips": 64, "eval_encode_s": 4.0, "eval_encoded_clips": 8},
        {"iteration": 1, "iteration_s": 2.5, "stop_step": 1.0},
        {"iteration": 2, "iteration_s": 3.0, "stop_step": 0.0, "checkpoint_save_s": 0.4, "export_s": 0.01}]


def _plan(tiny_teacher):
    """The tiny recipe's plan, given a decoder as the stand-in's (0.84 GFLOP a clip of 124 x 32 x 32
    pixel-frames; an eval of 32 quality samples and 8 media clips): the tiny teacher has none."""
    from dmd2_core.args import load_args
    from dmd2_core.memory import planner
    from dmd2_core.train.trainer_config import compute_trainer_args, compute_trainer_configs

    args = load_args("tiny", {"hf_checkpoint": tiny_teacher, "save": "/tmp/unused"})
    trainers = {c.role: compute_trainer_args(args, c) for c in compute_trainer_configs(args)}
    plan = time_plan.time_plan(trainers, planner.plan(trainers), "digits", peak_flops=2e12)
    decodes = {"eval": 40, "reference": 32, "eval_drift": 32, "reference_drift": 32, "eval_encoded": 8}
    return trainers, dataclasses.replace(plan, decode_flops=0.84e9, pixel_frames=124 * 32 * 32, decodes=decodes)


def test_the_eval_decoder_is_priced_at_the_rate_the_first_eval_measured(tiny_teacher):
    trainers, plan = _plan(tiny_teacher)
    device_rate = plan.implied_mfu * plan.peak_flops
    # uncalibrated: rank 0's 40 decodes at the device's rate, added to the sampling's seconds
    assert plan.eval_s == pytest.approx(plan.eval_flops / device_rate + 40 * 0.84e9 / device_rate)
    calibrated = time_plan.calibrate(plan, trainers, ROWS, "metrics.jsonl")
    assert calibrated.decode_flops_per_s == pytest.approx(72 * 0.84e9 / 18.0)  # 3.36 GFLOP/s, not the iteration's
    sampling = calibrated.eval_flops / (calibrated.implied_mfu * calibrated.peak_flops)
    host = 32 * 2.0 / 64 + 4.0  # the drift statistics a clip as measured, the media encode
    assert calibrated.eval_s == pytest.approx(sampling + 40 * 18.0 / 72 + host)
    # the reference: its 32 decodes and their drift statistics beside its sampling
    assert calibrated.reference_s == pytest.approx(calibrated.reference_flops / (calibrated.implied_mfu * 2e12)
                                                   + 32 * 18.0 / 72 + 32 * 2.0 / 64)


def test_the_host_work_is_priced_a_decoded_megapixel_frame(tiny_teacher):
    trainers, plan = _plan(tiny_teacher)
    calibrated = time_plan.calibrate(plan, trainers, ROWS, "metrics.jsonl")
    mpf = 124 * 32 * 32 / 1e6
    assert calibrated.drift_s_per_mpf == pytest.approx(2.0 / (64 * mpf))
    assert calibrated.encode_s_per_mpf == pytest.approx(4.0 / (8 * mpf))
    # a clip four times the pixels costs the host four times as long
    larger = dataclasses.replace(calibrated, pixel_frames=4 * plan.pixel_frames, decode_flops=0.0)
    host = lambda p: p.eval_s - p.eval_flops / (p.implied_mfu * p.peak_flops)  # noqa: E731
    assert host(larger) == pytest.approx(4 * (32 * 2.0 / 64 + 4.0))


def test_a_saves_fixed_part_is_its_warm_seconds_less_its_bytes_at_the_bandwidth(tiny_teacher):
    trainers, plan = _plan(tiny_teacher)
    bandwidth = plan.storage_gbps * 1e9
    # one save of a kind: the first is all there is (0.4 s, 0.01 s)
    one = time_plan.calibrate(plan, trainers, ROWS[:3], "metrics.jsonl")
    assert one.checkpoint_fixed_s == pytest.approx(0.4 - plan.checkpoint_bytes / bandwidth)
    assert (one.checkpoint_s, one.export_s) == (pytest.approx(0.4), pytest.approx(0.01))
    # several: the process's first save ran cold; the median of the saves after it prices a save
    # (0.1, 9.0, 0.2 -> 0.2; an export 0.002, 5.0, 0.003 -> 0.003), each kind its own
    rows = ROWS[:3] + [{"iteration": i, "iteration_s": 3.0, "stop_step": 0.0, "checkpoint_save_s": c, "export_s": e}
                       for i, c, e in ((3, 0.1, 0.002), (4, 9.0, 5.0), (5, 0.2, 0.003))]
    calibrated = time_plan.calibrate(plan, trainers, rows, "metrics.jsonl")
    assert calibrated.checkpoint_fixed_s == pytest.approx(0.2 - plan.checkpoint_bytes / bandwidth)
    assert (calibrated.checkpoint_s, calibrated.export_s) == (pytest.approx(0.2), pytest.approx(0.003))
    assert calibrated.calibrated["checkpoint_iterations"] == [3, 4, 5]
    assert calibrated.storage_gbps == plan.storage_gbps
    # at a thousand times the bytes the bandwidth decides: the fixed part stays what the saves showed
    bigger = dataclasses.replace(calibrated, checkpoint_bytes=1000 * plan.checkpoint_bytes)
    assert bigger.checkpoint_s == pytest.approx(calibrated.checkpoint_fixed_s + 1000 * plan.checkpoint_bytes / bandwidth)


class _Run:
    """An eval's run whose decodes and drift statistics take known seconds on 'rank 0'."""

    args = None

    def decode(self, latents):
        return latents

    def drift_stats(self, latents):
        return TimedStats([{"x": 0.0}] * latents.shape[0], decode_s=1.5, stats_s=0.5, clips=latents.shape[0])


def test_an_eval_splits_its_seconds_into_decoder_drift_and_encode():
    once = SampledOnce(_Run())
    once.drift_stats(torch.zeros(32, 4))
    before = dict(once.decoding)
    once.decode(torch.zeros(8, 4))  # the media, from the kept latents
    timings = once.timings(before, media_s=3.0)
    assert timings["eval_decoded_clips"] == 40 and timings["eval_drift_clips"] == 32
    assert timings["eval_drift_s"] == 0.5 and timings["eval_encoded_clips"] == 8
    assert timings["eval_decode_s"] == pytest.approx(1.5 + (timings["eval_decode_s"] - 1.5))
    assert timings["eval_encode_s"] == pytest.approx(3.0 - (timings["eval_decode_s"] - 1.5))


def test_the_reference_is_priced_at_the_sampling_rate_the_eval_that_made_it_measured(tiny_teacher):
    trainers, plan = _plan(tiny_teacher)
    plan = dataclasses.replace(plan, reference_flops=3e12)  # a teacher evaluator's (the digits one has none)
    decodes_and_drift = 32 * 18.0 / 72 + 32 * 2.0 / 64  # its 32 decodes and drift statistics, as calibrated
    rows = [{**ROWS[0], "eval_reference_s": 20.0}] + ROWS[1:]
    calibrated = time_plan.calibrate(plan, trainers, rows, "metrics.jsonl")
    # the same reference costs what it took; its sampling is not priced at the training step's rate
    assert calibrated.reference_s == pytest.approx(20.0)
    rate = calibrated.reference_flops / (20.0 - decodes_and_drift)
    assert calibrated.reference_flops_per_s == pytest.approx(rate)
    assert rate != pytest.approx(calibrated.implied_mfu * calibrated.peak_flops)
    # twice the reference's FLOPs (twice the steps), twice its sampling seconds
    doubled = dataclasses.replace(calibrated, reference_flops=2 * calibrated.reference_flops)
    assert doubled.reference_s == pytest.approx(2 * (20.0 - decodes_and_drift) + decodes_and_drift)
