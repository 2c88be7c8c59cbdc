"""Prompt sets from prompt lists, encoded once with the checkpoint pipeline's own text encoder(s),
so that training never loads a text encoder."""

from __future__ import annotations

import json
from typing import Optional

import torch

from dmd2_core import storage
from dmd2_core.errors import ArgsError, one_line
from dmd2_core.data import PromptSet
from dmd2_core.models import FAMILIES, describe_model_dir


def read_prompt_list(url: str) -> list[str]:
    if not storage.exists(url):
        raise ArgsError(f"prompts file not found: {url}")
    prompts = [line.strip() for line in storage.read_text(url).splitlines() if line.strip()]
    if not prompts:
        raise ArgsError(f"prompts file {url} holds no prompt (one per line)")
    return prompts


def prepare_prompts(
    hf_checkpoint: str,
    prompts: list[str],
    out: str,
    negative_prompt: str = "",
    max_sequence_length: Optional[int] = None,
) -> PromptSet:
    """Encode ``prompts`` (and the empty/negative prompt) and save the prompt set at ``out`` (when set)."""
    import diffusers

    info = describe_model_dir(hf_checkpoint, "hf_checkpoint")
    if FAMILIES[info["family"]].has_audio:  # MiniMax-H3: its modular pipeline's Qwen3-VL conditioner
        prompt_set = encode_conditioner_prompts(hf_checkpoint, prompts)
        if out:
            prompt_set.save(out)
        return prompt_set
    index = json.loads(storage.read_text(storage.join(hf_checkpoint, "model_index.json")))
    if "text_encoder" not in index:
        raise ArgsError(f"{hf_checkpoint}: the checkpoint has no text_encoder to encode prompts with")
    family = FAMILIES[info["family"]]
    pipeline_class = getattr(diffusers, index["_class_name"])
    with storage.local_copy(hf_checkpoint) as local:
        pipe = pipeline_class.from_pretrained(str(local), transformer=None, vae=None)
        with torch.no_grad():
            embeds, negative = family.encode_prompts(pipe, prompts, negative_prompt, max_sequence_length)
    prompt_set = PromptSet(list(prompts), {k: v.float().contiguous() for k, v in embeds.items()},
                           {k: v.float().contiguous() for k, v in negative.items()})
    if out:
        prompt_set.save(out)
    return prompt_set


def encode_conditioner_prompts(hf_checkpoint: str, prompts: list[str]) -> PromptSet:
    """MiniMax-H3's conditions: each prompt's Qwen3-VL ``hidden_states[50]`` as diffusers' t2va text
    step computes it (no chat template, no special tokens), zero-padded to the longest into
    ``prompt_embeds`` [N, T, 5120] with the true ``prompt_lengths`` [N] (one forward holds one text
    length: the trainer groups by it); no negative entry (the checkpoint is guidance-distilled)."""
    from dmd2_core.models.h3_repository import encode_prompts_h3

    try:
        embeds = encode_prompts_h3(hf_checkpoint, prompts)
    except ValueError as exc:
        raise ArgsError(f"hf_checkpoint: {one_line(exc)}") from None
    lengths = torch.tensor([e.shape[0] for e in embeds])
    packed = torch.zeros(len(embeds), int(lengths.max()), embeds[0].shape[-1])
    for i, e in enumerate(embeds):
        packed[i, :e.shape[0]] = e
    return PromptSet(list(prompts), {"prompt_embeds": packed, "prompt_lengths": lengths}, {})
