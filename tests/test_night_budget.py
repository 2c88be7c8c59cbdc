"""A night is a time-boxed leg of one distillation (``time_budget_s``): the budget's decision
(dmd2_core/run/time_budget.py), legs of the flow that end with the weights of one uninterrupted
run and keep one best student for the whole campaign, a night after the campaign that trains
nothing, the nights view's pace columns, and the nightly deployment's window."""

from __future__ import annotations

from pathlib import Path

import pytest

from dmd2_core import checkpoint
from dmd2_core.report import nights_view
from dmd2_core.run import time_budget
from dmd2_core.run.time_budget import SAFETY, TimeBudget
from tests.helpers import FAST, assert_same_saved_state, first_night_starts_late


# ---- the decision (no Ray, no Prefect) ----------------------------------------------------------

def test_an_iteration_is_the_last_when_one_more_and_the_end_would_not_fit(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time_budget, "clock", lambda: now[0])
    budget = TimeBudget(budget_s=100.0, started=0.0, default_s=30.0)  # the clock says all of it is used
    now[0] = 10.0  # 90 s left
    # nothing measured yet: every cost is the start-up's 30 s; 2 iterations + checkpoint + export + eval = 150
    assert budget.must_stop_after_next(evaluating=True)
    budget.note("iteration", 4.0)
    budget.note("iteration", 8.0)  # the largest seen counts
    budget.note("checkpoint", 10.0)
    budget.note("export", 6.0)
    budget.note("eval", 12.0)
    need = SAFETY * (2 * 8.0 + 10.0 + 6.0 + 12.0)  # 55 s
    assert budget.estimate("iteration") == pytest.approx(SAFETY * 8.0)
    assert not budget.must_stop_after_next(evaluating=True)
    now[0] = 100.0 - need + 0.5  # just under what one more iteration and the end take
    assert budget.must_stop_after_next(evaluating=True)
    assert not budget.must_stop_after_next(evaluating=False)  # no final eval to fit
    now[0] = 100.0 - need - 0.5
    assert not budget.must_stop_after_next(evaluating=True)
    assert budget.must_stop_after_next(evaluating=True, scheduled_s=1.0)  # its own scheduled eval or save counts
    with pytest.raises(ValueError, match="unknown cost 'evals'"):
        budget.note("evals", 1.0)


def test_a_negative_budget_is_refused_in_one_line():
    from dmd2_core.args import load_args
    from dmd2_core.errors import ArgsError

    with pytest.raises(ArgsError, match=r"^invalid value for 'time_budget_s' .*greater than or equal to 0"):
        load_args("tiny", {"time_budget_s": -1})
    assert load_args("tiny", {"time_budget_s": 0}).time_budget_s == 0  # 0: no budget


# ---- the nights view's pace -----------------------------------------------------------------------

def test_a_nights_row_shows_its_leg_its_pace_and_the_nights_left():
    view = {"name": "night-1", "start": 40, "iteration": 110, "final": 1000, "seconds_per_iteration": 490.4,
            "status": "completed, continues",
            "evals": [{"iteration": 40, "fd": 3.0}, {"iteration": 110, "fd": 2.0}]}
    row = nights_view.night_row(view, "completed, continues", 36000.0, "id-1", None, "2026-12-07")
    assert (row["from_iteration"], row["iteration"], row["final_iteration"]) == (40, 110, 1000)
    assert row["s_per_iteration"] == 490.4 and row["nights_left"] == 13  # 890 left at 70 a night
    done = nights_view.night_row(dict(view, start=960, iteration=1000), "completed", 1.0, "id-2", None, "2026-12-20")
    assert done["nights_left"] == 0
    text = nights_view.nights_markdown("minimax-h3", [row, done], None)
    assert "| iterations | s / iteration | nights left | wall |" in text
    assert "| 40 -> 110/1000 | 490.4 | 13 | 36000.0 s |" in text and "| 960 -> 1000/1000 | 490.4 | 0 |" in text
    assert nights_view.nights_left(5, 5, 10) is None  # a night that trained nothing has no pace


# ---- the nightly deployment's window ------------------------------------------------------------

def test_the_nightly_deployment_runs_each_night_as_a_leg_of_its_window():
    from deployments import serve
    from flows.dmd2 import resolve_args

    spec = next(s for s in serve.deployment_specs() if s["name"] == "minimax-h3")
    assert spec["cron"] == "0 2 * * *" and spec["parameters"]["time_budget_s"] == 10 * 3600
    args = resolve_args(**{**spec["parameters"], "hf_checkpoint": "s3://b/t", "prompts": "s3://b/p", "save": "s3://b/s"})
    assert args.time_budget_s == 10 * 3600


# ---- legs of one distillation through the flow ----------------------------------------------------

def run_leg(teacher: str, save: Path, **extra):
    from flows.dmd2 import dmd2

    return dmd2(recipe="tiny", overrides=dict(FAST), num_iterations=2, hf_checkpoint=teacher, save=str(save),
                return_state=True, **extra)


