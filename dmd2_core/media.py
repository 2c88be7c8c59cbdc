"""Eval media: PNG grids of image samples, animated GIFs of video samples, their storage URLs, and
the eval step of a run (K-step student samples -> media files + digits quality metrics).

Layout under the run's ``save`` URL::

    {save}/media/iter_{iteration:07d}.png            image runs: one grid, a column per prompt
    {save}/media/iter_{iteration:07d}_p{index}.gif   video runs: one GIF per prompt, its samples side by side

No Prefect here: the flow turns what ``run_eval`` returns into artifacts.
"""

from __future__ import annotations

import base64
import io
import json
import math
import struct
from typing import Any, Optional

import numpy as np
import torch
from PIL import Image

from dmd2_core import storage

MIN_CELL_PX = 64  # tiny samples (8x8 digits) are upscaled (nearest) to at least this per cell
PAD_PX = 2
PRESIGN_EXPIRES_S = 7 * 24 * 3600  # the SigV4 maximum


# ---- pictures ---------------------------------------------------------------------------------

def _to_uint8(images: torch.Tensor) -> np.ndarray:
    """[N, C, H, W] in [-1, 1] -> uint8 [N, H, W, C'] with C' 1 (grey) or 3 (RGB)."""
    x = torch.as_tensor(images).detach().float().cpu()
    if x.dim() == 3:
        x = x.unsqueeze(1)
    if x.dim() != 4:
        raise ValueError(f"image_grid: expected images [N, C, H, W], got shape {tuple(x.shape)}")
    c = x.shape[1]
    if c >= 3:
        x = x[:, :3]
    elif c != 1:
        x = x.mean(1, keepdim=True)  # not a displayable channel count (e.g. undecoded latents)
    x = ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).numpy()


def image_grid(images: torch.Tensor, nrow: int = 8, min_cell: int = MIN_CELL_PX, pad: int = PAD_PX) -> Image.Image:
    """A grid of images [N, C, H, W] in [-1, 1], ``nrow`` images per row, each upscaled with
    nearest-neighbour by an integer factor to at least ``min_cell`` pixels (8x8 digits -> 64x64)."""
    pixels = _to_uint8(images)
    n, h, w, c = pixels.shape
    if n == 0:
        raise ValueError("image_grid: no images")
    nrow = max(1, min(int(nrow), n))
    ncol_rows = math.ceil(n / nrow)
    scale = max(1, math.ceil(min_cell / max(h, w)))
    ch, cw = h * scale, w * scale
    mode = "L" if c == 1 else "RGB"
    grid = Image.new(mode, (nrow * cw + (nrow + 1) * pad, ncol_rows * ch + (ncol_rows + 1) * pad), color=128 if c == 1 else (128, 128, 128))
    for i in range(n):
        cell = Image.fromarray(pixels[i, :, :, 0] if c == 1 else pixels[i], mode=mode)
        if scale > 1:
            cell = cell.resize((cw, ch), Image.NEAREST)
        r, col = divmod(i, nrow)
        grid.paste(cell, (pad + col * (cw + pad), pad + r * (ch + pad)))
    return grid


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def save_png(img: Image.Image, url: str) -> bytes:
    """Write ``img`` as a PNG at the storage URL ``url``; returns the bytes written."""
    data = png_bytes(img)
    storage.write_bytes(url, data)
    return data


def video_media(video: torch.Tensor, fps: int = 8) -> bytes:
    """An animated GIF (looping) of video samples [N, C, F, H, W] in [-1, 1]: frame f shows every
    sample's frame f side by side. Pass one prompt's samples per call."""
    v = torch.as_tensor(video).detach().float().cpu()
    if v.dim() == 4:
        v = v.unsqueeze(0)
    if v.dim() != 5:
        raise ValueError(f"video_media: expected video [N, C, F, H, W], got shape {tuple(v.shape)}")
    n, frames = v.shape[0], v.shape[2]
    pictures = []
    for f in range(frames):
        grid = image_grid(v[:, :, f], nrow=n)
        pictures.append(grid.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=256))
    buf = io.BytesIO()
    pictures[0].save(buf, format="GIF", save_all=True, append_images=pictures[1:],
                     duration=max(1, round(1000 / max(1, fps))), loop=0, disposal=1)
    return buf.getvalue()


# ---- links ------------------------------------------------------------------------------------

def mime_type(data: bytes) -> str:
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data[:3] == b"\xff\xd8\xff":
        return "image/jpeg"
    return "image/png"


def data_uri(data: bytes, mime: Optional[str] = None) -> str:
    """``data:image/png;base64,...`` (the type sniffed from the bytes unless given)."""
    return f"data:{mime or mime_type(data)};base64,{base64.b64encode(data).decode('ascii')}"


def media_url(url: str, expires: int = PRESIGN_EXPIRES_S) -> Optional[str]:
    """An http(s) URL a browser can open for ``url``: itself when it is one, a presigned URL for
    s3:// (valid ``expires`` seconds), None for local paths or stores that cannot sign."""
    text = str(url)
    if text.startswith(("http://", "https://")):
        return text
    if storage.is_local(text):
        return None
    try:
        fs, path = storage.filesystem(text)
        signed = fs.url(path, expires=int(expires))
    except Exception:  # noqa: BLE001 - a store without signing just gets no browser link
        return None
    return signed if isinstance(signed, str) and signed.startswith(("http://", "https://")) else None


