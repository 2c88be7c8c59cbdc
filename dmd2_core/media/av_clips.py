"""Eval media with sound for joint video + audio models: MP4 (H.264 + AAC) writing and reading,
frame strips, animated GIFs, spectrograms, and a stereo balance measure.

Conventions:

* video frames: float ``[F, 3, H, W]`` in [-1, 1] (torch or numpy; what a VAE decoder gives
  after indexing ``[B, 3, F, H, W]`` as ``x[b].transpose(0, 1)``), or uint8 ``[F, H, W, 3]``;
  ``[F, 1, H, W]`` is shown as grey.
* audio: float waveform ``[C, S]`` in [-1, 1] (C = 1 or 2; channel 0 is left), torch or numpy;
  a 1-D ``[S]`` waveform is mono.

Imports only ``images`` (PNG bytes, data URIs) from dmd2_core; no Prefect.
"""

from __future__ import annotations

import io
import math
from fractions import Fraction
from typing import Any, BinaryIO, Optional, Sequence, Union

import av
import numpy as np
import torch
from PIL import Image

from dmd2_core.media.images import png_bytes

MIN_SIDE_PX = 128  # tiny frames are upscaled (nearest) so that players show them
AUDIO_BIT_RATE_PER_CHANNEL = 96_000
GIF_MAX_FRAMES = 48
SPECTROGRAM_SEPARATOR_PX = 2
KEYFRAME_GAP_PX = 4  # white columns between a frame strip's keyframes and its generated frames
KEYFRAME_PLACES = ("first", "last")  # a keyframe's anchor: its cell before / after the generated frames

PathOrFile = Union[str, BinaryIO]  # a path (str or path-like) or a seekable binary file object


# ---- conversions ------------------------------------------------------------------------------

def video_uint8(frames: Any) -> np.ndarray:
    """Video frames (see module docstring) -> uint8 ``[F, H, W, 3]``."""
    if isinstance(frames, np.ndarray) and frames.dtype == np.uint8:
        if frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"uint8 frames must be [F, H, W, 3], got shape {frames.shape}")
        return np.ascontiguousarray(frames)
    x = torch.as_tensor(np.asarray(frames) if not torch.is_tensor(frames) else frames)
    x = x.detach().float().cpu()
    if x.dim() != 4 or x.shape[1] not in (1, 3):
        raise ValueError(f"frames must be float [F, 3, H, W] (or [F, 1, H, W]), got shape {tuple(x.shape)}")
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    x = ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).contiguous().numpy()


def audio_float32(audio: Any) -> np.ndarray:
    """Audio waveform -> float32 ``[C, S]`` clipped to [-1, 1], C in {1, 2}."""
    a = audio.detach().float().cpu().numpy() if torch.is_tensor(audio) else np.asarray(audio, dtype=np.float32)
    if a.ndim == 1:
        a = a[None]
    if a.ndim != 2 or a.shape[0] not in (1, 2):
        raise ValueError(f"audio must be [C, S] with C = 1 or 2, got shape {a.shape}")
    return np.ascontiguousarray(np.clip(np.nan_to_num(a.astype(np.float32)), -1.0, 1.0))


def _upscale_factor(h: int, w: int, min_side: int) -> int:
    return max(1, math.ceil(min_side / max(1, min(h, w))))


def _upscale(pixels: np.ndarray, factor: int) -> np.ndarray:
    """Nearest-neighbour integer upscale of ``[F, H, W, 3]``."""
    if factor == 1:
        return pixels
    return pixels.repeat(factor, axis=1).repeat(factor, axis=2)


def _fps_fraction(fps: float) -> Fraction:
    rate = Fraction(fps).limit_denominator(1001)
    if rate <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    return rate


# ---- MP4 --------------------------------------------------------------------------------------

def _video_codec() -> str:
    return "libx264" if "libx264" in av.codecs_available else "mpeg4"


