"""Sounding digits: short clips in which a handwritten digit slides across the frame, with a stereo
soundtrack whose tone is set by the digit and whose left/right balance follows the digit.

A clip is ``FRAMES`` frames of ``HEIGHT`` x ``WIDTH`` pixels in [-1, 1] (background -1) and
``AUDIO_SAMPLES`` samples per stereo channel in [-1, 1]. Each clip is built from one 8x8 digit of
the digits split the image teacher uses (train clips from train digits, held-out clips from the
test digits), so the frames can be scored against the held-out digits. From the seed and the
clip's index: the start column and the direction (left-to-right or right-to-left,
``SPEED`` pixels per frame) and the tone's phase. The tone has ``tone_cycles(label)`` cycles per
clip, panned with a constant-power law by the digit's column (left at column 0, right at
``WIDTH - 8``), linearly between frame centres.

With keyframes (MiniMax-H3's ``fl2va``): each clip is conditioned on its digit's prompt and on its
own first and/or last frame (``keyframe_prompt_set``), as a keyframe request gives where the digit
starts and ends; the video "VAE" is the identity, so a keyframe's latents are the frame itself.

Latents are patches of pixels and samples (a lossless "VAE", so decoding gives real frames and
waveforms): the video latents [1, FRAMES, HEIGHT, WIDTH] are the frames; the audio latents
[2, 32, 8] hold, per channel, 8 rows of 32 consecutive samples scaled by ``1 / AUDIO_SCALE``
(row l, channel k = sample 32 l + k), which is MiniMax-H3's audio shape for a clip of 2-6 latent
frames (``minimax_h3.audio_latents``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dmd2_core.data import KEYFRAME_PIXELS, PromptSet
from dmd2_core.toys.digits import DIGITS_EMBED_DIM, DIGITS_TOKENS, digits_prompt_set, digits_tensors

FRAMES, HEIGHT, WIDTH = 4, 8, 16
DIGIT = 8
SPEED = 2  # pixels per frame
AUDIO_SAMPLES = 256  # per channel
AUDIO_ROWS, AUDIO_ROW = 8, 32  # MiniMax-H3's audio latents: 32 channels per row
AUDIO_SCALE = 0.5  # waveform = AUDIO_SCALE * latent: the tone's latents have unit-order spread
TONE_AMPLITUDE = 0.8
SAMPLE_RATE = AUDIO_SAMPLES * 24 // FRAMES  # a clip's 4 frames at MiniMax-H3's 24 fps: 1/6 s, so 1536 Hz
VIDEO_LATENT_SHAPE = [1, FRAMES, HEIGHT, WIDTH]
SAMPLE_SIZE = FRAMES * HEIGHT * WIDTH + 2 * AUDIO_ROWS * AUDIO_ROW
MAX_COLUMN = WIDTH - DIGIT


def tone_cycles(label: int) -> int:
    """Cycles of the class's tone per clip: 8, 12, .., 44 (periods of 32 down to ~6 samples)."""
    return 8 + 4 * int(label)


@dataclass
class Clips:
    frames: torch.Tensor  # [N, FRAMES, HEIGHT, WIDTH]
    audio: torch.Tensor  # [N, 2, AUDIO_SAMPLES]
    labels: torch.Tensor  # [N]
    columns: torch.Tensor  # [N, FRAMES] the digit's left column in each frame

    def __len__(self) -> int:
        return len(self.labels)


def _frame_centres() -> np.ndarray:
    per_frame = AUDIO_SAMPLES / FRAMES
    return per_frame * (np.arange(FRAMES) + 0.5)


