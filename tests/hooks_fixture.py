"""Train-input hooks the tests name by dotted path (Ray workers import them from the repo root)."""

import torch

from dmd2_core.train.input_hook import join_external_data

EXPECTED_LOCAL_BATCH = 4


def require_whole_local_batch(args, pairs, external_data):
    """Fails unless it sees the rank's whole batch, i.e. it runs before micro-batching."""
    joined = join_external_data(args, pairs, external_data)
    if joined["x_t"].shape[0] != EXPECTED_LOCAL_BATCH:
        raise AssertionError(f"hook saw {joined['x_t'].shape[0]} pairs")
    return joined


def zero_dmd2_gradient(args, pairs, external_data):
    joined = join_external_data(args, pairs, external_data)
    return {**joined, "dmd2_grad": torch.zeros_like(joined["dmd2_grad"])}



def wrong_signature(pairs):
    return pairs


def record_external_data(args, pairs, external_data):
    """Writes the tag it received to {save}/seen/<pid>-<tag>, then joins as the default does."""
    import os
    from pathlib import Path

    tag = int(external_data["tag"][0])
    seen = Path(args.save) / "seen"
    seen.mkdir(parents=True, exist_ok=True)
    (seen / f"{os.getpid()}-{tag}").write_text(str(external_data["tag"].tolist()))
    return join_external_data(args, pairs, external_data)


# ---- NaN injection (tests/test_faults.py). Counters are per process: each fresh actor starts at 0,
# so "the n-th call" is the n-th iteration that actor trains.
_CALLS: dict[str, int] = {}


def _call(name: str) -> int:
    _CALLS[name] = _CALLS.get(name, 0) + 1
    return _CALLS[name]


def _nan_row0(t):
    t = t.clone()
    t[0].view(-1)[0] = float("nan")
    return t


def nan_into_actor_inputs(args, pairs, external_data):
    """Actor hook: NaN in the DMD gradient on its 2nd train, in the student's x_t on its 3rd."""
    joined = join_external_data(args, pairs, external_data)
    n = _call("actor")
    if n == 2:
        joined["dmd2_grad"] = _nan_row0(joined["dmd2_grad"])
    elif n == 3:
        joined["x_t"] = _nan_row0(joined["x_t"])
    return joined


def nan_into_critic_inputs(args, pairs, external_data):
    """Critic hook: NaN in the student samples the critic trains and scores on, on its 4th train."""
    joined = join_external_data(args, pairs, external_data)
    if _call("critic") == 4:
        joined["x0"] = _nan_row0(joined["x0"])
    return joined


def nan_dmd2_gradient_always(args, pairs, external_data):
    joined = join_external_data(args, pairs, external_data)
    joined["dmd2_grad"] = _nan_row0(joined["dmd2_grad"])
    return joined