def write_mp4(
    path_or_file: PathOrFile,
    frames: Any,
    audio: Optional[Any],
    fps: float,
    sample_rate: int,
    min_side: int = MIN_SIDE_PX,
    video_codec: Optional[str] = None,
    crf: int = 18,
    audio_bit_rate_per_channel: int = AUDIO_BIT_RATE_PER_CHANNEL,
) -> None:
    """Write an MP4 with an H.264 video stream (mpeg4 if PyAV's FFmpeg lacks libx264) and an AAC
    audio stream (mono or stereo, as ``audio`` has 1 or 2 channels; ``audio=None`` writes video only).

    ``path_or_file`` is a path or a seekable binary file object such as ``io.BytesIO``.
    Frames whose short side is below ``min_side`` are upscaled by an integer factor (nearest);
    an odd height or width is then padded by one replicated edge row/column, as yuv420p needs even
    sizes. Audio and video keep their own lengths (neither is trimmed or padded to the other).
    ``video_codec`` overrides the choice of encoder (e.g. "mpeg4"). ``crf``: H.264's constant rate
    factor (18: visually lossless; each +6 about halves the size; mpeg4 gets the matching bit
    rate). Files written to a path get
    the index at the front (``movflags=+faststart``, for progressive playback); FFmpeg cannot do
    that for file objects, whose MP4 keeps the index at the end (players fetch it by range request).
    """
    pixels = video_uint8(frames)
    n_frames, h, w, _ = pixels.shape
    if n_frames == 0:
        raise ValueError("write_mp4: no frames")
    pixels = _upscale(pixels, _upscale_factor(h, w, min_side))
    pixels = np.pad(pixels, ((0, 0), (0, pixels.shape[1] % 2), (0, pixels.shape[2] % 2), (0, 0)), mode="edge")
    waveform = audio_float32(audio) if audio is not None else None
    rate = _fps_fraction(fps)
    sample_rate = int(sample_rate)

    is_path = isinstance(path_or_file, str) or hasattr(path_or_file, "__fspath__")
    target = str(path_or_file) if is_path else path_or_file
    with av.open(target, mode="w", format="mp4", options={"movflags": "+faststart"} if is_path else None) as container:
        codec = video_codec or _video_codec()
        video = container.add_stream(codec, rate=rate,
                                     options={"crf": str(int(crf)), "preset": "veryfast"} if codec == "libx264" else None)
        video.width, video.height = pixels.shape[2], pixels.shape[1]
        video.pix_fmt = "yuv420p"
        video.codec_context.time_base = 1 / rate
        if codec == "mpeg4":
            video.bit_rate = int(4_000_000 * 2 ** ((18 - crf) / 6))
        sound = None
        if waveform is not None:
            sound = container.add_stream("aac", rate=sample_rate)
            sound.layout = "stereo" if waveform.shape[0] == 2 else "mono"
            sound.format = "fltp"
            sound.bit_rate = int(audio_bit_rate_per_channel) * waveform.shape[0]
            sound.codec_context.time_base = Fraction(1, sample_rate)
        container.start_encoding()  # opens the encoders, so the AAC frame size is known
        chunk = (sound.codec_context.frame_size or 1024) if sound is not None else 0
        audio_pos = 0
        n_samples = waveform.shape[1] if waveform is not None else 0

        def encode_audio_until(end_sample: int) -> None:
            nonlocal audio_pos
            while audio_pos < min(end_sample, n_samples):
                piece = waveform[:, audio_pos:audio_pos + chunk]
                frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(piece), format="fltp", layout=sound.layout)
                frame.sample_rate = sample_rate
                frame.pts = audio_pos
                frame.time_base = Fraction(1, sample_rate)
                container.mux(sound.encode(frame))
                audio_pos += piece.shape[1]

        # Encode in presentation order (audio up to the end of each video frame) so the muxer
        # interleaves without buffering a whole stream.
        for i in range(n_frames):
            frame = av.VideoFrame.from_ndarray(pixels[i], format="rgb24")
            frame.pts = i
            frame.time_base = 1 / rate
            container.mux(video.encode(frame))
            if sound is not None:
                encode_audio_until(math.ceil((i + 1) * sample_rate / rate))
        container.mux(video.encode(None))
        if sound is not None:
            encode_audio_until(n_samples)
            container.mux(sound.encode(None))


