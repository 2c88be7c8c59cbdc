"""MiniMax-H3's fl2va workflow on the CPU stand-in: keyframes prepared once into the prompt set
with diffusers' own fl2va blocks, the packed layout with keyframe condition rows as diffusers
builds it (noised to 0.999, held at max(t, 0.999), never reached by a loss), one trainer
iteration on keyframes, and every bad keyframe or workflow refused in one line before any actor."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dmd2_core.args import load_args
from dmd2_core.errors import ArgsError
from dmd2_core.models import load_model_dir
from dmd2_core.run.distill_run import preflight
from dmd2_core.toys.standins import H3_GEOMETRY, build_h3_standin, h3_prompt_set
from tests.helpers import DecodedRun

CPU = dict(device="cpu", num_devices=1, dtype="float32", global_batch_size=2, micro_batch_size=2, torch_threads=1,
           lora_rank=0, cp_size=1, eval_prompts=[0, 1], **H3_GEOMETRY)
PROMPTS = ["a red ball moving left", "a blue cat jumping"]


def _image(path, size=(32, 32), seed=0):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path.name


@pytest.fixture(scope="module")
def fl2va(tmp_path_factory):
    from dmd2_core.prepare.prompts import prepare_prompts

    root = tmp_path_factory.mktemp("fl2va")
    url = build_h3_standin(str(root / "h3"), with_conditioner=True)
    entries = [{"first": _image(root / f"first{i}.png", seed=i), "last": _image(root / f"last{i}.png", seed=9 + i)}
               for i in range(len(PROMPTS))]
    (root / "keyframes.json").write_text(json.dumps(entries))
    prompts = str(root / "fl2va.safetensors")
    prompt_set = prepare_prompts(url, PROMPTS, prompts, keyframes=str(root / "keyframes.json"))
    t2va = str(root / "t2va.safetensors")
    h3_prompt_set().save(t2va)
    loaded = load_model_dir(url)
    family = loaded.family.bind([24, 37, 2, 2], loaded.model, loaded.modality_shifts)
    return dict(root=root, url=url, prompts=prompts, t2va=t2va, set=prompt_set, model=loaded.model, family=family,
                entries=entries)


def test_prepared_set_holds_the_keyframes_as_diffusers_fl2va_blocks_encode_them(fl2va):
    """Per prompt: the presentation with a vision block per keyframe (its rows tagged video), the
    keyframes' VAE latents at the clip's latent frame size and their anchors, first then last."""
    embeds = fl2va["set"].embeds
    n, k = len(PROMPTS), 2
    assert embeds["keyframe_latents"].shape == (n, k, 24, 1, 2, 2)
    assert embeds["keyframe_anchors"].tolist() == [[0, 1]] * n
    for i in range(n):
        tags = embeds["text_token_tags"][i, :embeds["prompt_lengths"][i]]
        assert (tags == 0).sum() > 0 and (tags == 1).sum() > 0  # vision rows (video) and text rows
    assert not torch.equal(embeds["keyframe_latents"][0], embeds["keyframe_latents"][1])


def _picture(path):
    """An image file as uint8 [3, H, W]."""
    from PIL import Image

    return torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1)


def test_the_set_keeps_the_keyframes_pictures_for_the_eval_media_and_no_batch_reads_them(fl2va):
    """``keyframe_pixels`` [N, K, 3, H, W] uint8 are the keyframe files themselves, in the
    latents' order; a training batch's conditions (the stored set's rows, a loaded set's) never
    carry them."""
    from dmd2_core.data import KEYFRAME_PIXELS, StoredPromptSet, load_prompt_set

    pixels = fl2va["set"].embeds[KEYFRAME_PIXELS]
    assert pixels.dtype == torch.uint8 and pixels.shape == (len(PROMPTS), 2, 3, 32, 32)
    for i, entry in enumerate(fl2va["entries"]):
        assert torch.equal(pixels[i, 0], _picture(fl2va["root"] / entry["first"]))
        assert torch.equal(pixels[i, 1], _picture(fl2va["root"] / entry["last"]))
    stored = StoredPromptSet(fl2va["prompts"]).cond([1, 0])
    loaded = load_prompt_set(fl2va["prompts"]).cond([1, 0])
    assert KEYFRAME_PIXELS not in stored and KEYFRAME_PIXELS not in loaded
    assert set(stored) == set(loaded) and all(torch.equal(stored[k], loaded[k]) for k in stored)


def _cells(png: bytes, cell: int) -> tuple[np.ndarray, int]:
    """A frame strip's pixels [cell, width, 3] and its width."""
    import io

    from PIL import Image

    strip = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    assert strip.shape[0] == cell
    return strip, strip.shape[1]


