"""Prompt sets from prompt lists, encoded once with the checkpoint pipeline's own text encoder(s),
so that training never loads a text encoder."""

from __future__ import annotations

import json
from typing import Optional

import torch

from dmd2_core import storage
from dmd2_core.errors import ArgsError, one_line
from dmd2_core.data import KEYFRAME_PIXELS, REFERENCE_PIXELS, PromptSet
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
    references: Optional[str] = None,
    clip: Optional[tuple[int, int, int]] = None,
) -> PromptSet:
    """Encode ``prompts`` (and the empty/negative prompt) and save the prompt set at ``out`` (when set);
    with ``keyframes`` (a MiniMax-H3 fl2va set: :func:`read_keyframes`), each prompt's keyframes too;
    with ``references`` (a ref2va set: :func:`read_references`), each prompt's references, a sound
    cut to the duration of ``clip`` (num_frames, height, width), as diffusers cuts it."""
    import diffusers

    info = describe_model_dir(hf_checkpoint, "hf_checkpoint")
    for flag, given in (("keyframes", keyframes), ("references", references)):
        if given and not FAMILIES[info["family"]].has_audio:
            raise ArgsError(f"{flag}: {hf_checkpoint} ({info['family']}) conditions on text alone; {flag} are "
                            f"MiniMax-H3's {'fl2va' if flag == 'keyframes' else 'ref2va'} conditions")
    if keyframes and references:
        raise ArgsError("references: a prompt set is one workflow's: keyframes (fl2va) or references (ref2va), not both")
    if FAMILIES[info["family"]].has_audio:  # MiniMax-H3: its modular pipeline's Qwen3-VL conditioner
        if references:
            if clip is None or None in clip:
                raise ArgsError("num_frames: references are prepared for a clip: set num_frames, height and width "
                                "(a sound reference is cut to the clip's duration)")
            prompt_set = encode_reference_prompts(hf_checkpoint, prompts, read_references(
                references, prompts, _audio_rate(hf_checkpoint)), clip)
        elif keyframes:
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


def read_condition_list(url: str, flag: str, prompts: list[str]) -> tuple[list, str]:
    """A conditions file (``flag``: keyframes or references): its JSON list, one entry per prompt,
    and the folder its relative paths start from; a missing, unparsable or miscounted file is
    named in one line."""
    if not storage.exists(url):
        raise ArgsError(f"{flag}: no {flag} file at {url}{storage.nearest_sibling(url)}")
    try:
        entries = json.loads(storage.read_text(url))
    except ValueError as exc:
        raise ArgsError(f"{flag}: {url} is not JSON ({one_line(exc)})") from None
    if not isinstance(entries, list) or len(entries) != len(prompts):
        count = f"{len(entries)} entries" if isinstance(entries, list) else "no list"
        raise ArgsError(f"{flag}: {url} holds {count} for {len(prompts)} prompts (one entry per prompt)")
    return entries, url.rsplit("/", 1)[0] if "/" in url else "."


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

    entries, base = read_condition_list(url, "keyframes", prompts)
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
    from dmd2_core.models.minimax_h3 import KEYFRAME_ANCHORS

    try:
        encoded = encode_keyframe_prompts_h3(hf_checkpoint, prompts, keyframes)
    except ValueError as exc:
        raise ArgsError(f"hf_checkpoint: {one_line(exc)}") from None
    text = padded_presentations(encoded)
    anchors = torch.tensor([[KEYFRAME_ANCHORS.index(a) for a in e["keyframe_anchors"]] for e in encoded])
    pixels = torch.stack([torch.stack([keyframe_pixels(images[KEYFRAME_ROLES[a]]) for a in e["keyframe_anchors"]])
                          for images, e in zip(keyframes, encoded)])
    return PromptSet(list(prompts), {**text, "keyframe_latents": torch.stack([e["keyframe_latents"] for e in encoded]),
                                     "keyframe_anchors": anchors, KEYFRAME_PIXELS: pixels}, {})


