"""The GAN head: its losses and generator gradient against hand-written references, the hand-over
to the actor, the reference loop as its oracle, resume, real-data checks and prepare-latents."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from dmd2_core.train import dmd2_iteration
from dmd2_core.train import gan
from dmd2_core import flow_matching as fm
from dmd2_core.errors import ArgsError
from dmd2_core.run.distill_run import preflight
from dmd2_core.train.reference import ReferenceLoop
from dmd2_core.train.trainer import Trainer
from tests.helpers import in_process_trainers, iterate_in_process, resume_in_process, tiny_args

GAN = dict(real_data="digits", gan_weight=0.05, gan_critic_weight=0.1)


def _hand_head(head: gan.DiscriminatorHead, feats: torch.Tensor) -> torch.Tensor:
    """The head written out by hand in float64: LayerNorm, Linear, SiLU, Linear, mean over tokens."""
    p = {k: v.double() for k, v in head.state_dict().items()}
    f = feats.double()
    mu = f.mean(-1, keepdim=True)
    var = ((f - mu) ** 2).mean(-1, keepdim=True)
    h = (f - mu) / torch.sqrt(var + head.norm.eps) * p["norm.weight"] + p["norm.bias"]
    h = h @ p["fc1.weight"].T + p["fc1.bias"]
    h = h * (1 / (1 + torch.exp(-h)))
    return (h @ p["fc2.weight"].T + p["fc2.bias"]).squeeze(-1).mean(1)


def _softplus(x):
    return torch.log1p(torch.exp(x))


def test_discriminator_loss_is_softplus_on_each_side():
    real, fake = torch.tensor([0.0, 2.0]), torch.tensor([-1.0, 3.0])
    d_real, d_fake = gan.discriminator_loss(real, fake)
    assert d_real.item() == pytest.approx((math.log(2) + math.log(1 + math.exp(-2))) / 2, rel=1e-6)
    assert d_fake.item() == pytest.approx((math.log(1 + math.exp(-1)) + math.log(1 + math.exp(3))) / 2, rel=1e-6)


def test_head_and_generator_gradient_match_a_hand_written_reference():
    """A tiny head on features that are a fixed nonlinear function of x_t: logits against the
    hand-written head, and g_gan against central finite differences of weight * d * softplus(-D)
    through the noising x_t = (1 - s) x0 + s eps (float64, no autograd)."""
    torch.manual_seed(0)
    head = gan.build_head(dim=4, seed=7, hidden=5).double()
    mix = torch.randn(4, 4, dtype=torch.float64)
    x0, eps = torch.randn(3, 1, 2, 4, dtype=torch.float64), torch.randn(3, 1, 2, 4, dtype=torch.float64)
    sigma = torch.tensor([0.2, 0.5, 0.9], dtype=torch.float64)
    weight = 0.3

    def feats(x0_):  # [B, 1, 2, 4] -> tokens [B, 2, 4]
        x_t = (1 - sigma.view(-1, 1, 1, 1)) * x0_ + sigma.view(-1, 1, 1, 1) * eps
        return torch.tanh(x_t.squeeze(1) @ mix)

    leaf = x0.clone().requires_grad_(True)
    logits = head(feats(leaf))
    torch.testing.assert_close(logits.double(), _hand_head(head, feats(x0)), rtol=1e-6, atol=1e-6)
    g = gan.generator_gradient(logits, leaf, weight)

    d, h, expected = x0[0].numel(), 1e-5, torch.zeros_like(x0)
    with torch.no_grad():
        for idx in range(x0.numel()):
            e = torch.zeros(x0.numel(), dtype=torch.float64)
            e[idx] = h
            e = e.view_as(x0)
            up = _softplus(-_hand_head(head, feats(x0 + e))).sum()
            down = _softplus(-_hand_head(head, feats(x0 - e))).sum()
            expected.view(-1)[idx] = weight * d * (up - down) / (2 * h)
    torch.testing.assert_close(g.double(), expected, rtol=1e-4, atol=1e-7)
    assert expected.abs().max() > 1e-3  # not vacuous


def _critic(teacher, save, scoring, steps, **kw):
    return Trainer(preflight(tiny_args(teacher, save, dmd2_critic_scoring=scoring, dmd2_update_ratio=steps, **GAN, **kw))["critic"], "critic")


@pytest.mark.parametrize("scoring", ["fused", "original"])
def test_critic_hands_over_g_dmd_plus_g_gan_and_the_actor_x0_gradient_is_their_sum(tiny_teacher, tmp_path, scoring, monkeypatch):
    actor = Trainer(preflight(tiny_args(tiny_teacher, str(tmp_path), **GAN))["actor"], "actor")
    pairs, _ = actor.rollout(1)
    two_steps = _critic(tiny_teacher, str(tmp_path), scoring, 2)
    outputs, metrics = two_steps.train(1, pairs)
    for key in ("gan_d_loss_real", "gan_d_loss_fake", "gan_d_acc_real", "gan_d_acc_fake", "gan_grad_norm", "dmd2_grad_norm"):
        assert math.isfinite(metrics[key]), key
    # the critic and head weights of the last step = after one step of the same streams
    one_step = _critic(tiny_teacher, str(tmp_path), scoring, 1)
    one_step.train(1, pairs)
    stream = dmd2_iteration.critic_stream(1) if scoring == "fused" else dmd2_iteration.SCORING_STREAM
    x0 = pairs["x0"]
    sigma, noise = dmd2_iteration.noisy_inputs(two_steps.args, 1, stream, tuple(x0.shape), slice(None))
    cond = one_step._cond(pairs["prompt_index"])
    g_dmd = one_step.learner.score(x0, fm.add_noise(x0, noise, sigma), sigma, cond)["grad"]
    # g_gan written out: a hook on the middle block, the head, softplus(-D), d/dx0 through the noising
    leaf = x0.clone().requires_grad_(True)
    captured = {}
    block = one_step.model.transformer_blocks[1]
    handle = block.register_forward_hook(lambda m, i, o: captured.update(f=o[1]))
    one_step.family.predict_velocity(one_step.model, (1 - sigma.view(-1, 1, 1, 1)) * leaf + sigma.view(-1, 1, 1, 1) * noise, sigma, cond)
    handle.remove()
    (dx0,) = torch.autograd.grad(torch.nn.functional.softplus(-one_step.disc(captured["f"])).sum(), leaf)
    g_gan = GAN["gan_weight"] * x0[0].numel() * dx0
    assert g_gan.abs().max() > 1e-6
    torch.testing.assert_close(outputs["dmd2_grad"], g_dmd + g_gan, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(outputs["dmd2_grad"], g_dmd, atol=1e-6)

    # the actor's loss gradient w.r.t. its graded x0 is exactly (g_dmd + g_gan) / numel
    import dmd2_core.train.actor as actor_module

    grads = []
    real_loss = actor_module.dmd2_loss

    def spy(x0_graded, grad):
        x0_graded.register_hook(lambda g: grads.append(g.detach().clone()))
        return real_loss(x0_graded, grad)

    monkeypatch.setattr(actor_module, "dmd2_loss", spy)
    actor.train(1, pairs, outputs)
    torch.testing.assert_close(grads[0], (g_dmd + g_gan) / x0.numel(), atol=1e-8, rtol=1e-4)


@pytest.mark.parametrize("scoring", ["fused", "original"])
def test_reference_loop_is_the_oracle_of_the_trainers_with_the_head(tiny_teacher, tmp_path, scoring):
    args = tiny_args(tiny_teacher, str(tmp_path), dmd2_critic_scoring=scoring, micro_batch_size=3, **GAN)
    trainers = in_process_trainers(args)
    loop = ReferenceLoop(args)
    for i in (1, 2):
        iterate_in_process(trainers, i)
        loop.iterate(i)
    for mine, theirs in ((trainers["actor"].weights(), loop.student), (trainers["critic"].weights(), loop.critic),
                         (trainers["critic"].disc.state_dict(), loop.disc)):
        a, b = mine, theirs.state_dict()
        assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    fresh = gan.build_head(loop.disc.norm.normalized_shape[0], args.seed).state_dict()
    assert max((fresh[k] - loop.disc.state_dict()[k]).abs().max().item() for k in fresh) > 1e-6


def test_sleep_save_and_resume_with_the_head_are_bitwise(tiny_teacher, tmp_path):
    args = tiny_args(tiny_teacher, str(tmp_path), **GAN)
    trainers = in_process_trainers(args)
    for i in (1, 2):
        iterate_in_process(trainers, i)
    critic = trainers["critic"]
    digest = critic.state_digest()
    critic.sleep()
    assert all(p.untyped_storage().nbytes() == 0 for p in critic.disc.parameters())
    assert critic.state_digest() == digest  # woken bit for bit, head and its optimizer included
    resumed = resume_in_process(args, trainers, 2)
    assert resumed["critic"].disc_optimizer.state  # the head's AdamW moments came back


def test_a_nonfinite_critic_step_leaves_the_head_alone_and_a_nonfinite_head_is_never_saved(tiny_teacher, tmp_path):
    """NaN in the samples the critic trains on: the critic's steps are skipped, and so are the
    head's (weights and AdamW moments untouched). A head that holds NaN is refused at save."""
    from dmd2_core.errors import NonFiniteError

    roles = preflight(tiny_args(tiny_teacher, str(tmp_path), **GAN))
    actor, critic = Trainer(roles["actor"], "actor"), Trainer(roles["critic"], "critic")
    pairs, _ = actor.rollout(1)
    critic.train(1, pairs)  # a normal step: the head has moved and has AdamW state
    head = {k: v.clone() for k, v in critic.disc.state_dict().items()}
    moments = {i: {k: v.clone() for k, v in st.items()} for i, st in critic.disc_optimizer.state_dict()["state"].items()}
    assert moments
    bad = {**pairs, "x0": pairs["x0"].clone()}
    bad["x0"][0].view(-1)[0] = float("nan")
    metrics = critic.train(2, bad)[1]
    assert metrics["critic_nonfinite_steps"] == roles["critic"].num_steps_per_rollout
    assert all(torch.equal(v, head[k]) for k, v in critic.disc.state_dict().items())
    after = critic.disc_optimizer.state_dict()["state"]
    assert all(torch.equal(v, moments[i][k]) for i, st in after.items() for k, v in st.items())

    with torch.no_grad():
        critic.disc.fc2.weight.view(-1)[0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"critic: not saving iteration 2: 'extra\.disc\.fc2\.weight' holds 1 non-finite"):
        critic.save(2)
    assert not (tmp_path / "trainers").exists()