def test_the_eval_frame_strip_shows_the_keyframes_at_the_ends_they_anchor(fl2va, tmp_path):
    """An fl2va eval's frame strip of prompt p: its first keyframe's cell, a white gap, the
    generated frames, a white gap, its last keyframe's cell (each the keyframe file itself, shown
    at the strip's height); a set prepared before the pictures were kept gives the strip of the
    generated frames alone, and no error."""
    from dmd2_core.data import KEYFRAME_PIXELS, PromptSet
    from dmd2_core.media.av_clips import KEYFRAME_GAP_PX, MIN_SIDE_PX, video_uint8
    from dmd2_core.media.eval_files import write_eval_media

    cell, scale = MIN_SIDE_PX, MIN_SIDE_PX // 32  # 32 px frames shown 128 px high: 4x nearest

    def shown(picture):  # uint8 [3, H, W] -> its cell
        return picture.permute(1, 2, 0).numpy().repeat(scale, 0).repeat(scale, 1)

    args = load_args("minimax-h3", dict(CPU, hf_checkpoint=fl2va["url"], prompts=fl2va["prompts"], workflow="fl2va",
                                        save=str(tmp_path / "run")))
    run = DecodedRun(args)
    media = write_eval_media(run, 3, [1, 0], None, 512 * 1024, 256 * 1024)
    strips = {m["url"]: m for m in media if m["url"].endswith("_frames.png")}
    for p in (1, 0):
        strip_url = str(tmp_path / "run" / "media" / f"iter_0000003_p{p}_frames.png")
        assert "first and last keyframes" in strips[strip_url]["caption"]
        strip, width = _cells((tmp_path / "run" / "media" / f"iter_0000003_p{p}_frames.png").read_bytes(), cell)
        assert width == 10 * cell + 2 * KEYFRAME_GAP_PX  # 8 generated frames between the two keyframes
        entry = fl2va["entries"][p]
        np.testing.assert_array_equal(strip[:, :cell], shown(_picture(fl2va["root"] / entry["first"])))
        np.testing.assert_array_equal(strip[:, -cell:], shown(_picture(fl2va["root"] / entry["last"])))
        assert (strip[:, cell:cell + KEYFRAME_GAP_PX] == 255).all()
        assert (strip[:, -cell - KEYFRAME_GAP_PX:-cell] == 255).all()
        first_generated = video_uint8(run.sample([p], 0)["video"][0].permute(1, 0, 2, 3))[0]
        start = cell + KEYFRAME_GAP_PX
        np.testing.assert_array_equal(strip[:, start:start + cell], first_generated.repeat(scale, 0).repeat(scale, 1))

    older = str(tmp_path / "older.safetensors")  # the same set, as prepared before the pictures were kept
    PromptSet(PROMPTS, {k: v for k, v in fl2va["set"].embeds.items() if k != KEYFRAME_PIXELS}, {}).save(older)
    run.args = load_args("minimax-h3", dict(CPU, hf_checkpoint=fl2va["url"], prompts=older, workflow="fl2va",
                                            save=str(tmp_path / "older")))
    media = write_eval_media(run, 3, [1, 0], None, 512 * 1024, 256 * 1024)
    _, width = _cells((tmp_path / "older" / "media" / "iter_0000003_p1_frames.png").read_bytes(), cell)
    assert width == 8 * cell
    assert [m["caption"] for m in media if m["url"].endswith("_frames.png")][0].endswith(": frames")


def _capturing(model, seen):
    def forward(**kwargs):
        out = model(**kwargs)
        out[0].retain_grad()
        seen.update(kwargs, video_out=out[0])
        return out
    return forward


