"""The eval media a tracker is given, read back from the run's storage: what ``run_eval`` wrote
(a PNG grid, a GIF per prompt, or per prompt an MP4 with sound, its frame strip and spectrogram)
as ``Medium`` items named by what they show; the MP4's soundtrack also as a WAV."""

from __future__ import annotations

import io
import wave

import numpy as np

from dmd2_core import storage
from dmd2_core.trackers.base import Medium

KINDS = {"png": "image", "gif": "video", "mp4": "video"}


def medium_name(url: str) -> str:
    """``.../media/iter_0000002_p3_frames.png`` -> ``p3_frames``; the grid (``iter_0000002.png``) -> ``samples``."""
    stem = str(url).rstrip("/").rpartition("/")[2].rpartition(".")[0]
    rest = stem.partition("_")[2].partition("_")[2] if stem.startswith("iter_") else stem
    return rest or "samples"


def as_media(items: list[dict]) -> list[Medium]:
    """``run_eval``'s media dicts as Medium items (each file read once from storage)."""
    out: list[Medium] = []
    for item in items:
        for key in ("url", "video_url"):
            url = item.get(key)
            if not url:
                continue
            ext = str(url).rpartition(".")[2].lower()
            data = storage.read_bytes(url)
            caption = str(item.get("caption") or "")
            name = medium_name(url)
            out.append(Medium(name, KINDS.get(ext, "image"), data, ext, caption))
            if ext == "mp4":
                sound = soundtrack_wav(data)
                if sound is not None:
                    out.append(Medium(f"{name}_sound", "audio", *sound[:2], caption, *sound[2:]))
    return out


def soundtrack_wav(mp4: bytes):
    """The MP4's soundtrack as 16-bit WAV: (bytes, "wav", sample rate, channels, frames); None
    without one."""
    from dmd2_core.media.av_clips import read_mp4

    clip = read_mp4(io.BytesIO(mp4))
    audio = clip["audio"]  # [C, S] float32
    if not clip["audio_channels"] or audio.shape[1] == 0:
        return None
    pcm = (np.clip(audio.T, -1.0, 1.0) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(audio.shape[0])
        out.setsampwidth(2)
        out.setframerate(int(clip["sample_rate"]))
        out.writeframes(pcm.tobytes())
    return buf.getvalue(), "wav", int(clip["sample_rate"]), int(audio.shape[0]), int(audio.shape[1])


def stored_media(save_url: str, iteration: int) -> list[dict]:
    """An eval's media as ``run_eval`` described them, found again in the save
    (``{save}/media/iter_{i:07d}*``; without their captions): what a tracker that lost them is given again."""
    from dmd2_core.save_layout import media_stem

    stem = media_stem(save_url, iteration)
    folder, _, prefix = stem.rpartition("/")
    names = sorted(n for n in (storage.list_names(folder) if storage.exists(folder) else [])
                   if n.startswith(prefix) and n[len(prefix):len(prefix) + 1] in ("", ".", "_"))
    return [{("video_url" if n.endswith(".mp4") else "url"): storage.join(folder, n)} for n in names]
