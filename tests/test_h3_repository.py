"""The tiny MiniMax-H3 repository: loads through diffusers' modular pipeline (also after being
copied, and with its transformer/ rewritten by a plain safetensors writer), runs t2va from given
prompt embeddings, and encodes prompts with the tiny Qwen3-VL conditioner."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dmd2_core.models.h3_repository import (
    TokenTypeProcessor,
    build_tiny_h3_repository,
    encode_prompts_h3,
    load_t2va,
    run_t2va,
    run_t2va_with_prompt,
)

FRAMES, HEIGHT, WIDTH, STEPS = 124, 32, 32, 5
LATENT_SHAPE = (24, 37, 2, 2)
AUDIO_LATENT_SHAPE = (2, 32, 207)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> str:
    return build_tiny_h3_repository(str(tmp_path_factory.mktemp("h3") / "repo"), seed=0)


@pytest.fixture(scope="module")
def pipe(repo):
    return load_t2va(repo)


@pytest.fixture(scope="module")
def conditioned(repo):
    """The t2va pipeline with the text-encoder step and the tiny Qwen3-VL conditioner loaded."""
    return load_t2va(repo, with_text_encoder=True)


@pytest.fixture(scope="module")
def embeds() -> torch.Tensor:
    return torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(123))


@pytest.fixture(scope="module")
def result(pipe, embeds) -> dict:
    return run_t2va(pipe, embeds, STEPS, FRAMES, HEIGHT, WIDTH, seed=0)


def _run(pipe, embeds, seed=0, **kwargs):
    return run_t2va(pipe, embeds, STEPS, FRAMES, HEIGHT, WIDTH, seed=seed, **kwargs)


def _write_transformer(model, directory) -> None:
    """What the project's exporter writes: config.json + diffusion_pytorch_model.safetensors."""
    from safetensors.torch import save_file

    shutil.rmtree(directory)
    directory.mkdir()
    model.save_config(str(directory))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(directory / "diffusion_pytorch_model.safetensors"))


def test_repository_loads_as_minimax_h3_and_is_portable(repo, tmp_path):
    from diffusers import MiniMaxH3ModularPipeline, ModularPipeline

    index = json.loads((Path(repo) / "modular_model_index.json").read_text())
    assert index["_class_name"] == "MiniMaxH3ModularPipeline"
    assert index["_blocks_class_name"] == "MiniMaxH3Blocks"
    entries = {k: v[2] for k, v in index.items() if isinstance(v, list) and len(v) == 3}
    written = {"transformer", "vae", "audio_vae", "scheduler", "audio_scheduler", "text_encoder", "tokenizer"}
    assert written <= set(entries)
    assert all(e["pretrained_model_name_or_path"] is None for e in entries.values())  # no absolute paths

    assert type(ModularPipeline.from_pretrained(repo)) is MiniMaxH3ModularPipeline

    moved = tmp_path / "elsewhere"
    shutil.copytree(repo, moved)
    pipe = ModularPipeline.from_pretrained(str(moved), workflow="t2va")
    assert type(pipe) is MiniMaxH3ModularPipeline
    assert pipe.get_component_spec("transformer").pretrained_model_name_or_path == str(moved)
    pipe.load_components(names=["transformer", "vae", "audio_vae", "scheduler", "audio_scheduler"])
    assert pipe.transformer.config.hidden_size == 32 and pipe.transformer.config.text_dim == 32
    assert pipe.scheduler.config.shift == 12.0 and pipe.audio_scheduler.config.shift == 3.0
    std = torch.tensor(pipe.vae.config.latents_std)
    assert std.shape == (24,) and 0.5 <= std.min() and std.max() <= 1.5 and std.std() > 0.05
    assert torch.tensor(pipe.audio_vae.config.latents_mean).abs().max() > 0.05


def test_run_t2va_shapes(result, pipe):
    assert result["video"].shape == (3, FRAMES, HEIGHT, WIDTH) and result["video"].dtype == torch.float32
    assert 0.0 <= result["video"].min() and result["video"].max() <= 1.0
    assert result["audio"].shape == (2, 207 * 800) and result["sampling_rate"] == 32000
    assert result["latents"].shape == LATENT_SHAPE
    assert result["audio_latents"].shape == AUDIO_LATENT_SHAPE
    assert all(torch.isfinite(result[k]).all() for k in ("video", "audio", "latents", "audio_latents"))

    # the latents are in normalised model space: the video is the VAE decode of latents * std + mean
    vae = pipe.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        pixels = vae.decode(result["latents"][None] * std + mean, return_dict=False)[0]
    pixels = (pixels * torch.tensor(pipe.pixel_std).view(1, -1, 1, 1, 1)
              + torch.tensor(pipe.pixel_mean).view(1, -1, 1, 1, 1)).clamp(0, 1)
    torch.testing.assert_close(pixels[0], result["video"])


def test_run_t2va_is_seeded(result, pipe, embeds):
    again = _run(pipe, embeds, seed=0)
    for key in ("latents", "audio_latents", "video", "audio"):
        assert torch.equal(again[key], result[key]), key
    other = _run(pipe, embeds, seed=1)
    assert not torch.allclose(other["latents"], result["latents"])
    assert not torch.allclose(other["audio_latents"], result["audio_latents"])