# ---- prompts ----------------------------------------------------------------------------------

def prompt_texts(prompts_url: Optional[str]) -> list[str]:
    """The prompt texts of a prompt set, read from the safetensors header alone (no tensors are
    loaded, so a large embedding file costs one small read)."""
    from dmd2_core.data import DIGITS, digits_prompt_set

    if prompts_url is None or prompts_url == DIGITS:
        return list(digits_prompt_set().prompts)
    fs, path = storage.filesystem(prompts_url)
    with fs.open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    texts = json.loads((header.get("__metadata__") or {}).get("prompts", "[]"))
    if texts:
        return list(texts)
    shape = header.get("prompt_embeds", {}).get("shape") or [0]
    return [f"prompt {i}" for i in range(int(shape[0]))]


# ---- the eval step of a run -------------------------------------------------------------------

def media_stem(save_url: str, iteration: int) -> str:
    return storage.join(save_url, "media", f"iter_{int(iteration):07d}")


def eval_prompt_indices(args, num_prompts: int) -> list[int]:
    indices = list(args.eval_prompts) if args.eval_prompts else list(range(num_prompts))
    bad = [i for i in indices if not 0 <= i < num_prompts]
    if bad:
        from dmd2_core.args import ArgsError

        raise ArgsError(f"eval_prompts: index {bad[0]} out of range for {num_prompts} prompts")
    return indices


def run_eval(run, iteration: int, embed_limit: int = 512 * 1024) -> dict[str, Any]:
    """Eval of a DistillRun (anything with ``.args`` and ``.sample(prompt_index, seed)``) at
    ``iteration``: K-step student samples of the eval prompts saved as media under the run's save
    URL, plus {fd, acc, diversity} on ``eval_num_samples`` balanced digits when the prompt set is
    digits. Returns {iteration, metrics, media: [{url, browser_url, src, link, full, caption, bytes}]}."""
    import time

    args = run.args
    start = time.perf_counter()
    texts = prompt_texts(args.prompts)
    indices = eval_prompt_indices(args, len(texts))
    per_prompt = args.eval_samples_per_prompt
    # Sample-major order: row s holds sample s of every eval prompt (a column per prompt).
    order = [p for _ in range(per_prompt) for p in indices]
    samples = run.sample(order, args.eval_seed)
    stem = media_stem(args.save, iteration)
    media = []
    if isinstance(samples, dict):  # video + sound: per prompt an MP4, a frame strip and a spectrogram
        for p in indices:
            j = order.index(p)
            media += av_media_of(samples, j, f"{stem}_p{p}", texts[p], embed_limit)
    elif samples.dim() == 5:  # video [N, C, F, H, W]: one GIF per prompt
        for p in indices:
            rows = [j for j, q in enumerate(order) if q == p]
            data = video_media(samples[rows], fps=args.eval_fps)
            media.append(_publish(f"{stem}_p{p}.gif", data, texts[p], embed_limit))
    else:
        data = png_bytes(image_grid(samples, nrow=len(indices)))
        caption = f"iteration {iteration}: columns = prompts {indices}, {per_prompt} samples each"
        media.append(_publish(f"{stem}.png", data, caption, embed_limit))
    metrics: dict[str, float] = {"eval_media_s": time.perf_counter() - start}
    if args.prompts == "digits":
        from dmd2_core import evaluation

        t = time.perf_counter()
        labels = evaluation.balanced_labels(args.eval_num_samples, len(texts))
        images = run.sample(labels.tolist(), args.eval_seed)
        metrics.update(evaluation.evaluate_digits(images, labels))
        metrics["eval_quality_s"] = time.perf_counter() - t
    return {"iteration": int(iteration), "metrics": metrics, "media": media}


FPS_OF_SOUNDING_VIDEO = 24  # MiniMax-H3's frame rate; its clips play at it


def av_media_of(samples: dict, j: int, stem: str, caption: str, embed_limit: int) -> list[dict[str, Any]]:
    """Sample ``j`` of decoded video + sound ({'video' [N, 3, F, H, W], 'audio' [N, C, S],
    'sample_rate'}): the MP4 with its soundtrack (linked), a frame strip and the spectrogram (shown)."""
    from dmd2_core import av_media

    frames = samples["video"][j].permute(1, 0, 2, 3)  # [F, 3, H, W]
    audio, rate = samples["audio"][j], int(samples["sample_rate"])
    buf = io.BytesIO()
    av_media.write_mp4(buf, frames, audio, fps=FPS_OF_SOUNDING_VIDEO, sample_rate=rate)
    mp4_url = f"{stem}.mp4"
    storage.write_bytes(mp4_url, buf.getvalue())
    play = media_url(mp4_url) or mp4_url
    strip = _publish(f"{stem}_frames.png", av_media.frame_strip_png(frames), f"{caption}: frames", embed_limit)
    spectrum = _publish(f"{stem}_spectrogram.png", av_media.spectrogram_png(audio, rate),
                        f"{caption}: soundtrack (left above right, balance {av_media.stereo_balance(audio):+.2f})",
                        embed_limit)
    strip.update(video_url=mp4_url, play=play)
    return [strip, spectrum]


def _publish(url: str, data: bytes, caption: str, embed_limit: int) -> dict[str, Any]:
    """Write a medium; say how it embeds (``report.embed``: whole when local and small, else a
    thumbnail data URI linked to the full file)."""
    from dmd2_core.report import embed

    storage.write_bytes(url, data)
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
