"""A tiny MiniMax-H3 repository and the diffusers-native ways to run it.

MiniMax-H3 (joint video + audio) ships in diffusers only as a *modular* pipeline
(``MiniMaxH3ModularPipeline`` over ``MiniMaxH3Blocks``), so its repository is indexed by a
``modular_model_index.json``. ``build_tiny_h3_repository`` writes one with the released layout
(``transformer/``, ``transformer_ref/`` (ref2va's partition), ``vae/``, ``audio_vae/``, ``scheduler/``,
``audio_scheduler/``, ``text_encoder/``, ``tokenizer/``) and tiny seeded random components, produced
by the pipeline's own ``save_pretrained``.

Pitfalls this module works around:

* The index is made portable: ``save_pretrained`` records the (temporary) save directory as every
  component's ``pretrained_model_name_or_path``. The entries are rewritten to ``null``: when a
  repository is loaded from a local directory, diffusers points every component whose files are
  present there at that directory (``_is_local_component``), whatever the index says, so ``null``
  means "this repository" and the directory can be copied, moved or uploaded (and its
  ``transformer/`` replaced by a student's) without dangling paths.
* ``Qwen3VLProcessor`` cannot be constructed here: its video processor (``Qwen3VLVideoProcessor``)
  requires torchvision, which is absent. The ``processor`` component is therefore omitted from the
  stand-in (its index entry stays, with no files; ``load_components`` skips it). The only thing the
  t2va text path uses it for is ``processor.create_mm_token_type_ids`` (inside diffusers'
  ``get_qwen3vl_prompt_embeds``); :class:`TokenTypeProcessor` provides exactly that, running
  transformers' own ``ProcessorMixin.create_mm_token_type_ids`` over the tokenizer's vision pad ids.
* A diffusers-loadable ``model_index.json`` is no alternative: from a plain ``model_index.json`` whose
  ``_class_name`` is ``MiniMaxH3ModularPipeline``, ``ModularPipeline.from_pretrained`` resolves the
  generic ``ModularPipeline`` and fails ("No pipeline blocks could be resolved").
* ``Qwen2TokenizerFast`` (= ``Qwen2Tokenizer`` in transformers 5) rebuilds its backend from vocab and
  merges on load, so the word-level vocabulary is expressed as byte-level BPE merges (see
  :func:`_tokenizer`). Unlike Qwen's, this tokenizer adds a prefix space, so the first word of a
  prompt is the same token as any other occurrence.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch

from dmd2_core import storage

TEXT_DIM = 32
TEXT_ENCODER_LAYERS = 51  # diffusers reads hidden_states[50] and refuses a stack of <= 50 layers
TEXT_ENCODER_LAYER = 50
VIDEO_LATENT_CHANNELS = 24
AUDIO_LATENT_CHANNELS = 32

# Qwen's special tokens, in Qwen's order (their ids follow the word vocabulary here).
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
    "<|video_pad|>",
]

TOKENIZER_WORDS = (
    "zero one two three four five six seven eight nine ten "
    "red green blue yellow orange purple pink white black gray brown "
    "cat dog bird fish horse cow sheep lion tiger bear mouse rabbit duck frog cats dogs birds horses "
    "moving left right up down fast slow still jumping running walking flying swimming spinning "
    "tone high low loud quiet beep music voice noise silence "
    "a an the and of on in with to at is are small big large circle square ball box video sound "
    "background foreground scene camera"
).split()
PUNCTUATION = list(",.!?:;'-")

BYTE_LEVEL_SPACE = "\u0120"  # how the byte-level pre-tokenizer spells a leading space ("Ġ")


# --------------------------------------------------------------------------------------------
# components
# --------------------------------------------------------------------------------------------


def _transformer():
    from diffusers import MiniMaxH3Transformer3DModel

    return MiniMaxH3Transformer3DModel(
        num_attention_heads=2, attention_head_dim=16, hidden_size=32, num_layers=2, num_refiner_layers=1,
        ffn_dim=64, in_channels=VIDEO_LATENT_CHANNELS, audio_in_channels=AUDIO_LATENT_CHANNELS, patch_size=(1, 2, 2),
        text_dim=TEXT_DIM, freq_dim=32, time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=2,
    )


def _latent_stats(n: int, generator: torch.Generator) -> tuple[list[float], list[float]]:
    """Non-trivial per-channel normalisation: mean in [-0.5, 0.5], std in [0.5, 1.5]."""
    mean = (torch.rand(n, generator=generator) - 0.5).tolist()
    std = (torch.rand(n, generator=generator) + 0.5).tolist()
    return [round(v, 6) for v in mean], [round(v, 6) for v in std]


def _video_vae(generator: torch.Generator):
    from diffusers import AutoencoderKLMiniMaxH3

    mean, std = _latent_stats(VIDEO_LATENT_CHANNELS, generator)
    return AutoencoderKLMiniMaxH3(
        latent_channels=VIDEO_LATENT_CHANNELS, block_out_channels=(8, 8, 8, 8, 8, 8), layers_per_block=1,
        norm_num_groups=4, decoder_num_layers=1, decoder_num_attention_heads=2, decoder_attention_head_dim=8,
        decoder_num_register_tokens=1, decoder_ffn_mult=1, latents_mean=mean, latents_std=std,
    )


def _audio_vae(generator: torch.Generator):
    from diffusers import AutoencoderKLMiniMaxH3Audio

    mean, std = _latent_stats(AUDIO_LATENT_CHANNELS, generator)
    return AutoencoderKLMiniMaxH3Audio(
        encoder_dim=4, latent_dim=32, latent_channels=AUDIO_LATENT_CHANNELS, num_attention_heads=2, decoder_dim=128,
        resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1,),), latents_mean=mean, latents_std=std,
    )


def _tokenizer():
    """A word-level vocabulary as a real ``Qwen2TokenizerFast`` (byte-level BPE).

    Qwen2Tokenizer rebuilds its backend from vocab + merges on load (its own NFC normaliser, Qwen's
    split regex and a byte-level pre-tokenizer), so a custom pre-tokenizer would not survive
    ``from_pretrained``; the words are made single tokens through the BPE itself instead. With
    ``add_prefix_space=True`` every word reaches the BPE as ``Ġword``, and the merges only ever
    extend a ``Ġ``-prefix by one character (``Ġ r -> Ġr``, ``Ġr e -> Ġre``, ...): no merge can fire
    inside a word, so each vocabulary word becomes exactly one token whatever the merge ranks.
    """
    from transformers import Qwen2TokenizerFast

    vocab: dict[str, int] = {}

    def add(token: str) -> None:
        vocab.setdefault(token, len(vocab))

    for ch in sorted(set(BYTE_LEVEL_SPACE + "".join(TOKENIZER_WORDS) + "".join(PUNCTUATION))):
        add(ch)
    merges: list[tuple[str, str]] = []
    for word in TOKENIZER_WORDS:
        spelled = BYTE_LEVEL_SPACE + word
        for end in range(2, len(spelled) + 1):
            if spelled[:end] not in vocab:
                add(spelled[:end])
                merges.append((spelled[: end - 1], spelled[end - 1]))
    for token in QWEN_SPECIAL_TOKENS:
        add(token)
    return Qwen2TokenizerFast(
        vocab=vocab, merges=merges, add_prefix_space=True, additional_special_tokens=QWEN_SPECIAL_TOKENS[1:],
    )


def _text_encoder(tokenizer):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=TEXT_DIM, intermediate_size=64,
            num_hidden_layers=TEXT_ENCODER_LAYERS,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [4, 2, 2],
                             "mrope_interleaved": True},
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=16, spatial_merge_size=2,
            temporal_patch_size=2, out_hidden_size=TEXT_DIM, num_position_embeddings=64,
            deepstack_visual_indexes=[0],
        ),
        **ids,
    )
    return Qwen3VLForConditionalGeneration(config).eval()


class TokenTypeProcessor:
    """The part of ``Qwen3VLProcessor`` that MiniMax-H3's text encoding uses, without torchvision.

    ``get_qwen3vl_prompt_embeds`` only calls ``processor.create_mm_token_type_ids(batch_of_ids)``;
    this runs transformers' own implementation (``ProcessorMixin.create_mm_token_type_ids``) with
    the image/video pad ids Qwen3VLProcessor would read off the tokenizer. The keyframe / reference
    workflows need the real processor's ``image_processor``, which this stand-in does not provide.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.image_token_ids = [tokenizer.convert_tokens_to_ids("<|image_pad|>")]
        self.video_token_ids = [tokenizer.convert_tokens_to_ids("<|video_pad|>")]
        self.audio_token_ids = [None]

    def create_mm_token_type_ids(self, input_ids):
        from transformers.processing_utils import ProcessorMixin

        return ProcessorMixin.create_mm_token_type_ids(self, input_ids)


