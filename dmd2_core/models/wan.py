"""Wan-style video models (WanTransformer3DModel): latents [B, C, F, H, W], text tokens only."""

from __future__ import annotations

from typing import Optional

import torch

from dmd2_core.models.base import ModelFamily


class WanVideoFamily(ModelFamily):
    class_name = "WanTransformer3DModel"
    time_embedding = "condition_embedder.time_embedder"
    pipeline_class = "WanPipeline"
    cond_keys = ("prompt_embeds",)
    is_video = True
    vae_class = "AutoencoderKLWan"
    vae_params, vae_spatial_ratio, decode_chunk_frames = 127_000_000, 8, 4
    blocks_attr = "blocks"
    context_parallel = True  # diffusers' plan splits the video tokens; the text stays whole on every rank

    def pixel_frames(self, latent_frames: int) -> int:
        return (latent_frames - 1) * 4 + 1  # the Wan VAE: 4x in time, the first frame alone

    def forward(self, model, x_t, t, cond):
        return model(hidden_states=x_t, timestep=t, encoder_hidden_states=cond["prompt_embeds"], return_dict=False)[0]

    def sample_shape(self, model, latent_shape: Optional[list[int]] = None):
        if not latent_shape:
            raise ValueError("latent_shape: Wan video models need [C, F, H, W] latents set in the recipe")
        return tuple(int(d) for d in latent_shape)

    default_text_tokens = 512  # UMT5 max_sequence_length of the Wan pipelines

    def tokens(self, config, sample_shape):
        pt, ph, pw = config["patch_size"]
        return (sample_shape[-3] // pt) * (sample_shape[-2] // ph) * (sample_shape[-1] // pw)

    def activation_elements(self, config, image_tokens, text_tokens):
        d = config["num_attention_heads"] * config["attention_head_dim"]
        # self-attention (norm, qkv, out, projection) 6d, cross-attention (norm, q, out,
        # projection) 4d, FFN input and its hidden before and after GELU, residuals 2d;
        # the cross-attention keys and values on the text tokens
        return image_tokens * (12 * d + 2 * config["ffn_dim"]) + text_tokens * 2 * d

    def encode_prompts(self, pipe, prompts, negative_prompt, max_sequence_length):
        extra = {"max_sequence_length": max_sequence_length} if max_sequence_length else {}
        pe, npe = pipe.encode_prompt(prompt=prompts, negative_prompt=negative_prompt,
                                     do_classifier_free_guidance=True, device="cpu", **extra)
        return {"prompt_embeds": pe}, {"prompt_embeds": npe[:1]}

    def unscale_latents(self, vae, latents):
        cfg = vae.config
        mean = torch.tensor(cfg.latents_mean, dtype=torch.float32, device=latents.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(cfg.latents_std, dtype=torch.float32, device=latents.device).view(1, -1, 1, 1, 1)
        return latents * std + mean

    def scale_latents(self, vae, latents):
        cfg = vae.config
        mean = torch.tensor(cfg.latents_mean, dtype=torch.float32, device=latents.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(cfg.latents_std, dtype=torch.float32, device=latents.device).view(1, -1, 1, 1, 1)
        return (latents - mean) / std
