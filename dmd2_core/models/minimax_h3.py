"""MiniMax-H3 (MiniMaxH3Transformer3DModel): joint video + audio in one packed sequence.

What differs from the project's flow-matching math, mapped here and nowhere else:

- **One sample is a video and its soundtrack.** The project's DMD2 code sees one flat latent per
  sample: the video latents [24, F, H, W] then the audio latents [2 (stereo), 32, L], both in the
  model's normalised latent space. ``segments`` names the two parts (per-modality normalisers,
  loss weights and metrics).
- **Two schedules.** The project's per-sample ``sigma`` is the schedule position ``u`` shared by
  both modalities (the grid ``linspace(1, 0, n)`` of ``MiniMaxH3Scheduler``); video sits at
  ``shift(u, 12)`` and audio at ``shift(u, 3)`` (the two schedulers' shifts), so every elementwise
  use of sigma goes through ``sigma_field``.
- **Velocity sign and time.** The transformer's velocity points to the data, ``x0 = x_t + s v``,
  and it takes ``t = 1 - s``; ``predict_velocity`` returns the project's ``eps - x0`` convention.
- **One layout per forward.** The batch axis of a forward is pure replication: its rows share one
  timestep set and one text length. A batch is split into groups of equal (u, text length), one
  forward each; rollouts (one u for the whole batch) stay batched, the critic's per-sample u runs
  item by item. Padding is not an option: the model has no attention mask.
- **Guidance-distilled.** One forward per step; no negative prompt, no guidance scale.
- **Deterministic student steps.** The student steps like ``MiniMaxH3Scheduler`` (Euler, eta 0:
  ``x_next = x0 + s_next / s * (x_t - x0)``), so diffusers' own modular pipeline with the student
  inside, ``num_inference_steps = K + 1``, reproduces the student's samples.

- **Workflows.** ``t2va`` conditions on text alone. ``fl2va`` conditions on keyframes too: a
  prompt set prepared with keyframes carries, per prompt, their clean VAE latents
  (``keyframe_latents`` [N, K, 24, 1, H, W]), which end each is anchored to (``keyframe_anchors``
  [N, K]: 0 first, 1 last) and the presentation's modality tags (``text_token_tags`` [N, T]: a
  keyframe's vision block is tagged video). The forward reads them from the condition dict, so
  the student, the teacher and the fake score see the same keyframes for a sample. As diffusers'
  fl2va blocks do, the keyframes become condition rows in front of the generated video rows,
  noised to ``t = 0.999`` and held at ``max(t, 0.999)``; the model's outputs on them are dropped,
  so no loss and no DMD gradient reaches them. An eval sample j draws as a request of seed
  ``s + j`` does, each keyframe's noise first and then the clip's (``eval_condition_noise``,
  ``eval_noise``), so the export loaded with ``workflow="fl2va"`` samples the eval's latents
  from the same inputs.
- ``ref2va`` conditions on references and distills the repository's other partition,
  ``transformer_ref/``. A prompt set prepared with references carries, per prompt, the image
  references' clean VAE latents (``reference_latents`` [N, I, 24, 1, h, w], at their own size),
  the audio references' normalised rows (``reference_audio_latents`` [N, A, 2 L, 32], channel-major,
  where there are any), their order (``reference_kinds`` [N, R]: 0 image, 1 audio) and the
  presentation's tags. As diffusers' ref2va blocks do, each reference is a block of condition rows
  in front of the generated ones (``build_ref2va_packed_sequence``): an image's video rows noised to
  0.999 and held at ``max(t, 0.999)``, an audio reference's rows clean and held at t = 1; the
  outputs on both are dropped. An eval sample j draws each image reference's noise from seed
  ``s + j`` before its clip's (``eval_condition_noise``). Video references are not encoded here:
  Qwen3-VL's video processor needs torchvision.

The packed layout and the per-row timesteps are built by diffusers' own blocks
(``MiniMaxH3PrepareLayoutStep.build_packed_sequence``, ``MiniMaxH3SetTimestepsStep
.build_row_timesteps``, ``patchify_video_latents``).
"""

from __future__ import annotations

import copy
import json
import math
from functools import cached_property
from typing import Any, Optional, Sequence

import torch

from dmd2_core import storage
from dmd2_core.errors import ArgsError
from dmd2_core.models.base import ModelFamily

FPS = 24
FRAMES_PER_CHUNK, LATENTS_PER_CHUNK = 17, 5  # the video VAE's clip_length and tokens per chunk
AUDIO_LATENTS_PER_SECOND = 40
AUDIO_CHANNELS = 2
AUDIO_LATENT_CHANNELS = 32
MIN_SECONDS, MAX_SECONDS = 5.0, 15.0
MIN_ASPECT, MAX_ASPECT = 1 / 4, 4.0
VIDEO_SHIFT, AUDIO_SHIFT = 12.0, 3.0
MODALITIES = ("video", "audio")  # ``shifts``' order, and each flat sample's
MODALITY_SCHEDULERS = {"video": "scheduler", "audio": "audio_scheduler"}  # the repository's folders
TEXT_TAG = 1
VIDEO_TAG, AUDIO_TAG = 0, 2
PIXEL_MEAN, PIXEL_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

