"""Tiny stand-ins of real checkpoints, built from config with seeded random weights: the same
diffusers classes and directory layout as a real SD3 image or Wan video checkpoint (transformer/,
vae/, scheduler/, model_index.json) and a prompt set in the real embedding format. Tests and docs
exercise the large-model recipes on them, since real weights cannot be downloaded here."""

from __future__ import annotations

import json

import torch

from dmd2_core import storage
from dmd2_core.data import PromptSet
from dmd2_core.models import FAMILIES, save_checkpoint

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


def h3_transformer():
    return FAMILIES["MiniMaxH3Transformer3DModel"].build(dict(
        num_attention_heads=2, attention_head_dim=16, hidden_size=32, num_layers=2, num_refiner_layers=1, ffn_dim=64,
        in_channels=24, audio_in_channels=32, patch_size=(1, 2, 2), text_dim=TEXT_DIM, freq_dim=32,
        time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=2,
    ))


def h3_vaes(seed: int = 0) -> tuple:
    """The video VAE (x16 spatial, 17 frames -> 5 latents per chunk) and the audio VAE (32 kHz, 40
    latents per second), tiny, with seeded non-trivial latent statistics (normalisation bugs show)."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

    g = torch.Generator().manual_seed(seed + 1)
    stats = lambda n: ([round(float(v), 4) for v in torch.randn(n, generator=g) * 0.3],  # noqa: E731
                       [round(float(v), 4) for v in 0.5 + torch.rand(n, generator=g)])
    video_mean, video_std = stats(24)
    audio_mean, audio_std = stats(32)
    video = AutoencoderKLMiniMaxH3(
        latent_channels=24, block_out_channels=(8,) * 6, layers_per_block=1, norm_num_groups=4, decoder_num_layers=1,
        decoder_num_attention_heads=2, decoder_attention_head_dim=8, decoder_num_register_tokens=1, decoder_ffn_mult=1,
        latents_mean=video_mean, latents_std=video_std)
    audio = AutoencoderKLMiniMaxH3Audio(
        encoder_dim=4, latent_dim=32, latent_channels=32, num_attention_heads=2, decoder_dim=128,
        resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1,),), latents_mean=audio_mean, latents_std=audio_std)
    return video, audio


def build_h3_standin(url: str, seed: int = 0) -> str:
    """A MiniMax-H3 checkpoint directory of tiny random components in the repository's layout:
    transformer/, vae/, audio_vae/, scheduler/ (shift 12, video), audio_scheduler/ (shift 3),
    model_index.json. Clips: 124 frames (5.2 s) of 32 x 32 pixels -> latents [24, 37, 2, 2] and
    audio latents [2, 32, 207]."""
    import diffusers
    from diffusers import MiniMaxH3Scheduler

    torch.manual_seed(seed)
    transformer = h3_transformer()
    video_vae, audio_vae = h3_vaes(seed)
    with storage.staged_dir(url) as tmp:
        transformer.save_pretrained(str(tmp / "transformer"), safe_serialization=True)
        video_vae.save_pretrained(str(tmp / "vae"), safe_serialization=True)
        audio_vae.save_pretrained(str(tmp / "audio_vae"), safe_serialization=True)
        MiniMaxH3Scheduler(shift=12.0).save_pretrained(str(tmp / "scheduler"))
        MiniMaxH3Scheduler(shift=3.0).save_pretrained(str(tmp / "audio_scheduler"))
        index = {"_class_name": "MiniMaxH3ModularPipeline", "_diffusers_version": diffusers.__version__,
                 "transformer": ["diffusers", "MiniMaxH3Transformer3DModel"],
                 "vae": ["diffusers", "AutoencoderKLMiniMaxH3"], "audio_vae": ["diffusers", "AutoencoderKLMiniMaxH3Audio"],
                 "scheduler": ["diffusers", "MiniMaxH3Scheduler"], "audio_scheduler": ["diffusers", "MiniMaxH3Scheduler"]}
        (tmp / "model_index.json").write_text(json.dumps(index, indent=2))
    return url


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
    save_checkpoint(transformer, url, shift=shift, vae=vae)
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