def test_a_head_whose_gradient_keeps_going_nonfinite_is_counted_and_stops_the_run(tiny_teacher, tmp_path):
    """The head's gradient goes non-finite while the critic's stays finite: the head's steps are
    skipped and reported (``gan_nonfinite``), and ``max_nonfinite_steps`` of them in a row end the
    run in one line naming the head, as the critic's own skips would; the count survives a save."""
    from dmd2_core.errors import NonFiniteError

    roles = preflight(tiny_args(tiny_teacher, str(tmp_path), **GAN, max_nonfinite_steps=3))
    actor, critic = Trainer(roles["actor"], "actor"), Trainer(roles["critic"], "critic")
    steps = roles["critic"].num_steps_per_rollout
    assert steps < 3  # one train call stays under the limit
    pairs, _ = actor.rollout(1)
    assert critic.train(1, pairs)[1]["gan_nonfinite"] == 0
    head = {k: v.clone() for k, v in critic.disc.state_dict().items()}
    critic.disc.fc2.weight.register_hook(lambda grad: grad * float("nan"))
    metrics = critic.train(2, pairs)[1]
    assert metrics["critic_nonfinite_steps"] == 0 and metrics["gan_nonfinite"] == steps
    assert all(torch.equal(v, head[k]) for k, v in critic.disc.state_dict().items())
    assert critic.save(2)["iteration"] == 2
    fresh = Trainer(roles["critic"], "critic")
    fresh.load(2, str(tmp_path))
    assert fresh.learner.disc_nonfinite.in_a_row == steps
    with pytest.raises(NonFiniteError, match=r"^critic GAN head: 3 non-finite steps in a row at iteration 3 "
                                             r"\(GAN head gradient norm nan; max_nonfinite_steps=3\)"):
        critic.train(3, pairs)


