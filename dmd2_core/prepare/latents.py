"""Real sets from images (or video clips) and captions, encoded once with the checkpoint's own VAE
and text encoder(s): the GAN head's real samples, in the model's latent space.

    python -m dmd2_core prepare-latents --hf-checkpoint URL --images DIR --captions FILE --out URL

DIR (any fsspec URL) holds images (.png .jpg .jpeg .webp .bmp) or, for a video family, clips
(.mp4 .webm .mov .mkv .avi, read with PyAV; a still image is a one-frame clip). FILE has one
caption per line, either ``name<TAB>caption`` lines or plain lines in the sorted order of the
files. Images are resized (shorter side) and centre-cropped to the pixel size of the model's
latents; a clip gives its first frames. The output follows the prompt-set conventions
(``prompt_embeds`` ..., their ``negative_`` entries, the captions in the metadata) plus
``latents`` [N, ...], the VAE posterior means scaled as the model sees them.

A MiniMax-H3 fl2va run's real clips are conditioned as its samples are: with
``--keyframe-anchors first,last`` (or either) each clip's own first / last frame is its keyframe,
encoded as ``prepare-prompts --keyframes`` encodes a prompt's (``keyframe_latents``,
``keyframe_anchors``, the presentation's embeddings and tags).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from dmd2_core import storage
from dmd2_core.errors import ArgsError, nearest
from dmd2_core.data import REAL_LATENTS, RealSet, write_safetensors
from dmd2_core.models import FAMILIES, describe_model_dir

IMAGE_EXTS = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}
VIDEO_EXTS = {".mp4", ".webm", ".mov", ".mkv", ".avi"}


def list_media(url: str, video: bool) -> list[str]:
    """File names under ``url`` the family can read, sorted."""
    if not storage.exists(url):
        raise ArgsError(f"images: no such directory {url}{storage.nearest_sibling(url)}")
    exts = IMAGE_EXTS | (VIDEO_EXTS if video else set())
    names = [name for name in storage.list_names(url) if Path(name).suffix.lower() in exts]
    if not names:
        raise ArgsError(f"images: {url} holds no {'image or clip' if video else 'image'} ({', '.join(sorted(exts))})")
    return names


def read_captions(url: str, names: list[str]) -> list[str]:
    if not storage.exists(url):
        raise ArgsError(f"captions: no such file {url}{storage.nearest_sibling(url)}")
    lines = [line.rstrip("\r") for line in storage.read_text(url).splitlines() if line.strip()]
    if lines and all("\t" in line for line in lines):
        table = dict(line.split("\t", 1) for line in lines)
        missing = [n for n in names if n not in table and Path(n).stem not in table]
        if missing:
            raise ArgsError(f"captions: {url} has no caption for '{missing[0]}'")
        return [table.get(n, table.get(Path(n).stem)).strip() for n in names]
    if len(lines) != len(names):
        raise ArgsError(f"captions: {url} has {len(lines)} lines for {len(names)} files (one per file, sorted by name, "
                        "or name<TAB>caption lines)")
    return [line.strip() for line in lines]


def _fit(image, height: int, width: int) -> np.ndarray:
    """PIL image -> [H, W, 3] uint8: resize the shorter side, centre-crop."""
    from PIL import Image

    image = image.convert("RGB")
    scale = max(height / image.height, width / image.width)
    size = (max(width, round(image.width * scale)), max(height, round(image.height * scale)))
    image = image.resize(size, Image.Resampling.BICUBIC)
    left, top = (image.width - width) // 2, (image.height - height) // 2
    return np.asarray(image.crop((left, top, left + width, top + height)))


def read_media(data: bytes, name: str, frames: Optional[int], height: int, width: int) -> torch.Tensor:
    """Pixels in [-1, 1]: [3, H, W] for an image family (``frames`` None), else [3, F, H, W]."""
    from PIL import Image

    if Path(name).suffix.lower() in VIDEO_EXTS:
        import av

        with av.open(io.BytesIO(data)) as container:
            got = []
            for frame in container.decode(video=0):
                got.append(_fit(frame.to_image(), height, width))
                if len(got) == frames:
                    break
        if len(got) < frames:
            raise ArgsError(f"images: clip {name} has {len(got)} frames, the model's latents need {frames}")
        pixels = np.stack(got)  # [F, H, W, 3]
    else:
        pixels = _fit(Image.open(io.BytesIO(data)), height, width)[None]
        if frames is not None and frames != 1:
            raise ArgsError(f"images: {name} is a still image, the model's latents need {frames}-frame clips")
    x = torch.from_numpy(pixels.copy()).float().div(127.5).sub(1.0).permute(3, 0, 1, 2)  # [3, F, H, W]
    return x if frames is not None else x[:, 0]


def read_clip_with_sound(data: bytes, name: str, num_frames: int, height: int, width: int, fps: float,
                         sample_rate: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A clip and its soundtrack for a joint video + audio model: pixels [3, F, H, W] in [-1, 1],
    the first ``num_frames`` frames at ``fps`` (a clip at another rate is sampled in time, the
    frame showing at each instant), and a stereo waveform [2, S] of the same seconds at
    ``sample_rate`` (a mono track on both channels)."""
    from PIL import Image

    from dmd2_core.media.av_clips import read_mp4

    try:
        clip = read_mp4(io.BytesIO(data), sample_rate=sample_rate)
    except Exception as exc:  # noqa: BLE001 - any decoding failure is this file's problem
        raise ArgsError(f"images: clip {name} cannot be decoded ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    if not clip["audio_channels"]:
        raise ArgsError(f"images: clip {name} has no soundtrack; the model learns video and audio together")
    seconds = num_frames / fps
    source_fps = clip["fps"] or fps
    index = [int(k * source_fps / fps + 1e-6) for k in range(num_frames)]
    if index[-1] >= len(clip["frames"]):
        raise ArgsError(f"images: clip {name} has {len(clip['frames'])} frames at {source_fps:g} fps "
                        f"({len(clip['frames']) / source_fps:.2f} s), the model's clips are {seconds:.2f} s")
    samples = round(seconds * sample_rate)
    audio = torch.from_numpy(clip["audio"])
    if audio.shape[1] < samples - round(sample_rate / fps):  # a frame's worth short is padding, more is missing sound
        raise ArgsError(f"images: clip {name}'s soundtrack lasts {audio.shape[1] / sample_rate:.2f} s, the model's "
                        f"clips are {seconds:.2f} s")
    audio = torch.nn.functional.pad(audio, (0, max(0, samples - audio.shape[1])))[:, :samples]
    audio = audio.expand(2, -1) if audio.shape[0] == 1 else audio[:2]
    frames = np.stack([_fit(Image.fromarray(clip["frames"][i]), height, width) for i in index])
    pixels = torch.from_numpy(frames).float().div(127.5).sub(1.0).permute(3, 0, 1, 2)
    return pixels, audio.float().contiguous()


def pixel_size(family, vae, sample_shape: tuple) -> tuple[Optional[int], int, int]:
    """(frames or None, height, width) of the pixels whose latents have ``sample_shape``."""
    cfg = vae.config
    if family.is_video:
        spatial = 2 ** (len(cfg.dim_mult) - 1)
        temporal = 2 ** sum(bool(t) for t in cfg.temperal_downsample)
        _, f, h, w = sample_shape
        return (f - 1) * temporal + 1, h * spatial, w * spatial
    spatial = 2 ** (len(cfg.block_out_channels) - 1)
    return None, sample_shape[-2] * spatial, sample_shape[-1] * spatial


def keyframe_anchor_list(anchors) -> list[str]:
    """``first``, ``last`` or both (a comma list or a sequence), in the order given; a name that is
    no anchor, or one given twice, is named in one line with the nearest anchor."""
    from dmd2_core.prepare.prompts import KEYFRAME_ROLES

    names = [a.strip() for a in (anchors.split(",") if isinstance(anchors, str) else anchors)]
    for name in names:
        if name not in KEYFRAME_ROLES:
            raise ArgsError(f"keyframe_anchors: '{name}' is no keyframe anchor ({' or '.join(KEYFRAME_ROLES)})"
                            f"{nearest(name, KEYFRAME_ROLES)}")
    if not names or len(set(names)) != len(names):
        raise ArgsError(f"keyframe_anchors: {','.join(names) or 'nothing'}; give first, last or first,last")
    return names


def clip_keyframes(pixels: torch.Tensor, anchors: list[str]) -> dict:
    """A clip's own keyframes for fl2va's encoder: {'image' / 'last_image': PIL image} of its first
    and last frames (pixels [3, F, H, W] in [-1, 1], the uint8 frames it was read from)."""
    from PIL import Image

    from dmd2_core.media.av_clips import video_uint8
    from dmd2_core.prepare.prompts import KEYFRAME_ROLES

    frames = video_uint8(pixels.transpose(0, 1)[[0 if a == "first" else -1 for a in anchors]])
    return {KEYFRAME_ROLES[a]: Image.fromarray(frame) for a, frame in zip(anchors, frames)}


def prepare_latents(hf_checkpoint: str, images: str, captions: str, out: str, latent_shape: Optional[list[int]] = None,
                    negative_prompt: str = "", max_sequence_length: Optional[int] = None, batch_size: int = 8,
                    clip: Optional[tuple[int, int, int]] = None, keyframe_anchors=None) -> RealSet:
    """Encode every image/clip of ``images`` with its caption and write the real set to ``out``.
    ``clip``: (num_frames, height, width) of a joint video + audio model's clips (or its
    ``latent_shape``). ``keyframe_anchors`` (MiniMax-H3 fl2va): each clip conditioned on its own
    first and/or last frame."""
    from types import SimpleNamespace

    from dmd2_core.data import KEYFRAME_PIXELS
    from dmd2_core.prepare.prompts import encode_keyframe_prompts, prepare_prompts

    info = describe_model_dir(hf_checkpoint, "hf_checkpoint")
    family = FAMILIES[info["family"]]
    anchors = keyframe_anchor_list(keyframe_anchors) if keyframe_anchors else None
    if anchors and not family.has_audio:
        raise ArgsError(f"keyframe_anchors: {hf_checkpoint} ({info['family']}) conditions on text alone; keyframes "
                        "are MiniMax-H3's fl2va conditions")
    if not info["vae_url"]:
        raise ArgsError(f"{hf_checkpoint}: the checkpoint has no vae/ to encode images with")
    config = json.loads(storage.read_text(storage.join(info["transformer_url"], "config.json")))
    if family.has_audio:
        latent_shape = _clip_latent_shape(info, clip, latent_shape)
    try:
        model = SimpleNamespace(config=SimpleNamespace(**config))
        family = family.bind(latent_shape, model)
        shape = family.sample_shape(model, latent_shape)
    except ValueError as exc:
        raise ArgsError(str(exc)) from None
    names = list_media(images, family.is_video)
    texts = read_captions(captions, names)
    vae = family.load_vae(info["vae_url"], torch.float32).eval()
    latents, keyframes = [], []
    if family.has_audio:
        from dmd2_core.models.minimax_h3 import spatial_ratio

        ratio = spatial_ratio(info)
        height, width = latent_shape[2] * ratio, latent_shape[3] * ratio
        rate = int(vae["audio"].config.sampling_rate)
        for n in names:
            pixels, sound = read_clip_with_sound(storage.read_bytes(storage.join(images, n)), n, family.num_frames,
                                                 height, width, family.fps, rate)
            latents.append(family.encode_clip(vae, pixels, sound))
            if anchors:
                keyframes.append(clip_keyframes(pixels, anchors))
    else:
        frames, height, width = pixel_size(family, vae, shape)
        for start in range(0, len(names), batch_size):
            batch = [read_media(storage.read_bytes(storage.join(images, n)), n, frames, height, width)
                     for n in names[start:start + batch_size]]
            latents.append(family.encode(vae, torch.stack(batch)))
    latents = torch.cat(latents)
    if tuple(latents.shape[1:]) != tuple(shape):
        raise ArgsError(f"{hf_checkpoint}: its VAE gives latents {list(latents.shape[1:])}, the model samples {list(shape)}")
    if anchors:  # the pictures stay with the prompt set's eval media; no forward reads them
        prompt_set = encode_keyframe_prompts(hf_checkpoint, texts, keyframes)
        prompt_set.embeds.pop(KEYFRAME_PIXELS)
    else:
        prompt_set = prepare_prompts(hf_checkpoint, texts, None, negative_prompt, max_sequence_length)
    tensors = {REAL_LATENTS: latents, **prompt_set.embeds, **{f"negative_{k}": v for k, v in prompt_set.negative.items()}}
    write_safetensors(out, tensors, {"prompts": json.dumps(texts), "files": json.dumps(names)})
    return RealSet(latents, prompt_set.embeds)


def _clip_latent_shape(info: dict, clip: Optional[tuple[int, int, int]], latent_shape: Optional[list[int]]) -> list[int]:
    """A joint video + audio model's video latents [C, F, H, W], from the clip's geometry."""
    from dmd2_core.models.minimax_h3 import clip_latent_shape_agreeing

    if clip is None:
        if latent_shape:
            return list(latent_shape)
        raise ArgsError("num_frames: a video + audio model's real set needs the clips' --num-frames, --height and "
                        "--width (as the recipe's)")
    return clip_latent_shape_agreeing(clip, latent_shape, info)