# --------------------------------------------------------------------------------------------
# the repository
# --------------------------------------------------------------------------------------------


def _portable_index(directory: Path, **config) -> None:
    """Point every component entry of ``modular_model_index.json`` at "this repository" (null), and
    set the pipeline ``config`` values given."""
    index_path = directory / "modular_model_index.json"
    index = json.loads(index_path.read_text())
    index.update(config)
    for name, value in index.items():
        if isinstance(value, list) and len(value) == 3 and isinstance(value[2], dict):
            spec = value[2]
            spec["pretrained_model_name_or_path"] = None
            spec["revision"] = None
            if (directory / name).is_dir():
                spec["subfolder"] = name
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


REFERENCE_IMAGE_SHORT_EDGE = 32  # the tiny clips' canvas: an image reference encodes to one 2x2 latent frame


def build_tiny_h3_repository(url_or_path: str, seed: int = 0, with_conditioner: bool = True) -> str:
    """Write a tiny MiniMax-H3 repository to ``url_or_path`` (a local path or a storage URL) that
    ``diffusers.ModularPipeline.from_pretrained`` loads as ``MiniMaxH3ModularPipeline``; returns it.

    Components are seeded random (``seed``); ``with_conditioner`` adds the Qwen3-VL text encoder
    (51 layers of width 32) and its word-level tokenizer. ``transformer_ref/`` is a second
    transformer of the same config and its own weights, as the released ref2va partition is; the
    index configures image references at the tiny canvas's short edge
    (``reference_image_short_edge``, 2048 for the released checkpoint), as a fine-tune trained at
    another resolution is configured. ``processor`` is never written (see the module docstring)."""
    from diffusers import MiniMaxH3Blocks, MiniMaxH3Scheduler

    with torch.random.fork_rng(devices=[]):  # seeded weights without touching the caller's RNG
        torch.manual_seed(seed)
        generator = torch.Generator().manual_seed(seed)
        components = dict(
            transformer=_transformer(), vae=_video_vae(generator), audio_vae=_audio_vae(generator),
            scheduler=MiniMaxH3Scheduler(shift=12.0), audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
        )
        if with_conditioner:  # built last, so the other components do not depend on it
            tokenizer = _tokenizer()
            components.update(tokenizer=tokenizer, text_encoder=_text_encoder(tokenizer))
        components.update(transformer_ref=_transformer())  # last: the other components' weights stay as they were

    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(**components)
    with storage.staged_dir(url_or_path) as tmp:
        pipe.save_pretrained(str(tmp), overwrite_modular_index=True)
        _portable_index(tmp, reference_image_short_edge=REFERENCE_IMAGE_SHORT_EDGE)
    return url_or_path