def pan_gains(columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Constant-power (left, right) gains per sample [N, AUDIO_SAMPLES] of clips whose digit is at
    ``columns`` [N, FRAMES]."""
    pan = np.stack([np.interp(np.arange(AUDIO_SAMPLES), _frame_centres(), c / MAX_COLUMN) for c in columns])
    return np.cos(pan * math.pi / 2), np.sin(pan * math.pi / 2)


def make_clips(split: str = "train", seed: int = 0) -> Clips:
    """One clip per digit of ``split`` ('train' or 'test'), deterministic from ``seed``."""
    digits, labels = digits_tensors(split)
    n = len(labels)
    g = np.random.default_rng([seed, 0 if split == "train" else 1])
    rightward = g.random(n) < 0.5
    span = SPEED * (FRAMES - 1)
    start = g.integers(0, MAX_COLUMN - span + 1, size=n)
    start = np.where(rightward, start, MAX_COLUMN - start)
    steps = np.arange(FRAMES) * SPEED
    columns = np.where(rightward[:, None], start[:, None] + steps, start[:, None] - steps)
    phase = g.random(n) * 2 * math.pi

    frames = np.full((n, FRAMES, HEIGHT, WIDTH), -1.0, dtype=np.float32)
    images = digits[:, 0].numpy()
    for i in range(n):
        for f in range(FRAMES):
            c = columns[i, f]
            frames[i, f, :, c:c + DIGIT] = images[i]
    t = np.arange(AUDIO_SAMPLES) / AUDIO_SAMPLES
    cycles = np.array([tone_cycles(y) for y in labels.tolist()])
    tone = TONE_AMPLITUDE * np.sin(2 * math.pi * cycles[:, None] * t[None] + phase[:, None])
    left, right = pan_gains(columns)
    audio = np.stack([tone * left, tone * right], axis=1).astype(np.float32)
    return Clips(torch.from_numpy(frames), torch.from_numpy(audio), labels.clone(), torch.from_numpy(columns))


# ---- latents: patches of pixels and samples ------------------------------------------------------

def encode(frames: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
    """Frames [N, FRAMES, H, W] and stereo audio [N, 2, S] -> flat H3 samples [N, D] (video latents
    [1, F, H, W], then audio latents [2, 32, 8])."""
    n = frames.shape[0]
    audio_latents = (audio / AUDIO_SCALE).reshape(n, 2, AUDIO_ROWS, AUDIO_ROW).permute(0, 1, 3, 2)
    return torch.cat([frames.reshape(n, -1), audio_latents.reshape(n, -1)], dim=1).float()


def decode(samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``encode``, clamped to what would be saved: frames [N, F, H, W] and audio
    [N, 2, S], both in [-1, 1]."""
    n = samples.shape[0]
    video_size = FRAMES * HEIGHT * WIDTH
    frames = samples[:, :video_size].reshape(n, FRAMES, HEIGHT, WIDTH)
    audio = samples[:, video_size:].reshape(n, 2, AUDIO_ROW, AUDIO_ROWS).permute(0, 1, 3, 2).reshape(n, 2, -1)
    return frames.float().clamp(-1, 1), (AUDIO_SCALE * audio.float()).clamp(-1, 1)


def prompt_set() -> PromptSet:
    """The digits prompts (the image teacher's embeddings, ``DIGITS_TOKENS`` tokens each) as
    MiniMax-H3 conditions: ``prompt_embeds`` and ``prompt_lengths``, no negative entry (the
    teacher is trained without label dropout: guidance-distilled, as the family expects)."""
    digits = digits_prompt_set()
    embeds = digits.embeds["prompt_embeds"]
    assert embeds.shape[1:] == (DIGITS_TOKENS, DIGITS_EMBED_DIM)
    return PromptSet(prompts=[f"a sounding handwritten digit {d}" for d in range(10)],
                     embeds={"prompt_embeds": embeds, "prompt_lengths": torch.full((10,), DIGITS_TOKENS)}, negative={},
                     evaluator="sounding-digits")


KEYFRAME_ANCHORS = ("first", "last")  # the keyframe world's: where the digit starts and ends


def heldout_clips(n: int, seed: int = 0) -> Clips:
    """``n`` held-out clips (the test split's in order, repeated past its size): an fl2va eval's
    keyframes and labels."""
    clips = make_clips("test", seed)
    idx = torch.arange(n) % len(clips)
    return Clips(clips.frames[idx], clips.audio[idx], clips.labels[idx], clips.columns[idx])


def keyframe_frames(anchors: tuple[str, ...]) -> list[int]:
    """The clip's frame each keyframe anchor names: ``first`` 0, ``last`` ``FRAMES - 1``."""
    return [0 if a == "first" else FRAMES - 1 for a in anchors]


def keyframe_prompt_set(clips: Clips, anchors: tuple[str, ...] = KEYFRAME_ANCHORS) -> PromptSet:
    """MiniMax-H3 fl2va conditions, one row per clip: its digit's prompt (``prompt_set``'s
    embeddings, tagged text) and its own frames at ``anchors`` as keyframes (``keyframe_latents``
    [N, K, 1, 1, H, W], ``keyframe_anchors`` [N, K], the pictures ``keyframe_pixels`` uint8
    [N, K, 3, H, W] for the eval media), the keys ``prepare-prompts --keyframes`` writes. The
    digits' prompts carry no vision block: the keyframes reach the model as condition rows only."""
    from dmd2_core.media.av_clips import video_uint8
    from dmd2_core.models import minimax_h3

    digits = prompt_set()
    n, tokens = len(clips), DIGITS_TOKENS
    frames = clips.frames[:, keyframe_frames(anchors)]  # [N, K, H, W]
    pixels = torch.from_numpy(video_uint8(frames.reshape(-1, 1, HEIGHT, WIDTH)))  # [N K, H, W, 3]
    return PromptSet(
        prompts=[f"a sounding handwritten digit {y} from its {' and '.join(anchors)} frame"
                 for y in clips.labels.tolist()],
        embeds={"prompt_embeds": digits.embeds["prompt_embeds"][clips.labels],
                "prompt_lengths": torch.full((n,), tokens), "text_token_tags": torch.full((n, tokens), minimax_h3.TEXT_TAG),
                "keyframe_latents": frames[:, :, None, None].contiguous(),
                "keyframe_anchors": torch.tensor([minimax_h3.KEYFRAME_ANCHORS.index(a) for a in anchors]).repeat(n, 1),
                KEYFRAME_PIXELS: pixels.reshape(n, len(anchors), HEIGHT, WIDTH, 3).permute(0, 1, 4, 2, 3).contiguous()},
        negative={})


def reference_partners(labels: torch.Tensor) -> torch.Tensor:
    """Per clip, another clip of the same digit (the next of its class, cyclically): whose glyph
    is its picture reference, so the reference names the digit without being the clip's own."""
    partners = torch.arange(len(labels))
    for digit in labels.unique().tolist():
        members = torch.nonzero(labels == digit).flatten()
        partners[members] = members.roll(-1)
    return partners


def glyphs(clips: Clips) -> torch.Tensor:
    """Each clip's digit as a still 8x8 picture [N, DIGIT, DIGIT] in [-1, 1], cut from its first frame."""
    return torch.stack([clip[0, :, c:c + DIGIT] for clip, c in zip(clips.frames, clips.columns[:, 0].tolist())])


def neutral_prompt() -> torch.Tensor:
    """A prompt that names no digit: the mean of the ten digits' embeddings [DIGITS_TOKENS, D]."""
    return prompt_set().embeds["prompt_embeds"].mean(0)


def reference_prompt_set(clips: Clips) -> PromptSet:
    """MiniMax-H3 ref2va conditions, one row per clip: a prompt that names no digit
    (``neutral_prompt``, tagged text) and, as its one picture reference, the glyph of another clip
    of its digit (``reference_partners``) at the glyph's own 8x8 size (``reference_latents``
    [N, 1, 1, 1, 8, 8]: the identity "VAE"), with ``reference_kinds`` and the pictures
    ``reference_pixels`` uint8 [N, 1, 3, 8, 8]: the keys ``prepare-prompts --references`` writes.
    The reference alone tells the clip's digit, and so its tone."""
    from dmd2_core.data import REFERENCE_PIXELS
    from dmd2_core.media.av_clips import video_uint8
    from dmd2_core.models import minimax_h3

    n, tokens = len(clips), DIGITS_TOKENS
    references = glyphs(clips)[reference_partners(clips.labels)]  # [N, 8, 8]
    pixels = torch.from_numpy(video_uint8(references[:, None]))  # [N, 8, 8, 3]
    return PromptSet(
        prompts=["a sounding handwritten digit, the one its picture reference shows"] * n,
        embeds={"prompt_embeds": neutral_prompt().expand(n, -1, -1).contiguous(),
                "prompt_lengths": torch.full((n,), tokens), "text_token_tags": torch.full((n, tokens), minimax_h3.TEXT_TAG),
                "reference_latents": references[:, None, None, None].contiguous(),
                "reference_kinds": torch.zeros(n, 1, dtype=torch.long),
                REFERENCE_PIXELS: pixels.permute(0, 3, 1, 2)[:, None].contiguous()},
        negative={})