SCRIPTED_FD = {0: 1.0, 1: 2.0, 2: 5.0}  # the start scores best; night 2's only eval is worse than night 1's


def test_legs_of_a_budget_end_as_one_uninterrupted_run_with_the_campaigns_best_student(harness, tiny_teacher, tmp_path,
                                                                                       monkeypatch):
    """Night 1's start-up takes (on the budget's clock) more than its budget: its first iteration
    is its last, checkpointed, evaluated and exported; it completes and says it continues. Night
    2 resumes from there and reaches num_iterations with the uninterrupted run's weights; night 3
    starts no actor and says the campaign is complete. One best student for the campaign (the
    evals' FD scripted): night 1's eval at 1 is the best; night 2's at 2 is worse, so its student
    stays iteration 1's export, and its summary's header, its student line and its nights row all
    name iteration 1 (the start's eval is no result of the campaign)."""
    from dmd2_core import report
    from dmd2_core.memory import time_plan
    from dmd2_core.run.checkpoint_commits import read_best_student
    from flows import driver as driver_module
    from flows import nights

    reference = tmp_path / "reference"
    assert run_leg(tiny_teacher, reference).is_completed()

    real_evaluate = driver_module.evaluate
    monkeypatch.setattr(driver_module, "evaluate", lambda run_id, i: {
        **real_evaluate(run_id, i), "metrics": {"fd": SCRIPTED_FD[i]}})
    monkeypatch.setattr(time_plan, "cluster_peak_flops", lambda: 1e12)  # CPUs have no peak of their own
    starts, views, rows = first_night_starts_late(monkeypatch), [], []

    def record(view, outcome, wall_s):
        views.append(view)
        rows.append(nights_view.night_row(view, outcome, wall_s, f"id-{len(rows)}", None, f"2026-12-0{len(rows) + 1}"))

    monkeypatch.setattr(nights, "record_night", record)
    save = tmp_path / "campaign"

    night1 = run_leg(tiny_teacher, save, time_budget_s=1000.0)
    assert night1.is_completed(), night1.message
    assert night1.message.startswith("continues: stopped at iteration 1 of 2"), night1.message
    result = night1.result()
    assert (result["continues"], result["stopped_at"], result["num_iterations"]) == (True, 1, 2)
    assert checkpoint.read_latest(str(save)) == 1
    assert (save / "exports" / "iter_0000001" / "export.json").is_file()  # the stop iteration's student
    assert (save / "media" / "iter_0000001.png").is_file()  # and its eval
    assert (rows[-1]["outcome"], rows[-1]["from_iteration"], rows[-1]["iteration"], rows[-1]["nights_left"]) == (
        "completed, continues", 0, 1, 1)
    assert rows[-1]["s_per_iteration"] > 0

    night2 = run_leg(tiny_teacher, save, time_budget_s=1000.0)
    assert night2.is_completed(), night2.message
    assert night2.message == "campaign complete: iteration 2 of 2"
    assert (night2.result()["start_iteration"], night2.result()["continues"]) == (1, False)
    assert_same_saved_state(save, reference, 2)
    assert (rows[-1]["from_iteration"], rows[-1]["iteration"], rows[-1]["nights_left"]) == (1, 2, 0)

    best = read_best_student(str(save))
    assert (best["iteration"], best["value"]) == (1, 2.0) and best["export_url"].endswith("iter_0000001")
    view, row = views[-1], rows[-1]
    assert view["student"].endswith("iter_0000002")  # the latest export, not the campaign's student
    assert view["best_student"] == best["export_url"] and view["best_iteration"] == 1
    text = report.summary_markdown(view)
    assert "Best eval so far (the campaign's): iteration 1 (fd 2)." in text
    assert "the campaign's best eval, iteration 1;" in text
    assert (row["student"], row["student_iteration"]) == (best["export_url"], 1)
    assert (row["campaign_best"], row["campaign_best_iteration"]) == (2.0, 1)
    assert (row["best"], row["best_iteration"]) == (5.0, 2)  # the night's own best, what a regression is judged by
    assert row["mfu"] == view["mfu"] > 0  # the pace and the MFU it implies
    shown = nights_view.nights_markdown("tiny", rows, None)
    assert f"2026-12-02: iteration 1 `{best['export_url']}`" in shown
    assert "iter_0000002`" not in shown.split("Best students")[1]

    metrics = (save / "metrics.jsonl").read_bytes()
    night3 = run_leg(tiny_teacher, save, time_budget_s=1000.0)
    assert night3.is_completed() and len(starts) == 2  # no actor, no group started
    assert night3.message.startswith(f"campaign complete: {save} is at iteration 2 of 2; nothing to train")
    assert night3.result()["campaign_complete"] and (save / "metrics.jsonl").read_bytes() == metrics
    assert (rows[-1]["outcome"], rows[-1]["nights_left"]) == ("campaign complete", 0)
