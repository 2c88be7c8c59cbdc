"""MiniMax-H3's ref2va workflow on the CPU stand-in: image and sound references prepared once into
the prompt set with diffusers' own ref2va blocks, the packed layout with reference blocks as
diffusers builds it (an image's rows noised to 0.999 and held at max(t, 0.999), a sound's rows
clean at t = 1, neither reached by a loss), the repository's transformer_ref/ distilled and
exported into transformer_ref/, and every bad reference refused in one line before any actor."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dmd2_core.args import load_args
from dmd2_core.errors import ArgsError, ModelDirError
from dmd2_core.models import load_model_dir
from dmd2_core.run.distill_run import preflight
from dmd2_core.toys.standins import H3_GEOMETRY, build_h3_standin
from tests.helpers import DecodedRun

CPU = dict(device="cpu", num_devices=1, dtype="float32", global_batch_size=2, micro_batch_size=2, torch_threads=1,
           lora_rank=0, cp_size=1, eval_prompts=[0, 1], workflow="ref2va", **H3_GEOMETRY)
PROMPTS = ["a red ball moving left", "a blue cat jumping"]
SAMPLE_RATE = 32000  # the stand-in's audio VAE
IMAGE_ROWS = 1  # an image reference at the 32 px short edge: one 2x2 latent frame, one row at patch 2
AUDIO_ROWS = 2 * 207  # a sound cut to the 124-frame clip: 207 latents per stereo channel


def _image(path, size=(64, 64), seed=0):
    from PIL import Image

    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return path.name


def _sound(path, seconds=6.0, rate=SAMPLE_RATE, seed=0):
    from scipy.io import wavfile

    tone = np.sin(2 * np.pi * (220 + 110 * seed) * np.arange(int(seconds * rate)) / rate).astype(np.float32) * 0.3
    wavfile.write(path, rate, np.stack([tone, tone * 0.5], axis=1))
    return path.name


@pytest.fixture(scope="module")
def ref2va(tmp_path_factory):
    from dmd2_core.prepare.prompts import prepare_prompts

    root = tmp_path_factory.mktemp("ref2va")
    url = build_h3_standin(str(root / "h3"), with_conditioner=True)
    entries = [[{"image": _image(root / f"subject{i}.png", seed=i)}, {"audio": _sound(root / f"voice{i}.wav", seed=i)}]
               for i in range(len(PROMPTS))]
    (root / "references.json").write_text(json.dumps(entries))
    prompts = str(root / "ref2va.safetensors")
    prompt_set = prepare_prompts(url, PROMPTS, prompts, references=str(root / "references.json"),
                                 clip=tuple(H3_GEOMETRY.values()))
    loaded = load_model_dir(url, transformer="transformer_ref")
    family = loaded.family.bind([24, 37, 2, 2], loaded.model, loaded.modality_shifts)
    return dict(root=root, url=url, prompts=prompts, set=prompt_set, model=loaded.model, family=family,
                entries=entries)


def test_prepared_set_holds_the_references_as_diffusers_ref2va_blocks_encode_them(ref2va):
    """Per prompt: the presentation with a vision block for the picture (its rows tagged video),
    the image's VAE latents at its own 32 px short edge (the stand-in's configured
    ``reference_image_short_edge``), the sound's rows cut to the clip, the order, and the resized
    picture for the eval media; a training batch's conditions never carry the picture."""
    from dmd2_core.data import REFERENCE_PIXELS, StoredPromptSet

    embeds = ref2va["set"].embeds
    n = len(PROMPTS)
    assert embeds["reference_latents"].shape == (n, 1, 24, 1, 2, 2)
    assert embeds["reference_audio_latents"].shape == (n, 1, AUDIO_ROWS, 32)
    assert embeds["reference_kinds"].tolist() == [[0, 1]] * n
    assert embeds[REFERENCE_PIXELS].shape == (n, 1, 3, 32, 32) and embeds[REFERENCE_PIXELS].dtype == torch.uint8
    for i in range(n):
        tags = embeds["text_token_tags"][i, :embeds["prompt_lengths"][i]]
        assert (tags == 0).sum() > 0 and (tags == 1).sum() > 0
    assert not torch.equal(embeds["reference_latents"][0], embeds["reference_latents"][1])
    assert not torch.equal(embeds["reference_audio_latents"][0], embeds["reference_audio_latents"][1])
    assert REFERENCE_PIXELS not in StoredPromptSet(ref2va["prompts"]).cond([0, 1])


def _capturing(model, seen):
    def forward(**kwargs):
        out = model(**kwargs)
        out[0].retain_grad()
        out[1].retain_grad()
        seen.update(kwargs, video_out=out[0], audio_out=out[1])
        return out
    return forward


