"""The exported student's scheduler: the diffusers scheduler config whose ``set_timesteps(K)``
gives the student's K sigmas, so a pipeline's ``num_inference_steps=K`` is the student's sampler.

- A student that re-noises its x0 with fresh noise between steps (LCM's sampler) gets
  ``FlowMatchLCMScheduler``: a config solved for its one K (``student_scheduler_config``). That
  scheduler's grid ends at a fixed sigma for every K (and is undefined at K = 1 with a terminal),
  so no one config serves a set of step counts.
- A student that steps along its velocity (Euler, no fresh noise) gets
  ``FlowMapEulerDiscreteScheduler(shift=S)``, whose ``set_timesteps(K)`` is the student's
  ``shift(linspace(1, 0, K + 1)[:-1])`` at every K: one export serves every step count of a set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

from dmd2_core import flow_matching as fm

SCHEDULER_CLASS = "FlowMatchLCMScheduler"
EULER_SCHEDULER_CLASS = "FlowMapEulerDiscreteScheduler"


@dataclass(frozen=True)
class StudentSteps:
    """The step counts a student serves, ascending, and whether it steps by Euler."""
    counts: tuple[int, ...]
    euler: bool = False

    @classmethod
    def of(cls, num_steps: Union[int, Sequence[int], "StudentSteps"], euler: bool = False) -> "StudentSteps":
        if isinstance(num_steps, StudentSteps):
            return num_steps
        counts = (int(num_steps),) if isinstance(num_steps, int) else tuple(sorted({int(k) for k in num_steps}))
        return cls(counts, bool(euler))

    def per_count(self, figure: Callable[[int], Any]) -> Any:
        """``figure(K)`` for a student of one K; ``{str(K): figure(K)}`` for each K of a set (the
        shape export.json gives each per-K entry)."""
        if len(self.counts) == 1:
            return figure(self.counts[0])
        return {str(k): figure(k) for k in self.counts}

    def marker(self, shift: float) -> dict[str, Any]:
        """export.json's ``num_steps`` and ``sigmas``: one K as before, a set as lists per K."""
        return {"num_steps": self.counts[0] if len(self.counts) == 1 else list(self.counts),
                "sigmas": self.per_count(lambda k: fm.student_sigmas(k, shift))}


def student_scheduler(shift: float, num_steps: Union[int, Sequence[int], StudentSteps]) -> tuple[str, dict[str, Any]]:
    """(diffusers scheduler class, config) whose ``set_timesteps(K)`` gives ``fm.student_sigmas(K,
    shift)`` for every K the student serves; ValueError where none does (a re-noising student
    of several step counts: the run refuses that before it starts)."""
    steps = StudentSteps.of(num_steps)
    if not (shift > 0 and all(k >= 1 for k in steps.counts)):
        raise ValueError(f"shift must be positive and num_steps >= 1, got shift={shift}, num_steps={list(steps.counts)}")
    if steps.euler:
        config: dict[str, Any] = {"num_train_timesteps": 1000, "shift": float(shift)}
        for k in steps.counts:
            err = max(abs(g - w) for g, w in zip(scheduler_sigmas(config, k, EULER_SCHEDULER_CLASS),
                                                 fm.student_sigmas(k, shift)))
            if err > 1e-6:
                raise ValueError(f"{EULER_SCHEDULER_CLASS} does not give the student's sigmas for shift {shift}, "
                                 f"K {k} (max error {err:.2e})")
        return EULER_SCHEDULER_CLASS, config
    if len(steps.counts) > 1:
        raise ValueError(f"a re-noising student of step counts {list(steps.counts)}: {SCHEDULER_CLASS} serves one "
                         "step count per config; train it with dmd2_student_sampler=euler")
    return SCHEDULER_CLASS, student_scheduler_config(shift, steps.counts[0])


