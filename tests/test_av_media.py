"""Eval media with sound (dmd2_core/media/av_clips.py): MP4s that play picture and sound in sync, and the
PNG/GIF views of them the Prefect UI shows."""

from __future__ import annotations

import base64
import io

import av
import numpy as np
import pytest
import torch
from PIL import Image

from dmd2_core.media import av_clips
from dmd2_core.media.images import data_uri

FPS = 24
SAMPLE_RATE = 32_000
N_FRAMES = 30  # 1.25 s at 24 fps
SIZE = 32
SQUARE = 6
TONE_HZ = 440.0


def moving_square(n_frames: int = N_FRAMES, size: int = SIZE) -> torch.Tensor:
    """[F, 3, H, W] in [-1, 1]: a white square on black moving left to right."""
    frames = -torch.ones(n_frames, 3, size, size)
    for i in range(n_frames):
        x = 2 + round((size - SQUARE - 4) * i / max(1, n_frames - 1))
        frames[i, :, 12:12 + SQUARE, x:x + SQUARE] = 1.0
    return frames


def left_tone(seconds: float = N_FRAMES / FPS) -> np.ndarray:
    """Stereo [2, S]: 440 Hz on the left, silence on the right."""
    t = np.arange(round(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    return np.stack([0.5 * np.sin(2 * np.pi * TONE_HZ * t), np.zeros_like(t)]).astype(np.float32)


def centroids(frames_uint8: np.ndarray) -> np.ndarray:
    """(y, x) centroid of bright pixels per frame, [F, 2]."""
    out = []
    for frame in frames_uint8:
        ys, xs = np.nonzero(frame.mean(axis=-1) > 128)
        assert len(xs) > 0, "no bright pixels: the square is gone"
        out.append((ys.mean(), xs.mean()))
    return np.array(out)


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.asarray(x, np.float64) ** 2)))


def dominant_hz(wave: np.ndarray, sample_rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(wave * np.hanning(len(wave))))
    return float(np.argmax(spectrum) * sample_rate / len(wave))


@pytest.fixture(scope="module")
def clip_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("av") / "clip.mp4"
    av_clips.write_mp4(path, moving_square(), torch.from_numpy(left_tone()), fps=FPS, sample_rate=SAMPLE_RATE)
    return path


def assert_tone_clip(clip: dict) -> None:
    assert abs(len(clip["frames"]) - N_FRAMES) <= 1
    assert clip["frames"].dtype == np.uint8
    assert clip["fps"] == pytest.approx(FPS, abs=0.01)
    assert clip["duration_s"] == pytest.approx(N_FRAMES / FPS, abs=0.1)
    assert clip["sample_rate"] == SAMPLE_RATE
    assert clip["audio_channels"] == 2 and clip["audio"].shape[0] == 2
    # Decoded audio is as long as the input (AAC pads its last frame; the reader trims it).
    assert abs(clip["audio"].shape[1] - round(N_FRAMES / FPS * SAMPLE_RATE)) <= 32
    left, right = clip["audio"]
    assert dominant_hz(left, SAMPLE_RATE) == pytest.approx(TONE_HZ, rel=0.05)
    assert rms(left) > 0.2  # 0.5 amplitude sine: rms 0.35
    assert rms(right) < 0.05 * rms(left)


def test_mp4_has_h264_video_and_stereo_aac_that_decode_to_the_input(clip_file):
    with av.open(str(clip_file)) as container:
        assert len(container.streams.video) == 1 and len(container.streams.audio) == 1
        assert container.streams.video[0].codec_context.name in ("h264", "mpeg4")
        assert container.streams.audio[0].codec_context.name == "aac"
        assert container.streams.audio[0].layout.name == "stereo"
    data = clip_file.read_bytes()
    assert data.find(b"moov") < data.find(b"mdat")  # index first (faststart): plays while downloading
    clip = av_clips.read_mp4(clip_file)
    assert_tone_clip(clip)
    # 32x32 frames are upscaled x4 (nearest) so players show them; the square moves as it did.
    assert clip["frames"].shape[1:] == (4 * SIZE, 4 * SIZE, 3)
    expected = centroids(av_clips.video_uint8(moving_square())) * 4 + 1.5  # pixel centres after x4
    got = centroids(clip["frames"][:N_FRAMES])
    assert np.abs(got - expected[:len(got)]).max() < 2.0
    assert got[-1, 1] - got[0, 1] > 60


