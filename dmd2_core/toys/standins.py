"""Tiny stand-ins of real checkpoints, built from config with seeded random weights: the same
diffusers classes and directory layout as a real SD3 image or Wan video checkpoint (transformer/,
vae/, scheduler/, model_index.json) and a prompt set in the real embedding format. Tests and docs
exercise the large-model recipes on them, since real weights cannot be downloaded here."""

from __future__ import annotations

import json

import torch

from dmd2_core import storage
from dmd2_core.data import PromptSet
from dmd2_core.models import FAMILIES, save_model_dir

TEXT_DIM = 32
TEXT_TOKENS = 6
LATENT_CHANNELS = 4


def _sd3_transformer():
    return FAMILIES["SD3Transformer2DModel"].build(dict(
        sample_size=8, patch_size=2, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=TEXT_DIM, caption_projection_dim=32,
        pooled_projection_dim=TEXT_DIM, pos_embed_max_size=8,
    ))


def _sd3_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS, block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=4, layers_per_block=1, scaling_factor=1.5305, shift_factor=0.0609,
    )


def _wan_transformer():
    return FAMILIES["WanTransformer3DModel"].build(dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS, text_dim=TEXT_DIM, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=32,
    ))


def _wan_vae():
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(
        base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[],
        temperal_downsample=[True], latents_mean=[0.0] * LATENT_CHANNELS, latents_std=[1.0] * LATENT_CHANNELS,
    )


def build_h3_standin(url: str, seed: int = 0, with_conditioner: bool = False) -> str:
    """A MiniMax-H3 repository of tiny random components (dmd2_core.models.h3_repository):
    transformer/, vae/, audio_vae/, scheduler/ (shift 12, video), audio_scheduler/ (shift 3) and
    modular_model_index.json (plus the Qwen3-VL conditioner with ``with_conditioner``). Clips: 124
    frames (5.2 s) of 32 x 32 pixels -> latents [24, 37, 2, 2] and audio latents [2, 32, 207]."""
    from dmd2_core.models.h3_repository import build_tiny_h3_repository

    return build_tiny_h3_repository(url, seed=seed, with_conditioner=with_conditioner)


H3_GEOMETRY = {"num_frames": 124, "height": 32, "width": 32}


def h3_prompt_set(num_prompts: int = 4, seed: int = 0, dim: int = TEXT_DIM, max_tokens: int = TEXT_TOKENS) -> PromptSet:
    """Random conditioner embeddings of varying token counts (zero-padded to the longest), their
    lengths in ``prompt_lengths``, and no negative entries: MiniMax-H3 is guidance-distilled."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([max_tokens - (i % 3) for i in range(num_prompts)])
    embeds = torch.randn(num_prompts, max_tokens, dim, generator=g)
    embeds *= (torch.arange(max_tokens)[None, :, None] < lengths[:, None, None])
    return PromptSet(prompts=[f"stand-in clip {i}" for i in range(num_prompts)],
                     embeds={"prompt_embeds": embeds, "prompt_lengths": lengths}, negative={})


STANDINS = {
    "sd3": (_sd3_transformer, _sd3_vae, 3.0, True),
    "wan": (_wan_transformer, _wan_vae, 5.0, False),
}


TEXT_WORDS = ["<pad>", "</s>", "<unk>"] + "a an the of on in with cat dog bird red blue green running video photo".split()


def _add_wan_text_encoder(url: str) -> None:
    """A one-layer UMT5 encoder and a word-level tokenizer, in the pipeline's own layout."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(TEXT_WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(TEXT_WORDS), d_model=TEXT_DIM, d_kv=16, d_ff=64,
                                          num_layers=1, num_heads=2))
    with storage.staged_dir(url) as tmp:
        tokenizer.save_pretrained(str(tmp / "tokenizer"))
        encoder.save_pretrained(str(tmp / "text_encoder"))
        index = describe_standin(url)
        index.update(text_encoder=["transformers", "UMT5EncoderModel"], tokenizer=["transformers", "PreTrainedTokenizerFast"])
        (tmp / "model_index.json").write_text(json.dumps(index, indent=2))


def build_standin(url: str, kind: str = "sd3", seed: int = 0, with_text_encoder: bool = False) -> str:
    """Write a stand-in checkpoint of ``kind`` ('sd3' image or 'wan' video) to ``url``; for 'wan',
    optionally with the pipeline's text encoder and tokenizer."""
    make_transformer, make_vae, shift, _ = STANDINS[kind]
    torch.manual_seed(seed)
    transformer, vae = make_transformer(), make_vae()
    save_model_dir(transformer, url, shift=shift, vae=vae)
    if with_text_encoder:
        if kind != "wan":
            raise ValueError("stand-in text encoders exist for 'wan' only")
        _add_wan_text_encoder(url)
    return url


def standin_prompt_set(kind: str = "sd3", num_prompts: int = 4, seed: int = 0, dim: int = TEXT_DIM) -> PromptSet:
    """Random embeddings in the format the kind's text encoders produce (SD3: tokens + pooled)."""
    g = torch.Generator().manual_seed(seed)
    pooled = STANDINS[kind][3]
    embeds = {"prompt_embeds": torch.randn(num_prompts + 1, TEXT_TOKENS, dim, generator=g)}
    if pooled:
        embeds["pooled_prompt_embeds"] = torch.randn(num_prompts + 1, dim, generator=g)
    return PromptSet(
        prompts=[f"stand-in prompt {i}" for i in range(num_prompts)],
        embeds={k: v[:num_prompts] for k, v in embeds.items()},
        negative={k: v[num_prompts:] for k, v in embeds.items()},
    )


def describe_standin(url: str) -> dict:
    return json.loads(storage.read_text(storage.join(url, "model_index.json")))