def test_keyframe_rows_are_conditions_never_reached_by_the_loss(fl2va):
    """The keyframes lead the video rows, noised to 0.999 and held at max(t_video, 0.999); the
    model's outputs on them get no gradient from a loss on the family's velocity, and the
    keyframes change the generated rows' velocity (the condition is seen)."""
    family, model = fl2va["family"], fl2va["model"]
    cond = fl2va["set"].cond([0, 0])  # one layout: one forward
    x = torch.randn(2, family.segments["audio"].stop, generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.5, 0.5])
    seen: dict = {}
    v = family.predict_velocity(_capturing(model, seen), x, sigma, cond)
    assert v.shape == x.shape
    rows = 2 * 1 * 1  # two keyframes of one 2x2 latent frame at patch 2: one row each
    t_video = 1 - family.modality_sigmas(0.5)[0]
    row_t = seen["timestep"][seen["timestep_indices"]]
    torch.testing.assert_close(row_t[seen["video_indices"][:rows]], torch.full((rows,), 0.999))
    torch.testing.assert_close(row_t[seen["video_indices"][rows:]], torch.full((37,), t_video))
    torch.testing.assert_close(seen["hidden_states"][:, :rows], family.condition_rows(cond["keyframe_latents"]))
    v.square().sum().backward()
    grad = seen["video_out"].grad
    assert grad[:, :rows].abs().max() == 0 and grad[:, rows:].abs().max() > 0
    with torch.no_grad():
        other = dict(cond, keyframe_latents=fl2va["set"].cond([1, 1])["keyframe_latents"])
        assert not torch.allclose(family.predict_velocity(model, x, sigma, other), v)


def test_one_fl2va_iteration_trains_on_keyframes(fl2va, tmp_path):
    """Through preflight and the in-process trainers: the rollout, the critic and the student on
    the keyframe set, the student moves."""
    from dmd2_core.train.trainer import Trainer

    args = load_args("minimax-h3", dict(CPU, hf_checkpoint=fl2va["url"], prompts=fl2va["prompts"], workflow="fl2va",
                                        save=str(tmp_path / "run")))
    roles = preflight(args)
    actor, critic = Trainer(roles["actor"], "actor"), Trainer(roles["critic"], "critic")
    pairs, _ = actor.rollout(1)
    outputs, metrics = critic.train(1, pairs)
    assert metrics["dmd2_grad_norm_video"] > 0
    before = actor.weights()
    _, trained = actor.train(1, pairs, outputs)
    assert trained["graded_x0_drift"] < 1e-4
    assert any(not torch.equal(before[k], after) for k, after in actor.weights().items())


class _LeadingRows:
    """The leading ``count`` video rows of each forward ``module`` runs (its ``hidden_states``)."""

    def __init__(self, module, count):
        self.module, self.count, self.seen = module, count, []

    def __enter__(self):
        self.handle = self.module.register_forward_pre_hook(
            lambda _, args, kwargs: self.seen.append(kwargs["hidden_states"][:, :self.count].detach().clone()),
            with_kwargs=True)
        return self.seen

    def __exit__(self, *exc):
        self.handle.remove()


def test_an_fl2va_export_serves_the_fl2va_workflow_with_the_trainers_latents(fl2va, tmp_path):
    """An fl2va run's export (and one written after the fact from its checkpoint) names its
    workflow in export.json, and diffusers' modular pipeline
    loaded with it (``ModularPipeline.from_pretrained(export, workflow="fl2va")``), given a prompt
    set row (the presentation's embeddings and tags, the keyframes' latents and anchors), seed
    s + j and num_inference_steps K + 1, samples the trainer's eval sample j, video and audio
    latents both. Each keyframe's noise is drawn from that seed before the clip's, as diffusers
    draws it: every step of both sees the same noised keyframe rows (their 0.1 % of noise moves the
    stand-in's latents by ~1e-6 only, so the rows are compared themselves)."""
    import contextlib
    import io

    from dmd2_core.cli import main
    from dmd2_core.models.h3_repository import load_denoising, run_fl2va
    from tests.helpers import in_process_trainers, iterate_in_process

    save = tmp_path / "run"
    trainers = in_process_trainers(load_args("minimax-h3", dict(
        CPU, hf_checkpoint=fl2va["url"], prompts=fl2va["prompts"], workflow="fl2va", save=str(save),
        async_save=False, dmd2_student_steps=[2])))
    iterate_in_process(trainers, 1)
    actor = trainers["actor"]
    url = actor.save(1, export=True)["export_url"]
    marker = json.loads((save / "exports" / "iter_0000001" / "export.json").read_text())
    assert marker["workflow"] == "fl2va" and marker["num_inference_steps"] == 3
    later = tmp_path / "later"  # exported after the fact from the checkpoint: the workflow it recorded
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["export", "--load", str(save), "--out", str(later), "--format", "pipeline"]) == 0
    assert json.loads((later / "export.json").read_text())["workflow"] == "fl2va"
    rows = 2 * 1 * 1  # two keyframes of one 2x2 latent frame at patch 2
    with _LeadingRows(actor.model, rows) as ours_rows:
        ours = actor.sample([1, 0], seed=7, decode=False)  # rows j use seed 7 + j
    pipe = load_denoising(url, marker["workflow"])
    embeds = fl2va["set"].embeds
    for j, p in enumerate([1, 0]):
        length = int(embeds["prompt_lengths"][p])
        with _LeadingRows(pipe.transformer, rows) as theirs_rows:
            theirs = run_fl2va(pipe, embeds["prompt_embeds"][p, :length], embeds["text_token_tags"][p, :length],
                               embeds["keyframe_latents"][p], embeds["keyframe_anchors"][p].tolist(),
                               num_inference_steps=3, num_frames=124, height=32, width=32, seed=7 + j)
        joined = fl2va["family"].join(theirs["latents"][None], theirs["audio_latents"][None])
        torch.testing.assert_close(joined, ours[j:j + 1], atol=2e-4, rtol=2e-4)
        per_step = torch.cat(ours_rows).unflatten(0, (2, 2))  # [step, sample]: the forwards run step by step
        assert len(theirs_rows) == 2  # the student's 2 steps
        for step, anchors in enumerate(theirs_rows):
            torch.testing.assert_close(anchors[0], per_step[step, j], atol=1e-6, rtol=0)


