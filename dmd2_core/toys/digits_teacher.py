"""Pretrain a small prompt-conditioned flow-matching teacher on the digits train split.

    python -m dmd2_core.toys.digits_teacher --save runs/teacher [--steps N] [--seed S] [--reuse] [--table]

Rectified-flow training as in SD3: x_t = (1 - s) x0 + s eps, target v = eps - x0, sigmas drawn
logit-normal (SD3's best-performing ``rf/lognorm(0, 1)``: it concentrates training on the middle
sigmas, where the velocity is hardest to predict; on digits it matched shift-3 uniform sigmas at
50 Euler steps and clearly beat them at 1-4), labels dropped to the empty prompt for classifier-free
guidance, AdamW with warmup and cosine decay, and an EMA of the weights, which is what gets saved.
The shift is the sampling grid's, saved with the checkpoint's scheduler.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from typing import Callable, Optional

import torch

from dmd2_core import flow_matching as fm
from dmd2_core.toys.digits import digits_prompt_set, digits_tensors
from dmd2_core.models import describe_model_dir, save_model_dir
from dmd2_core.errors import ModelDirError
from dmd2_core.models.sd3 import SD3ImageFamily
from dmd2_core.toys.digits import tiny_digits_config

DEFAULT_STEPS = 2500
DEFAULT_BATCH_SIZE = 128
DEFAULT_LR = 1e-3
DEFAULT_EMA_DECAY = 0.999
DEFAULT_SHIFT = 3.0
WARMUP_STEPS = 100


def new_teacher_model(seed: int = 0) -> torch.nn.Module:
    """A freshly initialised digits teacher (SD3 MMDiT); the init depends on ``seed`` alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return SD3ImageFamily().build(tiny_digits_config())


def logit_normal_sigmas(n: int, generator: torch.Generator, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    return torch.sigmoid(mean + std * torch.randn(n, generator=generator))


def lr_factor(step: int, num_steps: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < WARMUP_STEPS:
        return (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, num_steps - WARMUP_STEPS)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def ema_update(ema: torch.nn.Module, model: torch.nn.Module, decay: float) -> None:
    for e, p in zip(ema.parameters(), model.parameters()):
        e.lerp_(p, 1 - decay)


def train_teacher(
    save_url: Optional[str],
    seed: int = 0,
    num_steps: int = DEFAULT_STEPS,
    batch_size: int = DEFAULT_BATCH_SIZE,
    lr: float = DEFAULT_LR,
    label_dropout: float = 0.1,
    shift: float = DEFAULT_SHIFT,
    ema_decay: Optional[float] = DEFAULT_EMA_DECAY,
    weight_decay: float = 0.01,
    log: Optional[Callable[[str], None]] = print,
    log_every: int = 500,
) -> dict:
    """Train a teacher and save it (the EMA weights when ``ema_decay`` is set) at ``save_url`` in
    diffusers format with a FlowMatchEulerDiscreteScheduler of ``shift`` (sampling only: training
    sigmas are logit-normal); ``save_url=None`` skips saving. Deterministic for a seed at a fixed torch thread count.

    Returns {url, seed, steps, batch_size, lr, train_time_s, final_loss, num_params, model}, where
    ``final_loss`` is the mean training loss over the last 100 steps and ``model`` the trained
    (EMA) module."""
    family = SD3ImageFamily()
    prompts = digits_prompt_set()
    x_train, y_train = digits_tensors("train")
    model = new_teacher_model(seed)
    ema = copy.deepcopy(model).requires_grad_(False) if ema_decay else None
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, num_steps))
    g = torch.Generator().manual_seed(seed)
    uncond_all = prompts.uncond(batch_size)

    model.train()
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(num_steps):
        idx = torch.randint(0, len(x_train), (batch_size,), generator=g)
        x0, labels = x_train[idx], y_train[idx]
        noise = torch.randn(x0.shape, generator=g)
        sigma = logit_normal_sigmas(batch_size, g)
        drop = torch.rand(batch_size, generator=g) < label_dropout
        cond = prompts.cond(labels)
        cond = {k: torch.where(drop.view(-1, *[1] * (v.dim() - 1)), uncond_all[k], v) for k, v in cond.items()}

        x_t = fm.add_noise(x0, noise, sigma)
        v = family.predict_velocity(model, x_t, sigma, cond)
        loss = torch.nn.functional.mse_loss(v, fm.velocity_target(x0, noise))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if ema is not None:
            # Short warmup of the decay so the EMA is not dominated by the random init in short runs.
            ema_update(ema, model, min(ema_decay, (1 + step) / (10 + step)))
        losses.append(loss.item())
        if log and log_every and ((step + 1) % log_every == 0 or step + 1 == num_steps):
            recent = losses[-log_every:]
            log(f"teacher step {step + 1}/{num_steps} loss {sum(recent) / len(recent):.4f} "
                f"({time.perf_counter() - start:.0f}s)")
    train_time = time.perf_counter() - start

    final = (ema if ema is not None else model).eval()
    if save_url is not None:
        save_model_dir(final, save_url, shift=shift)
        if log:
            log(f"teacher saved to {save_url}")
    tail = losses[-100:]
    return {
        "url": save_url,
        "seed": seed,
        "steps": num_steps,
        "batch_size": batch_size,
        "lr": lr,
        "train_time_s": round(train_time, 2),
        "final_loss": sum(tail) / len(tail) if tail else float("nan"),
        "num_params": sum(p.numel() for p in final.parameters()),
        "model": final,
    }


