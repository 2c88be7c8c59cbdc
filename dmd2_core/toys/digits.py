"""The digits data: scikit-learn's 8x8 digits, ten prompts standing in for a text encoder's, and
the config of a tiny SD3 MMDiT to train on them (the built-in set: ``toys/digits_world.py``)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from dmd2_core.data import PromptSet

DIGITS_EMBED_DIM = 32
DIGITS_TOKENS = 4
DIGITS_TEST_SIZE = 497  # held-out digits for the Fréchet distance; 1300 train


def digits_prompt_set() -> PromptSet:
    """Ten prompts, one per digit, with fixed embeddings standing in for a text encoder's (seeded,
    so every process builds the same set), and an empty-prompt entry of its own."""
    g = torch.Generator().manual_seed(20240514)
    tokens = torch.randn(11, DIGITS_TOKENS, DIGITS_EMBED_DIM, generator=g)
    pooled = torch.randn(11, DIGITS_EMBED_DIM, generator=g)
    return PromptSet(
        prompts=[f"a handwritten digit {d}" for d in range(10)],
        embeds={"prompt_embeds": tokens[:10], "pooled_prompt_embeds": pooled[:10]},
        negative={"prompt_embeds": tokens[10:], "pooled_prompt_embeds": pooled[10:]},
    )


@lru_cache(maxsize=1)
def digits_split() -> dict[str, np.ndarray]:
    """scikit-learn's 8x8 digits scaled to [-1, 1], with a fixed held-out test split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    images = (data.images.astype(np.float32) / 8.0) - 1.0
    x_tr, x_te, y_tr, y_te = train_test_split(
        images, data.target, test_size=DIGITS_TEST_SIZE, random_state=0, stratify=data.target
    )
    return {"train_x": x_tr, "train_y": y_tr, "test_x": x_te, "test_y": y_te}


def digits_tensors(split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """Images [N, 1, 8, 8] and labels [N] of one split."""
    d = digits_split()
    return torch.from_numpy(d[f"{split}_x"]).unsqueeze(1), torch.from_numpy(d[f"{split}_y"]).long()


def tiny_digits_config(embed_dim: int = 32, pooled_dim: int = 32) -> dict:
    """An SD3 MMDiT small enough to train on 8x8 digits on two CPU cores in minutes."""
    return dict(
        sample_size=8,
        patch_size=2,
        in_channels=1,
        out_channels=1,
        num_layers=3,
        attention_head_dim=32,
        num_attention_heads=2,
        joint_attention_dim=embed_dim,
        caption_projection_dim=64,
        pooled_projection_dim=pooled_dim,
        pos_embed_max_size=8,
    )