def _features_by_hand(family, model, x0, cond, keyframes=0, u=0.5, seed=0):
    """What the teacher's features of ``x0`` must be: each sample noised alone with its feature
    noise and run (stopped at the middle block) under every entry of its ``cond``, the block's
    rows read off diffusers' layout [text | keyframes | audio | video] by position."""
    from dmd2_core.evaluation.teacher_features import sample_noise
    from dmd2_core.models.feature_tap import FeatureTap

    noise = sample_noise(x0.shape, seed)
    rows_per_frame = family.video_shape[2] * family.video_shape[3] // 4  # patch 2 x 2
    audio_rows = family.audio_shape[0] * family.audio_shape[2]
    out = {"video": [], "audio": []}
    for i in range(x0.shape[0]):
        with torch.no_grad(), FeatureTap(family, model, None, stop=True) as tap:
            family.predict_velocity(model, family.add_noise(x0[i:i + 1], noise[i:i + 1], u), torch.full((1,), u),
                                    {k: v[i:i + 1] for k, v in cond.items()})
        audio_start = int(cond["prompt_lengths"][i]) + keyframes * rows_per_frame
        out["audio"].append(tap.features[0, audio_start:audio_start + audio_rows].mean(0))
        out["video"].append(tap.features[0, audio_start + audio_rows:].mean(0))
    return {k: torch.stack(v) for k, v in out.items()}


def test_the_teachers_features_of_an_fl2va_clip_see_its_keyframes(fl2va):
    """An fl2va eval's teacher features judge a clip under the conditions it was made with: its
    keyframes are in the teacher's forward (other keyframes, other features) and only the
    generated rows are pooled; a t2va clip's features are the text-only forward's, as before."""
    from dmd2_core.data import load_prompt_set
    from dmd2_core.evaluation.teacher_features import teacher_features

    family, model = fl2va["family"], fl2va["model"]
    x0 = torch.randn(2, family.segments["audio"].stop, generator=torch.Generator().manual_seed(3))
    cond = fl2va["set"].cond([0, 1])
    feats = teacher_features(family, model, x0, cond)
    swapped = teacher_features(family, model, x0, dict(cond, keyframe_latents=cond["keyframe_latents"].flip(0)))
    assert all(not torch.allclose(swapped[k][i], feats[k][i]) for k in ("video", "audio") for i in range(2))
    expected = _features_by_hand(family, model, x0, cond, keyframes=2)
    for k in ("video", "audio"):
        torch.testing.assert_close(feats[k], expected[k], atol=1e-5, rtol=1e-5)
    text_only = load_prompt_set(fl2va["t2va"]).cond([0, 1])
    t2va = teacher_features(family, model, x0, text_only)
    for k, f in _features_by_hand(family, model, x0, text_only).items():
        torch.testing.assert_close(t2va[k], f, atol=1e-5, rtol=1e-5)


def test_guidance_keeps_the_keyframes_in_both_branches(fl2va):
    """Classifier-free guidance on an fl2va sample: both branches see its keyframes (a text-only
    negative has none of its own), v_u + w (v_c - v_u) of the two forwards run apart."""
    from dmd2_core.sampling import guided_velocity

    family, model = fl2va["family"], fl2va["model"]
    cond = fl2va["set"].cond([0, 0])
    uncond = {"prompt_embeds": torch.zeros_like(cond["prompt_embeds"]), "prompt_lengths": cond["prompt_lengths"]}
    x = torch.randn(2, family.segments["audio"].stop, generator=torch.Generator().manual_seed(4))
    sigma = torch.tensor(0.5)
    with torch.no_grad():
        guided = guided_velocity(family, model, x, sigma, cond, uncond, 3.0)
        v_c = family.predict_velocity(model, x, sigma, cond)
        v_u = family.predict_velocity(model, x, sigma, dict(cond, prompt_embeds=uncond["prompt_embeds"]))
    torch.testing.assert_close(guided, v_u + 3.0 * (v_c - v_u), atol=1e-5, rtol=1e-5)


