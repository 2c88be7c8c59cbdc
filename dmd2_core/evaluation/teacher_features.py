"""Features of samples in the frozen teacher's own eyes: re-noise, one (stopped) forward, pool a block.

A sample x0 (the family's latent, or flat sample for MiniMax-H3) is noised at one fixed schedule
position ``u`` with noise fixed per sample index (so sample i of the student and sample i of the
teacher see the same noise), the teacher runs up to one transformer block (``FeatureTap(stop=True)``:
the blocks after it never run), and that block's output tokens are mean-pooled per modality.
No weights but the teacher's own.
"""

from __future__ import annotations

from typing import Optional

import torch

from dmd2_core import rng
from dmd2_core.models.feature_tap import FeatureTap

NOISE_STREAM = "evaluation/teacher_features"


def sample_noise(shape, seed: int, index_offset: int = 0) -> torch.Tensor:
    """The noise of samples ``index_offset .. index_offset + shape[0] - 1`` (float32 [N, *shape[1:]]):
    row i drawn from (seed, index_offset + i) alone, whatever the batch it comes in."""
    shape = tuple(int(d) for d in shape)
    return torch.stack([rng.randn(shape[1:], seed, index_offset + i, NOISE_STREAM) for i in range(shape[0])]) \
        if shape[0] else torch.empty(shape)


def modality_name(family) -> str:
    """The one key of a single-modality family's features: 'video' or 'image'."""
    return "video" if family.is_video else "image"


def _forward_groups(family, cond: dict, n: int, micro_batch: int) -> list[tuple[list[int], tuple]]:
    """Rows in micro-batches, as (rows, their layout: ``family.layout_keys``). A micro-batch holds
    one layout only (MiniMax-H3: one forward per text length, text tags and keyframe anchors): the
    tap stops the first forward, so a batch of two layouts would lose the second's rows."""
    keyed: dict[tuple, list[int]] = {}
    for i, layout in enumerate(family.layout_keys(cond, n)):
        keyed.setdefault(layout, []).append(i)
    return [(rows[s:s + micro_batch], layout) for layout, rows in keyed.items() for s in range(0, len(rows), micro_batch)]


@torch.no_grad()
def teacher_features(family, teacher_model: torch.nn.Module, x0: torch.Tensor, cond: dict, *,
                     block: Optional[int] = None, u: float = 0.5, seed: int = 0, micro_batch: int = 8,
                     index_offset: int = 0, stop: bool = True) -> dict[str, torch.Tensor]:
    """Teacher features of samples ``x0`` [N, *sample_shape] (the family's latents: SD3 [N, C, H, W],
    Wan [N, C, F, H, W], MiniMax-H3 flat [N, D] of a bound family) under ``cond`` ({key: [N, ...]};
    the teacher sees the entries the family's forward reads, ``family.sample_cond``: an fl2va
    sample's keyframes too, noised with the fixed training draw unless ``cond`` holds the sample's
    own ``keyframe_noise``, so the student's, the reference's and the real rows' clips are seen
    alike): {modality: float32 [N, width] on the CPU}, width the block's
    hidden size. Keys: 'video' and 'audio' for MiniMax-H3 (the generated rows only: text and
    keyframe rows are in neither), 'image' for SD3, 'video' for Wan.

    Each sample is noised at the shared schedule position ``u`` (the project's sigma: SD3 and Wan
    at sigma u, MiniMax-H3's video at shift(u, 12) and audio at shift(u, 3) through the family's
    ``add_noise``) with ``sample_noise(seed, index_offset + i)``, and the teacher runs to block
    ``block`` (default the middle one, ``family.feature_block``) and stops there. Eval mode, no
    grad, ``micro_batch`` samples per forward (the result does not depend on it up to float
    rounding); ``index_offset`` numbers the samples of a chunk of a larger set. ``teacher_model``
    must be a plain module with ``stop`` (a stopped sharded forward would leave FSDP's hooks half
    done): a sharded teacher runs its whole forward on every rank (``stop=False``), same features."""
    n = x0.shape[0]
    if n == 0:
        raise ValueError("teacher_features: no samples")
    device = next(teacher_model.parameters()).device
    cond = {k: torch.as_tensor(v) for k, v in family.sample_cond(cond).items()}
    for k, v in cond.items():
        if v.shape[0] != n:
            raise ValueError(f"teacher_features: cond[{k!r}] has {v.shape[0]} rows for {n} samples")
    noise = sample_noise(x0.shape, seed, index_offset)
    out: dict[str, torch.Tensor] = {}
    was_training = teacher_model.training
    teacher_model.eval()
    try:
        for rows, (text_tokens, *layout) in _forward_groups(family, cond, n, max(1, int(micro_batch))):
            index = torch.tensor(rows)
            x_t = family.add_noise(x0[index].to(device).float(), noise[index].to(device), u)
            sigma = torch.full((len(rows),), float(u))
            with FeatureTap(family, teacher_model, block, stop=stop) as tap:
                family.predict_velocity(teacher_model, x_t, sigma, {k: v[index] for k, v in cond.items()})
            tokens = tap.features
            if tokens is None or tokens.shape[0] != len(rows):
                raise RuntimeError(f"teacher_features: the feature block saw {None if tokens is None else tokens.shape[0]} "
                                   f"rows of a forward of {len(rows)} (a family that splits a batch into "
                                   "several forwards needs its rows grouped here)")
            spans = family.feature_tokens(text_tokens, tuple(layout)) or {modality_name(family): None}
            for name, span in spans.items():
                part = tokens if span is None else tokens.index_select(1, span.to(tokens.device))
                pooled = part.float().mean(1).cpu()
                if name not in out:
                    out[name] = torch.empty(n, pooled.shape[1])
                out[name][index] = pooled
    finally:
        teacher_model.train(was_training)
    return out
