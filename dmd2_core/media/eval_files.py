"""Eval media: the student's samples of an eval written to storage as the files a person looks at
(PNG grids and GIFs: images.py; MP4s with sound, frame strips and spectrograms: av_clips.py),
and their browser URLs. The eval step (``evaluation.eval_step``) calls it.

Layout under the run's ``save`` URL::

    {save}/media/iter_{iteration:07d}.png            image runs: one grid, a column per prompt
    {save}/media/iter_{iteration:07d}_p{index}.gif   video runs: one GIF per prompt, its samples side by side

No Prefect here: the flow turns what the eval step returns into artifacts.
"""

from __future__ import annotations

import io
from typing import Any, Optional

import torch
from PIL import Image

from dmd2_core import storage
from dmd2_core.data import keyframe_pictures, prompt_texts, reference_pictures
from dmd2_core.media.images import data_uri, embed, image_grid, mime_type, png_bytes, video_media
from dmd2_core.save_layout import media_stem

PRESIGN_EXPIRES_S = 7 * 24 * 3600  # the SigV4 maximum


# ---- links ------------------------------------------------------------------------------------

def save_png(img: Image.Image, url: str) -> bytes:
    """Write ``img`` as a PNG at the storage URL ``url``; returns the bytes written."""
    data = png_bytes(img)
    storage.write_bytes(url, data, content_type="image/png")
    return data


def media_url(url: str, expires: int = PRESIGN_EXPIRES_S) -> Optional[str]:
    """An http(s) URL a browser can open for ``url``: itself when it is one, a presigned URL for
    s3:// (valid ``expires`` seconds), None for local paths or stores that cannot sign."""
    text = str(url)
    if text.startswith(("http://", "https://")):
        return text
    if storage.is_local(text):
        return None
    try:
        signed = storage.signed_url(text, expires)
    except Exception:  # noqa: BLE001 - a store without signing just gets no browser link
        return None
    return signed if isinstance(signed, str) and signed.startswith(("http://", "https://")) else None


# ---- an eval's media ---------------------------------------------------------------------------

def write_eval_media(run, iteration: int, indices: list[int], num_steps: Optional[int], embed_limit: int,
                     inline_limit: int) -> list[dict[str, Any]]:
    """The media of one eval of the prompts ``indices`` at one step count (``num_steps``: None
    for a student of one K, whose files keep their names): a PNG grid, a GIF per prompt, or per
    prompt an MP4 with sound, its frame strip (with the prompt's keyframes, where its set keeps
    their pictures) and spectrogram."""
    args = run.args
    texts = prompt_texts(args.prompts)
    per_prompt = args.eval_samples_per_prompt
    # Sample-major order: row s holds sample s of every eval prompt (a column per prompt).
    order = [p for _ in range(per_prompt) for p in indices]
    samples = run.sample(order, args.eval_seed, num_steps=num_steps)
    stem = media_stem(args.save, iteration) + (f"_k{num_steps}" if num_steps else "")
    steps = f"{num_steps} steps: " if num_steps else ""
    media = []
    if isinstance(samples, dict):  # video + sound: per prompt an MP4, a frame strip and a spectrogram
        keyframes = keyframe_pictures(args.prompts, indices)
        references = reference_pictures(args.prompts, indices)
        for p in indices:
            j = order.index(p)
            media += av_media_of(samples, j, f"{stem}_p{p}", steps + texts[p], embed_limit, inline_limit // len(indices),
                                 keyframes.get(p), references.get(p))
    elif samples.dim() == 5:  # video [N, C, F, H, W]: one GIF per prompt
        for p in indices:
            rows = [j for j, q in enumerate(order) if q == p]
            data = video_media(samples[rows], fps=args.eval_fps)
            media.append(publish(f"{stem}_p{p}.gif", data, steps + texts[p], embed_limit))
    else:
        data = png_bytes(image_grid(samples, nrow=len(indices)))
        caption = f"{steps}iteration {iteration}: columns = prompts {indices}, {per_prompt} samples each"
        media.append(publish(f"{stem}.png", data, caption, embed_limit))
    return media


# The copies played in place, tried in turn until one fits the clip's share: (long side at most,
# px; H.264 crf; AAC bit rate per channel; every n-th frame). Never upscaled (the player scales a
# small clip), so a MiniMax-H3 stand-in's 32 px clip of 124 frames fits the share of one of its
# four eval prompts; a full-size clip steps down to a smaller, coarser copy with the same sound.
PREVIEWS = ((256, 32, 32_000, 1), (128, 40, 16_000, 1), (96, 46, 12_000, 2), (64, 51, 8_000, 3))
INLINE_VIDEO_BYTES = 256 * 1024  # an eval's clips played in place share this (the summary must stay small)