def test_an_fl2va_eval_reference_is_its_own_cache_entry(fl2va, tmp_path):
    """The teacher's cached reference of an fl2va run is keyed by its workflow: an entry made
    before its features saw the keyframes is not a hit; a t2va run's key has no workflow in it."""
    from dmd2_core.data import prompt_texts
    from dmd2_core.evaluation.teacher_evaluator import reference_key, set_file_identity, settings_key, teacher_identity

    base = dict(CPU, hf_checkpoint=fl2va["url"], prompts=fl2va["prompts"], save=str(tmp_path / "run"))
    fl2va_args = load_args("minimax-h3", dict(base, workflow="fl2va"))
    t2va_args = load_args("minimax-h3", base)
    identity = teacher_identity(fl2va_args)
    assert reference_key(fl2va_args, [0, 1], identity) != reference_key(t2va_args, [0, 1], identity)
    assert reference_key(t2va_args, [0, 1], identity) == settings_key({
        **identity, "prompts": t2va_args.prompts, "texts": prompt_texts(t2va_args.prompts),
        "prompt_set": set_file_identity(t2va_args.prompts), "order": [0, 1],
        "seed": t2va_args.eval_seed, "latent_shape": t2va_args.latent_shape, "steps": t2va_args.eval_reference_steps,
        "guidance": t2va_args.dmd2_guidance_scale, "shift": t2va_args.dmd2_shift})


def _bad_set(fl2va, name, **changes):
    from dmd2_core.data import PromptSet

    embeds = dict(fl2va["set"].embeds, **changes)
    path = str(fl2va["root"] / name)
    PromptSet(PROMPTS, embeds, {}).save(path)
    return path


@pytest.mark.parametrize("override, message", [
    (dict(workflow="fl2v"), r"^workflow: 'fl2v' is not a MiniMax-H3 workflow; did you mean 'fl2va'\?"),
    (dict(workflow="ref2va"), r"^prompts: .*fl2va.safetensors holds keyframes .*set workflow: fl2va"),
    (dict(workflow="fl2va", prompts="t2va"), r"^prompts: .*t2va.safetensors holds no 'keyframe_latents' .*--keyframes"),
    (dict(workflow="t2va"), r"^prompts: .*fl2va.safetensors holds keyframes .*set workflow: fl2va"),
    (dict(workflow="fl2va", prompts="big"), r"^prompts: .* keyframes encode to 4x4 latents, the clip's frames to 2x2"),
    (dict(workflow="fl2va", prompts="one_picture"),
     r"^prompts: .*'keyframe_pixels' is U8 \[2, 1, 3, 32, 32\]; it must be uint8 \[2, 2, 3, H, W\]"),
])
def test_a_bad_workflow_or_keyframe_set_fails_before_any_actor_in_one_line(fl2va, tmp_path, override, message):
    sets = {"t2va": fl2va["t2va"], "big": lambda: _bad_set(fl2va, "big.safetensors",
                                                           keyframe_latents=torch.zeros(2, 2, 24, 1, 4, 4)),
            "one_picture": lambda: _bad_set(fl2va, "one_picture.safetensors",
                                            keyframe_pixels=torch.zeros(2, 1, 3, 32, 32, dtype=torch.uint8))}
    prompts = override.pop("prompts", None)
    url = fl2va["prompts"] if prompts is None else sets[prompts]() if callable(sets[prompts]) else sets[prompts]
    args = load_args("minimax-h3", dict(CPU, hf_checkpoint=fl2va["url"], prompts=url, save=str(tmp_path / "run"),
                                        **override))
    with pytest.raises(ArgsError, match=message) as err:
        preflight(args)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("entries, message", [
    ([{"first": "first0.png"}, {}], r"^keyframes: row 1 \('a blue cat jumping'\) has no keyframe"),
    ([{"first": "first0.png"}, {"frist": "first1.png"}], r"^keyframes: row 1 .*'frist' is no keyframe; did you mean 'first'"),
    ([{"first": "first0.png"}, {"first": "wide.png"}], r"^keyframes: row 1 .* first: 64x32 pixels, row 0's are 32x32"),
    ([{"first": "first0.png"}, {"last": "last1.png"}], r"^keyframes: row 1 .* anchors last; row 0 anchors first"),
    ([{"first": "first0.png"}], r"^keyframes: .* holds 1 entries for 2 prompts"),
    ([{"first": "first0.png"}, {"first": "missing.png"}], r"^keyframes: row 1 .* first: no image at .*missing.png"),
])
def test_a_bad_keyframe_is_named_in_one_line_before_encoding(fl2va, tmp_path, entries, message):
    from dmd2_core.prepare.prompts import prepare_prompts

    _image(fl2va["root"] / "wide.png", size=(64, 32))
    listing = fl2va["root"] / "bad_keyframes.json"
    listing.write_text(json.dumps(entries))
    out = tmp_path / "never.safetensors"
    with pytest.raises(ArgsError, match=message) as err:
        prepare_prompts(fl2va["url"], PROMPTS, str(out), keyframes=str(listing))
    assert "\n" not in str(err.value) and not out.exists()


