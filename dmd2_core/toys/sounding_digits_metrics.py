"""What a person would see and hear in generated sounding-digit clips (``dmd2_core.toys.sounding_digits``).

Every metric works on decoded clips: frames in [-1, 1] and stereo waveforms in [-1, 1].

- ``frame_fd``: Fréchet distance, in the digits classifier's feature space (``evaluation``), of
  every frame's digit (the 8x8 window holding the most ink) against the held-out test digits;
  ``frame_acc``: that classifier's accuracy on those digits against the prompted class.
- ``sound_acc``: a small sound classifier's (trained here on the train clips, cached like the
  digits classifier) accuracy against the prompted class; ``sound_fd``: Fréchet distance, in that
  classifier's hidden features, of the sound against the held-out test clips' (the sound's
  counterpart of ``frame_fd``).
- ``agreement``: the fraction of clips whose sound's class is the picture's digit (the digits
  classifier's vote over the frames) *and* whose stereo balance follows the digit's motion (the
  balance moves the way the digit moves, by more than ``BALANCE_MIN_CHANGE``); both parts are
  also reported, ``class_agreement`` and ``stereo_agreement``.
- ``diversity``: the digits' within-prompt diversity (``evaluation.within_prompt_diversity``).
- ``sound_mel_kid`` and ``sound_mel_kid_se``: the product's weight-free sound distance
  (``evaluation.sound_distance``) against the held-out test clips, the sound FD's reference: what
  a night reads from its few eval clips, beside the ground truth it is validated against.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from dmd2_core.evaluation.sound_distance import MIN_CLIPS, clip_features, sound_mel_kid
from dmd2_core.toys import digits_metrics
from dmd2_core.toys import sounding_digits as sd
from dmd2_core.toys.digits import digits_tensors

SOUND_CLASSIFIER_VERSION = "spectrum-mlp-64-v1"
BALANCE_MIN_CHANGE = 0.1
METRICS = ("frame_fd", "frame_acc", "sound_acc", "agreement", "class_agreement", "stereo_agreement", "diversity")


def balanced_labels(n: int) -> torch.Tensor:
    return torch.arange(n) % 10


# ---- where the digit is -------------------------------------------------------------------------

def locate_digits(frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Frames [N, F, H, W] -> (the left column [N, F] of the 8-wide window with the most ink, the
    8x8 crops there [N, F, 8, 8])."""
    ink = (frames.float() + 1).sum(dim=2)  # [N, F, W]
    windows = ink.unfold(-1, sd.DIGIT, 1).sum(-1)  # [N, F, W - 7]
    # digits often leave a blank column at an edge, so several windows hold all the ink: the one
    # centred on the ink's centre of mass wins the tie
    x = torch.arange(ink.shape[-1], dtype=ink.dtype)
    centre = (ink * x).sum(-1, keepdim=True) / ink.sum(-1, keepdim=True).clamp_min(1e-6) - (sd.DIGIT - 1) / 2
    columns = (windows - 1e-3 * (torch.arange(windows.shape[-1]) - centre).abs()).argmax(-1)
    offsets = columns[..., None] + torch.arange(sd.DIGIT)  # [N, F, 8]
    index = offsets[:, :, None, :].expand(-1, -1, frames.shape[2], -1)
    return columns, torch.gather(frames.float(), 3, index)


# ---- what the sound says ------------------------------------------------------------------------

def spectrum(audio: torch.Tensor) -> torch.Tensor:
    """log(1 + magnitude spectrum) of a stereo clip [N, 2, S] -> [N, S // 2 + 1] (the two
    channels' magnitudes combined, so panning and phase do not change it)."""
    mag = torch.fft.rfft(audio.float(), dim=-1).abs()
    return torch.log1p(mag.pow(2).sum(1).sqrt())


class SoundClassifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(sd.AUDIO_SAMPLES // 2 + 1, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 10))

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        return self.net(spectrum(audio))


def sound_classifier_path() -> Path:
    return digits_metrics.cache_dir() / f"sound-classifier-{SOUND_CLASSIFIER_VERSION}.safetensors"


@torch.enable_grad()
def _train_sound_classifier(seed: int = 0, epochs: int = 30, batch_size: int = 64) -> SoundClassifier:
    clips = sd.make_clips("train", seed)
    x, y = clips.audio, clips.labels
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SoundClassifier()
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=g)
        for i in range(0, len(x), batch_size):
            idx = perm[i:i + batch_size]
            # random gain and hiss: generated sound is quieter or noisier than the clean tones
            gain = 0.2 + torch.rand(len(idx), 1, 1, generator=g)
            xb = gain * x[idx] + 0.1 * torch.rand(len(idx), 1, 1, generator=g) * torch.randn(x[idx].shape, generator=g)
            loss = torch.nn.functional.cross_entropy(model(xb), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


_SOUND: dict[str, SoundClassifier] = {}


def sound_classifier() -> SoundClassifier:
    """From memory, else the cache file, else trained on one thread and written."""
    path = sound_classifier_path()
    if str(path) in _SOUND:
        return _SOUND[str(path)]
    model = SoundClassifier()
    if path.is_file():
        model.load_state_dict(load_file(str(path)))
    else:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            model = _train_sound_classifier()
        finally:
            torch.set_num_threads(threads)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp),
                  metadata={"version": SOUND_CLASSIFIER_VERSION})
        os.replace(tmp, path)
    model.eval().requires_grad_(False)
    _SOUND[str(path)] = model
    return model


@torch.no_grad()
def sound_classes(audio: torch.Tensor) -> np.ndarray:
    return sound_classifier()(audio).argmax(1).numpy()


