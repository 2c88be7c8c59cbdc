"""Which iterations of a run evaluate, save a checkpoint and export the student: one object the
flow (what to run after an iteration) and the run (what a checkpoint writes) both ask."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dmd2_core.args import Args


@dataclass(frozen=True)
class Schedule:
    final: int  # the run's last iteration
    save_interval: int = 0  # 0: save only at the final iteration
    export_interval: int = 0  # 0: export at every save
    eval_interval: int = 0  # 0: never evaluate

    @classmethod
    def of(cls, args: Args, final: Optional[int] = None) -> "Schedule":
        """The schedule of ``args``, its last iteration ``final`` (default ``num_iterations``)."""
        return cls(final=args.num_iterations if final is None else final, save_interval=args.save_interval,
                   export_interval=args.export_interval, eval_interval=args.eval_interval)

    @property
    def evaluating(self) -> bool:
        return self.eval_interval > 0

    def evals_at(self, i: int) -> bool:
        """Every ``eval_interval``-th iteration and the final one, when the run evaluates at all."""
        return self.evaluating and (i % self.eval_interval == 0 or i == self.final)

    def saves_at(self, i: int) -> bool:
        """Every ``save_interval``-th iteration and the final one."""
        return bool(self.save_interval and i % self.save_interval == 0) or i == self.final

    def waits_at(self, i: int) -> bool:
        """The save of iteration i waits until it is durable: the final one (the run ends on it)."""
        return i == self.final

    def exports_at(self, i: int, wait: Optional[bool] = None) -> bool:
        """A save of iteration i also exports the student: every ``export_interval``-th iteration
        (every save when 0) and any save that waits (``wait``, default ``waits_at(i)``)."""
        if wait is None:
            wait = self.waits_at(i)
        return wait or not self.export_interval or i % self.export_interval == 0

    def follows_directly(self, i: int) -> bool:
        """Iteration i+1 comes right after i, with no eval or checkpoint between them."""
        return i < self.final and not (self.evals_at(i) or self.saves_at(i))