def test_the_plan_counts_the_keyframe_rows(fl2va):
    """Every keyframe adds one latent frame of rows to each sequence: the memory plan's tokens and
    the time plan's FLOPs grow with them."""
    from dmd2_core.memory.time_plan import model_flops

    family, config = fl2va["family"], dict(fl2va["model"].config)
    plain = family.tokens(config, None)
    assert family.bind(family.latent_shape, keyframes=2).tokens(config, None) == plain + 2 * 1 * 1
    shape = tuple(family.latent_shape)
    assert model_flops(fl2va["url"], shape, None, 8, 2).forward > model_flops(fl2va["url"], shape, None, 8).forward


def test_an_fl2va_critics_real_set_must_carry_the_keyframes(fl2va, tmp_path):
    """The GAN head's real clips of an fl2va run are conditioned as its samples are: a real set
    holding the workflow's keys (its text padded to another length than the prompt set's) passes
    preflight; one with the text conditions alone (what prepare-latents writes without
    --keyframe-anchors) is refused in one
    line naming the missing key, before any actor, and nothing is written."""
    from dmd2_core.data import KEYFRAME_PIXELS, REAL_LATENTS, write_safetensors

    cond = {k: v for k, v in fl2va["set"].embeds.items() if k != KEYFRAME_PIXELS}
    pad = 3  # this set's longest text is 3 tokens longer than the prompt set's
    cond["prompt_embeds"] = torch.nn.functional.pad(cond["prompt_embeds"], (0, 0, 0, pad))
    cond["text_token_tags"] = torch.nn.functional.pad(cond["text_token_tags"], (0, pad), value=1)
    latents = torch.randn(len(PROMPTS), fl2va["family"].segments["audio"].stop)
    whole, text_only = str(tmp_path / "real.safetensors"), str(tmp_path / "real_text.safetensors")
    write_safetensors(whole, {REAL_LATENTS: latents, **cond})
    write_safetensors(text_only, {REAL_LATENTS: latents, "prompt_embeds": cond["prompt_embeds"],
                                  "prompt_lengths": cond["prompt_lengths"]})
    base = dict(CPU, hf_checkpoint=fl2va["url"], prompts=fl2va["prompts"], workflow="fl2va", gan_weight=0.05,
                gan_critic_weight=0.1, eval_real_samples=0)  # 2 real clips: too few for the sound's yardstick
    preflight(load_args("minimax-h3", dict(base, real_data=whole, save=str(tmp_path / "ok"))))
    with pytest.raises(ArgsError, match=r"^real_data: .*real_text.safetensors has no condition 'keyframe_latents' "
                                        r"\(the run conditions each sample on prompt_embeds, prompt_lengths, "
                                        r"keyframe_latents") as err:
        preflight(load_args("minimax-h3", dict(base, real_data=text_only, save=str(tmp_path / "run"))))
    assert "\n" not in str(err.value) and not (tmp_path / "run").exists()