def student_scheduler_config(shift: float, num_steps: int, num_train_timesteps: int = 1000) -> dict[str, Any]:
    """FlowMatchLCMScheduler settings whose ``set_timesteps(num_steps)`` gives
    ``fm.student_sigmas(num_steps, shift)`` (and timesteps 1000 sigma).

    Why not plain ``shift=shift``: set_timesteps(K) takes K points evenly spaced from 1 to the
    scheduler's smallest *shifted* training sigma s(1/1000) and shifts them again, e.g. shift 5,
    K=4: [1, .910, .717, .024], while the student samples at s([1, .75, .5, .25]) = [1, .938,
    .833, .625]. No setting keeps ``shift`` = the training shift and fixes this
    (num_train_timesteps would fix the grid but also scales the timestep the model is given).
    What does: the grid, shifted with some S', then ``shift_terminal`` (an affine stretch of
    1 - sigma that ends at T) is a Moebius map of the grid, as the student's schedule is; with
    T = the student's last sigma s(1/K) and S' the root of
    (S-1)(K-1) S'^2 + [(S-1)(K-1) - S K] M S' + S K M = 0 (M = num_train_timesteps - 1)
    the two agree exactly in real arithmetic (float32 rounding here: <= 2.4e-7 over shifts
    0.5..20, K 1..50). So the exported ``shift`` is S', not the training shift; export.json
    records the training shift (and describe_model_dir reads it from there). K=1 needs no
    change: set_timesteps(1) is [1] whatever the shift."""
    S, K, M = float(shift), int(num_steps), num_train_timesteps - 1
    if not (S > 0 and K >= 1):
        raise ValueError(f"shift must be positive and num_steps >= 1, got shift={shift}, num_steps={num_steps}")
    config: dict[str, Any] = {"num_train_timesteps": num_train_timesteps, "shift": S}
    if K > 1:
        a, b, c = (S - 1) * (K - 1), ((S - 1) * (K - 1) - S * K) * M, S * K * M
        if abs(a) < 1e-12:
            solved = -c / b
        else:
            d = math.sqrt(b * b - 4 * a * c)
            roots = [r for r in ((-b - d) / (2 * a), (-b + d) / (2 * a)) if r > 0]
            guess = S * K / (S + K - 1)  # the root as M -> infinity: the well-conditioned one
            solved = min(roots, key=lambda r: abs(r - guess))
        config.update(shift=float(solved), shift_terminal=float(fm.shift_sigma(1.0 / K, S)))
    got = scheduler_sigmas(config, K)
    want = fm.student_sigmas(K, S)
    err = max(abs(g - w) for g, w in zip(got, want))
    if len(got) != K or err > 1e-6:
        raise ValueError(f"no {SCHEDULER_CLASS} config gives the student's sigmas for shift {S}, K {K} "
                         f"(max error {err:.2e})")
    return config


def scheduler_sigmas(config: dict, num_steps: int, class_name: str = SCHEDULER_CLASS) -> list[float]:
    """The K sigmas a pipeline's ``set_timesteps(num_steps)`` gives with this config (of
    ``class_name``, or the class the config names)."""
    import diffusers

    name = config.get("_class_name", class_name)
    scheduler = getattr(diffusers, name)(**{k: v for k, v in config.items() if not k.startswith("_")})
    scheduler.set_timesteps(num_steps)
    return [float(s) for s in scheduler.sigmas[:-1]]


def write_scheduler(directory: str, shift: float, num_steps) -> tuple[str, dict[str, Any]]:
    """The student's scheduler saved into the local ``directory``; returns (class, config)."""
    import diffusers

    name, config = student_scheduler(shift, num_steps)
    getattr(diffusers, name)(**config).save_pretrained(directory)
    return name, config


def verify_written_scheduler(url: str, num_steps, shift: float) -> None:
    """The scheduler written under ``url``/scheduler gives the student's sigmas at each of its
    step counts; ModelDirError naming it if not."""
    import json

    from dmd2_core import storage
    from dmd2_core.errors import ModelDirError

    config = json.loads(storage.read_text(storage.join(url, "scheduler", "scheduler_config.json")))
    for k in StudentSteps.of(num_steps).counts:
        got = scheduler_sigmas(config, k)
        if len(got) != k or max(abs(g - w) for g, w in zip(got, fm.student_sigmas(k, shift))) > 1e-6:
            raise ModelDirError(f"{storage.join(url, 'scheduler')}: the written scheduler does not give the student's "
                                f"sigmas at {k} steps")
