"""A LoRA student's adapters in the layouts other tools load, and merged into its base tensor by
tensor. The adapters arrive as a checkpoint holds them (peft names, ``<module>.lora_A.default.weight``)
with the LoRA settings the run recorded (``lora.adapter_metadata``'s keys).

- ``peft_config``, ``peft_state``: a peft adapter directory (``adapter_config.json``, ``adapter_model.safetensors``
  keyed ``base_model.model.<module>.lora_A.weight``) that ``peft.PeftModel.from_pretrained`` loads
  onto the base transformer.
- ``original_state``: the family's original (non-diffusers) key layout, for the families whose
  diffusers loader documents the conversion back (``ORIGINAL_LAYOUTS``: Wan's
  ``_convert_non_diffusers_wan_lora_to_diffusers``, MiniMax-H3's
  ``_convert_non_diffusers_minimax_h3_lora_to_diffusers``); its ``alpha / r`` is folded into
  ``lora_B`` (no ``.alpha`` keys: those loaders then scale by 1). MiniMax-H3's original attention
  has one fused ``qkv_proj``: separate q, k, v adapters of rank r become one of rank 3r whose
  ``lora_A`` stacks theirs and whose ``lora_B`` is block-diagonal, which the loader splits back to
  the same products B A per projection. ``check_original`` proves a written file by that loader.
- ``MergedTensors``: the base's tensors (read one at a time from its safetensors files) with
  ``W + (alpha / r) B A`` on every adapted layer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Callable, Iterator, Optional

import torch

from dmd2_core.errors import ModelDirError
from dmd2_core.models import lora

PEFT_CONFIG_NAME = "adapter_config.json"
PEFT_WEIGHT_NAME = "adapter_model.safetensors"
ORIGINAL_PREFIX = "diffusion_model."


def adapted_modules(adapter_names) -> list[str]:
    """The modules a LoRA adapts, from its adapters' (peft) names, in order."""
    return list(dict.fromkeys(n.partition(".lora_")[0] for n in adapter_names if lora.is_adapter(n)))


def scale_of(metadata: dict) -> float:
    return float(metadata["lora_alpha"]) / float(metadata["r"])


def _pair(adapters: dict[str, torch.Tensor], module: str) -> tuple[torch.Tensor, torch.Tensor]:
    return (adapters[f"{module}.lora_A.{lora.ADAPTER}.weight"].float(),
            adapters[f"{module}.lora_B.{lora.ADAPTER}.weight"].float())


# ---- peft ---------------------------------------------------------------------------------------
def peft_config(metadata: dict, base: str):
    """The adapters' LoraConfig (its ``save_pretrained`` writes adapter_config.json)."""
    from peft import LoraConfig

    return LoraConfig(r=int(metadata["r"]), lora_alpha=metadata["lora_alpha"], base_model_name_or_path=base,
                      target_modules=list(metadata["target_modules"]), lora_dropout=0.0, bias="none")