WORKFLOWS = ("t2va", "fl2va", "ref2va")  # diffusers' MiniMaxH3Blocks._workflow_map
KEYFRAME_ANCHORS = ("first", "last")  # keyframe_anchors codes 0 and 1, diffusers' anchor names
KEYFRAME_KEYS = ("keyframe_latents", "keyframe_anchors", "text_token_tags")  # an fl2va prompt set's own keys
TEXT_COND_KEYS = ("prompt_embeds", "prompt_lengths")
# the keys each workflow conditions a sample on (``MiniMaxH3Family.sample_cond``)
REFERENCE_KINDS = ("image", "audio")  # reference_kinds codes 0 and 1 (a video reference: not encoded here)
REFERENCE_KEYS = ("reference_latents", "reference_kinds", "text_token_tags")  # a ref2va prompt set's own keys
REFERENCE_AUDIO = "reference_audio_latents"  # beside them where a set's references include sound
WORKFLOW_COND_KEYS = {"t2va": TEXT_COND_KEYS, "fl2va": (*TEXT_COND_KEYS, *KEYFRAME_KEYS),
                      "ref2va": (*TEXT_COND_KEYS, *REFERENCE_KEYS)}
WORKFLOW_TRANSFORMER = {"ref2va": "transformer_ref"}  # the repository partition a workflow distills (else transformer/)
EVAL_KEYFRAME_NOISE = "keyframe_noise"  # an eval sample's own draw of its keyframes' noise, beside its conditions
EVAL_REFERENCE_NOISE = "reference_noise"  # and of its image references' noise
# a set's noised conditions (noised to 0.999 as condition rows) -> the key of an eval sample's own draw of their noise
NOISED_CONDITIONS = {"keyframe_latents": EVAL_KEYFRAME_NOISE, "reference_latents": EVAL_REFERENCE_NOISE}
KEYFRAME_NOISE_AUG = 0.999  # the t a keyframe anchor is noised to and held at (pipe.keyframe_noise_aug)
# diffusers draws the anchors' 0.1 % of noise from the request's generator, before the clip's noise;
# training draws it once from this seed, so every forward of a sample (rollout, teacher, fake score)
# sees the same anchors; an eval sample j draws it as a request of seed + j does (``keyframe_noise``)
KEYFRAME_NOISE_SEED = 42


def workflow_problem(workflow: str) -> Optional[str]:
    """Why ``workflow`` is not one a MiniMax-H3 run distills, or None."""
    if workflow not in WORKFLOWS:
        from dmd2_core.args import nearest

        return f"workflow: '{workflow}' is not a MiniMax-H3 workflow{nearest(workflow, WORKFLOWS)} ({', '.join(WORKFLOWS)})"
    return None


def cond_workflow(cond: dict) -> str:
    """The workflow a batch's conditions were prepared for: the one whose own keys they hold."""
    return "fl2va" if "keyframe_latents" in cond else "ref2va" if "reference_latents" in cond else "t2va"


def reference_layout(kinds: Sequence[int], image_shape: Sequence[int], audio_rows: int) -> tuple:
    """One sample's references as its layout key holds them, in packed order: ('image', F, h, w)
    per image reference (its latents' frames and size) and ('audio', rows) per audio reference."""
    _, frames, height, width = (int(d) for d in image_shape)
    return tuple(("image", frames, height, width) if REFERENCE_KINDS[k] == "image" else ("audio", int(audio_rows))
                 for k in kinds)


def latent_frames(num_frames: int) -> int:
    """Latent frames of a ``17 n + 5`` frame clip: ``5 n + 2`` (diffusers' video_latent_num_frames)."""
    return (num_frames - LATENTS_PER_CHUNK) // FRAMES_PER_CHUNK * LATENTS_PER_CHUNK + 2


def pixel_frames(num_latent_frames: int) -> int:
    """The inverse: ``5 n + 2`` latent frames come from ``17 n + 5`` frames."""
    return (num_latent_frames - 2) // LATENTS_PER_CHUNK * FRAMES_PER_CHUNK + LATENTS_PER_CHUNK


def audio_latents(num_frames: int) -> int:
    """Audio latents per channel covering ``num_frames`` at 24 fps (diffusers' audio_latent_num_frames)."""
    return int(round(num_frames / FPS * AUDIO_LATENTS_PER_SECOND))


def nearest_multiples(value: int, multiple: int) -> str:
    """The positive multiples of ``multiple`` nearest ``value``: the one below and the one above
    (the closer first), or the smallest one when none is below."""
    below, above = value // multiple * multiple, (value // multiple + 1) * multiple
    if below <= 0:
        return str(multiple)
    return f"{below} or {above}" if value - below <= above - value else f"{above} or {below}"