def sound_features(audio: torch.Tensor) -> np.ndarray:
    """The sound classifier's hidden features [N, 64] (after its ReLU): the space of ``sound_fd``."""
    return sound_classifier().net[:2](spectrum(audio)).numpy()


def balance(audio: torch.Tensor) -> torch.Tensor:
    """Right share of the energy per frame's stretch of sound [N, F]: 0 all left, 1 all right."""
    energy = audio.float().reshape(audio.shape[0], 2, sd.FRAMES, -1).pow(2).sum(-1)  # [N, 2, F]
    return energy[:, 1] / (energy.sum(1) + 1e-8)


# ---- the metrics --------------------------------------------------------------------------------

_TEST_FEATURES: dict[str, np.ndarray] = {}


def _test_features() -> np.ndarray:
    key = str(digits_metrics.classifier_path())
    if key not in _TEST_FEATURES:
        _TEST_FEATURES[key] = digits_metrics.features(digits_tensors("test")[0])
    return _TEST_FEATURES[key]


@functools.lru_cache(maxsize=1)
def _test_clip_features() -> torch.Tensor:
    return clip_features(sd.make_clips("test", 0).audio, sd.SAMPLE_RATE)


def _test_sound_features() -> np.ndarray:
    key = str(sound_classifier_path())
    if key not in _TEST_FEATURES:
        _TEST_FEATURES[key] = sound_features(sd.make_clips("test", 0).audio)
    return _TEST_FEATURES[key]


@torch.no_grad()
def evaluate_clips(samples: torch.Tensor, labels) -> dict[str, float]:
    """The metrics (see the module doc) of flat H3 samples [N, D] prompted with ``labels``."""
    frames, audio = sd.decode(samples)
    return evaluate_decoded(frames, audio, labels)


@torch.no_grad()
def evaluate_decoded(frames: torch.Tensor, audio: torch.Tensor, labels) -> dict[str, float]:
    labels = np.asarray(labels).reshape(-1)
    columns, crops = locate_digits(frames)
    n, f = columns.shape
    digits = crops.reshape(n * f, 1, sd.DIGIT, sd.DIGIT)
    feats = digits_metrics.features(digits)
    frame_labels = np.repeat(labels, f)
    logits = digits_metrics.digits_classifier()(digits.clamp(-1, 1)).reshape(n, f, 10)
    picture = logits.log_softmax(-1).sum(1).argmax(-1).numpy()
    sound = sound_classes(audio)
    motion = (columns[:, -1] - columns[:, 0]).sign()
    trend = balance(audio)
    trend = trend[:, -1] - trend[:, 0]
    stereo = ((trend.abs() > BALANCE_MIN_CHANGE) & (trend.sign() == motion) & (motion != 0)).numpy()
    same_class = sound == picture
    return {
        "frame_fd": digits_metrics.frechet_distance(feats, _test_features()),
        "sound_fd": digits_metrics.frechet_distance(sound_features(audio), _test_sound_features()),
        "frame_acc": float((digits_metrics.predict(digits) == frame_labels).mean()),
        "sound_acc": float((sound == labels).mean()),
        "agreement": float((same_class & stereo).mean()),
        "class_agreement": float(same_class.mean()),
        "stereo_agreement": float(stereo.mean()),
        "diversity": digits_metrics.feature_diversity(feats, frame_labels),
        # fewer clips: a bench's direct call; a run's evals are refused them in preflight
        **(sound_mel_kid(_test_clip_features(), clip_features(audio, sd.SAMPLE_RATE)) if n >= MIN_CLIPS else {}),
    }


KEYFRAME_TOLERANCE = sd.SPEED  # columns, exclusive: a clip that starts or ends one frame off misses


def ink_centres(frames: torch.Tensor) -> torch.Tensor:
    """Frames [..., H, W] -> the mean column of their lit pixels (above 0 of [-1, 1]: the digit's
    strokes, not a faint background), NaN where none is lit."""
    lit = (frames.float() > 0).float().sum(dim=-2)  # [..., W]
    count = lit.sum(-1)
    columns = torch.arange(frames.shape[-1], dtype=lit.dtype)
    return (lit * columns).sum(-1) / count.where(count > 0, torch.tensor(float("nan")))


@torch.no_grad()
def keyframe_figures(samples: torch.Tensor, keyframes: torch.Tensor, anchors: tuple[str, ...]) -> dict[str, float]:
    """How well flat H3 samples [N, D] keep the keyframes [N, K, H, W] they were given at ``anchors``:
    ``keyframe_agreement``, the share of keyframes whose digit the clip's frame at that end shows
    where the keyframe does (the centres of their strokes less than ``KEYFRAME_TOLERANCE`` columns,
    one frame's motion, apart; an end with no stroke disagrees), and ``keyframe_l1``, the mean
    absolute pixel difference of those frames from their keyframes (pixels in [-1, 1])."""
    frames, _ = sd.decode(samples)
    ends = frames[:, sd.keyframe_frames(anchors)]  # [N, K, H, W]
    near = (ink_centres(ends) - ink_centres(keyframes)).abs() < KEYFRAME_TOLERANCE  # NaN compares False
    return {"keyframe_agreement": float(near.float().mean()),
            "keyframe_l1": float((ends - keyframes.float()).abs().mean())}


def real_clip_stats(num_samples: int = 500, split: str = "train", seed: int = 0) -> dict[str, float]:
    """The metrics of real clips (by default train clips, scored against the held-out test
    digits as generated ones are): what a perfect generator would reach."""
    clips = sd.make_clips(split, seed)
    idx = torch.arange(min(num_samples, len(clips)))
    return evaluate_decoded(clips.frames[idx], clips.audio[idx], clips.labels[idx])