def peft_state(adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters under the names ``PeftModel.save_pretrained`` gives them."""
    return {f"base_model.model.{n.replace(f'.{lora.ADAPTER}.', '.')}": v for n, v in adapters.items()}


# ---- the original layouts -------------------------------------------------------------------------
def _wan_module(module: str) -> Optional[str]:
    """A Wan diffusers module's original name, where diffusers' conversion maps it back."""
    attention = {"to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o"}
    match = re.fullmatch(r"blocks\.(\d+)\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)", module)
    if match:
        kind = "self_attn" if match.group(2) == "attn1" else "cross_attn"
        return f"blocks.{match.group(1)}.{kind}.{attention[match.group(3)]}"
    match = re.fullmatch(r"blocks\.(\d+)\.ffn\.net\.(0\.proj|2)", module)
    if match:
        return f"blocks.{match.group(1)}.ffn.{match.group(2)[0]}"
    fixed = {"proj_out": "head.head", "condition_embedder.time_proj": "time_projection.1",
             "condition_embedder.text_embedder.linear_1": "text_embedding.0",
             "condition_embedder.text_embedder.linear_2": "text_embedding.2",
             "condition_embedder.time_embedder.linear_1": "time_embedding.0",
             "condition_embedder.time_embedder.linear_2": "time_embedding.2"}
    return fixed.get(module)


def _wan_state(adapters: dict[str, torch.Tensor], metadata: dict) -> dict[str, torch.Tensor]:
    out = {}
    for module in adapted_modules(adapters):
        a, b = _pair(adapters, module)
        name = ORIGINAL_PREFIX + _wan_module(module)
        out[f"{name}.lora_A.weight"], out[f"{name}.lora_B.weight"] = a, b * scale_of(metadata)
    return out


_H3_STANDALONE = {"proj_in": "video_patch_proj", "audio_proj_in": "audio_patch_proj",
                  "context_embedder": "condition_proj", "time_embedder.linear_1": "time_embedder.proj_in",
                  "time_embedder.linear_2": "time_embedder.proj_out", "norm_out.linear": "final_layer.adaln_proj.linear",
                  "proj_out": "final_layer.video_out", "audio_proj_out": "final_layer.audio_out"}
_H3_BLOCK = {"attn.to_q": "attn.qkv_proj", "attn.to_k": "attn.qkv_proj", "attn.to_v": "attn.qkv_proj",
             "attn.to_out.0": "attn.out_proj", "ff.net.0.proj": "mlp.fc1", "ff.net.2": "mlp.fc2",
             "adaln_proj.linear": "adaln_proj.linear"}


def _h3_module(module: str) -> Optional[str]:
    if module in _H3_STANDALONE:
        return _H3_STANDALONE[module]
    match = re.fullmatch(r"(transformer_blocks|token_refiner\.refiner_blocks)\.(\d+)\.(.+)", module)
    if match and match.group(3) in _H3_BLOCK:
        stack = "blocks" if match.group(1) == "transformer_blocks" else "token_refiner.blocks"
        return f"{stack}.{match.group(2)}.{_H3_BLOCK[match.group(3)]}"
    return None


def _h3_state(adapters: dict[str, torch.Tensor], metadata: dict) -> dict[str, torch.Tensor]:
    scale, out, fused = scale_of(metadata), {}, {}
    for module in adapted_modules(adapters):
        a, b = _pair(adapters, module)
        name = ORIGINAL_PREFIX + _h3_module(module)
        if name.endswith(".qkv_proj"):
            fused.setdefault(name, {})[module.rsplit(".", 1)[1]] = (a, b * scale)
            continue
        if name.endswith(".mlp.fc1"):  # diffusers' SwiGLU fuses [value; gate], the original [gate; value]
            value, gate = b.chunk(2, dim=0)
            b = torch.cat([gate, value], dim=0)
        out[f"{name}.lora_A.weight"], out[f"{name}.lora_B.weight"] = a, b * scale
    for name, parts in fused.items():
        present = [parts[p] for p in ("to_q", "to_k", "to_v") if p in parts]
        rows = {b.shape[0] for _, b in present}
        if len(rows) != 1:
            raise ModelDirError(f"{name}: q, k and v differ in width {sorted(rows)}: no fused original layout")
        width, ranks = rows.pop(), [a.shape[0] for a, _ in present]
        up = torch.zeros(3 * width, sum(ranks))
        column = 0
        for i, p in enumerate(("to_q", "to_k", "to_v")):
            if p in parts:
                a, b = parts[p]
                up[i * width:(i + 1) * width, column:column + a.shape[0]] = b
                column += a.shape[0]
        out[f"{name}.lora_A.weight"] = torch.cat([a for a, _ in present], dim=0)
        out[f"{name}.lora_B.weight"] = up
    return out


# family (its diffusers transformer class) -> (module name back to the original's, the state)
ORIGINAL_LAYOUTS: dict[str, tuple[Callable[[str], Optional[str]], Callable]] = {
    "WanTransformer3DModel": (_wan_module, _wan_state),
    "MiniMaxH3Transformer3DModel": (_h3_module, _h3_state),
}


def unmapped_module(class_name: str, modules: list[str]) -> Optional[str]:
    """The first adapted module the family's original layout has no name for (None: all map)."""
    to_original = ORIGINAL_LAYOUTS[class_name][0]
    return next((m for m in modules if to_original(m) is None), None)


def original_state(class_name: str, adapters: dict[str, torch.Tensor], metadata: dict,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state = ORIGINAL_LAYOUTS[class_name][1](adapters, metadata)
    return {k: v.to(dtype).contiguous() for k, v in state.items()}


def check_original(path: str, loader, adapters: dict[str, torch.Tensor], metadata: dict, dtype: torch.dtype) -> None:
    """The original-layout file at the local ``path``, converted back by the family's own diffusers
    loader (``lora_state_dict``), gives every adapted module the student's update (alpha / r) B A
    (to the rounding of ``dtype``, the file's) and nothing else; ModelDirError if not."""
    rtol = 16 * torch.finfo(dtype).eps
    converted = loader.lora_state_dict(path)
    products = {}
    for key, value in converted.items():
        module, _, rest = key.removeprefix("transformer.").partition(".lora_")
        if rest == "A.weight":
            products[module] = converted[f"transformer.{module}.lora_B.weight"].float() @ value.float()
    scale = scale_of(metadata)
    for module in adapted_modules(adapters):
        a, b = _pair(adapters, module)
        if module not in products:
            raise ModelDirError(f"{path}: diffusers' loader finds no LoRA for '{module}' in the original layout")
        want = scale * (b @ a)
        err = (products.pop(module) - want).abs().max().item()
        if err > rtol * max(want.abs().max().item(), 1e-12):
            raise ModelDirError(f"{path}: '{module}' reloads through diffusers' loader {err:.2e} off the student's")
    stray = [m for m, p in products.items() if p.abs().max().item() > 0]
    if stray:
        raise ModelDirError(f"{path}: diffusers' loader finds a LoRA on '{stray[0]}', which the student never adapted")


# ---- merged ---------------------------------------------------------------------------------------
class MergedTensors(Mapping):
    """The base transformer's tensors (``files``: its WeightFiles, ``names``: the model's state
    names) with the adapters merged in, each read and merged when indexed, in fp32 where merged."""

    def __init__(self, files, names: list[str], adapters: dict[str, torch.Tensor], metadata: dict):
        self.files, self.adapters, self.scale = files, adapters, scale_of(metadata)
        merged = {f"{m}.weight" for m in adapted_modules(adapters)}
        self.specs = {n: (files.shape(n), torch.float32 if n in merged else files.tensor(n).dtype) for n in names}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.specs:
            raise KeyError(name)
        shape = self.specs[name][0]
        rows = shape[0] if shape else 1
        value = next(iter(self.files.read_rows([(name, 0, rows)], batch_bytes=0)))[3].clone()
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{module}.lora_A.{lora.ADAPTER}.weight" in self.adapters:
            a, b = _pair(self.adapters, module)
            value = value.float() + self.scale * (b @ a)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)