def geometry_problem(num_frames: int, height: int, width: int, spatial_ratio: int = 16,
                     patch: tuple[int, int, int] = (1, 2, 2)) -> Optional[str]:
    """Why a (frames, height, width) request is not one MiniMax-H3 generates, or None."""
    if num_frames % FRAMES_PER_CHUNK != LATENTS_PER_CHUNK:
        up = num_frames + (LATENTS_PER_CHUNK - num_frames) % FRAMES_PER_CHUNK
        return f"num_frames: {num_frames} is not of the form 17n + 5 (the video VAE's chunks); nearest above: {up}"
    seconds = num_frames / FPS
    if not MIN_SECONDS <= seconds <= MAX_SECONDS:
        return (f"num_frames: {num_frames} frames are {seconds:.2f} s at {FPS} fps; MiniMax-H3 generates "
                f"{MIN_SECONDS:g}-{MAX_SECONDS:g} s ({int(MIN_SECONDS * FPS)}-{int(MAX_SECONDS * FPS)} frames)")
    multiple = spatial_ratio * patch[2]
    for name, value in (("height", height), ("width", width)):
        if value <= 0 or value % multiple:
            return (f"{name}: {value} is not a positive multiple of {multiple} (VAE x{spatial_ratio} times patch "
                    f"{patch[2]}); nearest: {nearest_multiples(value, multiple)}")
    aspect = width / height
    if not MIN_ASPECT <= aspect <= MAX_ASPECT:
        return f"width: {width}x{height} has aspect ratio {aspect:g}; MiniMax-H3 supports 1:4 to 4:1"
    return None


# ---- clips and their latents (the CLI's num_frames / height / width) -----------------------------

def spatial_ratio(teacher: dict[str, Any]) -> int:
    """The video VAE's spatial compression (16 for MiniMax-H3's), from its config."""
    if not teacher.get("vae_url"):
        return 16
    config = json.loads(storage.read_text(storage.join(teacher["vae_url"], "config.json")))
    return int(math.prod(config.get("spatial_downsample_factors") or [16]))