# --------------------------------------------------------------------------------------------
# running it
# --------------------------------------------------------------------------------------------


ENCODING_STEPS = ("before_encode", "text_encoder", "vae_encoder")  # a workflow's steps before its denoise


def load_t2va(path: str, with_text_encoder: bool = False, device: Optional[str] = None):
    """The repository's t2va pipeline with its components loaded (``path``: local or storage URL).

    ``ModularPipeline.from_pretrained(path, workflow="t2va")`` prunes ``MiniMaxH3Blocks`` to the
    t2va execution blocks (flat: ``text_encoder``, ``denoise.*``, ``decode.*``). Without the text
    encoder, see :func:`load_denoising`. With it, the pipeline keeps the encoder step and gets
    :class:`TokenTypeProcessor` as its ``processor``.
    """
    if not with_text_encoder:
        return load_denoising(path, "t2va", device)
    from diffusers import ModularPipeline

    with storage.local_copy(path) as local:
        pipe = ModularPipeline.from_pretrained(str(local), workflow="t2va")
        pipe.load_components()
        if pipe.text_encoder is None or pipe.tokenizer is None:
            raise ValueError(f"{path}: the repository has no text_encoder/tokenizer (built without a conditioner?)")
        if getattr(pipe, "processor", None) is None:
            pipe.update_components(processor=TokenTypeProcessor(pipe.tokenizer))
    return _ready(pipe, path, device)


