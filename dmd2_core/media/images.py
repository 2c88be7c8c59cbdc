"""Image helpers with no dependency on the rest of dmd2_core: sample grids, PNG and GIF bytes,
thumbnails and data URIs. The eval media (eval_files.py) and the run report (report/) both use them.
"""

from __future__ import annotations

import base64
import io
import math
from typing import Optional

import numpy as np
import torch
from PIL import Image

MIN_CELL_PX = 64  # tiny samples (8x8 digits) are upscaled (nearest) to at least this per cell
PAD_PX = 2
THUMBNAIL_PX = 256  # longest side of an embedded thumbnail


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


def thumbnail(data: bytes, max_px: int = THUMBNAIL_PX) -> bytes:
    """A small PNG of an image (the first frame of a GIF), its longest side at most ``max_px``."""
    img = Image.open(io.BytesIO(data))
    img.seek(0)
    img = img.convert("RGB") if img.mode not in ("L", "RGB") else img.copy()
    img.thumbnail((max_px, max_px), Image.NEAREST)
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


# ---- data URIs --------------------------------------------------------------------------------

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


EMBED_LIMIT = 512 * 1024  # local media up to this many bytes are embedded whole


def embed(url: str, data: bytes, browser_url: Optional[str], embed_limit: int = EMBED_LIMIT) -> dict:
    """How a medium shows in an artifact, by where it is stored:

    - a browser link (S3 presigned, expiring): a thumbnail as a data URI, linked to the full file,
      so the picture survives the link's expiry;
    - no browser link (local storage), small enough: the whole file as a data URI;
    - no browser link, too large: a thumbnail as a data URI.

    Returns {src (data URI), link (browser URL or None), url (storage URL), full (bool)}."""
    if not browser_url and len(data) <= embed_limit:
        return {"src": data_uri(data), "link": None, "url": url, "full": True}
    return {"src": data_uri(thumbnail(data), "image/png"), "link": browser_url, "url": url, "full": False}
