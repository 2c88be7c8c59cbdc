"""The exported student's scheduler: the diffusers scheduler config whose ``set_timesteps(K)``
gives the student's K sigmas, so a pipeline's ``num_inference_steps=K`` is the student's sampler."""

from __future__ import annotations

import math
from typing import Any

from dmd2_core import flow_matching as fm

SCHEDULER_CLASS = "FlowMatchLCMScheduler"


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


def scheduler_sigmas(config: dict, num_steps: int) -> list[float]:
    """The K sigmas a pipeline's ``set_timesteps(num_steps)`` gives with this config."""
    import diffusers

    scheduler = getattr(diffusers, SCHEDULER_CLASS)(**config)
    scheduler.set_timesteps(num_steps)
    return [float(s) for s in scheduler.sigmas[:-1]]


def verify_written_scheduler(url: str, num_steps: int, shift: float) -> None:
    """The scheduler written under ``url``/scheduler gives the student's sigmas; CheckpointError naming it if not."""
    import json

    from dmd2_core import storage
    from dmd2_core.errors import ModelDirError

    got = scheduler_sigmas(json.loads(storage.read_text(storage.join(url, "scheduler", "scheduler_config.json"))),
                           num_steps)
    if max(abs(g - w) for g, w in zip(got, fm.student_sigmas(num_steps, shift))) > 1e-6:
        raise ModelDirError(f"{storage.join(url, 'scheduler')}: the written scheduler does not give the student's sigmas")