def load_denoising(path: str, workflow: str = "t2va", device: Optional[str] = None):
    """The repository's ``workflow`` pipeline from its prepared inputs on: the workflow's encoding
    steps (``ENCODING_STEPS``: the media setup, the conditioner, the keyframes' VAE encoder) are
    popped from (a copy of) its blocks and a pipeline is re-initialised from the rest with
    ``blocks.init_pipeline(path)``. It then takes what a prompt set holds: ``prompt_embeds`` /
    ``text_token_tags``, and for fl2va ``condition_latents`` / ``keyframe_anchors``; and
    ``load_components()`` loads only what those blocks expect (transformer, vae, audio_vae, the
    two schedulers)."""
    from diffusers import ModularPipeline

    with storage.local_copy(path) as local:
        blocks = ModularPipeline.from_pretrained(str(local), workflow=workflow).blocks  # a copy
        for name in [n for n in blocks.sub_blocks if n in ENCODING_STEPS]:
            blocks.sub_blocks.pop(name)
        pipe = blocks.init_pipeline(str(local))
        pipe.load_components()
    return _ready(pipe, path, device, workflow)


def _ready(pipe, path, device: Optional[str], workflow: str = "t2va"):
    from dmd2_core.models import transformer_folder

    transformer = transformer_folder(workflow)
    missing = [n for n in (transformer, "vae", "audio_vae", "scheduler", "audio_scheduler")
               if getattr(pipe, n, None) is None]
    if missing:
        raise ValueError(f"{path}: could not load {missing} from the repository")
    if device is not None:
        pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


_OUTPUTS = ["latents", "audio_latents", "videos", "audio", "sampling_rate"]


def _result(out: dict) -> dict:
    return dict(
        video=out["videos"][0].permute(1, 0, 2, 3).float().cpu(),  # [F, 3, H, W] -> [3, F, H, W], in [0, 1]
        audio=out["audio"][0].float().cpu(),  # [2, S]
        sampling_rate=int(out["sampling_rate"]),
        latents=out["latents"][0].float().cpu(),  # [24, F', h, w], normalised model space
        audio_latents=out["audio_latents"].float().cpu(),  # [2, 32, L], normalised
    )


def run_t2va(path, prompt_embeds: torch.Tensor, num_inference_steps: int, num_frames: int, height: int, width: int,
             seed: int, text_token_tags: Optional[torch.Tensor] = None, device: Optional[str] = None) -> dict:
    """t2va denoise + decode from given prompt embeddings ([1, T, 32] or [T, 32]) instead of the
    text encoder. ``path`` is a repository (local path or URL) or a pipeline from
    ``load_t2va(path)``. ``text_token_tags`` defaults to all-text (the t2va presentation). The noise
    comes from ``torch.Generator().manual_seed(seed)``: video noise first, then the audio rows.

    Returns video [3, F, H, W] in [0, 1], audio [2, S], sampling_rate, latents [24, F', h, w] and
    audio_latents [2, 32, L] (both normalised, i.e. before the VAEs' latents_std/mean)."""
    pipe = load_t2va(path, device=device) if isinstance(path, (str, os.PathLike)) else path
    embeds = prompt_embeds if prompt_embeds.dim() == 3 else prompt_embeds.unsqueeze(0)
    if embeds.shape[0] != 1:
        raise ValueError("MiniMax-H3 packs one request per sequence: prompt_embeds must be [1, T, D], "
                         f"got {tuple(embeds.shape)}")
    if text_token_tags is None:
        text_token_tags = torch.full((embeds.shape[1],), pipe.text_tag, dtype=torch.long)
    device_ = pipe._execution_device
    out = pipe(
        prompt_embeds=embeds.to(device_, pipe.transformer.dtype), text_token_tags=text_token_tags.to(torch.long),
        num_inference_steps=num_inference_steps, num_frames=num_frames, height=height, width=width,
        generator=torch.Generator().manual_seed(seed), output_type="pt", output=_OUTPUTS,
    )
    return _result(out)