def test_mp4_to_bytesio_gives_the_same_streams():
    buf = io.BytesIO()
    av_clips.write_mp4(buf, moving_square(), left_tone(), fps=FPS, sample_rate=SAMPLE_RATE)
    data = buf.getvalue()
    assert data[4:8] == b"ftyp"
    assert_tone_clip(av_clips.read_mp4(io.BytesIO(data)))


def test_sound_and_picture_are_in_sync():
    """A flash at frame 12 (0.5 s) and a 1 kHz beep starting at 0.5 s decode at the same time:
    the AAC encoder delay is compensated and neither stream is shifted."""
    frames = -torch.ones(N_FRAMES, 3, 16, 16)
    frames[12] = 1.0
    audio = np.zeros((2, round(N_FRAMES / FPS * SAMPLE_RATE)), np.float32)
    start = SAMPLE_RATE // 2
    audio[:, start:start + 800] = 0.8 * np.sin(2 * np.pi * 1000 * np.arange(800) / SAMPLE_RATE)
    buf = io.BytesIO()
    av_clips.write_mp4(buf, frames, audio, fps=FPS, sample_rate=SAMPLE_RATE)
    clip = av_clips.read_mp4(io.BytesIO(buf.getvalue()))
    assert int(np.argmax(clip["frames"].mean(axis=(1, 2, 3)))) == 12
    onset = int(np.nonzero(np.abs(clip["audio"][0]) > 0.3)[0][0])
    assert abs(onset - start) / SAMPLE_RATE < 0.005


@pytest.mark.skipif("mpeg4" not in av.codecs_available, reason="no mpeg4 encoder")
def test_odd_sizes_are_padded_and_mono_stays_mono():
    frames = np.zeros((6, 21, 31, 3), np.uint8)
    frames[:, :, -1] = 255  # bright last column: edge replication keeps the padded column bright
    av_buf = io.BytesIO()
    av_clips.write_mp4(av_buf, frames, left_tone(0.25)[:1], fps=FPS, sample_rate=SAMPLE_RATE, min_side=0, video_codec="mpeg4")
    clip = av_clips.read_mp4(io.BytesIO(av_buf.getvalue()))
    assert clip["frames"].shape[1:] == (22, 32, 3)
    assert clip["frames"][:, :, -2:].mean() > 200
    assert clip["audio_channels"] == 1 and clip["audio"].shape[0] == 1
    assert dominant_hz(clip["audio"][0], SAMPLE_RATE) == pytest.approx(TONE_HZ, rel=0.05)