def test_reference_rows_are_conditions_never_reached_by_the_loss(ref2va):
    """The picture's rows lead the video rows, noised to 0.999 and held at max(t_video, 0.999);
    the sound's rows lead the audio rows, clean, at t = 1; the model's outputs on both get no
    gradient from a loss on the family's velocity, and each reference changes the generated rows'
    velocity (both are seen)."""
    family, model = ref2va["family"], ref2va["model"]
    cond = ref2va["set"].cond([0, 0])
    x = torch.randn(2, family.segments["audio"].stop, generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.5, 0.5])
    seen: dict = {}
    v = family.predict_velocity(_capturing(model, seen), x, sigma, cond)
    assert v.shape == x.shape
    t_video, t_audio = (1 - s for s in family.modality_sigmas(0.5))
    row_t = seen["timestep"][seen["timestep_indices"]]
    video_idx, audio_idx = seen["video_indices"], seen["audio_indices"]
    torch.testing.assert_close(row_t[video_idx[:IMAGE_ROWS]], torch.full((IMAGE_ROWS,), 0.999))
    torch.testing.assert_close(row_t[video_idx[IMAGE_ROWS:]], torch.full((37,), t_video))
    torch.testing.assert_close(row_t[audio_idx[:AUDIO_ROWS]], torch.full((AUDIO_ROWS,), 1.0))
    torch.testing.assert_close(row_t[audio_idx[AUDIO_ROWS:]], torch.full((AUDIO_ROWS,), t_audio))
    torch.testing.assert_close(seen["hidden_states"][:, :IMAGE_ROWS], family.condition_rows(cond["reference_latents"]))
    torch.testing.assert_close(seen["audio_hidden_states"][:, :AUDIO_ROWS], cond["reference_audio_latents"][:, 0])
    v.square().sum().backward()
    for out, given in (("video_out", IMAGE_ROWS), ("audio_out", AUDIO_ROWS)):
        grad = seen[out].grad
        assert grad[:, :given].abs().max() == 0 and grad[:, given:].abs().max() > 0
    other = ref2va["set"].cond([1, 1])
    with torch.no_grad():
        for key in ("reference_latents", "reference_audio_latents"):
            assert not torch.allclose(family.predict_velocity(model, x, sigma, dict(cond, **{key: other[key]})), v)


def test_one_ref2va_iteration_distills_transformer_ref(ref2va, tmp_path):
    """Through preflight and the in-process trainers: the student starts as the repository's
    transformer_ref/ (not transformer/), and the rollout, the critic and the student train on the
    reference set."""
    from dmd2_core.train.trainer import Trainer

    args = load_args("minimax-h3", dict(CPU, hf_checkpoint=ref2va["url"], prompts=ref2va["prompts"],
                                        save=str(tmp_path / "run")))
    roles = preflight(args)
    actor, critic = Trainer(roles["actor"], "actor"), Trainer(roles["critic"], "critic")
    before = actor.weights()
    ref, plain = ref2va["model"].state_dict(), load_model_dir(ref2va["url"]).model.state_dict()
    stored = [k for k in before if k in ref]  # the weights, not the computed buffers
    assert len(stored) > 50 and all(torch.equal(before[k], ref[k]) for k in stored)
    assert any(not torch.equal(before[k], plain[k]) for k in stored)
    pairs, _ = actor.rollout(1)
    outputs, metrics = critic.train(1, pairs)
    assert metrics["dmd2_grad_norm_video"] > 0 and metrics["dmd2_grad_norm_audio"] > 0
    actor.train(1, pairs, outputs)
    assert any(not torch.equal(before[k], after) for k, after in actor.weights().items())