def run_fl2va(path, prompt_embeds: torch.Tensor, text_token_tags: torch.Tensor, keyframe_latents: torch.Tensor,
              keyframe_anchors, num_inference_steps: int, num_frames: int, height: int, width: int, seed: int,
              device: Optional[str] = None) -> dict:
    """fl2va denoise + decode from a prompt set's row instead of images: its presentation's
    embeddings ([1, T, D] or [T, D]) and modality tags [T], its keyframes' VAE latents
    [K, 24, 1, h, w] (normalised) and their anchors ('first' / 'last', or the set's codes 0 / 1).
    ``path`` is a repository (local path or URL) or a pipeline from ``load_denoising(path,
    "fl2va")``. From ``torch.Generator().manual_seed(seed)`` diffusers draws each keyframe's noise
    first, then the clip's video noise, then its audio rows. Returns :func:`run_t2va`'s dict."""
    from dmd2_core.models.minimax_h3 import KEYFRAME_ANCHORS

    pipe = load_denoising(path, "fl2va", device) if isinstance(path, (str, os.PathLike)) else path
    embeds = prompt_embeds if prompt_embeds.dim() == 3 else prompt_embeds.unsqueeze(0)
    anchors = tuple(a if isinstance(a, str) else KEYFRAME_ANCHORS[int(a)] for a in keyframe_anchors)
    device_ = pipe._execution_device
    out = pipe(
        prompt_embeds=embeds.to(device_, pipe.transformer.dtype), text_token_tags=text_token_tags.to(torch.long),
        condition_latents=[k[None].to(device_, torch.float32) for k in keyframe_latents], keyframe_anchors=anchors,
        num_inference_steps=num_inference_steps, num_frames=num_frames, height=height, width=width,
        generator=torch.Generator().manual_seed(seed), output_type="pt", output=_OUTPUTS,
    )
    return _result(out)


def run_ref2va(path, prompt_embeds: torch.Tensor, text_token_tags: torch.Tensor, reference_latents: torch.Tensor,
               reference_kinds, reference_audio_latents: Optional[torch.Tensor], num_inference_steps: int,
               num_frames: int, height: int, width: int, seed: int, device: Optional[str] = None) -> dict:
    """ref2va denoise + decode from a prompt set's row instead of media: its presentation's
    embeddings and tags, its image references' VAE latents [I, 24, 1, h, w], their order
    (``reference_kinds``: 'image' / 'audio', or the set's codes 0 / 1) and its sounds' rows
    [A, 2 L, 32] (or None). ``path`` is a repository (local path or URL: its ``transformer_ref/``
    runs) or a pipeline from ``load_denoising(path, "ref2va")``. From
    ``torch.Generator().manual_seed(seed)`` diffusers draws each image reference's noise first,
    then the clip's. Returns :func:`run_t2va`'s dict."""
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3AudioReference, MiniMaxH3ImageReference

    from dmd2_core.models.minimax_h3 import REFERENCE_KINDS

    pipe = load_denoising(path, "ref2va", device) if isinstance(path, (str, os.PathLike)) else path
    embeds = prompt_embeds if prompt_embeds.dim() == 3 else prompt_embeds.unsqueeze(0)
    kinds = [k if isinstance(k, str) else REFERENCE_KINDS[int(k)] for k in reference_kinds]
    # the layout reads a reference's kind alone; its media were encoded into the latents already
    references = [MiniMaxH3ImageReference(image=None) if k == "image" else MiniMaxH3AudioReference(audio=None)
                  for k in kinds]
    device_ = pipe._execution_device
    out = pipe(
        prompt_embeds=embeds.to(device_, pipe.transformer_ref.dtype), text_token_tags=text_token_tags.to(torch.long),
        normalized_references=references,
        condition_latents=[k[None].to(device_, torch.float32) for k in reference_latents],
        audio_condition_latents=[] if reference_audio_latents is None else
        [rows.to(device_, torch.float32) for rows in reference_audio_latents],
        num_inference_steps=num_inference_steps, num_frames=num_frames, height=height, width=width,
        generator=torch.Generator().manual_seed(seed), output_type="pt", output=_OUTPUTS,
    )
    return _result(out)