def test_prepare_latents_conditions_each_real_clip_on_its_own_first_and_last_frames(fl2va, tmp_path, capsys):
    """``prepare-latents --keyframe-anchors first,last``: each real clip's keyframes are its own
    first and last frames, encoded as prepare-prompts encodes a prompt's (the latents and the
    presentation of a keyframes file holding those frames), no pictures beside them; the set is an
    fl2va run's GAN real data. An anchor that is none, or one given twice, is named in one line and
    nothing is written."""
    from PIL import Image

    from dmd2_core.cli import main
    from dmd2_core.data import KEYFRAME_PIXELS
    from dmd2_core.media.av_clips import write_mp4
    from dmd2_core.prepare.latents import prepare_latents, read_clip_with_sound
    from dmd2_core.prepare.prompts import prepare_prompts

    clips, rng = tmp_path / "clips", np.random.default_rng(0)
    clips.mkdir()
    tone = (0.5 * np.sin(2 * np.pi * 440 * np.arange(round(16000 * 124 / 24)) / 16000)).astype(np.float32)
    for name in ("a", "b"):
        write_mp4(str(clips / f"{name}.mp4"), rng.integers(0, 256, (124, 32, 32, 3), dtype=np.uint8),
                  np.stack([tone, tone]), fps=24, sample_rate=16000, min_side=32)
    (tmp_path / "captions.tsv").write_text("".join(f"{n}\t{p}\n" for n, p in zip("ab", PROMPTS)))
    out = str(tmp_path / "real.safetensors")
    real = prepare_latents(fl2va["url"], str(clips), str(tmp_path / "captions.tsv"), out, clip=(124, 32, 32),
                           keyframe_anchors="first,last")
    assert real.cond["keyframe_latents"].shape == (2, 2, 24, 1, 2, 2) and KEYFRAME_PIXELS not in real.cond
    assert real.cond["keyframe_anchors"].tolist() == [[0, 1]] * 2

    entries = []
    for name in ("a", "b"):  # the clip's frames as the run reads them, saved losslessly
        pixels, _ = read_clip_with_sound((clips / f"{name}.mp4").read_bytes(), f"{name}.mp4", 124, 32, 32, 24, 16000)
        for end, frame in (("first", pixels[:, 0]), ("last", pixels[:, 123])):
            Image.fromarray(frame.add(1).mul(127.5).round().byte().permute(1, 2, 0).numpy()).save(tmp_path / f"{name}{end}.png")
        entries.append({"first": f"{name}first.png", "last": f"{name}last.png"})
    (tmp_path / "keyframes.json").write_text(json.dumps(entries))
    same = prepare_prompts(fl2va["url"], PROMPTS, None, keyframes=str(tmp_path / "keyframes.json"))
    for key in ("keyframe_latents", "keyframe_anchors", "prompt_embeds", "prompt_lengths", "text_token_tags"):
        assert torch.equal(real.cond[key], same.embeds[key]), key
    assert not torch.equal(real.cond["keyframe_latents"][:, 0], real.cond["keyframe_latents"][:, 1])

    base = dict(CPU, hf_checkpoint=fl2va["url"], prompts=fl2va["prompts"], workflow="fl2va", gan_weight=0.05,
                gan_critic_weight=0.1, eval_real_samples=0)  # 2 real clips: too few for the sound's yardstick
    preflight(load_args("minimax-h3", dict(base, real_data=out, save=str(tmp_path / "run"))))

    bad = str(tmp_path / "bad.safetensors")
    for anchors, line in (("frist", "error: keyframe_anchors: 'frist' is no keyframe anchor (first or last); did you "
                                    "mean 'first'?"),
                          ("last,last", "error: keyframe_anchors: last,last; give first, last or first,last")):
        capsys.readouterr()
        code = main(["prepare-latents", "--hf-checkpoint", fl2va["url"], "--images", str(clips), "--captions",
                     str(tmp_path / "captions.tsv"), "--out", bad, "--num-frames", "124", "--height", "32",
                     "--width", "32", "--keyframe-anchors", anchors])
        assert code == 2 and capsys.readouterr().err == line + "\n"
    assert not (tmp_path / "bad.safetensors").exists()


def _block_outputs(family, model, x_t, sigma, cond):
    """Every forward's output of the middle block (the GAN head's feature block) at (x_t, sigma | cond)."""
    from dmd2_core.models.feature_tap import FeatureTap

    with torch.no_grad(), FeatureTap(family, model, None) as tap:
        family.predict_velocity(model, x_t, sigma, cond)
    return tap.forwards


