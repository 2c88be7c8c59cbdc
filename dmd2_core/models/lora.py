"""LoRA trainers (peft) over a frozen base, and the critic's one shared base.

``attach`` injects one peft LoRA adapter (``lora_rank``, ``lora_alpha``, ``lora_target_modules``,
``lora_dropout``; the critic's from its ``critic_lora_*`` flags) into a loaded transformer, before
sharding: the base weights are frozen (``requires_grad`` off), the adapters are the only trained
parameters. ``parallel.shard_model`` then stores the frozen base in the compute dtype and the
adapters in fp32 (master weights, gradients, AdamW state, EMA: ``trained`` names them), in the
same FSDP2 units as the base layers they wrap; activation checkpointing is the model's own, as for
full fine-tuning. A rank of 0 is full fine-tuning: nothing is attached.

The shared base. The student, the fake score and the teacher start from the same weights. When
the critic's fake score is a LoRA of the teacher (``shares_base``), the critic group loads one
model: the fake score is the base with its adapter on, the real score (``RealScore``) the same
module with every adapter off (peft's ``LoraLayer`` then returns ``base_layer(x)`` alone), so the
base is stored, and sharded, once. Its forward is the frozen teacher's, bit for bit, in the
compute dtype (tests/test_lora.py compares it with a separately loaded, sharded teacher).

Parameter names are peft's (``...to_q.base_layer.weight``, ``...to_q.lora_A.default.weight``);
checkpoints hold the adapters only (``saved_state``), the export writes them in diffusers' LoRA
format (``diffusers_lora_state``), or merged into the base (``merged_state``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from dmd2_core.args import Args

ADAPTER = "default"
DEFAULT_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # attention projections (SD3, Wan, MiniMax-H3)


def shares_base(args: Args) -> bool:
    """The critic's fake score is a LoRA of the teacher itself: one model holds both."""
    teacher = args.teacher_checkpoint or args.hf_checkpoint
    return args.lora_rank > 0 and teacher == args.hf_checkpoint


def config(args: Args):
    from peft import LoraConfig

    return LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha or args.lora_rank,
                      target_modules=list(args.lora_target_modules or DEFAULT_TARGETS),
                      lora_dropout=args.lora_dropout, init_lora_weights=True)


def attach(model: torch.nn.Module, args: Args) -> torch.nn.Module:
    """Inject the trainer's adapter in place (rank 0: leave the model as it is). B starts at zero,
    so the model's forward is unchanged; A is drawn from ``args.seed`` (every rank draws the same
    before sharding)."""
    if not args.lora_rank:
        return model
    from peft import inject_adapter_in_model

    model.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        try:
            inject_adapter_in_model(config(args), model, adapter_name=ADAPTER)
        except ValueError as exc:
            raise ValueError(f"lora_target_modules: {str(exc).splitlines()[0]}") from None
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    return model


@torch.no_grad()
def init_adapters(model: torch.nn.Module, seed: int) -> None:
    """The adapters' start, after sharding a model built on the meta device (whose adapters hold
    uninitialised memory): peft's own init, A kaiming-uniform (a = sqrt(5)) drawn from ``seed``
    whole and in parameter order, B zero; each rank keeps its rows. Every rank count draws the
    same adapters."""
    import math

    from dmd2_core import parallel

    g = torch.Generator().manual_seed(seed)
    for name, param in trained(model):
        whole = torch.zeros(param.shape, dtype=torch.float32)
        if ".lora_A." in name:
            bound = math.sqrt(6.0 / ((1 + 5.0) * whole.shape[1]))  # kaiming_uniform_(a=sqrt(5)), fan_in
            whole.uniform_(-bound, bound, generator=g)
        start, stop = parallel.shard_rows(name, param)
        parallel.local(param).copy_(whole[start:stop].to(param.dtype))


def base_names(named) -> dict[str, torch.Tensor]:
    """(name, tensor) pairs by the names the diffusers checkpoint holds them under: a LoRA layer's
    base weights without peft's ``base_layer``, its adapters left out."""
    return {name.replace(".base_layer.", "."): t for name, t in named if not is_adapter(name)}


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def has_adapters(model: torch.nn.Module) -> bool:
    return any(is_adapter(n) for n, _ in model.named_parameters())