def run_t2va_with_prompt(path, prompt: str, num_inference_steps: int, num_frames: int, height: int, width: int,
                         seed: int, device: Optional[str] = None) -> dict:
    """The whole t2va pipeline, prompt string in: diffusers' ``MiniMaxH3TextEncoderStep`` runs the
    tiny Qwen3-VL conditioner (hidden_states[50]); returns :func:`run_t2va`'s dict plus
    ``prompt_embeds`` [1, T, 32] and ``text_token_tags`` [T]."""
    pipe = load_t2va(path, with_text_encoder=True, device=device) if isinstance(path, (str, os.PathLike)) else path
    out = pipe(
        prompt=prompt, num_inference_steps=num_inference_steps, num_frames=num_frames, height=height, width=width,
        generator=torch.Generator().manual_seed(seed), output_type="pt",
        output=_OUTPUTS + ["prompt_embeds", "text_token_tags"],
    )
    result = _result(out)
    result.update(prompt_embeds=out["prompt_embeds"].float().cpu(), text_token_tags=out["text_token_tags"].cpu())
    return result


def encode_prompts_h3(path, prompts: list[str], layer: int = TEXT_ENCODER_LAYER) -> list[torch.Tensor]:
    """Per prompt, the conditioner's hidden state ``hidden_states[layer]`` as [T_i, 32], through
    diffusers' own ``get_qwen3vl_prompt_embeds`` on ``MiniMaxH3TextEncoderStep``'s tokenization
    (``tokenizer(prompt, add_special_tokens=False)``, no chat template). ``path``: a repository or
    a pipeline from ``load_t2va(path, with_text_encoder=True)``."""
    from diffusers.modular_pipelines.minimax_h3.encoders import get_qwen3vl_prompt_embeds

    if isinstance(path, (str, os.PathLike)):
        from diffusers import ModularPipeline

        with storage.local_copy(path) as local:
            pipe = ModularPipeline.from_pretrained(str(local), workflow="t2va")
            pipe.load_components(names=["text_encoder", "tokenizer"])
    else:
        pipe = path
    if pipe.text_encoder is None or pipe.tokenizer is None:
        raise ValueError(f"{path}: the repository has no text_encoder/tokenizer (built without a conditioner?)")
    processor = getattr(pipe, "processor", None) or TokenTypeProcessor(pipe.tokenizer)
    embeds = []
    with torch.no_grad():
        for prompt in prompts:
            token_ids = pipe.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            hidden = get_qwen3vl_prompt_embeds(
                pipe.text_encoder, processor, token_ids, {}, text_encoder_layer=layer,
                device=pipe._execution_device, dtype=pipe.text_encoder.dtype,
            )
            embeds.append(hidden[0].float().cpu())
    return embeds