def read_mp4(path_or_file: PathOrFile, sample_rate: Optional[int] = None) -> dict:
    """Decode an MP4 (first video and first audio stream). Returns ``frames`` uint8
    ``[F, H, W, 3]``, ``audio`` float32 ``[C, S]`` whose sample 0 plays with frame 0 (``[0, 0]``
    without an audio stream), ``fps``, ``sample_rate`` (the stream's, or ``sample_rate`` when
    given: the audio is resampled to it) and ``audio_channels`` (0 without audio), and
    ``duration_s`` (the container's)."""
    if hasattr(path_or_file, "__fspath__"):
        path_or_file = str(path_or_file)
    with av.open(path_or_file, mode="r") as container:
        if not container.streams.video:
            raise ValueError("read_mp4: no video stream")
        video = container.streams.video[0]
        sound = container.streams.audio[0] if container.streams.audio else None
        frames: list[np.ndarray] = []
        chunks: list[np.ndarray] = []
        video_start = audio_start = None
        resampler = None
        rate_out = int(sample_rate or (sound.rate if sound is not None else 0))
        if sound is not None:
            resampler = av.AudioResampler(format="fltp", layout=sound.layout, rate=rate_out)
        streams = [video] + ([sound] if sound is not None else [])
        for packet in container.demux(streams):
            for frame in packet.decode():
                if packet.stream is video:
                    if video_start is None and frame.time is not None:
                        video_start = frame.time
                    frames.append(frame.to_ndarray(format="rgb24"))
                else:
                    if audio_start is None and frame.time is not None:
                        audio_start = frame.time
                    chunks.extend(f.to_ndarray() for f in resampler.resample(frame))
        if resampler is not None:
            chunks.extend(f.to_ndarray() for f in resampler.resample(None))
        channels = sound.layout.nb_channels if sound is not None else 0
        waveform = np.concatenate(chunks, axis=1).astype(np.float32) if chunks else np.zeros((channels, 0), np.float32)
        if chunks:
            if sound.duration is not None:
                # The last AAC frame is zero-padded to 1024 samples; the stream duration trims it
                # (FFmpeg may keep up to 31 padding samples, under 1 ms).
                waveform = waveform[:, :round(float(sound.duration * sound.time_base) * rate_out)]
            # Align sample 0 with the first video frame, as a player does.
            offset = round(((audio_start or 0.0) - (video_start or 0.0)) * rate_out)
            if offset > 0:
                waveform = np.concatenate([np.zeros((channels, offset), np.float32), waveform], axis=1)
            elif offset < 0:
                waveform = waveform[:, -offset:]
        rate = video.average_rate or video.guessed_rate or video.base_rate
        if container.duration is not None:
            duration = container.duration / av.time_base
        else:
            duration = max(float(s.duration * s.time_base) for s in streams if s.duration is not None)
        return {
            "frames": np.stack(frames) if frames else np.zeros((0, video.height, video.width, 3), np.uint8),
            "audio": waveform,
            "fps": float(rate) if rate else 0.0,
            "sample_rate": rate_out,
            "audio_channels": channels,
            "duration_s": float(duration),
        }


# ---- pictures ---------------------------------------------------------------------------------

def frame_strip_png(frames: Any, max_frames: int = 8, height: int = MIN_SIDE_PX, keyframes: Any = None,
                    anchors: Sequence[str] = ()) -> bytes:
    """A PNG of up to ``max_frames`` evenly spaced frames side by side, each resized to ``height``
    pixels high (nearest when enlarging), width in proportion: strip width = n * frame width.

    ``keyframes`` (frames as above, one per entry of ``anchors``: 'first' or 'last') are the
    conditions the clip was generated from: a 'first' keyframe's cell goes before the generated
    frames, a 'last' one's after them, each set apart by ``KEYFRAME_GAP_PX`` white columns and
    resized to the generated frames' cell, so the clip's ends sit next to what anchored them."""
    pixels = video_uint8(frames)
    n_frames, h, w, _ = pixels.shape
    if n_frames == 0:
        raise ValueError("frame_strip_png: no frames")
    conditions = video_uint8(keyframes) if keyframes is not None else np.zeros((0, h, w, 3), np.uint8)
    if len(conditions) != len(anchors) or any(a not in KEYFRAME_PLACES for a in anchors):
        raise ValueError(f"frame_strip_png: {len(conditions)} keyframes for anchors {list(anchors)} (one each, "
                         f"{' or '.join(KEYFRAME_PLACES)})")
    n = max(1, min(int(max_frames), n_frames))
    picks = np.linspace(0, n_frames - 1, n).round().astype(int)
    cell_w = max(1, round(w * height / h))
    before = [conditions[k] for k, a in enumerate(anchors) if a == "first"]
    after = [conditions[k] for k, a in enumerate(anchors) if a == "last"]
    cells = [*before, *(pixels[i] for i in picks), *after]
    gaps = [KEYFRAME_GAP_PX if (slot == len(before) and before) or (slot == len(before) + n and after) else 0
            for slot in range(len(cells))]  # before each cell: a gap where conditions meet generated frames
    strip = Image.new("RGB", (len(cells) * cell_w + sum(gaps), height), (255, 255, 255))
    x = 0
    for cell, gap in zip(cells, gaps):
        x += gap
        resample = Image.NEAREST if height >= cell.shape[0] else Image.BOX
        strip.paste(Image.fromarray(cell).resize((cell_w, height), resample), (x, 0))
        x += cell_w
    return png_bytes(strip)