def trained(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of what the trainer trains, in parameter order: the adapters of a LoRA,
    every parameter otherwise."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def trained_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for _, p in trained(model)]


def saved_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model section of a checkpoint: the whole state dict for full fine-tuning, the adapters
    alone for a LoRA (the frozen base is the teacher's checkpoint, never saved)."""
    if not has_adapters(model):
        return model.state_dict()
    return dict(trained(model))


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """Every LoRA layer of ``model`` computes its base layer alone inside the block. The flag is
    set directly: peft's ``enable_adapters(False)`` would also flip the adapters'
    ``requires_grad``, which must not change on sharded parameters."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, was in zip(layers, before):
            m._disable_adapters = was


class RealScore:
    """The teacher of a shared base: the critic's model called with every adapter off and without
    autograd (the real score is never differentiated). Attributes are the model's."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __call__(self, *args, **kwargs):
        from dmd2_core.models import step_conditioning

        with adapters_off(self.model), step_conditioning.off(self.model), torch.no_grad():
            return self.model(*args, **kwargs)

    def parameters(self, recurse: bool = True):
        return self.model.parameters(recurse)

    def __getattr__(self, name: str):
        return getattr(self.model, name)


# ---- export -----------------------------------------------------------------------------------
def diffusers_lora_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of a whole (gathered) state in diffusers' LoRA format, as the pipelines'
    ``save_lora_weights(transformer_lora_layers=...)`` take them: ``<module>.lora_A.weight``."""
    return {n.replace(f".{ADAPTER}.", "."): v for n, v in state.items() if is_adapter(n)}


def adapter_record(args: Args) -> Optional[dict]:
    """What a LoRA checkpoint's adapters are (rank, alpha, targets); None for full fine-tuning."""
    if not args.lora_rank:
        return None
    cfg = config(args)
    return {"rank": cfg.r, "alpha": float(cfg.lora_alpha), "targets": sorted(cfg.target_modules)}


def adapter_metadata(args: Args) -> dict:
    """The LoraConfig diffusers' loader rebuilds the adapter from (rank, alpha, targets)."""
    cfg = config(args)
    return {"r": cfg.r, "lora_alpha": cfg.lora_alpha, "target_modules": sorted(cfg.target_modules),
            "lora_dropout": 0.0, "bias": "none", "use_dora": False}


def metadata_of_record(record: dict) -> dict:
    """``adapter_metadata`` of the adapters a checkpoint recorded (``adapter_record``'s keys)."""
    return {"r": int(record["rank"]), "lora_alpha": float(record["alpha"]), "target_modules": sorted(record["targets"]),
            "lora_dropout": 0.0, "bias": "none", "use_dora": False}


def merged_state(state: dict[str, torch.Tensor], metadata: dict, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """A whole LoRA state (peft names) merged into plain diffusers names: W + (alpha / r) B A for
    every adapted layer (in fp32, then ``dtype``), the base's other tensors as they are."""
    scale = metadata["lora_alpha"] / metadata["r"]
    out = {}
    for name, value in state.items():
        if is_adapter(name):
            continue
        if ".base_layer." in name:
            prefix, _, leaf = name.partition(".base_layer.")
            if leaf == "weight":
                a, b = state[f"{prefix}.lora_A.{ADAPTER}.weight"], state[f"{prefix}.lora_B.{ADAPTER}.weight"]
                value = value.float() + scale * (b.float() @ a.float())
            name = f"{prefix}.{leaf}"
        out[name] = value if dtype is None or not value.is_floating_point() else value.to(dtype)
    return out


# the class whose ``save_lora_weights`` / ``load_lora_weights`` a family's LoRA goes through
LORA_LOADERS = {"StableDiffusion3Pipeline": "StableDiffusion3Pipeline", "WanPipeline": "WanPipeline",
                "MiniMaxH3ModularPipeline": "MiniMaxH3LoraLoaderMixin"}
LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"


def lora_loader(family):
    import diffusers
    import diffusers.loaders

    name = LORA_LOADERS.get(family.pipeline_class)
    if name is None:
        raise ValueError(f"lora_rank: no diffusers LoRA loader known for {family.pipeline_class}")
    return getattr(diffusers, name, None) or getattr(diffusers.loaders, name)
