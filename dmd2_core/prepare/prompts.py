"""Prompt sets from prompt lists, encoded once with the checkpoint pipeline's own text encoder(s),
so that training never loads a text encoder."""

from __future__ import annotations

import json
from typing import Optional

import torch

from dmd2_core import storage
from dmd2_core.errors import ArgsError, one_line
from dmd2_core.data import KEYFRAME_PIXELS, PromptSet
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
    keyframes: Optional[str] = None,
) -> PromptSet:
    """Encode ``prompts`` (and the empty/negative prompt) and save the prompt set at ``out`` (when set);
    with ``keyframes`` (a MiniMax-H3 fl2va set: :func:`read_keyframes`), each prompt's keyframes too."""
    import diffusers

    info = describe_model_dir(hf_checkpoint, "hf_checkpoint")
    if keyframes and not FAMILIES[info["family"]].has_audio:
        raise ArgsError(f"keyframes: {hf_checkpoint} ({info['family']}) conditions on text alone; keyframes are "
                        "MiniMax-H3's fl2va conditions")
    if FAMILIES[info["family"]].has_audio:  # MiniMax-H3: its modular pipeline's Qwen3-VL conditioner
        if keyframes:
            prompt_set = encode_keyframe_prompts(hf_checkpoint, prompts, read_keyframes(keyframes, prompts))
        else:
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


KEYFRAME_ROLES = {"first": "image", "last": "last_image"}  # a keyframes entry's keys -> diffusers' fl2va inputs
CANVAS_MULTIPLE = 32  # MiniMax-H3's: the VAE's x16 times the patch's 2


def read_keyframes(url: str, prompts: list[str]) -> list[dict]:
    """The keyframes file: a JSON list, entry i for prompt i, ``{"first": image, "last": image}``
    (either or both; image paths or URLs, relative ones beside the file). Every entry anchors the
    same ends (one layout per set) and every image is the clip's frame: one height x width, a
    multiple of 32 (diffusers would stretch any other onto the canvas; the run's clip is set
    apart from the set, so the size is checked here and against the run in preflight). Returns
    {'image' / 'last_image': PIL image} per prompt; a bad entry is named in one line."""
    import io

    from PIL import Image

    from dmd2_core.args import nearest

    if not storage.exists(url):
        raise ArgsError(f"keyframes: no keyframes file at {url}{storage.nearest_sibling(url)}")
    try:
        entries = json.loads(storage.read_text(url))
    except ValueError as exc:
        raise ArgsError(f"keyframes: {url} is not JSON ({one_line(exc)})") from None
    if not isinstance(entries, list) or len(entries) != len(prompts):
        count = f"{len(entries)} entries" if isinstance(entries, list) else "no list"
        raise ArgsError(f"keyframes: {url} holds {count} for {len(prompts)} prompts (one entry per prompt)")
    base = url.rsplit("/", 1)[0] if "/" in url else "."
    frames, anchors, size = [], None, None
    for row, (entry, prompt) in enumerate(zip(entries, prompts)):
        where = f"keyframes: row {row} ({prompt!r})"
        if not isinstance(entry, dict) or not entry:
            raise ArgsError(f"{where} has no keyframe; give 'first' and/or 'last'")
        for key in entry:
            if key not in KEYFRAME_ROLES:
                raise ArgsError(f"{where}: '{key}' is no keyframe{nearest(key, KEYFRAME_ROLES)} (first, last)")
        ends = tuple(k for k in KEYFRAME_ROLES if k in entry)
        if anchors is None:
            anchors = ends
        elif ends != anchors:
            raise ArgsError(f"{where} anchors {', '.join(ends)}; row 0 anchors {', '.join(anchors)} (every row "
                            "anchors the same ends)")
        images = {}
        for end in ends:
            image_url = entry[end] if "://" in entry[end] or entry[end].startswith("/") else storage.join(base, entry[end])
            if not storage.exists(image_url):
                raise ArgsError(f"{where} {end}: no image at {image_url}{storage.nearest_sibling(image_url)}")
            try:
                image = Image.open(io.BytesIO(storage.read_bytes(image_url))).convert("RGB")
            except Exception as exc:  # noqa: BLE001 - any undecodable file: one line naming it
                raise ArgsError(f"{where} {end}: {image_url} is not an image ({one_line(exc)})") from None
            width, height = image.size
            if size is None:
                if width % CANVAS_MULTIPLE or height % CANVAS_MULTIPLE:
                    raise ArgsError(f"{where} {end}: {width}x{height} pixels; a keyframe is the clip's frame, each "
                                    f"side a multiple of {CANVAS_MULTIPLE}")
                size = image.size
            elif image.size != size:
                raise ArgsError(f"{where} {end}: {width}x{height} pixels, row 0's are {size[0]}x{size[1]}; every "
                                "keyframe is the clip's frame (one size)")
            images[KEYFRAME_ROLES[end]] = image
        frames.append(images)
    return frames