def animated_gif(frames: Any, fps: float, max_frames: int = GIF_MAX_FRAMES, min_side: int = MIN_SIDE_PX) -> bytes:
    """An animated GIF that loops forever, playing in real time. Longer clips keep every k-th frame
    (at most ``max_frames``, and none shorter than 20 ms, which browsers slow down), each shown
    k / fps seconds; GIF delays are in 10 ms steps, so they alternate (e.g. 40/40/50 ms at 24 fps)
    to keep the running time exact. Small frames are upscaled (nearest) to at least ``min_side``.
    Pillow merges identical consecutive frames (adding their delays), so a clip with repeated
    frames has fewer GIF frames but the same running time."""
    pixels = video_uint8(frames)
    n_frames, h, w, _ = pixels.shape
    if n_frames == 0:
        raise ValueError("animated_gif: no frames")
    if fps <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    step = max(1, math.ceil(n_frames / max(1, int(max_frames))), math.ceil(0.02 * fps - 1e-9))
    pixels = _upscale(pixels[::step], _upscale_factor(h, w, min_side))
    ends_cs = [round(k * step * 100 / fps) for k in range(len(pixels) + 1)]  # centiseconds
    durations = [10 * max(1, b - a) for a, b in zip(ends_cs, ends_cs[1:])]
    images = [Image.fromarray(p) for p in pixels]
    buf = io.BytesIO()
    images[0].save(buf, format="GIF", save_all=True, append_images=images[1:], duration=durations, loop=0)
    return buf.getvalue()


# ---- audio ------------------------------------------------------------------------------------

def spectrogram_db(audio: Any, n_fft: int = 1024, hop: int = 256, floor_db: float = -80.0) -> torch.Tensor:
    """Log-magnitude STFT (Hann window) in dB relative to the loudest bin over all channels,
    clamped at ``floor_db``: ``[C, n_fft // 2 + 1, T]``, row k is k * sample_rate / n_fft Hz.
    Silent audio gives ``floor_db`` everywhere."""
    wave = torch.from_numpy(audio_float32(audio)).double()
    if wave.shape[1] == 0:
        raise ValueError("spectrogram: empty audio")
    if wave.shape[1] < n_fft:  # reflect padding (center=True) needs more than n_fft // 2 samples
        wave = torch.nn.functional.pad(wave, (0, n_fft - wave.shape[1]))
    spec = torch.stft(wave, n_fft=n_fft, hop_length=hop, window=torch.hann_window(n_fft, dtype=wave.dtype), center=True, return_complex=True)
    magnitude = spec.abs()
    peak = float(magnitude.max())
    if not peak > 1e-12:
        return torch.full(magnitude.shape, float(floor_db), dtype=torch.float32)
    db = 20 * torch.log10(magnitude.clamp_min(peak * 1e-12) / peak)
    return db.clamp_min(floor_db).float()


def _colormap_lut(name: str) -> np.ndarray:
    from matplotlib import colormaps  # no pyplot: only the colour table

    return (colormaps[name](np.linspace(0.0, 1.0, 256))[:, :3] * 255).round().astype(np.uint8)


def spectrogram_png(
    audio: Any,
    sample_rate: int,
    n_fft: int = 1024,
    hop: int = 256,
    floor_db: float = -80.0,
    cmap: str = "magma",
) -> bytes:
    """PNG of the log-magnitude spectrogram (see ``spectrogram_db``): one panel per channel,
    stacked vertically (left on top), ``n_fft // 2 + 1`` rows each, frequency increasing upwards
    (the bottom row of a panel is 0 Hz, bin k is k * sample_rate / n_fft Hz), one column per STFT
    frame, panels separated by ``SPECTROGRAM_SEPARATOR_PX`` white rows. ``sample_rate`` is not
    needed for the pixels; it is checked and kept in the signature for the caller's axis labels."""
    if int(sample_rate) <= 0:
        raise ValueError(f"sample_rate must be positive, got {sample_rate}")
    db = spectrogram_db(audio, n_fft=n_fft, hop=hop, floor_db=floor_db)
    levels = ((db - floor_db) / -floor_db * 255).round().clamp(0, 255).to(torch.uint8).numpy()
    lut = _colormap_lut(cmap)
    n_channels, n_bins, n_steps = levels.shape
    separator = np.full((SPECTROGRAM_SEPARATOR_PX, n_steps, 3), 255, np.uint8)
    rows: list[np.ndarray] = []
    for c in range(n_channels):
        if c:
            rows.append(separator)
        rows.append(lut[levels[c, ::-1]])
    return png_bytes(Image.fromarray(np.concatenate(rows, axis=0)))


def stereo_balance(audio: Any, eps: float = 1e-8) -> float:
    """(rms_R - rms_L) / (rms_R + rms_L + eps) in [-1, 1]: -1 left only, +1 right only, 0 equal
    (and 0 for mono or silence)."""
    wave = audio_float32(audio).astype(np.float64)
    if wave.shape[0] < 2 or wave.shape[1] == 0:
        return 0.0
    rms_left, rms_right = np.sqrt((wave[:2] ** 2).mean(axis=1))
    return float((rms_right - rms_left) / (rms_right + rms_left + eps))
