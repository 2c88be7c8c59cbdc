"""The fake score told which step count made its samples (a student of several step counts).

One fake score trained on the samples of every K models their mixture. Where the K differ (a
1-step student's samples are narrower than the data, an 8-step one's wider), the mixture can
match the data while no K does, and the DMD gradient (fake score minus real score) then pushes
none of them. Each K gets a learned vector added to the fake score's time embedding, zero at the
start (the fake score starts as the teacher), so the one network models each K's samples
separately at the cost of ``len(K) x width`` parameters. The fake score is never exported, so its
architecture is free; the real score (a shared base's adapters off) never sees the vector.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

ATTR = "dmd2_step_count_embedding"


def attach(model: torch.nn.Module, time_embedding: str, counts: Sequence[int]) -> None:
    """Give ``model`` one trained vector per step count of ``counts``, added to the output of its
    submodule ``time_embedding`` while ``at(model, K)`` says which K the batch's samples are of.
    Built where the model is (the meta device before sharding); ``init`` zeroes it."""
    module = model.get_submodule(time_embedding)
    linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
    width = linears[-1].out_features
    first = next(model.parameters())
    # given its weight, Embedding draws nothing from the global generator
    embedding = torch.nn.Embedding(len(counts), width, _weight=torch.zeros(len(counts), width, device=first.device))
    setattr(model, ATTR, embedding)
    model._dmd2_step_counts = tuple(int(k) for k in counts)
    model._dmd2_step_index = None

    def add_vector(_module, _inputs, output):
        index = model._dmd2_step_index
        if index is None:
            return output
        return output + getattr(model, ATTR).weight[index].to(output.dtype)

    module.register_forward_hook(add_vector)


def wanted(args) -> bool:
    """Whether a trainer of these args trains a fake score told its samples' step count: a
    critic (not the student) of a student of several step counts, unless the flag says no."""
    return args.loss_type != "dmd2" and args.dmd2_critic_step_conditioning and len(args.student_step_counts) > 1


def attach_for(model: torch.nn.Module, family, args) -> torch.nn.Module:
    """``attach`` where ``wanted(args)``; the model either way."""
    if wanted(args):
        if not family.time_embedding:
            raise ValueError(f"dmd2_critic_step_conditioning: {family.class_name} names no time embedding to "
                             "condition; set it to false")
        attach(model, family.time_embedding, args.student_step_counts)
    return model


def optimizer_groups(model: torch.nn.Module, trained: list[torch.nn.Parameter], lr: float, lr_scale: float) -> list[dict]:
    """AdamW's parameter groups for the ``trained`` parameters of ``model``: one, or with step
    vectors a second one for them at ``lr_scale`` times ``lr``: they start at zero and must reach
    the time embedding's scale within a run that gives each K a share of its critic steps."""
    if not is_conditioned(model):
        return [{"params": trained}]
    vectors = getattr(model, ATTR).weight
    return [{"params": [p for p in trained if p is not vectors]}, {"params": [vectors], "lr": lr * lr_scale}]


def is_conditioned(model) -> bool:
    return hasattr(model, ATTR)


def is_step_embedding(name: str) -> bool:
    return ATTR in name


def in_saved_groups(param_groups: list[dict]) -> bool:
    """Whether a checkpoint's optimizer parameter groups (parameter names) hold step vectors."""
    return any(is_step_embedding(name) for group in param_groups for name in group["params"])


@torch.no_grad()
def init(model: torch.nn.Module) -> None:
    """Zero the vectors (this rank's rows of them): the fake score starts as the teacher."""
    if is_conditioned(model):
        from dmd2_core import parallel

        parallel.local(getattr(model, ATTR).weight).zero_()


@contextlib.contextmanager
def at(model, num_steps: int):
    """The model's forwards inside see the vector of ``num_steps`` (no-op on a model without)."""
    if not is_conditioned(model):
        yield
        return
    counts = model._dmd2_step_counts
    if num_steps not in counts:
        raise ValueError(f"step count {num_steps} is not one of the fake score's {list(counts)}")
    before, model._dmd2_step_index = model._dmd2_step_index, counts.index(num_steps)
    try:
        yield
    finally:
        model._dmd2_step_index = before


@contextlib.contextmanager
def off(model):
    """The model's forwards inside see no vector (the real score of a shared base)."""
    if not is_conditioned(model):
        yield
        return
    before, model._dmd2_step_index = model._dmd2_step_index, None
    try:
        yield
    finally:
        model._dmd2_step_index = before


def batch_steps(pairs: dict) -> int:
    """The one step count of a batch of train pairs (an iteration draws one K for all its rows)."""
    values = torch.as_tensor(pairs["student_steps"]).unique()
    if values.numel() != 1:
        raise ValueError(f"train pairs of {values.numel()} step counts in one batch, expected one")
    return int(values[0])
