"""The interface every model family implements."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from dmd2_core import flow_matching as fm
from dmd2_core.errors import ArgsError


class ModelFamily:
    class_name: str = ""  # the diffusers transformer class
    pipeline_class: str = ""  # written to model_index.json of saved checkpoints
    cond_keys: tuple[str, ...] = ("prompt_embeds",)
    is_video: bool = False
    has_audio: bool = False
    guidance_distilled: bool = False  # guidance baked into the weights: one forward, no CFG
    deterministic_student: bool = False  # the student steps by Euler (eta 0) instead of fresh noise
    modular_pipeline: bool = False  # its diffusers pipeline is modular and its own schedulers step the student
    fixed_shift: Optional[float] = None  # the project's sigma shift, where the family fixes it
    keep_fp32_modules: bool = False  # shard the model's _keep_in_fp32_modules in fp32
    segments: Optional[dict[str, slice]] = None  # modalities of a flat sample; None: one
    time_embedding: str = ""  # the transformer's submodule whose output is the per-sample time embedding
    fps: Optional[float] = None  # frames per second of the clips it makes (a family with sound says)
    # its eval decoder, as the memory plan prices it; None where a family did not say (the plan refuses to guess)
    vae_params: Optional[int] = None  # the VAE's parameters, for a plan without the VAE's config at hand
    vae_spatial_ratio: Optional[int] = None  # pixels per latent side
    decode_chunk_frames: Optional[int] = None  # frames the VAE decodes at once (1: images)

    def decoder_facts(self) -> tuple[int, int, int]:
        """(VAE parameters, spatial ratio, frames decoded at once) of its eval decoder."""
        facts = (self.vae_params, self.vae_spatial_ratio, self.decode_chunk_frames)
        if any(f is None for f in facts):
            raise NotImplementedError(f"{self.class_name}: the family does not say its eval decoder's vae_params, "
                                      "vae_spatial_ratio and decode_chunk_frames")
        return facts

    def pixel_frames(self, latent_frames: int) -> int:
        """Frames of the clip whose latents have ``latent_frames`` frames (a video family says)."""
        raise NotImplementedError(f"{self.class_name}: the family does not say how its latent frames map to frames")

    def clip_latent_shape(self, clip: tuple[int, int, int], latent_shape, teacher: dict) -> list[int]:
        """The latents of a clip of (num_frames, height, width): a joint video + audio family's geometry."""
        raise ArgsError(f"num_frames: clip geometry is for joint video + audio models; {self.class_name} takes "
                        "latent_shape")

    def latent_shape_problem(self, latent_shape: list[int], teacher: dict) -> Optional[str]:
        """Why ``latent_shape`` is not the latents of a clip the family makes, or None."""
        return None

    def bind(self, latent_shape, model=None, shifts=None) -> "ModelFamily":
        """This family for one sample geometry (families whose forward needs it return a copy)."""
        return self

    # ---- a sample's conditions: what the forward reads of a batch's cond ------------------------
    def sample_cond(self, cond: dict) -> dict:
        """The entries of a batch's ``cond`` ({key: [N, ...]}) that condition its samples: what the
        family's forward reads (``cond_keys``; a family with several workflows adds the keys of the
        one ``cond`` was prepared for). Whoever picks a sample's conditions out of a larger dict
        (the teacher's features, guidance's batched branches) asks here, so a condition the forward
        reads is never dropped on the way."""
        return {k: cond[k] for k in self.cond_keys}

    def workflow_cond_keys(self, workflow: str) -> tuple[str, ...]:
        """The keys a ``workflow`` run conditions each sample on, so every set it reads (the
        prompt set, the GAN head's real set) is checked for them: ``cond_keys`` (text alone)."""
        return tuple(self.cond_keys)

    def layout_keys(self, cond: dict, n: int) -> list[tuple]:
        """Each of ``n`` samples' sequence layout under ``cond``, its text tokens first: samples of
        one key can share a forward (MiniMax-H3 runs one forward per key, so a caller that must see
        a single forward, the teacher features' stopped tap, groups the rows by it). Default: one
        layout, the text width."""
        return [(cond["prompt_embeds"].shape[1] if "prompt_embeds" in cond else 0,)] * n

    def forward_groups(self, sigma, cond: dict, n: int) -> list[tuple[list[int], tuple]]:
        """The forwards ``predict_velocity`` runs for ``n`` samples at ``sigma`` under ``cond``, in
        its order: (the samples, their ``layout_keys`` key) each, so a tap on a block can tell whose
        rows each forward's output holds. Default: one forward of every sample."""
        return [(list(range(n)), self.layout_keys(cond, n)[0])]

    # ---- sigma, elementwise: one place for the families that map it per element ----------------
    def sigma_field(self, sigma, like: torch.Tensor):
        return sigma

    def stepping_at(self, shifts: Optional[dict[str, float]]) -> "ModelFamily":
        """This family with the student's steps at ``shifts`` (modality -> schedule shift,
        ``student_modality_shifts``); itself when none. A family of one modality has no modality to
        shift (preflight refuses the key for it)."""
        if shifts:
            raise ValueError(f"student_modality_shifts: {type(self).__name__} has one modality, nothing to shift")
        return self

    def on_schedulers(self) -> "ModelFamily":
        """This family on the checkpoint's own schedules (the teacher's samplers and features), whatever
        the student steps on: its draws with nothing moved."""
        return self.drawing_at(None)

    def drawing_at(self, shifts: Optional[dict[str, float]]) -> "ModelFamily":
        """This family with the critic's and the DMD gradient's draws at ``shifts`` (modality ->
        schedule shift, ``dmd2_modality_shifts``, the others at the schedulers'); itself when none."""
        if shifts:
            raise ValueError(f"dmd2_modality_shifts: {type(self).__name__} has one modality, nothing to shift")
        return self

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, sigma) -> torch.Tensor:
        return fm.add_noise(x0, noise, self.sigma_field(sigma, x0))

    def velocity_to_x0(self, x_t: torch.Tensor, v: torch.Tensor, sigma) -> torch.Tensor:
        return fm.velocity_to_x0(x_t, v, self.sigma_field(sigma, x_t))

    def euler_step(self, x_t: torch.Tensor, x0: torch.Tensor, sigma, sigma_next) -> torch.Tensor:
        """x at sigma_next on the line through x_t and x0 (an Euler step, no fresh noise)."""
        s = fm.broadcast_sigma(self.sigma_field(sigma, x_t), x_t)
        s_next = fm.broadcast_sigma(self.sigma_field(sigma_next, x_t), x_t)
        ratio = s_next / s
        return ratio * x_t.float() + (1 - ratio) * x0.float()

    def eval_noise(self, n: int, seed: int, conditions: Sequence[tuple] = ()) -> Optional[torch.Tensor]:
        """Initial eval noise drawn as the family's own pipeline draws it (after the draws of the
        noised ``conditions``, each one's latent shape, where its pipeline draws those first:
        MiniMax-H3's fl2va and ref2va); None: the project's default (one generator for the batch,
        see dmd2.eval_samples)."""
        return None

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
        cond = {k: v.to(device=x_t.device, dtype=dtype) for k, v in self.sample_cond(cond).items()}
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

    # ---- context parallelism (dmd2_core.context_parallel) -------------------------------------
    context_parallel: bool = False  # the transformer's diffusers _cp_plan splits its sequence in training

    def context_parallel_problem(self, config, cp_size: int) -> Optional[str]:
        """Why the model cannot split its sequence over ``cp_size`` ranks, or None."""
        if cp_size == 1:
            return None
        if not self.context_parallel:
            return f"{self.class_name} has no context-parallel plan for training; set cp_size to 1"
        heads = int(config["num_attention_heads"])
        if heads % cp_size:
            return (f"{self.class_name} has {heads} attention heads, which do not split over {cp_size} ranks "
                    f"(Ulysses gives each rank heads / cp_size)")
        return None

    def split_tokens(self, config, sample_shape: tuple[int, ...], text_tokens: int) -> int:
        """Tokens of the sequence context parallelism splits, for a prompt of ``text_tokens``."""
        return self.tokens(config, sample_shape)

    vae_class: str = "AutoencoderKL"
    blocks_attr: str = "transformer_blocks"  # the transformer's block list (GAN features)

    def decode_flops(self, vae_url: str, latent_shape: tuple[int, ...]) -> int:
        """FLOPs of decoding one sample of ``latent_shape`` with the VAE at ``vae_url`` (its config
        alone, built on the meta device): ``count_decode``. The family's latent scaling (a few
        elementwise operations) is left out."""
        vae = meta_vae(self.vae_class, vae_url)
        with torch.device("meta"):
            latents = torch.randn(1, *latent_shape)
        return count_decode(vae, lambda: vae.decode(latents, return_dict=False))

    def decoded_pixel_frames(self, latent_shape: tuple[int, ...]) -> int:
        """Pixels of one decoded sample, over its frames (an image is one frame): the host's work
        on it (drift statistics, the media encode) scales with them."""
        _, scale, _ = self.decoder_facts()
        frames = self.pixel_frames(latent_shape[-3]) if len(latent_shape) == 4 else 1
        return frames * latent_shape[-2] * scale * latent_shape[-1] * scale

    def feature_block(self, model: torch.nn.Module, index: Optional[int]) -> torch.nn.Module:
        """The block whose output tokens feed the GAN head; default the middle one."""
        blocks = getattr(model, self.blocks_attr)
        return blocks[len(blocks) // 2 if index is None else index]

    def feature_dim(self, model: torch.nn.Module) -> int:
        return model.config.num_attention_heads * model.config.attention_head_dim

    def feature_tokens(self, text_tokens: int, layout: tuple = ()) -> Optional[dict[str, torch.Tensor]]:
        """Which rows of a block's output (the token axis a ``FeatureTap`` keeps) are which modality
        of the sample, as index tensors, for a prompt of ``text_tokens`` tokens (``layout``: the rest
        of the sample's ``layout_keys`` key); None: every row is the sample's one modality (SD3's
        image stream, Wan's video tokens)."""
        return None

    def judged_rows(self, text_tokens: int, layout: tuple = (), modalities: Optional[Sequence[str]] = None) -> Optional[torch.Tensor]:
        """Which rows of a block's output the GAN head judges, for a prompt of ``text_tokens`` tokens
        (``layout`` as in ``feature_tokens``; ``modalities``: a joint model's to judge, default all);
        None: every row (no condition rows in the sequence)."""
        return None

    def encode_prompts(self, pipe, prompts: list[str], negative_prompt: str, max_sequence_length: Optional[int]):
        """The pipeline's own text encoding -> ({key: [N, ...]}, {key: [1, ...]} for the negative)."""
        raise NotImplementedError
    def load_vae(self, url: str, dtype: torch.dtype) -> torch.nn.Module:
        import diffusers

        from dmd2_core import storage

        with storage.local_copy(url) as local:
            return getattr(diffusers, self.vae_class).from_pretrained(str(local), torch_dtype=dtype,
                                                                     use_safetensors=True)

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


def meta_vae(class_name: str, url: str) -> torch.nn.Module:
    """The diffusers VAE ``class_name`` from the config at ``url``, its weights on the meta device."""
    import json

    import diffusers

    from dmd2_core import storage

    config = json.loads(storage.read_text(storage.join(url, "config.json")))
    with torch.device("meta"):
        return getattr(diffusers, class_name).from_config(config).eval()


def count_decode(vae: torch.nn.Module, decode) -> int:
    """FLOPs of ``decode()`` (a call of ``vae`` on meta tensors), with torch's FlopCounterMode. A
    video VAE runs its ``decoder`` once per temporal chunk and spatial tile, on inputs of a few
    shapes: each distinct input is counted once and its count reused for the calls like it (at
    MiniMax-H3's clip, 8 chunks of 28 tiles: tracing every one took minutes), so a real-size
    decode counts in seconds."""
    from torch.utils.flop_counter import FlopCounterMode

    decoder = getattr(vae, "decoder", None)
    seen: dict[tuple, tuple[int, torch.Tensor]] = {}
    reused = 0
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        if decoder is not None:
            inner = decoder.forward

            def forward(*args, **kwargs):
                nonlocal reused
                key = (tuple(tuple(a.shape) if torch.is_tensor(a) else type(a).__name__ for a in args),
                       tuple(sorted((k, v) for k, v in kwargs.items() if isinstance(v, (bool, int, float, str)))))
                if key in seen:
                    flops, out = seen[key]
                    reused += flops
                    return torch.empty_like(out)
                before = counter.get_total_flops()
                out = inner(*args, **kwargs)
                if torch.is_tensor(out):
                    seen[key] = (counter.get_total_flops() - before, out)
                return out

            decoder.forward = forward
        try:
            decode()
        finally:
            if decoder is not None:
                del decoder.forward  # the instance attribute: the class's forward again
    return int(counter.get_total_flops()) + reused