def padded_presentations(encoded: list[dict]) -> dict[str, torch.Tensor]:
    """Each prompt's presentation (``prompt_embeds`` [T_i, D], ``text_token_tags`` [T_i]) zero-padded
    to the longest, as :func:`encode_conditioner_prompts` pads them (tags padded as text), with the
    true ``prompt_lengths``."""
    from dmd2_core.models.minimax_h3 import TEXT_TAG

    lengths = torch.tensor([e["prompt_embeds"].shape[0] for e in encoded])
    longest = int(lengths.max())
    embeds = torch.zeros(len(encoded), longest, encoded[0]["prompt_embeds"].shape[-1])
    tags = torch.full((len(encoded), longest), TEXT_TAG, dtype=torch.long)
    for i, e in enumerate(encoded):
        embeds[i, :lengths[i]] = e["prompt_embeds"]
        tags[i, :lengths[i]] = e["text_token_tags"]
    return {"prompt_embeds": embeds, "prompt_lengths": lengths, "text_token_tags": tags}


def keyframe_pixels(image) -> torch.Tensor:
    """A keyframe (PIL RGB) as uint8 [3, H, W]."""
    import numpy as np

    return torch.from_numpy(np.array(image.convert("RGB"), dtype=np.uint8)).permute(2, 0, 1).contiguous()


def _audio_rate(hf_checkpoint: str) -> int:
    """The audio VAE's sample rate (a reference sound must come at it: resampling needs torchaudio)."""
    return int(json.loads(storage.read_text(storage.join(hf_checkpoint, "audio_vae", "config.json")))["sampling_rate"])


def read_references(url: str, prompts: list[str], sample_rate: int) -> list[list]:
    """The references file: a JSON list, entry i for prompt i, a list of references in the order
    the model reads them, each ``{"image": path}`` or ``{"audio": path}`` (paths or URLs, relative
    ones beside the file). Every row names the same kinds in the same order (one layout per set),
    an image first among them (a sound never stands alone); a sound comes at the audio VAE's
    ``sample_rate``. A video reference is refused: Qwen3-VL's video processor needs torchvision,
    which this install lacks. Returns diffusers' reference objects per prompt; a bad entry is
    named in one line."""
    import io

    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3AudioReference, MiniMaxH3ImageReference
    from PIL import Image

    from dmd2_core.args import nearest
    from dmd2_core.models.minimax_h3 import REFERENCE_KINDS  # a references entry's keys

    entries, base = read_condition_list(url, "references", prompts)
    out, layout = [], None
    for row, (entry, prompt) in enumerate(zip(entries, prompts)):
        where = f"references: row {row} ({prompt!r})"
        if not isinstance(entry, list) or not entry:
            raise ArgsError(f"{where} has no reference; give a list of {{\"image\": path}} / {{\"audio\": path}}")
        kinds, refs = [], []
        for j, ref in enumerate(entry):
            key = next(iter(ref)) if isinstance(ref, dict) and len(ref) == 1 else None
            if key == "video":
                raise ArgsError(f"{where} reference {j}: a video reference needs Qwen3-VL's video processor, which "
                                "needs torchvision (not installed); give image and audio references")
            if key not in REFERENCE_KINDS:
                raise ArgsError(f"{where} reference {j}: {json.dumps(ref)} is no reference"
                                f"{nearest(str(key), REFERENCE_KINDS)} (one key: image or audio)")
            media = ref[key] if "://" in ref[key] or ref[key].startswith("/") else storage.join(base, ref[key])
            if not storage.exists(media):
                raise ArgsError(f"{where} reference {j}: no {key} at {media}{storage.nearest_sibling(media)}")
            try:
                if key == "image":
                    refs.append(MiniMaxH3ImageReference(
                        image=Image.open(io.BytesIO(storage.read_bytes(media))).convert("RGB")))
                else:
                    with storage.local_copy(media) as local:
                        refs.append(MiniMaxH3AudioReference.from_file(str(local)))
            except Exception as exc:  # noqa: BLE001 - any undecodable file: one line naming it
                raise ArgsError(f"{where} reference {j}: {media} is not an {key} ({one_line(exc)})") from None
            if key == "image":
                width, height = refs[-1].image.size
                if width > 4 * height or height > 4 * width:
                    raise ArgsError(f"{where} reference {j}: {width}x{height} pixels; an image reference is within "
                                    "1:4 and 4:1")
            elif refs[-1].sample_rate != sample_rate:
                raise ArgsError(f"{where} reference {j}: {media} is at {refs[-1].sample_rate} Hz, the audio VAE takes "
                                f"{sample_rate} Hz (resampling needs torchaudio, not installed); resample it first")
            kinds.append(key)
        if kinds[0] != "image":
            raise ArgsError(f"{where}: its first reference is a sound; an image comes first (a sound never stands "
                            "alone, and the set's layout starts with its images' rows)")
        if layout is None:
            layout = kinds
        elif kinds != layout:
            raise ArgsError(f"{where} names {', '.join(kinds)}; row 0 names {', '.join(layout)} (every row names "
                            "the same kinds in the same order)")
        out.append(refs)
    return out