def clip_latent_shape(num_frames: int, height: int, width: int, teacher: dict[str, Any]) -> list[int]:
    """The video latents [C, F, H, W] of a MiniMax-H3 clip of ``num_frames`` frames of
    ``height`` x ``width`` (``teacher``: ``describe_model_dir``'s answer); ArgsError naming the
    key when the model does not generate that clip."""
    ratio = spatial_ratio(teacher)
    problem = geometry_problem(num_frames, height, width, ratio)
    if problem:
        raise ArgsError(problem)
    config = json.loads(storage.read_text(storage.join(teacher["transformer_url"], "config.json")))
    return [int(config.get("in_channels", 24)), latent_frames(num_frames), height // ratio, width // ratio]



def clip_latent_shape_agreeing(clip: tuple[int, int, int], latent_shape: Optional[list[int]], teacher: dict) -> list[int]:
    """The video latents of ``clip`` (num_frames, height, width); a ``latent_shape`` set beside it must agree."""
    shape = clip_latent_shape(*clip, teacher)
    if latent_shape and list(latent_shape) != shape:
        raise ArgsError(f"latent_shape: {list(latent_shape)} disagrees with num_frames/height/width ({shape}); "
                        "set one of them")
    return shape



def latent_shape_problem(latent_shape: list[int], teacher: dict[str, Any]) -> Optional[str]:
    """Why a video ``latent_shape`` [C, F, H, W] is not the latents of a clip MiniMax-H3 makes, or None."""
    _, frames, height, width = (list(latent_shape) + [0] * 4)[:4]
    ratio = spatial_ratio(teacher)
    problem = geometry_problem(pixel_frames(frames), height * ratio, width * ratio, ratio)
    if problem or (frames - 2) % LATENTS_PER_CHUNK:
        return problem or "latent frames must be 5n + 2"
    return None


def shifted(u: torch.Tensor, shift: float) -> torch.Tensor:
    """``MiniMaxH3Scheduler``'s shift, in float32 as it computes it."""
    u = u.float()
    return shift * u / (1 + (shift - 1) * u)


class MiniMaxH3Family(ModelFamily):
    class_name = "MiniMaxH3Transformer3DModel"
    pipeline_class = "MiniMaxH3ModularPipeline"
    cond_keys = TEXT_COND_KEYS  # every workflow's; fl2va's own keys come with its prompt set (``sample_cond``)
    is_video = True
    has_audio = True
    guidance_distilled = True
    deterministic_student = True
    modular_pipeline = True
    fixed_shift = 1.0  # the project's sigma is the shared schedule position u
    vae_class = "AutoencoderKLMiniMaxH3"
    audio_vae_class = "AutoencoderKLMiniMaxH3Audio"
    fps = FPS
    vae_params, vae_spatial_ratio, decode_chunk_frames = 500_000_000, 16, FRAMES_PER_CHUNK
    time_embedding = "time_embedder"
    default_text_tokens = 256
    keep_fp32_modules = True  # proj_in/out, time embedder and rope stay fp32 (the checkpoint's own precision)
    context_parallel = True  # diffusers' plan splits the packed sequence (video, audio and text rows)

    def __init__(self, latent_shape: Optional[list[int]] = None, patch_size=(1, 2, 2),
                 shifts: tuple[float, float] = (VIDEO_SHIFT, AUDIO_SHIFT), keyframes: int = 0,
                 references: tuple = (), scheduler_shifts: Optional[tuple[float, float]] = None):
        self.latent_shape = tuple(int(d) for d in latent_shape) if latent_shape else None
        self.patch_size = tuple(int(p) for p in patch_size)
        self.shifts = tuple(float(s) for s in shifts)  # what this family steps and noises at
        # the checkpoint's schedulers' (the teacher's pairs of noise levels), whatever a student steps on
        self.scheduler_shifts = tuple(float(s) for s in scheduler_shifts or shifts)
        # per sample, for the plan (the forward reads the cond's): keyframes (fl2va), references (ref2va:
        # ``reference_layout``'s tuple)
        self.keyframes = int(keyframes)
        self.references = tuple(references)
        self._layouts: dict[tuple, tuple] = {}

    # ---- geometry -------------------------------------------------------------------------------
    def bind(self, latent_shape, model=None, shifts=None, keyframes: Optional[int] = None,
             references: Optional[tuple] = None) -> "MiniMaxH3Family":
        """This family for one clip geometry (video latents [24, F, H, W]; the audio follows) and,
        for the plan, ``keyframes`` condition frames (fl2va) or ``references`` (ref2va:
        ``reference_layout``'s tuple) per sample (each kept when None)."""
        if not latent_shape:
            raise ValueError("latent_shape: MiniMax-H3 needs the clip geometry (num_frames, height, width or "
                             "latent_shape [24, F, H, W])")
        patch = tuple(model.config.patch_size) if model is not None else self.patch_size
        return MiniMaxH3Family(latent_shape, patch, shifts or self.shifts,
                               self.keyframes if keyframes is None else keyframes,
                               self.references if references is None else references,
                               None if shifts else self.scheduler_shifts)

    def pixel_frames(self, latent_frames: int) -> int:
        return pixel_frames(latent_frames)

    def clip_latent_shape(self, clip: tuple[int, int, int], latent_shape, teacher: dict) -> list[int]:
        return clip_latent_shape_agreeing(clip, latent_shape, teacher)

    def latent_shape_problem(self, latent_shape: list[int], teacher: dict) -> Optional[str]:
        return latent_shape_problem(latent_shape, teacher)

    @property
    def video_shape(self) -> tuple[int, int, int, int]:
        if self.latent_shape is None:
            raise ValueError("MiniMaxH3Family is not bound to a clip geometry (family.bind(latent_shape))")
        return self.latent_shape  # type: ignore[return-value]

    @property
    def num_frames(self) -> int:
        return pixel_frames(self.video_shape[1])

    @property
    def audio_shape(self) -> tuple[int, int, int]:
        return (AUDIO_CHANNELS, AUDIO_LATENT_CHANNELS, audio_latents(self.num_frames))

    @cached_property
    def segments(self) -> dict[str, slice]:
        video = math.prod(self.video_shape)
        return {"video": slice(0, video), "audio": slice(video, video + math.prod(self.audio_shape))}

    def sample_shape(self, model, latent_shape=None):
        family = self.bind(latent_shape or self.latent_shape, model)
        return (family.segments["audio"].stop,)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat samples [B, D] -> video latents [B, 24, F, H, W], audio latents [B, 2, 32, L]."""
        seg = self.segments
        return (x[:, seg["video"]].reshape(-1, *self.video_shape), x[:, seg["audio"]].reshape(-1, *self.audio_shape))

    def join(self, video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)

    # ---- the two schedules ------------------------------------------------------------------------
    def sigma_field(self, sigma, like: torch.Tensor) -> torch.Tensor:
        """Per-element sigma [B, D]: video at shift(u, 12), audio at shift(u, 3)."""
        u = torch.as_tensor(sigma, dtype=torch.float32, device=like.device).reshape(-1, 1)
        seg = self.segments
        video = shifted(u, self.shifts[0]).expand(-1, seg["video"].stop)
        audio = shifted(u, self.shifts[1]).expand(-1, seg["audio"].stop - seg["audio"].start)
        return torch.cat([video, audio], dim=1).expand(like.shape[0], -1)

    def stepping_at(self, shifts: Optional[dict[str, float]]) -> "MiniMaxH3Family":
        """This family with the student's steps at its own shift of u per modality named in ``shifts``
        (``student_modality_shifts``; the export's schedulers carry them). Itself when ``shifts``
        changes nothing."""
        return self._at_shifts(shifts, self.shifts)

    def drawing_at(self, shifts: Optional[dict[str, float]]) -> "MiniMaxH3Family":
        """This family with a modality's noise at its own shift of the shared u (``dmd2_modality_shifts``),
        the others at the schedulers' (whatever the student steps on): where the critic trains and
        the DMD gradient is taken, the teacher's own pairs of noise levels unless told otherwise."""
        return self._at_shifts(shifts, self.scheduler_shifts)

    def _at_shifts(self, shifts: Optional[dict[str, float]], base: tuple[float, float]) -> "MiniMaxH3Family":
        wanted = tuple(float((shifts or {}).get(name, s)) for name, s in zip(MODALITIES, base))
        if wanted == self.shifts:
            return self
        changed = copy.copy(self)
        changed.shifts = wanted
        return changed

    def modality_sigmas(self, u: float) -> tuple[float, float]:
        t = torch.tensor([u], dtype=torch.float32)
        return float(shifted(t, self.shifts[0])), float(shifted(t, self.shifts[1]))

    # ---- a sample's conditions ------------------------------------------------------------------
    def sample_cond(self, cond: dict) -> dict:
        """The entries of ``cond`` a sample is conditioned on: its workflow's keys
        (``WORKFLOW_COND_KEYS``, of ``cond_workflow``: fl2va where ``cond`` holds keyframes, ref2va
        where it holds references), the audio references' rows where it holds them, and an eval
        sample's own condition noise where it holds one (``keyframe_noise`` / ``reference_noise``:
        without it the forward noises the conditions with the fixed training draw)."""
        keys = WORKFLOW_COND_KEYS[cond_workflow(cond)]
        extra = (REFERENCE_AUDIO, *NOISED_CONDITIONS.values())
        return {k: cond[k] for k in (*keys, *extra) if k in keys or k in cond}

    def workflow_cond_keys(self, workflow: str) -> tuple[str, ...]:
        return WORKFLOW_COND_KEYS[workflow]

    def layout_keys(self, cond: dict, n: int) -> list[tuple]:
        """Each sample's packed layout (text length, the text rows' tags or None, its conditions:
        the keyframes' anchors, or its references as ``reference_layout`` gives them):
        ``_layout``'s key with its text length. Samples of one key (and one u) share a forward."""
        lengths = cond["prompt_lengths"].reshape(-1).long().tolist()
        tags = [tuple(row[:length]) for row, length in zip(cond["text_token_tags"].long().tolist(), lengths)] \
            if "text_token_tags" in cond else [None] * n
        if "keyframe_latents" in cond:
            conditions = [tuple(KEYFRAME_ANCHORS[a] for a in row) for row in cond["keyframe_anchors"].long().tolist()]
        elif "reference_latents" in cond:
            audio_rows = cond[REFERENCE_AUDIO].shape[2] if REFERENCE_AUDIO in cond else 0
            image_shape = cond["reference_latents"].shape[2:]
            conditions = [reference_layout(row, image_shape, audio_rows) for row in cond["reference_kinds"].long().tolist()]
        else:
            conditions = [()] * n
        return list(zip(lengths, tags, conditions))

    # ---- the forward ------------------------------------------------------------------------------
    def _layout(self, text_tags: tuple[int, ...], conditions: tuple = ()) -> tuple:
        """diffusers' layout for this geometry, the text rows' modality tags and the sample's
        conditions (cached): t2va / fl2va's ``[text | keyframes | audio | video]`` (``conditions``:
        the keyframes' anchors) or ref2va's ``[text | references | audio | video]`` (``conditions``:
        ``reference_layout``'s tuple). (position ids, tags, video rows, audio rows, text rows, the
        leading video rows that are conditions, the leading audio rows that are.)"""
        key = (text_tags, conditions)
        if key not in self._layouts:
            from diffusers.modular_pipelines.minimax_h3.before_denoise import (
                MiniMaxH3PrepareLayoutStep,
                MiniMaxH3Ref2VAPrepareLayoutStep,
            )

            _, frames, height, width = self.video_shape
            tags = torch.tensor(text_tags, dtype=torch.long)
            if conditions and isinstance(conditions[0], tuple):
                from types import SimpleNamespace

                references = [SimpleNamespace(kind=c[0], has_audio=c[0] == "audio") for c in conditions]
                images = [torch.empty((1, 0, *c[1:]), device="meta") for c in conditions if c[0] == "image"]
                sounds = [torch.empty((c[1], 0), device="meta") for c in conditions if c[0] == "audio"]
                self._layouts[key] = MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
                    tags, references, images, sounds, frames, height, width, self.audio_shape[2], self.patch_size,
                    AUDIO_CHANNELS, AUDIO_TAG, VIDEO_TAG)
            else:
                self._layouts[key] = (*MiniMaxH3PrepareLayoutStep.build_packed_sequence(
                    tags, frames, height, width, self.audio_shape[2], self.patch_size, AUDIO_CHANNELS, AUDIO_TAG,
                    VIDEO_TAG, conditions)[:6], 0)
        return self._layouts[key]

    def feature_tokens(self, text_tokens: int, layout: tuple = ()) -> dict[str, torch.Tensor]:
        """The packed sequence's generated video and audio rows; text and condition rows (keyframes,
        references) are in neither. ``layout``: (text tags, conditions), the rest of a
        ``layout_keys`` key (none: t2va's layout)."""
        tags, conditions = layout or (None, ())
        _, _, video_idx, audio_idx, _, video_conditions, audio_conditions = self._layout(
            tags or (TEXT_TAG,) * int(text_tokens), conditions)
        return {"video": video_idx[video_conditions:], "audio": audio_idx[audio_conditions:]}

    def judged_rows(self, text_tokens: int, layout: tuple = (), modalities: Optional[Sequence[str]] = None) -> Optional[torch.Tensor]:
        """The rows the GAN head judges: the text rows and the generated ones (``feature_tokens``) of
        ``modalities`` (default both), never a sample's condition rows, keyframes or references (given,
        not generated: a head judging them would partly tell real from fake by the conditions); None where that is
        every row (t2va: the whole sequence, as the head has always seen it)."""
        tags, conditions = layout or (None, ())
        _, all_tags, _, _, text_idx, _, _ = self._layout(tags or (TEXT_TAG,) * int(text_tokens), conditions)
        generated = self.feature_tokens(text_tokens, layout)
        rows = torch.cat([text_idx, *(generated[m] for m in modalities or generated)]).sort().values
        return None if rows.numel() == all_tags.numel() else rows

    def _rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

        video, audio = self.split(x)
        n = x.shape[0]
        video_rows = patchify_video_latents(video, self.patch_size).reshape(n, -1, video.shape[1] * math.prod(self.patch_size))
        audio_rows = audio.permute(0, 1, 3, 2).reshape(n, -1, AUDIO_LATENT_CHANNELS)  # channel-major rows
        return video_rows, audio_rows

    def _unrows(self, video_rows: torch.Tensor, audio_rows: torch.Tensor) -> torch.Tensor:
        """The inverse of ``_rows`` (diffusers' MiniMaxH3AfterDenoiseStep)."""
        channels, frames, height, width = self.video_shape
        pt, ph, pw = self.patch_size
        n = video_rows.shape[0]
        video = video_rows.reshape(n, frames // pt, height // ph, width // pw, channels, pt, ph, pw)
        video = video.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(n, channels, frames, height, width)
        audio = audio_rows.reshape(n, AUDIO_CHANNELS, -1, AUDIO_LATENT_CHANNELS).permute(0, 1, 3, 2)
        return self.join(video, audio)

    def condition_rows(self, latents: torch.Tensor, noise: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Clean condition latents [n, K, 24, 1, H, W] (fl2va's keyframes, ref2va's image references)
        -> the condition rows [n, K * H W / patch, 24 * patch] that lead the video rows: each noised
        to t = 0.999 as diffusers' ``scale_noise`` mixes it (``keyframe_noise_aug``, in float32).
        ``noise`` [n, K, 24, 1, H, W]: each sample's own draws (an eval sample's, as its request draws
        them: ``eval_condition_noise``); None: one fixed draw per condition (``KEYFRAME_NOISE_SEED``),
        the same for every sample."""
        from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

        n, k = latents.shape[:2]
        if noise is None:
            g = torch.Generator().manual_seed(KEYFRAME_NOISE_SEED)
            noise = torch.stack([torch.randn(latents.shape[2:], generator=g) for _ in range(k)])
        t = torch.tensor(KEYFRAME_NOISE_AUG, dtype=torch.float32)
        noised = t * latents.float() + (1.0 - t) * noise.float().to(latents.device)
        rows = patchify_video_latents(noised.flatten(0, 1), self.patch_size)
        return rows.reshape(n, -1, rows.shape[-1])

    def _forward_group(self, model, x_t: torch.Tensor, u: float, text: torch.Tensor,
                       text_tags: Optional[tuple[int, ...]] = None, conditions: tuple = (),
                       video_conditions: Optional[torch.Tensor] = None,
                       audio_conditions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One forward of rows sharing (u, text length, text tags, conditions): the model's data-ward
        velocity on the generated rows, flat. ``video_conditions`` [n, rows, 24 * patch] (keyframes'
        or image references' noised rows: ``condition_rows``) lead the video rows and
        ``audio_conditions`` [n, rows, 32] (audio references' clean rows) the audio rows, where the
        layout of ``conditions`` has them; the outputs on both are dropped."""
        from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep

        device = x_t.device
        text_tags = text_tags or (TEXT_TAG,) * text.shape[1]
        position_ids, tags, video_idx, audio_idx, text_idx, video_rows_given, audio_rows_given = \
            self._layout(text_tags, conditions)
        s_video, s_audio = self.modality_sigmas(u)
        t_video = float(1.0 - torch.tensor(s_video, dtype=torch.float32))
        t_audio = float(1.0 - torch.tensor(s_audio, dtype=torch.float32))
        timestep, timestep_idx = MiniMaxH3SetTimestepsStep.build_row_timesteps(
            video_idx, audio_idx, video_rows_given, audio_rows_given, text.shape[1], t_video, t_audio,
            max(t_video, KEYFRAME_NOISE_AUG), 1.0)
        video_rows, audio_rows = self._rows(x_t.float())
        if video_rows_given:
            video_rows = torch.cat([video_conditions.float().to(device), video_rows], dim=1)
        if audio_rows_given:
            audio_rows = torch.cat([audio_conditions.float().to(device), audio_rows], dim=1)
        v_video, v_audio = model(
            hidden_states=video_rows, audio_hidden_states=audio_rows, encoder_hidden_states=text,
            timestep=timestep.to(device), timestep_indices=timestep_idx.to(device), token_tags=tags.to(device),
            position_ids=position_ids.to(device), video_indices=video_idx.to(device),
            audio_indices=audio_idx.to(device), text_indices=text_idx.to(device), return_dict=False)
        return self._unrows(v_video[:, video_rows_given:].float(), v_audio[:, audio_rows_given:].float())

    def forward_groups(self, sigma, cond: dict, n: int) -> list[tuple[list[int], tuple]]:
        """One forward per (u, ``layout_keys`` key), in the order of their first samples; under a
        sharded model one per sample (its forward is a collective: every rank must run as many as
        the others, and micro-batches are equal on every rank)."""
        u = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1).expand(n).tolist()
        sharded = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        groups: dict[tuple, list[int]] = {}
        for i, key in enumerate(zip(u, self.layout_keys(cond, n))):
            groups.setdefault((i, *key) if sharded else key, []).append(i)
        return [(rows, key[-1]) for key, rows in groups.items()]

    def predict_velocity(self, model, x_t, sigma, cond):
        """The project's velocity ``eps - x0`` (fp32): minus H3's data-ward velocity. An fl2va
        condition (``keyframe_latents``, ``keyframe_anchors``, ``text_token_tags``) conditions each
        sample on its own keyframes, a ref2va one (``reference_latents``, ``reference_kinds``, the
        audio references' rows, ``text_token_tags``) on its own references; the noised conditions
        with the sample's ``keyframe_noise`` / ``reference_noise`` where the cond holds one (an
        eval's) and with the fixed training draw where not."""
        n = x_t.shape[0]
        u = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1).expand(n).tolist()
        text = cond["prompt_embeds"].to(x_t.device)
        noised = next((key for key in NOISED_CONDITIONS if key in cond), None)
        noise = NOISED_CONDITIONS.get(noised)

        def pick(key, index):
            return cond[key].index_select(0, index.to(cond[key].device)) if key in cond else None

        order, parts = [], []
        for rows, (length, tags_i, conditions) in self.forward_groups(sigma, cond, n):
            index = torch.tensor(rows, device=x_t.device)
            video_conditions = self.condition_rows(pick(noised, index), pick(noise, index)) if conditions else None
            audio = pick(REFERENCE_AUDIO, index) if conditions else None
            parts.append(self._forward_group(model, x_t.index_select(0, index), u[rows[0]],
                                             text.index_select(0, index)[:, :length], tags_i, conditions,
                                             video_conditions, None if audio is None else audio.flatten(1, 2)))
            order += rows
        v = parts[0] if len(parts) == 1 else torch.cat(parts)
        if order != sorted(order):
            v = v[torch.argsort(torch.tensor(order, device=x_t.device))]
        return -v

    # ---- decoding ---------------------------------------------------------------------------------
    def decode_flops(self, vae_url: str, latent_shape) -> int:
        """One clip's decode: the video VAE's (per temporal chunk and spatial tile, each shape
        counted once: ``count_decode``) and the audio VAE's, built from their configs as shipped
        (the audio VAE's ``latents_mean`` may be null: the unscaling is left out, as everywhere in
        the count)."""
        from dmd2_core import storage
        from dmd2_core.models.base import count_decode, meta_vae

        family = self.bind(list(latent_shape))
        video = meta_vae(self.vae_class, vae_url)
        audio = meta_vae(self.audio_vae_class, storage.join(vae_url.rstrip("/").rsplit("/", 1)[0], "audio_vae"))
        with torch.device("meta"):
            video_latents = torch.randn(1, *family.video_shape)
            audio_latents = torch.randn(*family.audio_shape)  # the mono VAE takes the two channels as items
        return (count_decode(video, lambda: video.decode(video_latents, return_dict=False))
                + count_decode(audio, lambda: audio.decode(audio_latents, return_dict=False)))

    def load_vae(self, url: str, dtype: torch.dtype) -> torch.nn.Module:
        """The video VAE and, beside it, the audio VAE (``audio_vae/``), as one module."""
        import diffusers

        from dmd2_core import storage

        with storage.local_copy(url) as local:
            video = diffusers.AutoencoderKLMiniMaxH3.from_pretrained(str(local), torch_dtype=dtype, use_safetensors=True)
        audio_url = storage.join(url.rstrip("/").rsplit("/", 1)[0], "audio_vae")
        with storage.local_copy(audio_url) as local:
            audio = diffusers.AutoencoderKLMiniMaxH3Audio.from_pretrained(str(local), torch_dtype=dtype,
                                                                          use_safetensors=True)
        return torch.nn.ModuleDict({"video": video.eval(), "audio": audio.eval()})

    @torch.no_grad()
    def decode(self, vae, latents):
        """Flat samples -> {'video': [B, 3, F, H, W] in [-1, 1], 'audio': [B, 2, S] in [-1, 1],
        'sample_rate', 'fps'} as diffusers' decode steps produce them; without VAEs, the latents."""
        video_latents, audio_lat = self.split(latents.float())
        if vae is None:
            return {"video": video_latents, "audio": audio_lat.flatten(2), "sample_rate": AUDIO_LATENTS_PER_SECOND,
                    "fps": FPS}
        videos, sounds = [], []
        for v, a in zip(video_latents, audio_lat):  # one clip at a time, as the pipeline decodes
            videos.append(self._decode_video(vae["video"], v[None]))
            sounds.append(self._decode_audio(vae["audio"], a))
        return {"video": torch.cat(videos), "audio": torch.stack(sounds),
                "sample_rate": int(vae["audio"].config.sampling_rate), "fps": FPS}

    @staticmethod
    def _decode_video(vae, latents):
        dtype = next(vae.parameters()).dtype
        cfg = vae.config
        mean = torch.tensor(cfg.latents_mean, device=latents.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(cfg.latents_std, device=latents.device).view(1, -1, 1, 1, 1)
        video = vae.decode((latents * std + mean).to(dtype), return_dict=False)[0].float()
        pixel_mean = torch.tensor(PIXEL_MEAN, device=video.device).view(1, -1, 1, 1, 1)
        pixel_std = torch.tensor(PIXEL_STD, device=video.device).view(1, -1, 1, 1, 1)
        return ((video * pixel_std + pixel_mean).clamp(0, 1) * 2 - 1)

    @staticmethod
    def _decode_audio(vae, latents):
        """[2, 32, L] normalised latents -> [2, S] waveform (the mono VAE takes the channels as items)."""
        dtype = next(vae.parameters()).dtype
        cfg = vae.config
        mean = torch.tensor(cfg.latents_mean, device=latents.device).view(1, -1, 1)
        std = torch.tensor(cfg.latents_std, device=latents.device).view(1, -1, 1)
        audio = vae.decode((latents * std + mean).to(dtype), return_dict=False)[0].float()
        return audio[:, 0].clamp(-1, 1)

    @torch.no_grad()
    def encode_clip(self, vae, pixels: torch.Tensor, waveform: torch.Tensor) -> torch.Tensor:
        """A real clip -> its flat normalised latents [1, D] (posterior means): pixels [3, F, H, W] in
        [-1, 1] and a stereo waveform [2, S] at the audio VAE's rate."""
        video_vae, audio_vae = vae["video"], vae["audio"]
        dtype = next(video_vae.parameters()).dtype
        pixel_mean = torch.tensor(PIXEL_MEAN, device=pixels.device).view(-1, 1, 1, 1)
        pixel_std = torch.tensor(PIXEL_STD, device=pixels.device).view(-1, 1, 1, 1)
        normalised = ((pixels.float() + 1) / 2 - pixel_mean) / pixel_std
        z = video_vae.encode(normalised[None].to(dtype)).latent_dist.mode().float()
        cfg = video_vae.config
        z = (z - torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)) / torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)
        a = audio_vae.encode(waveform.float()[:, None].to(next(audio_vae.parameters()).dtype)).latent_dist.mode().float()
        acfg = audio_vae.config
        a = (a - torch.tensor(acfg.latents_mean).view(1, -1, 1)) / torch.tensor(acfg.latents_std).view(1, -1, 1)
        length = self.audio_shape[2]
        a = torch.nn.functional.pad(a, (0, max(0, length - a.shape[-1])))[..., :length]
        return self.join(z, a[None])

    # ---- eval noise, as the modular pipeline draws it --------------------------------------------
    def eval_noise(self, n: int, seed: int, conditions: Sequence[tuple] = ()) -> torch.Tensor:
        """Sample j's initial noise is what ``MiniMaxH3PrepareLatentsStep`` draws from
        ``torch.Generator().manual_seed(seed + j)``: the video latents, then the audio rows; a
        request with noised conditions (``conditions``: each one's latent shape, fl2va's keyframes
        or ref2va's image references) draws their noise first, one draw each
        (``MiniMaxH3PrepareConditionLatentsStep``), so its clip's noise comes after those."""
        return torch.cat([self._request_draws(seed + j, conditions)[1] for j in range(n)])

    def eval_condition_noise(self, n: int, seed: int, conditions: Sequence[tuple]) -> torch.Tensor:
        """Sample j's condition noise [n, K, *shape], the draws a request of seed + j makes before
        its clip's (``eval_noise``): the cond's ``keyframe_noise`` / ``reference_noise`` of an eval."""
        return torch.stack([self._request_draws(seed + j, conditions)[0] for j in range(n)])

    def _request_draws(self, seed: int, conditions: Sequence[tuple]) -> tuple[torch.Tensor, torch.Tensor]:
        """One request's draws from ``torch.Generator().manual_seed(seed)``, in diffusers' order:
        each noised condition's noise at its latent shape ([K, 24, 1, h, w]: one latent frame each),
        then the clip's video latents and audio rows (flat [1, D])."""
        g = torch.Generator().manual_seed(seed)
        condition_noise = torch.stack([torch.randn(tuple(shape), generator=g) for shape in conditions]) \
            if conditions else torch.zeros(0)
        video = torch.randn((1, *self.video_shape), generator=g)
        audio_rows = torch.randn((self.audio_shape[2] * AUDIO_CHANNELS, AUDIO_LATENT_CHANNELS), generator=g)
        audio = audio_rows.reshape(AUDIO_CHANNELS, -1, AUDIO_LATENT_CHANNELS).permute(0, 2, 1)
        return condition_noise, self.join(video, audio[None])

    # ---- for the memory plan ----------------------------------------------------------------------
    def tokens(self, config, sample_shape):
        family = self if self.latent_shape else None
        if family is None:
            raise ValueError("MiniMax-H3 tokens need the clip geometry")
        _, frames, height, width = self.video_shape
        pt, ph, pw = config.get("patch_size", self.patch_size)
        keyframe_rows = self.keyframes * (height // ph) * (width // pw)  # fl2va: one frame of rows each
        reference_rows = sum(c[1] // pt * (c[2] // ph) * (c[3] // pw) if c[0] == "image" else c[1]
                             for c in self.references)  # ref2va: each reference's block
        return ((frames // pt) * (height // ph) * (width // pw) + keyframe_rows + reference_rows
                + AUDIO_CHANNELS * self.audio_shape[2])

    def split_tokens(self, config, sample_shape, text_tokens):
        return self.tokens(config, sample_shape) + text_tokens

    def activation_elements(self, config, image_tokens, text_tokens):
        d = config["hidden_size"]
        inner = config["num_attention_heads"] * config["attention_head_dim"]
        # per row: norm1 and its modulation, q/k/v and their norms and rotations (inner wide),
        # attention out, norm2 and its modulation, SwiGLU input, gate and up projections and
        # their product, residual adds
        return (image_tokens + text_tokens) * (6 * d + 7 * inner + 3 * config["ffn_dim"])

    def feature_dim(self, model):
        return model.config.hidden_size
