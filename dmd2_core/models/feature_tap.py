"""A hook on one transformer block that keeps its output tokens: the GAN head's features (the
fake score's) and the teacher evaluator's (the frozen teacher's)."""

from __future__ import annotations

from typing import Optional

import torch

from dmd2_core import context_parallel


class _Stop(Exception):
    pass


class FeatureTap:
    """A forward hook on one transformer block that keeps its output tokens (``features``: the
    whole sequence, also when context parallelism splits it; ``forwards``: every forward's, in
    order, for a family that runs a batch as several forwards, MiniMax-H3's one per layout);
    ``stop=True`` ends the forward right there (the blocks after it are not needed)."""

    def __init__(self, family, model: torch.nn.Module, block: Optional[int], stop: bool = False):
        self.model, self.module = model, family.feature_block(model, block)
        self.stop, self._handle = stop, None
        self.forwards: list[torch.Tensor] = []

    @property
    def features(self) -> Optional[torch.Tensor]:
        """The last forward's output tokens (None before one)."""
        return self.forwards[-1] if self.forwards else None

    def _hook(self, module, inputs, output):
        tokens = output if torch.is_tensor(output) else output[-1]  # SD3 blocks: (context, image)
        self.forwards.append(context_parallel.gather_sequence(self.model, tokens))
        if self.stop:
            raise _Stop

    def __enter__(self) -> "FeatureTap":
        self._handle = self.module.register_forward_hook(self._hook)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._handle.remove()
        return exc_type is _Stop