def encode_keyframe_prompts(hf_checkpoint: str, prompts: list[str], keyframes: list[dict]) -> PromptSet:
    """MiniMax-H3's fl2va conditions, as diffusers' fl2va blocks compute them once per prompt
    (``encode_keyframe_prompts_h3``): the presentation's embeddings, zero-padded as
    :func:`encode_conditioner_prompts` pads them, their modality tags ``text_token_tags`` [N, T],
    the keyframes' VAE latents ``keyframe_latents`` [N, K, 24, 1, H, W] and their anchors
    ``keyframe_anchors`` [N, K] (0 first, 1 last). Training reads them; it loads no VAE encoder.
    Beside them the keyframes themselves, ``keyframe_pixels`` uint8 [N, K, 3, H, W] in the
    latents' order, for the eval media to show next to the clip (the video VAE decodes no single
    latent frame); no forward reads them (``StoredPromptSet.cond`` leaves them out)."""
    from dmd2_core.models.h3_repository import encode_keyframe_prompts_h3
    from dmd2_core.models.minimax_h3 import KEYFRAME_ANCHORS, TEXT_TAG

    try:
        encoded = encode_keyframe_prompts_h3(hf_checkpoint, prompts, keyframes)
    except ValueError as exc:
        raise ArgsError(f"hf_checkpoint: {one_line(exc)}") from None
    lengths = torch.tensor([e["prompt_embeds"].shape[0] for e in encoded])
    longest = int(lengths.max())
    embeds = torch.zeros(len(encoded), longest, encoded[0]["prompt_embeds"].shape[-1])
    tags = torch.full((len(encoded), longest), TEXT_TAG, dtype=torch.long)
    for i, e in enumerate(encoded):
        embeds[i, :lengths[i]] = e["prompt_embeds"]
        tags[i, :lengths[i]] = e["text_token_tags"]
    anchors = torch.tensor([[KEYFRAME_ANCHORS.index(a) for a in e["keyframe_anchors"]] for e in encoded])
    pixels = torch.stack([torch.stack([keyframe_pixels(images[KEYFRAME_ROLES[a]]) for a in e["keyframe_anchors"]])
                          for images, e in zip(keyframes, encoded)])
    return PromptSet(list(prompts), {"prompt_embeds": embeds, "prompt_lengths": lengths, "text_token_tags": tags,
                                     "keyframe_latents": torch.stack([e["keyframe_latents"] for e in encoded]),
                                     "keyframe_anchors": anchors, KEYFRAME_PIXELS: pixels}, {})


def keyframe_pixels(image) -> torch.Tensor:
    """A keyframe (PIL RGB) as uint8 [3, H, W]."""
    import numpy as np

    return torch.from_numpy(np.array(image.convert("RGB"), dtype=np.uint8)).permute(2, 0, 1).contiguous()
