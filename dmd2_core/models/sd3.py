"""SD3-style MMDiT image models (SD3Transformer2DModel): text tokens + pooled embedding."""

from __future__ import annotations

from typing import Optional


from dmd2_core.models.base import ModelFamily


class SD3ImageFamily(ModelFamily):
    class_name = "SD3Transformer2DModel"
    time_embedding = "time_text_embed"
    pipeline_class = "StableDiffusion3Pipeline"
    cond_keys = ("prompt_embeds", "pooled_prompt_embeds")
    vae_params, vae_spatial_ratio, decode_chunk_frames = 84_000_000, 8, 1

    def forward(self, model, x_t, t, cond):
        return model(
            hidden_states=x_t,
            encoder_hidden_states=cond["prompt_embeds"],
            pooled_projections=cond["pooled_prompt_embeds"],
            timestep=t,
            return_dict=False,
        )[0]

    def sample_shape(self, model, latent_shape: Optional[list[int]] = None):
        if latent_shape:
            return tuple(int(d) for d in latent_shape)
        cfg = model.config
        return (cfg.in_channels, cfg.sample_size, cfg.sample_size)

    default_text_tokens = 77 + 256  # CLIP tokens + T5 max_sequence_length of the SD3 pipelines

    def tokens(self, config, sample_shape):
        p = config["patch_size"]
        return (sample_shape[-2] // p) * (sample_shape[-1] // p)

    def activation_elements(self, config, image_tokens, text_tokens):
        d = config["num_attention_heads"] * config["attention_head_dim"]
        # per token and stream: norm, qkv, attention out, projection, MLP in and its 4d hidden
        # before and after GELU, residuals: ~17 d; a dual-attention block adds a second attention
        per_token = 17 * d + (6 * d if config.get("dual_attention_layers") else 0)
        return (image_tokens + text_tokens) * per_token

    def encode_prompts(self, pipe, prompts, negative_prompt, max_sequence_length):
        extra = {"max_sequence_length": max_sequence_length} if max_sequence_length else {}
        pe, npe, pooled, npooled = pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, negative_prompt=negative_prompt,
            do_classifier_free_guidance=True, device="cpu", **extra)
        return ({"prompt_embeds": pe, "pooled_prompt_embeds": pooled},
                {"prompt_embeds": npe[:1], "pooled_prompt_embeds": npooled[:1]})

    def unscale_latents(self, vae, latents):
        cfg = vae.config
        return latents / cfg.scaling_factor + (getattr(cfg, "shift_factor", None) or 0.0)

    def scale_latents(self, vae, latents):
        cfg = vae.config
        return (latents - (getattr(cfg, "shift_factor", None) or 0.0)) * cfg.scaling_factor
