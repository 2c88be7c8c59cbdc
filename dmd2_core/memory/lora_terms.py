"""The memory plan of a LoRA trainer (``lora_rank > 0``, see ``dmd2_core/models/lora.py``).

A LoRA trainer holds, per rank, after sharding over ``S`` ranks:

- the frozen base, as ``TrainerModels`` builds it (``build_empty`` in the compute ``dtype``): its
  parameters in ``dtype``, those under the class's ``_keep_in_fp32_modules`` in fp32 (the rule of
  ``models.loading.load_dtype``; ``parallel.shard_model`` leaves a LoRA's base as built, for every
  family), ``ceil(P / S)`` elements of each;
- the adapters: for every layer peft's target-module rule matches (``lora.config``; peft's own
  ``check_target_module_exists``) a ``lora_A`` and a ``lora_B``, ``rank * (in + out)`` parameters of
  a Linear; their fp32 master weights, gradients, AdamW's two moments and (the actor's) EMA, each
  ``4 * A / S`` bytes;
- buffers in ``dtype`` (the model is built in it);
- no separate teacher when the critic's fake score is a LoRA of the teacher (``lora.shares_base``):
  the real score is the same base with its adapters off, so the base is counted once.

The gather working set is the full-fine-tuning one (two blocks unsharded in ``dtype``, the
adapters included, and the root), except that the block's fp32 gradients before their
reduce-scatter are its adapters' alone. Activations are the full-fine-tuning ones: the backward
still runs through every block (the adapters' rank-wide intermediates, ``tokens * rank`` per
adapted layer, are left out: under 2% of a block's activations at rank 64).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

from dmd2_core import parallel, storage
from dmd2_core.models import lora
from dmd2_core.args import Args
from dmd2_core.errors import ArgsError
from dmd2_core.models import FAMILIES, describe_model_dir

FP32 = 4


@lru_cache(maxsize=4)
def meta_model(url: str) -> torch.nn.Module:
    """A checkpoint's transformer built from its config on the meta device (no weights), cached
    per URL within a process (the plan and the LoRA count read the same build)."""
    info = describe_model_dir(url)
    family = FAMILIES[info["family"]]
    config = json.loads(storage.read_text(storage.join(info["transformer_url"], "config.json")))
    with torch.device("meta"):
        return family.model_class.from_config(config)


@dataclass(frozen=True)
class LoraSize:
    adapters: int  # trainable adapter parameters, the whole model
    layers: int  # adapted layers
    largest_block: int  # adapter parameters of the largest block
    root: int  # adapter parameters outside the blocks
    base_fp32: int  # base parameters kept in fp32 (the class's _keep_in_fp32_modules)
    base_compute: int  # the other base parameters, in the compute dtype


def adapter_params(module: torch.nn.Module, rank: int) -> int:
    """The parameters of one peft LoRA adapter on ``module``: lora_A and lora_B (no bias)."""
    if isinstance(module, torch.nn.Linear):
        return rank * (module.in_features + module.out_features)
    if isinstance(module, torch.nn.modules.conv._ConvNd):  # A: the layer's kernel to rank, B: 1 x ... x 1 to out
        kernel = 1
        for k in module.kernel_size:
            kernel *= k
        return rank * (module.in_channels // module.groups) * kernel + module.out_channels * rank
    if isinstance(module, torch.nn.Embedding):
        return rank * (module.num_embeddings + module.embedding_dim)
    raise ArgsError(f"lora_target_modules: no LoRA plan for a {type(module).__name__} layer")


@lru_cache(maxsize=16)
def lora_size(url: str, rank: int, targets: tuple[str, ...], compute_dtype: str) -> LoraSize:
    """The adapters peft would attach to checkpoint ``url`` (``targets`` by peft's matching rule),
    counted on the meta-device build, and the base's parameters by stored dtype."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    from dmd2_core.models.loading import load_dtype

    model = meta_model(url)
    config = LoraConfig(r=rank, target_modules=list(targets))
    blocks = parallel.blocks(model)
    block_of = {id(m): i for i, b in enumerate(blocks) for m in b.modules()}
    per_block = [0] * len(blocks)
    total = layers = root = 0
    for name, module in model.named_modules():
        if not name or not bool(check_target_module_exists(config, name)):
            continue
        n = adapter_params(module, rank)
        total, layers = total + n, layers + 1
        if id(module) in block_of:
            per_block[block_of[id(module)]] += n
        else:
            root += n
    if not layers:
        raise ArgsError(f"lora_target_modules: {list(targets)} match no layer of {type(model).__name__}")
    dtype = getattr(torch, compute_dtype)
    rule = load_dtype(type(model), dtype)
    fp32 = sum(p.numel() for n, p in model.named_parameters() if rule(n, p.dtype) == torch.float32 != dtype)
    return LoraSize(total, layers, max(per_block, default=0), root, fp32,
                    sum(p.numel() for p in model.parameters()) - fp32)


def size_of(args: Args, url: Optional[str] = None) -> LoraSize:
    return lora_size(url or args.hf_checkpoint, args.lora_rank,
                     tuple(args.lora_target_modules or lora.DEFAULT_TARGETS), args.dtype)


@dataclass
class LoraState:
    """The per-rank bytes of a LoRA trainer's own model (``memory.group_plan`` adds the rest)."""
    params: int  # the adapters' fp32 master weights (so also their gradients, each AdamW moment, the EMA)
    base: int  # the frozen base in dtype (its fp32-kept modules in fp32)
    buffers: int  # the model's buffers, built in dtype
    largest_block: int  # a block's parameters gathered in dtype: the base's and the adapters'
    root: int
    block_grads: int  # one block's fp32 gradients before their reduce-scatter: the adapters'


def state(args: Args, size, shard_size: int, compute: int) -> LoraState:
    """``size``: the base's ``memory.ModelSize``."""
    lo = size_of(args)
    shard = lambda n: -(-n // shard_size)  # noqa: E731 - ceil division, as FSDP pads shards
    return LoraState(params=shard(lo.adapters) * FP32,
                     base=shard(lo.base_fp32) * FP32 + shard(lo.base_compute) * compute,
                     buffers=size.buffers_bytes * compute // FP32,
                     largest_block=size.largest_block + lo.largest_block,
                     root=size.root_params + lo.root,
                     block_grads=lo.largest_block * FP32)