def test_the_gan_head_judges_an_fl2va_clips_generated_rows_never_its_keyframes(fl2va):
    """The GAN head's features of an fl2va forward are its block output without the keyframe rows
    (diffusers' layout [text | keyframes | audio | video], read off by position): changing only the
    keyframe rows leaves every logit as it was, changing a generated row moves that sample's. Three
    samples at two u run as two forwards (samples 0 and 2 share one), each logit its own sample's."""
    from dmd2_core.train import gan

    family, model = fl2va["family"], fl2va["model"]
    cond = fl2va["set"].cond([0, 1, 0])
    sigma = torch.tensor([0.3, 0.6, 0.3])
    x_t = torch.randn(3, family.segments["audio"].stop, generator=torch.Generator().manual_seed(5))
    forwards = _block_outputs(family, model, x_t, sigma, cond)
    assert [f.shape[0] for f in forwards] == [2, 1]
    head = gan.build_head(family.feature_dim(model), seed=3)
    keyframe_rows = 2 * 1 * 1  # two keyframes of one 2x2 latent frame at patch 2: one row each

    def logits(outputs):
        with torch.no_grad():
            return gan.head_logits(head, gan.judged_features(family, outputs, sigma, cond, 3))

    judged = logits(forwards)
    start = [int(length) for length in cond["prompt_lengths"]]
    by_hand = []
    for i, (forward, row) in enumerate([(0, 0), (1, 0), (0, 1)]):
        block = forwards[forward][row:row + 1]
        kept = torch.cat([block[:, :start[i]], block[:, start[i] + keyframe_rows:]], dim=1)
        with torch.no_grad():
            by_hand.append(head(kept))
    torch.testing.assert_close(judged, torch.cat(by_hand), atol=1e-6, rtol=1e-6)

    other_keyframes = [f.clone() for f in forwards]
    for f, first in zip(other_keyframes, (start[0], start[1])):  # forward 0: prompt 0's samples; 1: prompt 1's
        f[:, first:first + keyframe_rows] = torch.randn(f.shape[0], keyframe_rows, f.shape[2]) * 10
    assert torch.equal(logits(other_keyframes), judged)
    other_clip = [f.clone() for f in forwards]
    other_clip[1][:, -1] = torch.randn(other_clip[1].shape[2]) * 10  # a generated video row of sample 1
    moved = logits(other_clip) != judged
    assert moved.tolist() == [False, True, False]


def test_the_gan_heads_t2va_logits_are_its_whole_block_output_as_before(fl2va):
    """A t2va forward has no condition rows: the head judges its block's whole output, bit for bit
    the logits it gave before fl2va's keyframes were left out (text rows included)."""
    from dmd2_core.data import load_prompt_set
    from dmd2_core.train import gan

    family, model = fl2va["family"], fl2va["model"]
    cond = load_prompt_set(fl2va["t2va"]).cond([0, 1])
    assert cond["prompt_lengths"][0] != cond["prompt_lengths"][1]  # two layouts: two forwards
    sigma = torch.tensor([0.5, 0.5])
    x_t = torch.randn(2, family.segments["audio"].stop, generator=torch.Generator().manual_seed(6))
    forwards = _block_outputs(family, model, x_t, sigma, cond)
    head = gan.build_head(family.feature_dim(model), seed=3)
    with torch.no_grad():
        judged = gan.head_logits(head, gan.judged_features(family, forwards, sigma, cond, 2))
        assert torch.equal(judged, torch.cat([head(f) for f in forwards]))


def test_the_critics_gan_logits_are_each_fl2va_samples_own_without_its_keyframes(fl2va):
    """``critic_forward`` on a micro-batch that MiniMax-H3 runs as one forward per sample (each its
    own u): a fake and a real logit per sample, each the head on that sample's block output
    without its keyframe rows, and the generator gradient reaches every sample."""
    from dmd2_core.train import gan

    family, model = fl2va["family"], fl2va["model"]
    cond = fl2va["set"].cond([0, 1])
    sigma = torch.tensor([0.3, 0.6])
    g = torch.Generator().manual_seed(7)
    x0, noise, x0_real, noise_real = (torch.randn(2, family.segments["audio"].stop, generator=g) for _ in range(4))
    head = gan.build_head(family.feature_dim(model), seed=3)
    out = gan.critic_forward(family, model, head, None, x0, noise, sigma, cond, real=(x0_real, noise_real, cond),
                             critic_weight=0.1, gen_weight=0.05)

    def by_hand(x, eps):
        logits = []
        for i in range(2):
            block = _block_outputs(family, model, family.add_noise(x[i:i + 1], eps[i:i + 1], sigma[i:i + 1]),
                                   sigma[i:i + 1], {k: v[i:i + 1] for k, v in cond.items()})[0]
            start = int(cond["prompt_lengths"][i])
            with torch.no_grad():
                logits.append(head(torch.cat([block[:, :start], block[:, start + 2:]], dim=1)))
        return torch.cat(logits)

    torch.testing.assert_close(out["logits_fake"], by_hand(x0, noise), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["logits_real"], by_hand(x0_real, noise_real), atol=1e-5, rtol=1e-5)
    assert (out["gan_grad"].abs().flatten(1).amax(1) > 0).all()