def _real_file(path, n=6, shape=(1, 8, 8), tokens=4, dim=32, pooled=True):
    tensors = {"latents": torch.randn(n, *shape), "prompt_embeds": torch.randn(n, tokens, dim),
               "negative_prompt_embeds": torch.randn(1, tokens, dim)}
    if pooled:
        tensors.update(pooled_prompt_embeds=torch.randn(n, dim), negative_pooled_prompt_embeds=torch.randn(1, dim))
    save_file(tensors, str(path))
    return str(path)


@pytest.mark.parametrize("kind, needle", [
    ("shape", "latents are [1, 4, 4] per sample, the model samples [1, 8, 8]"),
    ("cond", "'prompt_embeds' is [4, 16] per sample, the prompt set's is [4, 32]"),
    ("missing_cond", "has no condition 'pooled_prompt_embeds'"),
    ("no_file", "no real set at"),
])
def test_real_data_of_the_wrong_shape_or_conditions_fails_before_any_actor(tiny_teacher, tmp_path, kind, needle, monkeypatch):
    path = tmp_path / "real.safetensors"
    if kind == "shape":
        _real_file(path, shape=(1, 4, 4))
    elif kind == "cond":
        _real_file(path, dim=16)
    elif kind == "missing_cond":
        _real_file(path, pooled=False)
    monkeypatch.setattr(Trainer, "__init__", lambda *a, **k: pytest.fail("an actor started"))
    with pytest.raises(ArgsError) as err:
        preflight(tiny_args(tiny_teacher, str(tmp_path / "run"), **{**GAN, "real_data": str(path)}))
    assert needle in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_gan_weight_without_real_data_fails_with_one_line(tiny_teacher, tmp_path):
    good = tmp_path / "real.safetensors"
    _real_file(good)
    preflight(tiny_args(tiny_teacher, str(tmp_path / "ok"), **{**GAN, "real_data": str(good)}))  # fits
    proc = subprocess.run([sys.executable, "-m", "dmd2_core", "check", "--recipe", "tiny", "--gan-weight", "0.01",
                           "--real-data", "", "--hf-checkpoint", tiny_teacher],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "real_data" in proc.stderr, proc.stderr
    with pytest.raises(ArgsError, match="gan_critic_weight"):
        tiny_args(tiny_teacher, str(tmp_path), real_data="digits", gan_weight=0.01)


def _write_clip(path, frames, height, width, seed):
    import av
    import numpy as np

    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for _ in range(frames):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())