def test_a_ref2va_export_serves_the_ref2va_workflow_with_the_trainers_latents(ref2va, tmp_path):
    """A ref2va run's export holds the student in transformer_ref/ (no transformer/), names its
    workflow, and diffusers' modular pipeline loaded with it
    (``ModularPipeline.from_pretrained(export, workflow="ref2va")``), given a prompt set row (the
    presentation, the picture's latents, the sound's rows, their order), seed s + j and
    num_inference_steps K + 1, samples the trainer's eval sample j, video and audio latents both:
    the picture's noise is drawn from that seed before the clip's, as diffusers draws it."""
    from dmd2_core.models.h3_repository import load_denoising, run_ref2va
    from tests.helpers import in_process_trainers, iterate_in_process

    save = tmp_path / "run"
    trainers = in_process_trainers(load_args("minimax-h3", dict(
        CPU, hf_checkpoint=ref2va["url"], prompts=ref2va["prompts"], save=str(save), async_save=False,
        dmd2_student_steps=[2])))
    iterate_in_process(trainers, 1)
    actor = trainers["actor"]
    url = actor.save(1, export=True)["export_url"]
    export = save / "exports" / "iter_0000001"
    marker = json.loads((export / "export.json").read_text())
    assert marker["workflow"] == "ref2va" and marker["num_inference_steps"] == 3
    assert (export / "transformer_ref").is_dir() and not (export / "transformer").exists()
    index = json.loads((export / "modular_model_index.json").read_text())
    assert "transformer_ref" in index and "transformer" not in index
    ours = actor.sample([1, 0], seed=7, decode=False)  # rows j use seed 7 + j
    pipe = load_denoising(url, marker["workflow"])
    embeds = ref2va["set"].embeds
    for j, p in enumerate([1, 0]):
        length = int(embeds["prompt_lengths"][p])
        theirs = run_ref2va(pipe, embeds["prompt_embeds"][p, :length], embeds["text_token_tags"][p, :length],
                            embeds["reference_latents"][p], embeds["reference_kinds"][p].tolist(),
                            embeds["reference_audio_latents"][p], num_inference_steps=3, seed=7 + j, **H3_GEOMETRY)
        joined = ref2va["family"].join(theirs["latents"][None], theirs["audio_latents"][None])
        torch.testing.assert_close(joined, ours[j:j + 1], atol=2e-4, rtol=2e-4)


def _bad_set(ref2va, name, **changes):
    from dmd2_core.data import PromptSet

    embeds = dict(ref2va["set"].embeds, **changes)
    path = str(ref2va["root"] / name)
    PromptSet(PROMPTS, embeds, {}).save(path)
    return path


def _no_ref_partition(ref2va):
    import shutil

    repo = ref2va["root"] / "no_ref"
    if not repo.exists():
        shutil.copytree(ref2va["url"], repo, ignore=shutil.ignore_patterns("transformer_ref"))
    return str(repo)


@pytest.mark.parametrize("override, message", [
    (dict(workflow="t2va"), r"^prompts: .*ref2va.safetensors holds references .*set workflow: ref2va"),
    (dict(workflow="fl2va"), r"^prompts: .*ref2va.safetensors holds references .*set workflow: ref2va"),
    (dict(prompts="t2va"), r"^prompts: .*t2va.safetensors holds no 'reference_latents' .*--references"),
    (dict(prompts="kinds"), r"^prompts: .* row 0 names references \[0, 0\] .* for 1 image and 1 audio references"),
    (dict(prompts="long_sound"), r"^prompts: .* audio references span 300 latents, the clip's soundtrack 207"),
    (dict(prompts="sound_alone"), r"^prompts: .*'reference_latents' is \[2, 0, 24, 1, 2, 2\]; .*at least one image"),
    (dict(hf_checkpoint="no_ref"), r"^hf_checkpoint: .*no_ref/transformer_ref: missing"),
    (dict(num_devices=2, cp_size=2), r"^cp_size: 2 ranks do not split the \d+-token sequence of latent_shape "
                                     r"\[24, 37, 2, 2\] and its references with a \d+-token prompt"),
])
def test_a_bad_reference_set_fails_before_any_actor_in_one_line(ref2va, tmp_path, override, message):
    from dmd2_core.toys.standins import h3_prompt_set

    sets = {"t2va": lambda: h3_prompt_set().save(str(ref2va["root"] / "t2va.safetensors"))
            or str(ref2va["root"] / "t2va.safetensors"),
            "kinds": lambda: _bad_set(ref2va, "kinds.safetensors", reference_kinds=torch.zeros(2, 2, dtype=torch.long)),
            "long_sound": lambda: _bad_set(ref2va, "long.safetensors", reference_audio_latents=torch.zeros(2, 1, 600, 32)),
            "sound_alone": lambda: _bad_set(ref2va, "alone.safetensors", reference_latents=torch.zeros(2, 0, 24, 1, 2, 2),
                                            reference_kinds=torch.ones(2, 1, dtype=torch.long))}
    prompts = override.pop("prompts", None)
    url = ref2va["prompts"] if prompts is None else sets[prompts]()
    if override.get("hf_checkpoint") == "no_ref":
        override["hf_checkpoint"] = _no_ref_partition(ref2va)
    args = load_args("minimax-h3", dict(CPU, **dict(dict(hf_checkpoint=ref2va["url"], prompts=url,
                                                         save=str(tmp_path / "run")), **override)))
    with pytest.raises((ArgsError, ModelDirError), match=message) as err:
        preflight(args)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("entries, message", [
    ([[{"image": "subject0.png"}], [{"video": "clip.mp4"}]], r"^references: row 1 .* a video reference needs "
                                                              r"Qwen3-VL's video processor, which needs torchvision"),
    ([[{"image": "subject0.png"}], [{"imag": "subject1.png"}]], r"^references: row 1 .* is no reference; did you "
                                                                r"mean 'image'"),
    ([[{"image": "subject0.png"}], [{"image": "subject1.png"}, {"audio": "voice1.wav"}]],
     r"^references: row 1 .* names image, audio; row 0 names image"),
    ([[{"audio": "voice0.wav"}, {"image": "subject0.png"}], [{"image": "subject1.png"}]],
     r"^references: row 0 .* its first reference is a sound"),
    ([[{"image": "subject0.png"}, {"audio": "slow.wav"}], [{"image": "subject1.png"}, {"audio": "voice1.wav"}]],
     r"^references: row 0 .*/slow.wav is at 16000 Hz, the audio VAE takes 32000 Hz"),
    ([[{"image": "subject0.png"}], [{"image": "missing.png"}]], r"^references: row 1 .* no image at .*missing.png"),
    ([[{"image": "subject0.png"}, {"audio": "voice0.wav"}], [{"image": "subject1.png"}, {"audio": "short.wav"}]],
     r"^references: row 1 .* sounds encode to \[\(160, 32\)\] rows, row 0's to \[\(414, 32\)\]"),
])
def test_a_bad_reference_is_named_in_one_line(ref2va, tmp_path, entries, message):
    from dmd2_core.prepare.prompts import prepare_prompts

    _sound(ref2va["root"] / "slow.wav", rate=16000)
    _sound(ref2va["root"] / "short.wav", seconds=2.0)
    listing = ref2va["root"] / "bad_references.json"
    listing.write_text(json.dumps(entries))
    out = tmp_path / "never.safetensors"
    with pytest.raises(ArgsError, match=message) as err:
        prepare_prompts(ref2va["url"], PROMPTS, str(out), references=str(listing), clip=tuple(H3_GEOMETRY.values()))
    assert "\n" not in str(err.value)
    assert not out.exists()