def av_media_of(samples: dict, j: int, stem: str, caption: str, embed_limit: int,
                inline_limit: int = INLINE_VIDEO_BYTES,
                keyframes: Optional[tuple[torch.Tensor, list[int]]] = None,
                references: Optional[torch.Tensor] = None) -> list[dict[str, Any]]:
    """Sample ``j`` of decoded video + sound ({'video' [N, 3, F, H, W], 'audio' [N, C, S],
    'sample_rate', 'fps': the family's facts}): the MP4 with its soundtrack (linked, or played in place within
    ``inline_limit`` bytes for local saves), a frame strip and the spectrogram (shown). ``keyframes``:
    the sample's conditions as ``data.keyframe_pictures`` gives them (uint8 [K, 3, H, W], anchor
    codes), shown in the strip before / after the generated frames as they anchor them;
    ``references``: its image references (uint8 [I, 3, H, W]: ``data.reference_pictures``), shown
    before them."""
    from dmd2_core.media import av_clips

    frames = samples["video"][j].permute(1, 0, 2, 3)  # [F, 3, H, W]
    audio, rate, fps = samples["audio"][j], int(samples["sample_rate"]), float(samples["fps"])
    mp4 = mp4_bytes(frames, audio, rate, fps)
    mp4_url = f"{stem}.mp4"
    storage.write_bytes(mp4_url, mp4, content_type="video/mp4")
    play = media_url(mp4_url) or mp4_url
    strip_caption, shown = f"{caption}: frames", {}
    if keyframes is not None:
        from dmd2_core.models.minimax_h3 import KEYFRAME_ANCHORS

        pictures, codes = keyframes
        anchors = [KEYFRAME_ANCHORS[int(c)] for c in codes]
        shown = dict(keyframes=pictures.permute(0, 2, 3, 1).numpy(), anchors=anchors)  # uint8 [K, H, W, 3]
        strip_caption += f", set apart at the ends they anchor: its {' and '.join(anchors)} keyframe" + \
            ("s" if len(anchors) > 1 else "")
    elif references is not None:
        shown = dict(keyframes=references.permute(0, 2, 3, 1).numpy(), anchors=["first"] * len(references))
        strip_caption += f", set apart after its picture reference{'s' if len(references) > 1 else ''}"
    strip = publish(f"{stem}_frames.png", av_clips.frame_strip_png(frames, **shown), strip_caption, embed_limit)
    spectrum = publish(f"{stem}_spectrogram.png", av_clips.spectrogram_png(audio, rate),
                        f"{caption}: soundtrack (left above right, balance {av_clips.stereo_balance(audio):+.2f})",
                        embed_limit)
    strip.update(video_url=mp4_url, play=play)
    if not play.startswith(("http://", "https://")):  # local storage: no link a browser can open
        strip["inline_video"] = inline_mp4(mp4, frames, audio, rate, fps, inline_limit)
    return [strip, spectrum]


def mp4_bytes(frames: torch.Tensor, audio: torch.Tensor, rate: int, fps: float, **encoding) -> bytes:
    """A clip as MP4 bytes at its family's frame rate (``encoding``: ``av_clips.write_mp4``'s
    crf and audio bit rate)."""
    from dmd2_core.media import av_clips

    buf = io.BytesIO()
    av_clips.write_mp4(buf, frames, audio, fps=fps, sample_rate=rate, **encoding)
    return buf.getvalue()


def inline_mp4(mp4: bytes, frames: torch.Tensor, audio: torch.Tensor, rate: int, fps: float, limit: int) -> Optional[str]:
    """The clip as a ``data:video/mp4`` URI for the artifact to play in place (Prefect's markdown
    renders a ``<video>`` whose source is a data URI; a link to a local path would open a page of
    the UI's own): the MP4 itself when it fits ``limit`` bytes, else the first of ``PREVIEWS``
    that does (smaller frames, a lower bit rate, fewer frames a second, the same sound at a lower
    bit rate); None when none fits."""
    if len(mp4) <= limit:
        return data_uri(mp4, "video/mp4")
    for side, crf, audio_rate, every in PREVIEWS:
        preview = mp4_bytes(_preview_frames(frames, side, every), audio, rate, fps / every, crf=crf,
                            audio_bit_rate_per_channel=audio_rate, min_side=0)
        if len(preview) <= limit:
            return data_uri(preview, "video/mp4")
    return None


def _preview_frames(frames: torch.Tensor, side: int, every: int) -> torch.Tensor:
    """Every ``every``-th of ``frames`` [F, 3, H, W], at most ``side`` px on their long side."""
    kept = frames[::every]
    height, width = kept.shape[-2:]
    scale = min(1.0, side / max(height, width))
    if scale == 1.0:
        return kept
    size = (max(2, round(height * scale)), max(2, round(width * scale)))
    return torch.nn.functional.interpolate(kept.float(), size=size, mode="area")


def publish(url: str, data: bytes, caption: str, embed_limit: int) -> dict[str, Any]:
    """Write a medium; say how it embeds (``images.embed``: whole when local and small, else a
    thumbnail data URI linked to the full file)."""
    storage.write_bytes(url, data, content_type=mime_type(data))
    browser_url = media_url(url)
    shown = embed(url, data, browser_url, embed_limit)
    return {
        "url": url,
        "browser_url": browser_url,
        "src": shown["src"],
        "link": shown["link"],
        "full": shown["full"],
        "caption": caption,
        "bytes": len(data),
    }