def test_prepare_latents_encodes_clips_and_captions_into_a_real_set_the_critic_trains_on(tmp_path):
    """Wan stand-in (video): clips read with PyAV, encoded by the checkpoint's VAE; captions by its
    text encoder; the set passes preflight and a critic step with the GAN head runs on it."""
    from diffusers import WanPipeline

    from dmd2_core.args import load_args
    from dmd2_core.data import PromptSet, load_real_set
    from dmd2_core.prepare.latents import read_media
    from dmd2_core.models import FAMILIES
    from dmd2_core.toys.standins import build_standin
    from tests.helpers import CPU_OVERRIDES

    url = build_standin(str(tmp_path / "wan"), "wan", with_text_encoder=True)
    clips = tmp_path / "clips"
    clips.mkdir()
    for i in range(2):  # latents [4, 3, 8, 8] <- 5 frames of 16x16 (resized and cropped from 20x24)
        _write_clip(clips / f"clip{i}.mp4", 6, 20, 24, seed=i)
    captions = tmp_path / "captions.tsv"
    captions.write_text("clip1\ta dog running\nclip0.mp4\ta red cat\n")
    out = tmp_path / "real.safetensors"
    cmd = [sys.executable, "-m", "dmd2_core", "prepare-latents", "--hf-checkpoint", url, "--images", str(clips),
           "--captions", str(captions), "--out", str(out), "--latent-shape", "4", "3", "8", "8", "--max-sequence-length", "8"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    real = load_real_set(str(out))
    family = FAMILIES["WanTransformer3DModel"]
    vae = family.load_vae(url + "/vae", torch.float32)
    pixels = torch.stack([read_media((clips / f"clip{i}.mp4").read_bytes(), f"clip{i}.mp4", 5, 16, 16) for i in range(2)])
    assert pixels.shape == (2, 3, 5, 16, 16)
    torch.testing.assert_close(real.latents, family.encode(vae, pixels))
    pipe = WanPipeline.from_pretrained(url, transformer=None, vae=None)
    expected, _ = pipe.encode_prompt(prompt=["a red cat", "a dog running"], negative_prompt="", max_sequence_length=8)
    torch.testing.assert_close(real.cond["prompt_embeds"], expected)
    # the critic trains on it with the GAN head (a hook on a Wan block)
    prompts = tmp_path / "prompts.safetensors"
    PromptSet(["a red cat", "a dog running"], {"prompt_embeds": expected}, {"prompt_embeds": expected[:1] * 0}).save(str(prompts))
    args = load_args("wan-video", dict(CPU_OVERRIDES, hf_checkpoint=url, prompts=str(prompts), save=str(tmp_path / "run"),
                                        latent_shape=[4, 3, 8, 8], real_data=str(out), gan_weight=0.01, gan_critic_weight=0.01))
    roles = preflight(args)
    pairs, _ = Trainer(roles["actor"], "actor").rollout(1)
    outputs, metrics = Trainer(roles["critic"], "critic").train(1, pairs)
    assert outputs["dmd2_grad"].shape == pairs["x0"].shape and metrics["gan_grad_norm"] > 0
    # a clip too short for the latents names the file
    short = tmp_path / "short"
    short.mkdir()
    _write_clip(short / "a.mp4", 3, 16, 16, seed=0)
    (tmp_path / "one.txt").write_text("a cat\n")
    failed = subprocess.run([*cmd[:7], str(short), "--captions", str(tmp_path / "one.txt"), *cmd[10:]],
                            capture_output=True, text=True, timeout=300)
    assert failed.returncode == 2 and "clip a.mp4 has 3 frames" in failed.stderr, failed.stderr


def test_image_latents_round_trip_the_sd3_scaling(tmp_path):
    from PIL import Image

    from dmd2_core.prepare.latents import pixel_size, read_media
    from dmd2_core.models import FAMILIES
    from dmd2_core.toys.standins import build_standin

    url = build_standin(str(tmp_path / "sd3"), "sd3")
    family = FAMILIES["SD3Transformer2DModel"]
    vae = family.load_vae(url + "/vae", torch.float32)
    frames, h, w = pixel_size(family, vae, (4, 8, 8))
    assert (frames, h, w) == (None, 16, 16)
    path = tmp_path / "a.png"
    Image.fromarray((torch.rand(24, 20, 3) * 255).byte().numpy()).save(path)
    pixels = read_media(path.read_bytes(), "a.png", frames, h, w)
    assert pixels.shape == (3, 16, 16) and pixels.min() >= -1 and pixels.max() <= 1
    latents = family.encode(vae, pixels[None])
    assert latents.shape == (1, 4, 8, 8)
    torch.testing.assert_close(family.unscale_latents(vae, latents), vae.encode(pixels[None]).latent_dist.mode())
