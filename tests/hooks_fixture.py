"""Train-input hooks the tests name by dotted path (Ray workers import them from the repo root)."""

import torch

from dmd2_core.hooks import join_external_data

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