def ensure_teacher(url: str, seed: int = 0, log: Optional[Callable[[str], None]] = print, **train_kwargs) -> str:
    """``url`` itself when it already holds a readable checkpoint, else a teacher trained there."""
    try:
        describe_model_dir(url)
        if log:
            log(f"reusing teacher at {url}")
        return url
    except ModelDirError:
        pass
    train_teacher(url, seed=seed, log=log, **train_kwargs)
    return url


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dmd2_core.toys.digits_teacher", description=__doc__.splitlines()[0])
    parser.add_argument("--save", required=True, help="Storage URL of the teacher checkpoint (path, file:// or s3://).")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="Training steps.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the init and every training draw.")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    parser.add_argument("--lr", type=float, default=DEFAULT_LR)
    parser.add_argument("--reuse", action="store_true", help="Reuse a checkpoint already at --save.")
    parser.add_argument("--table", action="store_true", help="Print the quality table at 50/8/4/2/1 Euler steps.")
    parser.add_argument("--num-samples", type=int, default=2000, help="Samples per row of the table.")
    parser.add_argument("--eval-seed", type=int, default=0, help="Seed of the table's noise.")
    parser.add_argument("--guidance-scale", type=float, default=1.0, help="CFG scale of the table's sampler.")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads.")
    ns = parser.parse_args(argv)
    torch.set_num_threads(ns.threads)

    result: dict = {"url": ns.save}
    reused = False
    if ns.reuse:
        try:
            describe_model_dir(ns.save)
            reused = True
            print(f"reusing teacher at {ns.save}")
        except ModelDirError:
            pass
    if not reused:
        info = train_teacher(ns.save, seed=ns.seed, num_steps=ns.steps, batch_size=ns.batch_size, lr=ns.lr)
        info.pop("model")
        result.update(info)
    result["reused"] = reused
    if ns.table:
        from dmd2_core.toys import digits_metrics

        start = time.perf_counter()
        table = digits_metrics.teacher_table(ns.save, num_samples=ns.num_samples, seed=ns.eval_seed,
                                         guidance_scale=ns.guidance_scale)
        reference = digits_metrics.reference_stats()
        print(f"\nteacher quality, Euler steps, guidance {ns.guidance_scale}, {ns.num_samples} samples "
              f"(FD against the held-out test split; 'real' = train vs test digits)")
        print(digits_metrics.format_table(table, reference))
        result.update(table=table, reference=reference, guidance_scale=ns.guidance_scale,
                      eval_time_s=round(time.perf_counter() - start, 2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
