"""Conditioning sets (precomputed prompt embeddings) and the digits image set.

A prompt set is one safetensors file holding the tensors a real text-to-image pipeline's text
encoders produce: ``prompt_embeds`` [N, L, D], optionally ``pooled_prompt_embeds`` [N, P], and the
empty-prompt entry ``negative_prompt_embeds`` [1, L, D] (+ ``negative_pooled_prompt_embeds``) used
as the unconditional branch of classifier-free guidance; the prompt texts ride in its metadata.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from dmd2_core import storage

DIGITS = "digits"
DIGITS_EMBED_DIM = 32
DIGITS_TOKENS = 4
DIGITS_TEST_SIZE = 497  # held-out digits for the Fréchet distance; 1300 train


@dataclass
class PromptSet:
    prompts: list[str]
    embeds: dict[str, torch.Tensor]  # key -> [N, ...]
    negative: dict[str, torch.Tensor]  # key -> [1, ...]

    def __len__(self) -> int:
        return len(self.prompts)

    def cond(self, indices) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return {k: v[idx] for k, v in self.embeds.items()}

    def uncond(self, n: int) -> dict[str, torch.Tensor]:
        return {k: v.expand(n, *v.shape[1:]).clone() for k, v in self.negative.items()}

    def save(self, url: str) -> None:
        tensors = {**self.embeds, **{f"negative_{k}": v for k, v in self.negative.items()}}
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "prompts.safetensors"
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"prompts": json.dumps(self.prompts)})
            storage.write_bytes(url, path.read_bytes())


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


def load_prompt_set(url: str) -> PromptSet:
    if url == DIGITS:
        return digits_prompt_set()
    from safetensors import safe_open

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.safetensors"
        path.write_bytes(storage.read_bytes(url))
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    prompts = json.loads(meta.get("prompts", "[]"))
    embeds = {k: v for k, v in tensors.items() if not k.startswith("negative_")}
    negative = {k.removeprefix("negative_"): v for k, v in tensors.items() if k.startswith("negative_")}
    if "prompt_embeds" not in embeds or set(negative) != set(embeds):
        raise ValueError(f"{url}: a prompt set needs prompt_embeds and a negative_ entry for each key")
    if not prompts:
        prompts = [f"prompt {i}" for i in range(len(embeds["prompt_embeds"]))]
    return PromptSet(prompts, embeds, negative)


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