def encode_reference_prompts(hf_checkpoint: str, prompts: list[str], references: list[list],
                             clip: tuple[int, int, int]) -> PromptSet:
    """MiniMax-H3's ref2va conditions, as diffusers' ref2va blocks compute them once per prompt
    (``encode_reference_prompts_h3``): the presentation's embeddings and tags (padded as
    :func:`encode_conditioner_prompts` pads them), the image references' VAE latents
    ``reference_latents`` [N, I, 24, 1, h, w], the sounds' rows ``reference_audio_latents``
    [N, A, 2 L, 32] where there are any, the order ``reference_kinds`` [N, R] (0 image, 1 audio),
    and beside them the resized pictures ``reference_pixels`` uint8 [N, I, 3, H, W] for the eval
    media (no forward reads them). Every row's latents share one shape: an image of another aspect,
    or a sound of another length, is named in one line."""
    from dmd2_core.models.h3_repository import encode_reference_prompts_h3
    from dmd2_core.models.minimax_h3 import REFERENCE_AUDIO, REFERENCE_KINDS

    try:
        encoded = encode_reference_prompts_h3(hf_checkpoint, prompts, references, *clip)
    except ValueError as exc:
        raise ArgsError(f"references: {one_line(exc)}") from None
    images = list(encoded[0]["reference_latents"].shape)
    sounds = [tuple(r.shape) for r in encoded[0][REFERENCE_AUDIO]]
    for row, e in enumerate(encoded):
        if list(e["reference_latents"].shape) != images:
            raise ArgsError(f"references: row {row} ({prompts[row]!r}) images encode to "
                            f"{list(e['reference_latents'].shape)} latents, row 0's to {images}; give "
                            "every row's images one aspect ratio")
        if [tuple(r.shape) for r in e[REFERENCE_AUDIO]] != sounds:
            raise ArgsError(f"references: row {row} ({prompts[row]!r}) sounds encode to "
                            f"{[tuple(r.shape) for r in e[REFERENCE_AUDIO]]} rows, row 0's to {sounds}; give every "
                            "row sounds as long (at least the clip's duration)")
    text = padded_presentations(encoded)
    conditions = {
        **text, "reference_latents": torch.stack([e["reference_latents"] for e in encoded]),
        "reference_kinds": torch.tensor([[REFERENCE_KINDS.index(k) for k in e["kinds"]] for e in encoded]),
        REFERENCE_PIXELS: torch.stack([torch.stack([keyframe_pixels(image) for image in e["reference_images"]])
                                       for e in encoded])}
    if encoded[0][REFERENCE_AUDIO]:
        conditions[REFERENCE_AUDIO] = torch.stack([torch.stack(e[REFERENCE_AUDIO]) for e in encoded])
    return PromptSet(list(prompts), conditions, {})