def test_the_plan_counts_the_reference_rows(ref2va):
    """Every forward carries the picture's row and the sound's rows: the token count the memory
    plan reads, and the time plan's forward, grow by them."""
    from dmd2_core.data import references_per_sample
    from dmd2_core.memory.time_plan import model_flops

    family, config = ref2va["family"], dict(ref2va["model"].config)
    references = references_per_sample(ref2va["prompts"], "ref2va")
    assert references == (("image", 1, 2, 2), ("audio", AUDIO_ROWS))
    plain = family.tokens(config, None)
    assert family.bind(family.latent_shape, references=references).tokens(config, None) == plain + IMAGE_ROWS + AUDIO_ROWS
    shape = tuple(family.latent_shape)
    assert model_flops(ref2va["url"], shape, None, 8, 0, references).forward > model_flops(ref2va["url"], shape, None, 8).forward


def test_the_eval_frame_strip_shows_the_picture_reference_before_the_frames(ref2va, tmp_path):
    """A ref2va eval's frame strip of prompt p: its picture reference's cell (the image as the
    pipeline resized it: the set's ``reference_pixels``), a white gap, then the generated frames."""
    import io

    from PIL import Image

    from dmd2_core.media.av_clips import KEYFRAME_GAP_PX, MIN_SIDE_PX, video_uint8
    from dmd2_core.media.eval_files import write_eval_media

    cell, scale = MIN_SIDE_PX, MIN_SIDE_PX // 32
    args = load_args("minimax-h3", dict(CPU, hf_checkpoint=ref2va["url"], prompts=ref2va["prompts"],
                                        save=str(tmp_path / "run")))
    run = DecodedRun(args)
    media = write_eval_media(run, 3, [1, 0], None, 512 * 1024, 256 * 1024)
    captions = {m["url"]: m["caption"] for m in media if m["url"].endswith("_frames.png")}
    pictures = ref2va["set"].embeds["reference_pixels"]
    for p in (1, 0):
        url = tmp_path / "run" / "media" / f"iter_0000003_p{p}_frames.png"
        assert captions[str(url)].endswith("set apart after its picture reference")
        strip = np.asarray(Image.open(io.BytesIO(url.read_bytes())).convert("RGB"))
        assert strip.shape[:2] == (cell, 9 * cell + KEYFRAME_GAP_PX)
        picture = pictures[p, 0].permute(1, 2, 0).numpy().repeat(scale, 0).repeat(scale, 1)
        np.testing.assert_array_equal(strip[:, :cell], picture)
        assert (strip[:, cell:cell + KEYFRAME_GAP_PX] == 255).all()
        first = video_uint8(run.sample([p], 0)["video"][0].permute(1, 0, 2, 3))[0]
        start = cell + KEYFRAME_GAP_PX
        np.testing.assert_array_equal(strip[:, start:start + cell], first.repeat(scale, 0).repeat(scale, 1))


