"""The interface every model family implements."""

from __future__ import annotations

from typing import Optional

import torch

from dmd2_core import flow_matching as fm


class ModelFamily:
    class_name: str = ""  # the diffusers transformer class
    pipeline_class: str = ""  # written to model_index.json of saved checkpoints
    cond_keys: tuple[str, ...] = ("prompt_embeds",)
    is_video: bool = False

    @property
    def model_class(self):
        import diffusers

        return getattr(diffusers, self.class_name)

    def build(self, config: dict) -> torch.nn.Module:
        return self.model_class(**config)

    def forward(self, model: torch.nn.Module, x_t: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        raise NotImplementedError

    def predict_velocity(self, model: torch.nn.Module, x_t: torch.Tensor, sigma: torch.Tensor, cond: dict) -> torch.Tensor:
        """v(x_t, sigma | cond) in fp32; the model computes in its own dtype."""
        dtype = next(model.parameters()).dtype
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x_t.device).expand(x_t.shape[0])
        cond = {k: cond[k].to(device=x_t.device, dtype=dtype) for k in self.cond_keys}
        return self.forward(model, x_t.to(dtype), fm.timestep(sigma).to(dtype), cond).float()

    def sample_shape(self, model: torch.nn.Module, latent_shape: Optional[list[int]] = None) -> tuple[int, ...]:
        raise NotImplementedError

    # ---- for the memory plan: sizes from the config alone --------------------------------------
    default_text_tokens: int = 0  # the pipeline's text sequence length

    def tokens(self, config, sample_shape: tuple[int, ...]) -> int:
        """Image (or video) tokens of one sample after patchifying."""
        raise NotImplementedError

    def activation_elements(self, config, image_tokens: int, text_tokens: int) -> int:
        """Elements one transformer block keeps for backward, per sample (SDPA attention keeps no
        score matrix), from the block's own layer sizes."""
        raise NotImplementedError

    vae_class: str = "AutoencoderKL"
    blocks_attr: str = "transformer_blocks"  # the transformer's block list (GAN features)

    def feature_block(self, model: torch.nn.Module, index: Optional[int]) -> torch.nn.Module:
        """The block whose output tokens feed the GAN head; default the middle one."""
        blocks = getattr(model, self.blocks_attr)
        return blocks[len(blocks) // 2 if index is None else index]

    def feature_dim(self, model: torch.nn.Module) -> int:
        return model.config.num_attention_heads * model.config.attention_head_dim

    def encode_prompts(self, pipe, prompts: list[str], negative_prompt: str, max_sequence_length: Optional[int]):
        """The pipeline's own text encoding -> ({key: [N, ...]}, {key: [1, ...]} for the negative)."""
        raise NotImplementedError
    def load_vae(self, url: str, dtype: torch.dtype) -> torch.nn.Module:
        import diffusers

        from dmd2_core import storage

        with storage.local_copy(url) as local:
            return getattr(diffusers, self.vae_class).from_pretrained(str(local), torch_dtype=dtype)

    def unscale_latents(self, vae: torch.nn.Module, latents: torch.Tensor) -> torch.Tensor:
        """The model's normalised latents -> the VAE's own latent scale."""
        raise NotImplementedError

    def scale_latents(self, vae: torch.nn.Module, latents: torch.Tensor) -> torch.Tensor:
        """The inverse of ``unscale_latents``: VAE latents -> the model's normalised latents."""
        raise NotImplementedError

    @torch.no_grad()
    def encode(self, vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] ([B, 3, H, W], or [B, 3, F, H, W] for video) -> the model's latents
        (the posterior mean, so encoding is deterministic)."""
        dist = vae.encode(pixels.to(next(vae.parameters()).dtype)).latent_dist
        return self.scale_latents(vae, dist.mode().float())

    @torch.no_grad()
    def decode(self, vae: Optional[torch.nn.Module], latents: torch.Tensor) -> torch.Tensor:
        """Latents -> pixels in [-1, 1] ([B, 3, H, W], or [B, 3, F, H, W] for video); without a
        VAE the model works in pixel space."""
        if vae is None:
            return latents.float().clamp(-1, 1)
        scaled = self.unscale_latents(vae, latents.float())
        return vae.decode(scaled.to(next(vae.parameters()).dtype), return_dict=False)[0].float().clamp(-1, 1)