def keyframe_processor(tokenizer, text_encoder) -> TokenTypeProcessor:
    """:class:`TokenTypeProcessor` with the image processor the fl2va presentation needs: Qwen2-VL's
    PIL image processor (no torchvision) at the conditioner's own vision patch and merge sizes."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vision = text_encoder.config.vision_config
    processor = TokenTypeProcessor(tokenizer)
    processor.image_processor = Qwen2VLImageProcessorPil(
        patch_size=vision.patch_size, merge_size=vision.spatial_merge_size, temporal_patch_size=vision.temporal_patch_size)
    return processor


def load_encoding(path, workflow: str, needed: tuple[str, ...]):
    """The repository's ``workflow`` pipeline cut before its denoise (the media setup, the
    conditioner and the VAE encoders load, no transformer), with :func:`keyframe_processor` where
    the repository has no processor; ValueError naming what of ``needed`` it lacks."""
    from diffusers import ModularPipeline

    with storage.local_copy(path) as local:
        blocks = ModularPipeline.from_pretrained(str(local), workflow=workflow).blocks
        for name in [n for n in blocks.sub_blocks if n.startswith(("denoise.", "decode."))]:
            blocks.sub_blocks.pop(name)
        pipe = blocks.init_pipeline(str(local))
        pipe.load_components()
    missing = [n for n in needed if getattr(pipe, n, None) is None]
    if missing:
        raise ValueError(f"{path}: the repository has no {'/'.join(missing)} to encode {workflow} conditions with")
    if getattr(pipe, "processor", None) is None:
        pipe.update_components(processor=keyframe_processor(pipe.tokenizer, pipe.text_encoder))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def encode_keyframe_prompts_h3(path, prompts: list[str], keyframes: list[dict]) -> list[dict]:
    """Per prompt, what diffusers' fl2va blocks compute before denoising: the presentation
    (``"<Picture i>: "`` and a vision block per keyframe, then the prompt) through the Qwen3-VL
    conditioner (``prompt_embeds`` [T, D], ``text_token_tags`` [T]: vision rows tagged video) and the
    keyframes through the video VAE (``keyframe_latents`` [K, 24, 1, H, W], normalised) with their
    anchors (``keyframe_anchors``: 'first' / 'last'). ``keyframes[i]``: {'image' and/or
    'last_image': PIL image} at the clip's canvas. The pipeline is MiniMaxH3Blocks' fl2va workflow
    cut before its denoise: the conditioner and the VAE encoder load, no transformer."""
    pipe = load_encoding(path, "fl2va", ("text_encoder", "tokenizer", "vae"))
    encoded = []
    with torch.no_grad():
        for prompt, images in zip(prompts, keyframes):
            width, height = next(iter(images.values())).size
            out = pipe(prompt=prompt, height=height, width=width, **images,
                       output=["prompt_embeds", "text_token_tags", "condition_latents", "keyframe_anchors"])
            encoded.append(dict(prompt_embeds=out["prompt_embeds"][0].float().cpu(),
                                text_token_tags=out["text_token_tags"].long().cpu(),
                                keyframe_latents=torch.cat(out["condition_latents"]).float(),
                                keyframe_anchors=tuple(out["keyframe_anchors"])))
    return encoded


def encode_reference_prompts_h3(path, prompts: list[str], references: list[list], num_frames: int, height: int,
                                width: int) -> list[dict]:
    """Per prompt, what diffusers' ref2va blocks compute before denoising: the presentation (a
    label per reference, ``"<Picture i>: "`` with a vision block for an image, ``"<Audio j>: "``
    for a sound, then the prompt) through the Qwen3-VL conditioner (``prompt_embeds`` [T, D],
    ``text_token_tags`` [T]), each image reference at its own short edge through the video VAE
    (``reference_latents`` [I, 24, 1, h, w], normalised, with the resized pictures
    ``reference_images``) and each sound, cut to the clip's duration, through the audio VAE
    (``reference_audio_latents`` [A, 2 L, 32], normalised channel-major rows), with the kinds in
    packed order. ``references[i]``: prompt i's ``MiniMaxH3ImageReference`` /
    ``MiniMaxH3AudioReference`` list. The pipeline is MiniMaxH3Blocks' ref2va workflow cut before
    its denoise: the conditioner and the VAEs load, no transformer."""
    pipe = load_encoding(path, "ref2va", ("text_encoder", "tokenizer", "vae", "audio_vae"))
    encoded = []
    with torch.no_grad():
        for prompt, refs in zip(prompts, references):
            out = pipe(prompt=prompt, references=refs, num_frames=num_frames, height=height, width=width,
                       output=["prompt_embeds", "text_token_tags", "condition_latents", "audio_condition_latents",
                               "normalized_references"])
            normalized = out["normalized_references"]
            encoded.append(dict(
                prompt_embeds=out["prompt_embeds"][0].float().cpu(), text_token_tags=out["text_token_tags"].long().cpu(),
                reference_latents=torch.cat(out["condition_latents"]).float().cpu(),
                reference_audio_latents=[rows.float().cpu() for rows in out["audio_condition_latents"]],
                reference_images=[r.image for r in normalized if r.kind == "image"],
                kinds=tuple(r.kind for r in normalized)))
    return encoded