def test_a_ref2va_lora_export_loads_into_transformer_ref_through_diffusers(ref2va, tmp_path):
    """A LoRA ref2va student's adapters are written under ``transformer_ref.`` keys, so diffusers'
    ``MiniMaxH3LoraLoaderMixin`` loads them into the ref2va partition of the teacher's pipeline,
    even one holding both partitions (``ModularPipeline.from_pretrained(teacher)``, every
    workflow): the two share module names, and a ``transformer.`` file goes into the other one."""
    from diffusers import ModularPipeline

    from dmd2_core.export.pipeline import export_student
    from dmd2_core.models import lora

    args = load_args(None, dict(hf_checkpoint=ref2va["url"], prompts="digits", save=str(tmp_path), lora_rank=4,
                                lora_alpha=8.0))
    student = lora.attach(load_model_dir(ref2va["url"], transformer="transformer_ref").model, args)
    with torch.no_grad():
        for name, param in lora.trained(student):
            if ".lora_B." in name:
                param.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
    done = export_student(str(tmp_path / "export"), student, teacher_url=ref2va["url"], shift=1.0, num_steps=4,
                          export_dtype=torch.float32, lora_metadata=lora.adapter_metadata(args), workflow="ref2va")
    marker = json.loads((tmp_path / "export" / "export.json").read_text())
    assert marker["workflow"] == "ref2va" and marker["lora"]["partition"] == "transformer_ref"
    pipe = ModularPipeline.from_pretrained(ref2va["url"])
    pipe.load_components(names=["transformer", "transformer_ref"])
    pipe.load_lora_weights(done["url"])
    ours = {n.replace(f".{lora.ADAPTER}.", "."): p for n, p in student.named_parameters()}
    theirs = {n.replace(".default_0.", "."): p for n, p in pipe.transformer_ref.named_parameters()}
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert not any("lora" in n for n, _ in pipe.transformer.named_parameters())


def test_a_lora_ref2va_checkpoint_exported_whole_after_the_fact_serves_ref2va(ref2va, tmp_path):
    """A LoRA ref2va run's checkpoint, exported after the fact as a whole pipeline (``--format
    pipeline``): the adapters merged into transformer_ref/'s weights (not transformer/'s), written
    to the export's transformer_ref/, which diffusers' ref2va pipeline loads and samples the
    trainer's eval latents from."""
    import contextlib
    import io

    from dmd2_core.cli import main
    from dmd2_core.models.h3_repository import load_denoising, run_ref2va
    from tests.helpers import in_process_trainers, iterate_in_process

    save, out = tmp_path / "run", tmp_path / "whole"
    trainers = in_process_trainers(load_args("minimax-h3", dict(
        CPU, hf_checkpoint=ref2va["url"], prompts=ref2va["prompts"], save=str(save), async_save=False,
        dmd2_student_steps=[2], lora_rank=4, lora_alpha=8.0, ema_decay=None)))
    iterate_in_process(trainers, 1)
    actor = trainers["actor"]
    actor.save(1)
    actor.save_status(wait=True)
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["export", "--load", str(save), "--out", str(out), "--format", "pipeline"]) == 0
    assert (out / "transformer_ref").is_dir() and not (out / "transformer").exists()
    assert json.loads((out / "export.json").read_text())["workflow"] == "ref2va"
    ours = actor.sample([1], seed=7, decode=False)
    embeds, length = ref2va["set"].embeds, int(ref2va["set"].embeds["prompt_lengths"][1])
    theirs = run_ref2va(load_denoising(str(out), "ref2va"), embeds["prompt_embeds"][1, :length],
                        embeds["text_token_tags"][1, :length], embeds["reference_latents"][1],
                        embeds["reference_kinds"][1].tolist(), embeds["reference_audio_latents"][1],
                        num_inference_steps=3, seed=7, **H3_GEOMETRY)
    joined = ref2va["family"].join(theirs["latents"][None], theirs["audio_latents"][None])
    torch.testing.assert_close(joined, ours, atol=2e-4, rtol=2e-4)