def test_spectrogram_shows_the_tone_in_the_left_panel_only():
    audio = left_tone()
    n_fft, hop = 1024, 256
    img = Image.open(io.BytesIO(av_clips.spectrogram_png(audio, SAMPLE_RATE, n_fft=n_fft, hop=hop)))
    img.verify()
    img = Image.open(io.BytesIO(av_clips.spectrogram_png(audio, SAMPLE_RATE, n_fft=n_fft, hop=hop)))
    panel = n_fft // 2 + 1
    assert img.format == "PNG" and img.mode == "RGB"
    assert img.size == (1 + audio.shape[1] // hop, 2 * panel + av_clips.SPECTROGRAM_SEPARATOR_PX)
    pixels = np.asarray(img, np.float64).sum(axis=-1)
    left = pixels[:panel]
    right = pixels[panel + av_clips.SPECTROGRAM_SEPARATOR_PX:]
    brightest_bin = panel - 1 - int(np.argmax(left.mean(axis=1)))  # frequency increases upwards
    assert abs(brightest_bin - TONE_HZ * n_fft / SAMPLE_RATE) <= 2
    assert right.mean() < left.mean()


def test_spectrogram_of_silence_is_finite_and_uniform():
    silence = torch.zeros(2, SAMPLE_RATE // 4)
    db = av_clips.spectrogram_db(silence)
    assert torch.isfinite(db).all() and (db == -80.0).all()
    pixels = np.asarray(Image.open(io.BytesIO(av_clips.spectrogram_png(silence, SAMPLE_RATE))))
    panel = pixels[:513]
    assert (panel == panel[0, 0]).all()


def test_frame_strip_shows_evenly_spaced_frames_side_by_side():
    frames = moving_square()
    strip = Image.open(io.BytesIO(av_clips.frame_strip_png(frames, max_frames=8, height=64)))
    assert strip.format == "PNG" and strip.size == (8 * 64, 64)
    cells = np.asarray(strip).reshape(64, 8, 64, 3).transpose(1, 0, 2, 3)
    xs = centroids(cells)[:, 1]
    assert xs[0] < 20 and xs[-1] > 44 and (np.diff(xs) > 0).all()  # first and last frame, in order
    short = Image.open(io.BytesIO(av_clips.frame_strip_png(frames[:5], max_frames=8, height=64)))
    assert short.size == (5 * 64, 64)


def gif_frames(data: bytes) -> tuple[Image.Image, list[int]]:
    """The opened GIF and each frame's delay in ms."""
    gif = Image.open(io.BytesIO(data))
    delays = []
    for i in range(gif.n_frames):
        gif.seek(i)
        delays.append(gif.info["duration"])
    return gif, delays


def test_gif_has_every_frame_and_plays_in_real_time():
    ramp = torch.linspace(-1, 1, N_FRAMES).view(N_FRAMES, 1, 1, 1).expand(N_FRAMES, 3, SIZE, SIZE)
    gif, delays = gif_frames(av_clips.animated_gif(ramp, fps=FPS))
    assert gif.format == "GIF" and gif.n_frames == N_FRAMES and gif.info["loop"] == 0
    assert gif.size == (4 * SIZE, 4 * SIZE)  # small frames upscaled
    assert set(delays) <= {40, 50} and sum(delays) == pytest.approx(1000 * N_FRAMES / FPS, abs=10)
    # Repeated frames (the square does not move every frame) merge, keeping the running time.
    _, delays = gif_frames(av_clips.animated_gif(moving_square(), fps=FPS))
    assert sum(delays) == pytest.approx(1000 * N_FRAMES / FPS, abs=10)


def test_long_gif_keeps_every_kth_frame_shown_k_periods():
    ramp = torch.linspace(-1, 1, 100).view(100, 1, 1, 1).expand(100, 3, 8, 8)
    gif, delays = gif_frames(av_clips.animated_gif(ramp, fps=FPS))
    assert gif.n_frames == 34  # every 3rd of 100 (at most 48)
    assert sum(delays) == pytest.approx(1000 * 34 * 3 / FPS, abs=10)


def test_stereo_balance_and_data_uri():
    tone = left_tone(0.1)[0]
    silent = np.zeros_like(tone)
    assert av_clips.stereo_balance(np.stack([tone, silent])) == pytest.approx(-1.0, abs=1e-3)
    assert av_clips.stereo_balance(torch.from_numpy(np.stack([silent, tone]))) == pytest.approx(1.0, abs=1e-3)
    assert av_clips.stereo_balance(np.stack([tone, tone])) == pytest.approx(0.0, abs=1e-6)
    assert av_clips.stereo_balance(np.stack([tone, 0.5 * tone])) == pytest.approx(-1 / 3, abs=1e-3)
    png = av_clips.frame_strip_png(moving_square(4))
    uri = data_uri(png)  # the one data-URI helper (dmd2_core.media.images)
    assert uri.startswith("data:image/png;base64,")
    assert base64.b64decode(uri.split(",", 1)[1]) == png


def test_a_local_clip_plays_in_place_with_its_sound(tmp_path):
    """A local save has no link a browser can open: the artifact carries the MP4 itself as a data
    URI in a <video> (a preview with the same sound when the clip is too large), or names the path."""
    from dmd2_core import report
    from dmd2_core.media.eval_files import av_media_of

    samples = {"video": moving_square()[None].permute(0, 2, 1, 3, 4), "audio": torch.from_numpy(left_tone())[None],
               "sample_rate": SAMPLE_RATE, "fps": FPS}
    strip, _ = av_media_of(samples, 0, str(tmp_path / "iter_p0"), "p0", 512 * 1024, inline_limit=512 * 1024)
    assert strip["inline_video"].startswith("data:video/mp4;base64,")
    inline = base64.b64decode(strip["inline_video"].split(",", 1)[1])
    assert inline == (tmp_path / "iter_p0.mp4").read_bytes()
    assert_tone_clip(av_clips.read_mp4(io.BytesIO(inline)))
    text = report.summary_markdown({"name": "n", "iteration": 2, "final": 2, "evals": [], "media": [strip],
                                    "media_iteration": 2})
    assert f'<div><video controls preload="metadata" src="{strip["inline_video"]}"></video></div>' in text

    big = torch.rand(12, 3, 320, 320) * 2 - 1  # noise: an MP4 far above the limit
    samples = {"video": big[None].permute(0, 2, 1, 3, 4), "audio": torch.from_numpy(left_tone(12 / FPS))[None],
               "sample_rate": SAMPLE_RATE, "fps": FPS}
    full = (tmp_path / "big.mp4")
    strip, _ = av_media_of(samples, 0, str(tmp_path / "big"), "p0", 1 << 30, inline_limit=1 << 30)
    full_bytes = full.read_bytes()
    limit = len(full_bytes) // 2
    strip, _ = av_media_of(samples, 0, str(tmp_path / "big"), "p0", 1 << 30, inline_limit=limit)
    preview = base64.b64decode(strip["inline_video"].split(",", 1)[1])
    assert len(preview) <= limit
    clip = av_clips.read_mp4(io.BytesIO(preview))
    assert max(clip["frames"].shape[1:3]) == 256 and abs(len(clip["frames"]) - 12) <= 1
    left, right = clip["audio"]
    assert dominant_hz(left, SAMPLE_RATE) == pytest.approx(TONE_HZ, rel=0.05) and rms(right) < 0.05 * rms(left)

    strip, _ = av_media_of(samples, 0, str(tmp_path / "big"), "p0", 1 << 30, inline_limit=1000)
    assert strip["inline_video"] is None
    text = report.summary_markdown({"name": "n", "iteration": 2, "final": 2, "evals": [], "media": [strip],
                                    "media_iteration": 2})
    assert "<video" not in text and f"MP4 with sound: `{tmp_path / 'big.mp4'}`" in text


def test_a_summary_too_large_for_prefect_names_its_clips_instead_of_playing_them():
    from flows.artifacts import SUMMARY_MAX_CHARS, summary_text

    clip = {"src": "data:image/png;base64,AAAA", "url": "/r/m/iter_2_p0_frames.png", "full": True, "caption": "p0",
            "video_url": "/r/m/iter_2_p0.mp4", "play": "/r/m/iter_2_p0.mp4"}
    state = {"name": "n", "iteration": 2, "final": 2, "evals": [], "media_iteration": 2}
    small = summary_text({**state, "media": [{**clip, "inline_video": "data:video/mp4;base64,AAAA"}]})
    assert '<video controls preload="metadata" src="data:video/mp4;base64,AAAA">' in small
    big = summary_text({**state, "media": [{**clip, "inline_video": "data:video/mp4;base64," + "A" * SUMMARY_MAX_CHARS}]})
    assert len(big) < SUMMARY_MAX_CHARS and "<video" not in big and "MP4 with sound: `/r/m/iter_2_p0.mp4`" in big
