"""The recipes tell the truth: each names the cluster it is for and fits it by its own plan;
`python -m dmd2_core plan` checks against that cluster by default and, when a setting does not
fit, proposes the nearest that do (each re-planned here as fitting); minimax-h3's nightly numbers
are its plan's. The configs alone: no weights, no device."""

from __future__ import annotations

import json
import os

import pytest

from dmd2_core import cli
from dmd2_core.args import load_args, read_recipe, recipe_names, replace_args
from dmd2_core.memory import planner, time_plan
from dmd2_core.models import describe_model_dir
from dmd2_core.run import preflight_checks
from dmd2_core.train.trainer_config import compute_trainer_args, compute_trainer_configs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H3 = os.path.join(ROOT, "deployments", "model_configs", "minimax-h3")
GIB = planner.GIB


def _cli_plan(capsys, recipe: str, *flags) -> tuple[int, str, str]:
    code = cli.main(["plan", "--recipe", recipe, *flags])
    out = capsys.readouterr()
    return code, out.out, out.err


def _resolved(recipe: str, **overrides):
    args = load_args(recipe, overrides)
    return preflight_checks.check_family_args(args, describe_model_dir(args.hf_checkpoint))


def _plans(args, mfu: float = time_plan.DEFAULT_MFU, night_hours: float = time_plan.DEFAULT_NIGHT_HOURS):
    trainers = {c.role: compute_trainer_args(args, c) for c in compute_trainer_configs(args)}
    memory_plan = planner.plan(trainers)
    return memory_plan, time_plan.time_plan(trainers, memory_plan, "teacher", mfu,
                                            time_plan.device_peak_flops(args.device_kind), night_hours=night_hours)


@pytest.fixture(scope="module")
def h3_full_fine_tuning():
    """`plan` of minimax-h3 fully fine-tuned at cp 1 on its own cluster, as JSON (once: it searches)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["plan", "--recipe", "minimax-h3", "--hf-checkpoint", H3, "--json",
                         "--set", "lora_rank=0", "--set", "cp_size=1"])
    return code, json.loads(out.getvalue()), err.getvalue()


def test_every_shipped_recipe_names_the_cluster_it_is_for():
    for name in recipe_names():
        recipe = read_recipe(name)
        assert {"num_devices", "device_memory_gib"} <= set(recipe), name
        if recipe.get("device") == "cuda":  # the time plan prices a GPU by its kind
            assert recipe["device_kind"] in time_plan.DEVICE_PEAK_TFLOPS and recipe["host_memory_gib"], name


def test_minimax_h3_fits_its_8_h100s_by_its_own_plan_checked_by_default(capsys):
    code, out, err = _cli_plan(capsys, "minimax-h3", "--hf-checkpoint", H3)
    assert code == 0 and err == ""
    assert "of 72.0 GiB usable (80.0 GiB less 10%)" in out and "(8 devices, shard size 8" in out
    assert "host peak per node:" in out and "of 1843.2 GiB usable (2048.0 GiB less 10%)" in out
    assert "of 989.4 TFLOP/s per device" in out  # H100


def test_the_tiny_recipe_fits_its_cpu_by_its_own_plan(capsys, tiny_teacher, tmp_path):
    code, out, _ = _cli_plan(capsys, "tiny", "--hf-checkpoint", tiny_teacher, "--save", str(tmp_path / "run"))
    assert code == 0 and "GiB usable (4.0 GiB less 10%)" in out


def test_a_setting_that_does_not_fit_exits_2_in_one_line_naming_the_memory_and_the_nearest_fit(h3_full_fine_tuning):
    code, plan, err = h3_full_fine_tuning
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("error: memory plan: the critic group's train (beside the awake actor) needs 179.8 GiB per "
                          "device") and "more than the 72.0 GiB of one device (device_memory_gib" in err
    best = plan["proposals"][0]
    assert f"; nearest that fits: lora_rank={best['overrides']['lora_rank']}: " in err and "iterations a night" in err


def test_each_proposal_applied_plans_as_fitting_best_first(h3_full_fine_tuning):
    """Re-planned from scratch with its overrides, each proposal fits the recipe's cluster; those on
    the recipe's 8 devices come before those on more, fewer changed knobs first."""
    _, plan, _ = h3_full_fine_tuning
    proposals = plan["proposals"]
    assert len(proposals) >= 3 and not plan["fits"]
    base = _resolved("minimax-h3", hf_checkpoint=H3, lora_rank=0, cp_size=1)
    keys = []
    for p in proposals:
        memory_plan, timing = _plans(replace_args(base, p["overrides"], "a proposal"))
        assert memory_plan.fits and memory_plan.device_peak <= int(0.9 * 80 * GIB), p
        assert memory_plan.device_peak == p["device_peak"] and timing.iterations_per_night == p["iterations_per_night"]
        keys.append(("num_devices" in p["overrides"], len(p["overrides"]), -p["iterations_per_night"]))
    assert keys == sorted(keys) and not keys[0][0]  # the first stays on the recipe's 8 devices


def test_minimax_h3s_nightly_numbers_are_its_plans():
    """The recipe's eval, checkpoint and export intervals are the ones its plan gives a night of the
    nightly deployment's window (an eval in every night's first half and at its end); another clip
    size plans other numbers, so changing the size alone fails here."""
    from deployments import serve

    spec = next(s for s in serve.deployment_specs() if s["name"] == "minimax-h3")
    night_hours = spec["parameters"]["time_budget_s"] / 3600
    args = _resolved("minimax-h3", hf_checkpoint=H3)
    memory_plan, timing = _plans(args, night_hours=night_hours)
    nightly = time_plan.nightly_intervals(timing)
    assert memory_plan.fits
    assert nightly == {k: getattr(args, k) for k in nightly}
    assert timing.iterations_per_night >= 2 * args.eval_interval  # at least one eval before the night's last
    _, longer = _plans(_resolved("minimax-h3", hf_checkpoint=H3, num_frames=345, cp_size=8), night_hours=night_hours)
    assert time_plan.nightly_intervals(longer) != nightly


def test_a_lora_is_priced_as_it_runs(tiny_teacher):
    """A LoRA's backward runs through its frozen base (the inputs' gradients only: once a forward,
    not twice), and its export is its adapters unless merged."""
    def timing(**overrides):
        args = load_args("tiny", {"hf_checkpoint": tiny_teacher, "save": "/tmp/unused", "gan_weight": 0.0,
                                  "gan_critic_weight": 0.0, **overrides})
        trainers = {c.role: compute_trainer_args(args, c) for c in compute_trainer_configs(args)}
        return time_plan.time_plan(trainers, planner.plan(trainers), "digits", 0.4, 1e12)

    from dmd2_core.memory import lora_terms

    full, lora = timing(), timing(lora_rank=4)
    assert lora.iteration_flops["actor"] == pytest.approx(full.iteration_flops["actor"] * 2 / 3)
    assert lora.iteration_flops["rollout"] == full.iteration_flops["rollout"]
    adapters = lora_terms.size_of(load_args("tiny", {"hf_checkpoint": tiny_teacher, "lora_rank": 4})).adapters
    assert lora.export_bytes == 2 * adapters * 4 < full.export_bytes  # written and read back; float32, no EMA in tiny
    assert timing(lora_rank=4, export_merged=True).export_bytes == full.export_bytes
