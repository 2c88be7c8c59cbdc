"""A run's time budget (``time_budget_s``): a night of a nightly deployment is one time-boxed leg
of a distillation. The driver asks before each iteration whether it must be the leg's last, so that
the end of the leg (a checkpoint of that iteration, its eval, the best student's export) still
fits; the next run on the same save resumes from that checkpoint and goes on.

Every cost is estimated from what this run measured (the largest seen, times SAFETY); a cost not
measured yet is taken as the run's start-up (bringing every group up from storage, which reads
what a checkpoint writes): conservative where iterations are cheap, the right size where a save
is the load run backwards."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

SAFETY = 1.25  # a measured cost is taken as its largest seen times this (storage and evals vary)
COSTS = ("iteration", "eval", "checkpoint", "export")


def clock() -> float:
    """The budget's clock (seconds; module level so a test can move time)."""
    return time.perf_counter()


@dataclass
class TimeBudget:
    budget_s: float  # seconds from ``started``
    started: float  # clock() at the run's start
    default_s: float = 0.0  # the estimate of a cost this run has not measured yet (set to the start-up)
    seen: dict[str, float] = field(default_factory=dict)  # cost -> largest seconds measured

    def note(self, cost: str, seconds: float) -> None:
        """One measurement of ``cost`` (one of COSTS)."""
        if cost not in COSTS:
            raise ValueError(f"unknown cost {cost!r}; one of {', '.join(COSTS)}")
        self.seen[cost] = max(self.seen.get(cost, 0.0), float(seconds))

    def estimate(self, cost: str) -> float:
        return SAFETY * self.seen[cost] if cost in self.seen else self.default_s

    def elapsed(self) -> float:
        return clock() - self.started

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def end_s(self, evaluating: bool) -> float:
        """The leg's end: a checkpoint that waits until durable, the student's export, the final eval."""
        return self.estimate("checkpoint") + self.estimate("export") + (self.estimate("eval") if evaluating else 0.0)

    def must_stop_after_next(self, evaluating: bool, scheduled_s: float = 0.0) -> bool:
        """Whether the iteration about to start must be the leg's last: after it (and ``scheduled_s``,
        its own scheduled eval or checkpoint were it not the last), one more iteration and the end
        would not fit in what is left."""
        return self.left() < 2 * self.estimate("iteration") + scheduled_s + self.end_s(evaluating)

    def describe(self, evaluating: bool) -> str:
        """The figures the decision used, for its log line."""
        return (f"{self.elapsed():.1f}s of {self.budget_s:g}s used; an iteration ~{self.estimate('iteration'):.1f}s, "
                f"the end (checkpoint, export{', eval' if evaluating else ''}) ~{self.end_s(evaluating):.1f}s")
