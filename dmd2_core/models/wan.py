"""Wan-style video models (WanTransformer3DModel): latents [B, C, F, H, W], text tokens only."""

from __future__ import annotations

from typing import Optional

import torch

from dmd2_core import storage
from dmd2_core.models.base import ModelFamily


class WanVideoFamily(ModelFamily):
    class_name = "WanTransformer3DModel"
    pipeline_class = "WanPipeline"
    cond_keys = ("prompt_embeds",)
    is_video = True

    def forward(self, model, x_t, t, cond):
        return model(hidden_states=x_t, timestep=t, encoder_hidden_states=cond["prompt_embeds"], return_dict=False)[0]

    def sample_shape(self, model, latent_shape: Optional[list[int]] = None):
        if not latent_shape:
            raise ValueError("latent_shape: Wan video models need [C, F, H, W] latents set in the recipe")
        return tuple(int(d) for d in latent_shape)

    def load_vae(self, url, dtype):
        from diffusers import AutoencoderKLWan

        with storage.local_copy(url) as local:
            return AutoencoderKLWan.from_pretrained(str(local), torch_dtype=dtype)

    def decode(self, vae, latents):
        """[B, C, F, H, W] latents -> [B, 3, F', H', W'] video in [-1, 1]."""
        if vae is None:
            return latents.float().clamp(-1, 1)
        cfg = vae.config
        mean = torch.tensor(cfg.latents_mean, dtype=torch.float32, device=latents.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(cfg.latents_std, dtype=torch.float32, device=latents.device).view(1, -1, 1, 1, 1)
        scaled = latents.float() * std + mean
        with torch.no_grad():
            video = vae.decode(scaled.to(next(vae.parameters()).dtype), return_dict=False)[0]
        return video.float().clamp(-1, 1)
