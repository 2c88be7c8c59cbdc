"""Which iterations evaluate, save and export (dmd2_core/run/schedule.py)."""

from __future__ import annotations

from dmd2_core.run.schedule import Schedule
from tests.helpers import tiny_args


def _at(schedule: Schedule, first: int = 1) -> dict[str, list[int]]:
    iterations = range(first, schedule.final + 1)
    return {
        "evals": [i for i in iterations if schedule.evals_at(i)],
        "saves": [i for i in iterations if schedule.saves_at(i)],
        "exports": [i for i in iterations if schedule.saves_at(i) and schedule.exports_at(i)],
        "waits": [i for i in iterations if schedule.saves_at(i) and schedule.waits_at(i)],
        "follows": [i for i in iterations if schedule.follows_directly(i)],
    }


def test_intervals_of_zero_save_and_export_only_at_the_end_and_never_evaluate():
    schedule = Schedule(final=5)
    assert not schedule.evaluating
    assert _at(schedule) == {"evals": [], "saves": [5], "exports": [5], "waits": [5], "follows": [1, 2, 3, 4]}


def test_intervals_and_a_final_iteration_off_the_grid():
    schedule = Schedule(final=10, save_interval=4, export_interval=8, eval_interval=3)
    assert schedule.evaluating
    assert _at(schedule) == {
        "evals": [3, 6, 9, 10],  # and the final one
        "saves": [4, 8, 10],
        "exports": [8, 10],  # every 8th iteration, and the final save (it waits)
        "waits": [10],
        "follows": [1, 2, 5, 7],
    }


def test_export_interval_zero_exports_at_every_save():
    schedule = Schedule(final=6, save_interval=2)
    assert _at(schedule)["exports"] == [2, 4, 6]


def test_a_save_that_waits_exports_and_one_that_does_not_follows_the_interval():
    schedule = Schedule(final=10, save_interval=2, export_interval=4)
    assert schedule.exports_at(2, wait=True) and not schedule.exports_at(2, wait=False)
    assert schedule.exports_at(4, wait=False)
    assert not schedule.exports_at(10, wait=False) and schedule.exports_at(10)


def test_a_resumed_run_counts_on_from_its_checkpoint():
    """A resumed run's iterations keep their numbers: intervals count from iteration 0."""
    schedule = Schedule(final=12, save_interval=5, eval_interval=5)
    assert _at(schedule, first=8) == {"evals": [10, 12], "saves": [10, 12], "exports": [10, 12], "waits": [12],
                                      "follows": [8, 9, 11]}


def test_the_schedule_of_args():
    args = tiny_args("unused", "unused", num_iterations=7, save_interval=3, export_interval=6, eval_interval=2)
    assert Schedule.of(args) == Schedule(final=7, save_interval=3, export_interval=6, eval_interval=2)
    assert Schedule.of(args, final=9).final == 9
