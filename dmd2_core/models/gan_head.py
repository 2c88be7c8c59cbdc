"""The GAN head's module (train/gan.py trains it): a model of its own, so the plans that count
its parameters and FLOPs on the meta device build it where they build the transformers."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class DiscriminatorHead(torch.nn.Module):
    """Tokens [B, N, D] of one transformer block -> one logit per sample: a per-token MLP
    (LayerNorm, Linear, SiLU, Linear) averaged over tokens, so any token count fits."""

    def __init__(self, dim: int, hidden: int = 256):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, hidden)
        self.fc2 = torch.nn.Linear(hidden, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.fc1(self.norm(features.to(self.fc1.weight.dtype))))
        return self.fc2(h).squeeze(-1).flatten(1).mean(1)