def test_noise_is_drawn_video_first_then_audio_rows(result, pipe, embeds):
    g = torch.Generator().manual_seed(0)
    video_noise = torch.randn(1, *LATENT_SHAPE, generator=g)
    audio_rows = torch.randn(207 * 2, 32, generator=g)  # channel-major rows: [left 207 | right 207]
    audio_noise = audio_rows.reshape(2, 207, 32).permute(0, 2, 1)
    out = pipe(prompt_embeds=embeds, text_token_tags=torch.ones(6, dtype=torch.long), num_inference_steps=STEPS,
               num_frames=FRAMES, height=HEIGHT, width=WIDTH, latents=video_noise, audio_latents=audio_noise,
               output_type="pt", output=["latents", "audio_latents"])
    assert torch.equal(out["latents"][0], result["latents"])
    assert torch.equal(out["audio_latents"], result["audio_latents"])


def test_result_depends_on_the_transformer_directory(repo, pipe, embeds, result, tmp_path):
    copy = tmp_path / "student"
    shutil.copytree(repo, copy)
    transformer = pipe.transformer

    _write_transformer(transformer, copy / "transformer")  # same weights, the exporter's layout
    same = run_t2va(str(copy), embeds, STEPS, FRAMES, HEIGHT, WIDTH, seed=0)
    assert torch.equal(same["latents"], result["latents"])

    perturbed = type(transformer).from_config(transformer.config)
    perturbed.load_state_dict(transformer.state_dict())
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
    _write_transformer(perturbed, copy / "transformer")
    changed = run_t2va(str(copy), embeds, STEPS, FRAMES, HEIGHT, WIDTH, seed=0)
    assert not torch.allclose(changed["latents"], result["latents"])
    assert not torch.allclose(changed["audio_latents"], result["audio_latents"])


def test_encode_prompts_h3(repo, conditioned):
    prompts = ["red cat moving left", "a blue dog", "red cat moving left", "three green birds"]
    embeds = encode_prompts_h3(repo, prompts)  # from the path
    assert all(torch.equal(a, b) for a, b in zip(embeds, encode_prompts_h3(conditioned, prompts)))
    assert [e.shape for e in embeds] == [(len(p.split()), 32) for p in prompts]  # one token per word
    assert torch.equal(embeds[0], embeds[2])
    assert not torch.allclose(embeds[0][:3], embeds[1][:3])
    assert not torch.allclose(embeds[0], encode_prompts_h3(conditioned, prompts[:1], layer=10)[0])
    with pytest.raises(ValueError, match="hidden_states"):
        encode_prompts_h3(conditioned, prompts[:1], layer=51)  # diffusers' own check: needs more than 51 layers


def test_tokenizer_is_word_level_qwen2(pipe, repo):
    from transformers import Qwen2TokenizerFast

    from dmd2_core.models.h3_repository import QWEN_SPECIAL_TOKENS, TOKENIZER_WORDS

    tokenizer = Qwen2TokenizerFast.from_pretrained(str(Path(repo) / "tokenizer"))
    ids = tokenizer(" ".join(TOKENIZER_WORDS), add_special_tokens=False)["input_ids"]
    assert len(ids) == len(TOKENIZER_WORDS)
    special = tokenizer.convert_tokens_to_ids(QWEN_SPECIAL_TOKENS)
    assert len(set(special) | set(ids)) == len(special) + len(ids)  # special tokens: ids of their own
    assert tokenizer("<|vision_start|><|image_pad|>", add_special_tokens=False)["input_ids"] == special[3:6:2]
    # what get_qwen3vl_prompt_embeds asks of the processor: Qwen's 0 text / 1 image / 2 video types
    assert TokenTypeProcessor(tokenizer).create_mm_token_type_ids([[ids[0], special[5], special[6]]]) == [[0, 1, 2]]


def test_run_t2va_with_prompt_goes_through_the_conditioner(conditioned, pipe):
    prompt = "red cat moving left"
    out = run_t2va_with_prompt(conditioned, prompt, STEPS, FRAMES, HEIGHT, WIDTH, seed=0)
    assert out["prompt_embeds"].shape == (1, 4, 32)
    assert out["text_token_tags"].tolist() == [pipe.text_tag] * 4
    assert torch.equal(out["prompt_embeds"][0], encode_prompts_h3(conditioned, [prompt])[0])
    direct = run_t2va(pipe, out["prompt_embeds"], STEPS, FRAMES, HEIGHT, WIDTH, seed=0)
    assert torch.equal(direct["latents"], out["latents"])
    assert torch.equal(direct["audio"], out["audio"])


def test_repository_at_a_storage_url(s3_bucket, embeds, result):
    url = build_tiny_h3_repository(f"{s3_bucket}/h3", seed=0, with_conditioner=False)
    out = run_t2va(url, embeds, STEPS, FRAMES, HEIGHT, WIDTH, seed=0)
    assert torch.equal(out["latents"], result["latents"])  # same seed, same components
    with pytest.raises(ValueError, match="text_encoder"):
        encode_prompts_h3(url, ["red cat"])
