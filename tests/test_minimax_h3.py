"""MiniMax-H3, the flagship: the family's conventions against diffusers' own scheduler and layout
code, joint DMD2 on both modalities, the clip checks before any actor, and the minimax-h3 recipe
through the Prefect flow on a tiny stand-in of every H3 component (media with sound)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from dmd2_core.args import load_args
from dmd2_core.errors import ArgsError
from dmd2_core.run.distill_run import preflight
from dmd2_core.models import describe_model_dir, load_model_dir
from dmd2_core.toys.standins import H3_GEOMETRY, build_h3_standin, h3_prompt_set

# the stand-in fully fine-tuned on one CPU (the recipe's LoRA and cp_size 2 are its 8 H100s')
CPU = dict(device="cpu", num_devices=1, dtype="float32", global_batch_size=4, micro_batch_size=2, torch_threads=1,
           lora_rank=0, cp_size=1, **H3_GEOMETRY)


@pytest.fixture(scope="module")
def h3(tmp_path_factory):
    root = tmp_path_factory.mktemp("h3")
    url = build_h3_standin(str(root / "h3"))
    prompts = str(root / "prompts.safetensors")
    h3_prompt_set().save(prompts)
    loaded = load_model_dir(url)
    family = loaded.family.bind([24, 37, 2, 2], loaded.model, loaded.modality_shifts)
    return {"url": url, "prompts": prompts, "model": loaded.model, "family": family}


def _known(family, n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = family.segments["audio"].stop
    return torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)


def test_both_schedules_are_the_schedulers_own(h3):
    """The student's K steps at u = linspace(1, 0, K + 1)[:-1] sit, per modality, on exactly the
    sigmas MiniMaxH3Scheduler(shift).set_timesteps(K + 1) gives (what the modular pipeline steps)."""
    from diffusers import MiniMaxH3Scheduler

    from dmd2_core import flow_matching as fm

    family = h3["family"]
    assert describe_model_dir(h3["url"])["modality_shifts"] == (12.0, 3.0)
    for k in (1, 2, 4):
        u = torch.tensor(fm.student_sigmas(k, 1.0))
        x = torch.zeros(len(u), family.segments["audio"].stop)
        field = family.sigma_field(u, x)
        for name, shift in (("video", 12.0), ("audio", 3.0)):
            scheduler = MiniMaxH3Scheduler(shift=shift)
            scheduler.set_timesteps(k + 1)
            seg = family.segments[name]
            assert torch.equal(field[:, seg.start], scheduler.sigmas[:-1]), (k, name)
            assert (field[:, seg] == field[:, seg.start:seg.start + 1]).all()


def test_velocity_convention_gives_the_known_x0(h3):
    """Noising is H3's x_t = t x0 + (1 - t) eps per modality; with the data-ward velocity
    v = x0 - eps the family's x0 is exact, and its Euler step is MiniMaxH3Scheduler.step's."""
    from diffusers import MiniMaxH3Scheduler

    family = h3["family"]
    x0, eps = _known(family)
    u = torch.tensor([0.75, 0.75])
    x_t = family.add_noise(x0, eps, u)
    for name, shift in (("video", 12.0), ("audio", 3.0)):
        seg = family.segments[name]
        scheduler = MiniMaxH3Scheduler(shift=shift)
        scheduler.set_timesteps(5)  # grid 1, .75, .5, .25, 0: step 1 is u = 0.75
        t = scheduler.timesteps[1]
        torch.testing.assert_close(x_t[:, seg], scheduler.scale_noise(x0[:, seg], t, eps[:, seg]))
        v_h3 = x0[:, seg] - eps[:, seg]  # H3's velocity points to the data
        scheduler._step_index = 1
        stepped = scheduler.step(v_h3, t, x_t[:, seg], return_dict=False)[0]
        ours = family.euler_step(x_t, x0, u, torch.tensor([0.5, 0.5]))[:, seg]
        torch.testing.assert_close(ours, stepped, atol=1e-5, rtol=1e-5)
    # the project's velocity is eps - x0, minus H3's: its x0 is exact
    torch.testing.assert_close(family.velocity_to_x0(x_t, eps - x0, u), x0, atol=1e-5, rtol=0)


def test_pack_unpack_round_trip_uses_diffusers_patchify(h3):
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

    family = h3["family"]
    x, _ = _known(family, n=3)
    video_rows, audio_rows = family._rows(x)
    video, audio = family.split(x)
    assert torch.equal(video_rows.reshape(-1, video_rows.shape[-1]), patchify_video_latents(video, (1, 2, 2)))
    assert torch.equal(audio_rows[1], audio[1].permute(0, 2, 1).reshape(-1, 32))  # channel-major, as the pipeline packs
    assert torch.equal(family._unrows(video_rows, audio_rows), x)


def test_a_batch_of_mixed_noise_levels_and_prompt_lengths_equals_one_forward_per_item(h3):
    """One forward holds one layout: items of other (u, text length) run in their own forward,
    and the batch gives exactly what each item alone gives."""
    family, model = h3["family"], h3["model"]
    prompts = h3_prompt_set()
    x, _ = _known(family, n=4, seed=1)
    cond = prompts.cond(torch.tensor([0, 0, 0, 1]))  # text lengths 6, 6, 6, 5
    u = torch.tensor([0.5, 0.5, 0.3, 0.5])
    assert len(set(zip(u.tolist(), cond["prompt_lengths"].tolist()))) == 3
    with torch.no_grad():
        batched = family.predict_velocity(model, x, u, cond)
        alone = torch.cat([family.predict_velocity(model, x[i:i + 1], u[i:i + 1], {k: v[i:i + 1] for k, v in cond.items()})
                           for i in range(4)])
    torch.testing.assert_close(batched, alone, atol=1e-6, rtol=1e-6)
    # padding the text would change the forward: the lengths are honoured
    longer = dict(cond, prompt_lengths=cond["prompt_lengths"] + 0)
    longer["prompt_lengths"][3] = 6
    with torch.no_grad():
        assert not torch.allclose(family.predict_velocity(model, x, u, longer)[3], batched[3])


def test_joint_dmd2_gradient_has_a_normaliser_per_modality():
    from dmd2_core.losses import dmd2_gradient

    segments = {"video": slice(0, 3), "audio": slice(3, 5)}
    x0 = torch.tensor([[1.0, 1.0, 1.0, 10.0, 10.0]])
    real = torch.zeros_like(x0)
    fake = torch.tensor([[2.0, 2.0, 2.0, 20.0, 20.0]])
    g = dmd2_gradient(x0, real, fake, segments, {"audio": 0.5})
    # video: (2 - 0) / mean|1 - 0| = 2; audio: 0.5 * (20 - 0) / mean|10 - 0| = 1
    torch.testing.assert_close(g, torch.tensor([[2.0, 2.0, 2.0, 1.0, 1.0]]), atol=1e-5, rtol=0)


def test_one_iteration_trains_both_modalities(h3, tmp_path):
    """Rollout, critic train and score, student train on the stand-in: per-modality losses,
    gradients and gaps, the student moves, and the eval decodes to video and stereo sound."""
    from dmd2_core.train.trainer import Trainer

    args = load_args("minimax-h3", dict(CPU, hf_checkpoint=h3["url"], prompts=h3["prompts"], save=str(tmp_path / "run")))
    roles = preflight(args)
    assert roles["actor"].latent_shape == [24, 37, 2, 2] and roles["actor"].dmd2_shift == 1.0
    actor, critic = Trainer(roles["actor"], "actor"), Trainer(roles["critic"], "critic")
    pairs, rollout = actor.rollout(1)
    assert pairs["x0"].shape == (4, 3552 + 13248)
    outputs, metrics = critic.train(1, pairs)
    for key in ("critic_loss_video", "critic_loss_audio", "dmd2_grad_norm_video", "dmd2_grad_norm_audio",
                "dmd2_real_fake_gap_video", "dmd2_real_fake_gap_audio"):
        assert metrics[key] > 0, key
    before = actor.weights()
    _, trained = actor.train(1, pairs, outputs)
    after = actor.weights()
    assert trained["graded_x0_drift"] < 1e-4  # the graded forward redoes the rollout's last step
    assert any(not torch.equal(before[k], after[k]) for k in before)
    media = actor.sample([0, 1], seed=3)
    assert media["video"].shape == (2, 3, 124, 32, 32) and media["audio"].shape[:2] == (2, 2)
    assert media["sample_rate"] == 32000 and media["video"].min() >= -1 and media["video"].max() <= 1


@pytest.mark.parametrize("override, message", [
    (dict(num_frames=120), r"num_frames: 120 is not of the form 17n \+ 5 .* nearest above: 124"),
    (dict(num_frames=107), r"num_frames: 107 frames are 4.46 s .* 5-15 s"),
    (dict(width=160), r"width: 160x32 has aspect ratio 5; MiniMax-H3 supports 1:4 to 4:1"),
    (dict(height=40), r"height: 40 is not a positive multiple of 32 .*; nearest: 32 or 64$"),
    (dict(dmd2_guidance_scale=5.0), r"dmd2_guidance_scale: .* is guidance-distilled .* set dmd2_guidance_scale to 1"),
    (dict(dmd2_student_steps=[2, 4], dmd2_student_steps_guidance=[1.0, 1.5]),
     r"dmd2_student_steps_guidance: .* is guidance-distilled .* remove dmd2_student_steps_guidance"),
    (dict(dmd2_shift=3.0), r"dmd2_shift: MiniMaxH3Transformer3DModel shifts each modality by its own scheduler"),
    (dict(dmd2_modality_weights={"vidoe": 1.0}), r"unknown modality 'vidoe' .* did you mean 'video'"),
    (dict(gan_modality_weights={"audo": 0.0}), r"^gan_modality_weights: unknown modality 'audo' .* did you mean 'audio'"),
    (dict(gan_modality_weights={"audio": -1.0}), r"^gan_modality_weights: audio weight must be >= 0 \(got -1.0\)"),
    (dict(gan_judged_modalities=["vide"]), r"^gan_judged_modalities: unknown modality 'vide' .* did you mean 'video'"),
    (dict(gan_judged_modalities=[]), r"^gan_judged_modalities: empty; name the modalities"),
    (dict(dmd2_modality_min_sigma={"vido": 0.2}), r"^dmd2_modality_min_sigma: unknown modality 'vido' .* did you mean 'video'"),
    (dict(dmd2_modality_min_sigma={"video": 0.99}),
     r"^dmd2_modality_min_sigma: video floor 0.99 is outside the draws' range \[dmd2_min_sigma 0.02, dmd2_max_sigma 0.98\)$"),
    (dict(dmd2_modality_shifts={"audo": 1.0}), r"^dmd2_modality_shifts: unknown modality 'audo' .* did you mean 'audio'"),
    (dict(dmd2_modality_shifts={"audio": 0.0}), r"^dmd2_modality_shifts: audio shift must be > 0 \(got 0.0\)$"),
    (dict(student_modality_shifts={"vidoe": 1.0}), r"^student_modality_shifts: unknown modality 'vidoe' .* did you mean 'video'"),
    (dict(dmd2_regression_modality_weights={"audoi": 1.0}),
     r"^dmd2_regression_modality_weights: unknown modality 'audoi' .* did you mean 'audio'"),
    (dict(latent_shape=[24, 7, 2, 4]), r"latent_shape: \[24, 7, 2, 4\] disagrees with num_frames/height/width \(\[.*\]\); set one"),
])
def test_bad_clip_input_fails_before_any_actor_in_one_line(h3, tmp_path, override, message):
    args = load_args("minimax-h3", dict(CPU, hf_checkpoint=h3["url"], prompts=h3["prompts"],
                                        save=str(tmp_path / "run"), **override))
    with pytest.raises(ArgsError, match=message) as err:
        preflight(args)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()


def _real_set(h3, path, rows: int) -> str:
    from dmd2_core.data import REAL_LATENTS, write_safetensors

    write_safetensors(str(path), {REAL_LATENTS: torch.zeros(rows, h3["family"].segments["audio"].stop)})
    return str(path)


@pytest.mark.parametrize("overrides, line", [
    ({"eval_num_samples": 2}, r"eval_num_samples: 2: sound_mel_kid \(the run's sound distance\) would get 2 clips a "
                              r"side where it needs at least 3 \(its standard error\); set eval_num_samples to 3 or more"),
    ({"real_data": 2}, r"real_data: .*real.safetensors holds 2 rows: the KID to the real set needs at least 3 real "
                       r"samples; give a real set of 3 rows or more, or set eval_real_samples to 0 for none"),
])
def test_an_eval_too_small_for_the_sound_distance_is_refused_in_one_line_exit_2(h3, tmp_path, capsys, overrides, line):
    """An eval of fewer than 3 clips a side would leave the sound criterion's sound_mel_kid out of
    every eval, and a real set of fewer than 3 rows the KID to it: `check --deep` refuses either in
    one line naming the key and the minimum (exit 2), before any actor and writing nothing; at 3
    the run passes."""
    from dmd2_core import cli

    overrides = {k: _real_set(h3, tmp_path / "real.safetensors", v) if k == "real_data" else v for k, v in overrides.items()}
    base = ["check", "--deep", "--recipe", "minimax-h3", "--hf-checkpoint", h3["url"], "--prompts", h3["prompts"],
            *(a for k, v in CPU.items() for a in ("--set", f"{k}={json.dumps(v)}"))]
    argv = base + ["--save", str(tmp_path / "run"), *(a for k, v in overrides.items() for a in ("--set", f"{k}={v}"))]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(f"error: {line}.*\n", err) and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()
    least = ["--set", "eval_num_samples=3", "--set", f"real_data={_real_set(h3, tmp_path / 'least.safetensors', 3)}",
             "--set", "eval_real_samples=3", "--save", str(tmp_path / "ok")]
    assert cli.main(base + least) == 0, capsys.readouterr().err


@pytest.mark.parametrize("height, width, nearest", [
    (500, 512, "height: 500 is not a positive multiple of 32 (VAE x16 times patch 2); nearest: 512 or 480"),
    (512, 700, "width: 700 is not a positive multiple of 32 (VAE x16 times patch 2); nearest: 704 or 672"),
    (512, 16, "width: 16 is not a positive multiple of 32 (VAE x16 times patch 2); nearest: 32"),
    (496, 512, "height: 496 is not a positive multiple of 32 (VAE x16 times patch 2); nearest: 480 or 512"),
])
def test_a_clip_side_off_the_grid_is_told_the_nearest_valid_sides(height, width, nearest):
    """As num_frames is told its nearest 17n + 5, a height or width off the 32-pixel grid is told
    the valid sides around it, the closer first."""
    from dmd2_core.models.minimax_h3 import geometry_problem

    assert geometry_problem(124, height, width) == nearest


def test_a_checkpoint_without_its_audio_vae_is_named(h3, tmp_path):
    import shutil

    from dmd2_core.errors import ModelDirError

    broken = tmp_path / "h3"
    shutil.copytree(h3["url"], broken)
    shutil.rmtree(broken / "audio_vae")
    with pytest.raises(ModelDirError, match=r"audio_vae: missing: MiniMaxH3Transformer3DModel generates sound"):
        describe_model_dir(str(broken))


def test_export_loads_in_diffusers_modular_pipeline_and_reproduces_eval_samples(h3, tmp_path):
    """The exported student is a MiniMax-H3 repository: ModularPipeline.from_pretrained loads it
    (t2va), and with num_inference_steps = K + 1 and seed s + j it reproduces the project's eval
    sample j, video and audio latents both, at each step count of a student of several."""
    from dmd2_core import checkpoint
    from dmd2_core.models.h3_repository import run_t2va
    from dmd2_core.train.trainer import Trainer

    save = tmp_path / "run"
    args = load_args("minimax-h3", dict(CPU, hf_checkpoint=h3["url"], prompts=h3["prompts"], save=str(save),
                                        async_save=False, dmd2_student_steps=[2, 4]))
    roles = preflight(args)
    actor, critic = Trainer(roles["actor"], "actor"), Trainer(roles["critic"], "critic")
    pairs, _ = actor.rollout(1)
    outputs, _ = critic.train(1, pairs)
    actor.train(1, pairs, outputs)
    saved = actor.save(1, export=True)
    url = saved["export_url"]
    assert url == checkpoint.export_url(str(save), 1)
    marker = json.loads((save / "exports" / "iter_0000001" / "export.json").read_text())
    assert marker["num_inference_steps"] == [3, 5] and marker["num_steps"] == [2, 4] and marker["transformer"] == "ema"
    prompts = h3_prompt_set()
    family = h3["family"]
    for k in (2, 4):
        ours = actor.sample([1, 2], seed=7, decode=False, num_steps=k)  # rows j use seed 7 + j
        for j, p in enumerate([1, 2]):
            length = int(prompts.embeds["prompt_lengths"][p])
            theirs = run_t2va(url, prompts.embeds["prompt_embeds"][p:p + 1, :length], num_inference_steps=k + 1,
                              num_frames=124, height=32, width=32, seed=7 + j)
            joined = family.join(theirs["latents"][None], theirs["audio_latents"][None])
            torch.testing.assert_close(joined, ours[j:j + 1], atol=2e-4, rtol=2e-4)
    assert not torch.allclose(ours, actor.sample([1, 2], seed=7, decode=False, num_steps=2), atol=1e-3)


def test_a_student_on_its_own_sound_schedule_exports_schedulers_that_step_it_so(h3, tmp_path):
    """``student_modality_shifts: {audio: 1}``: the export's audio scheduler is at shift 1 (the
    picture's stays the teacher's 12), so diffusers' pipeline loaded from it reproduces the
    trainer's eval samples; the export command writes the same from the checkpoint."""
    from dmd2_core import checkpoint
    from dmd2_core.export.from_checkpoint import export_checkpoint, plan_export
    from dmd2_core.models.h3_repository import run_t2va
    from tests.helpers import in_process_trainers, iterate_in_process

    save = tmp_path / "run"
    trainers = in_process_trainers(load_args("minimax-h3", dict(
        CPU, hf_checkpoint=h3["url"], prompts=h3["prompts"], save=str(save), async_save=False,
        student_modality_shifts={"audio": 1.0})))
    iterate_in_process(trainers, 1)
    actor = trainers["actor"]
    url = actor.save(1, export=True)["export_url"]
    again = plan_export(str(save), out=str(tmp_path / "again"), export_format="pipeline")
    export_checkpoint(again)
    prompts = h3_prompt_set()
    ours = actor.sample([1], seed=7, decode=False)
    for export in (url, str(tmp_path / "again")):
        shifts = [json.loads((tmp_path / export / name / "scheduler_config.json").read_text())["shift"]
                  for name in ("scheduler", "audio_scheduler")]
        assert shifts == [12.0, 1.0], (export, shifts)
        length = int(prompts.embeds["prompt_lengths"][1])
        theirs = run_t2va(export, prompts.embeds["prompt_embeds"][1:2, :length], num_inference_steps=5,
                          num_frames=124, height=32, width=32, seed=7)
        joined = h3["family"].join(theirs["latents"][None], theirs["audio_latents"][None])
        torch.testing.assert_close(joined, ours, atol=2e-4, rtol=2e-4)
    assert url == checkpoint.export_url(str(save), 1)


def test_a_lora_student_on_its_own_sound_schedule_says_which_scheduler_to_set(h3, tmp_path):
    """A LoRA student's export holds adapters only, served on the teacher's pipeline: its marker
    names the scheduler to set, and the teacher's pipeline, given the adapters and set as the
    marker's note says, samples the student's eval latents (stepped on its own schedules: the
    recipe's, picture on 8 and sound on 1)."""
    from dmd2_core.export.pipeline import export_student
    from dmd2_core.models import lora
    from dmd2_core.models.h3_repository import load_t2va, run_t2va
    from dmd2_core.train import dmd2_iteration

    args = load_args("minimax-h3", dict(CPU, hf_checkpoint=h3["url"], prompts=h3["prompts"], save=str(tmp_path),
                                        lora_rank=4, lora_alpha=8.0))
    student = lora.attach(load_model_dir(h3["url"]).model, args)
    with torch.no_grad():
        for name, param in lora.trained(student):
            if ".lora_B." in name:
                param.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
    done = export_student(str(tmp_path / "export"), student, teacher_url=h3["url"], shift=1.0, num_steps=4,
                          export_dtype=torch.float32, lora_metadata=lora.adapter_metadata(args),
                          schedule_shifts={"video": 8.0, "audio": 1.0})
    said = json.loads((tmp_path / "export" / "export.json").read_text())["schedule_shifts"]
    assert said["audio_scheduler"] == 1.0 and said["scheduler"] == 8.0
    pipe = load_t2va(h3["url"])
    pipe.load_lora_weights(done["url"])
    exec(said["note"].split(": ", 1)[1], {"pipe": pipe})  # what the user runs
    prompts = h3_prompt_set()
    length = int(prompts.embeds["prompt_lengths"][1])
    theirs = run_t2va(pipe, prompts.embeds["prompt_embeds"][1:2, :length], num_inference_steps=5,
                      num_frames=124, height=32, width=32, seed=7)
    family = h3["family"].stepping_at({"video": 8.0, "audio": 1.0})
    cond = {k: v[:, :length] if k == "prompt_embeds" else v for k, v in prompts.cond(torch.tensor([1])).items()}
    ours = dmd2_iteration.eval_samples(family, student, cond, (1, family.segments["audio"].stop), 7, 4, 1.0)
    joined = family.join(theirs["latents"][None], theirs["audio_latents"][None])
    torch.testing.assert_close(joined, ours, atol=2e-4, rtol=2e-4)
    on_theirs = dmd2_iteration.eval_samples(h3["family"], student, cond, (1, family.segments["audio"].stop), 7, 4, 1.0)
    assert not torch.allclose(joined, on_theirs, atol=1e-3)  # the note matters


def test_an_adapter_layout_exported_after_the_fact_says_which_scheduler_to_set(h3, tmp_path):
    """A LoRA run's checkpoint of a student on its own sound schedule, exported after the fact in
    the peft layout: its marker names the scheduler to set, as the run's own LoRA export does."""
    from dmd2_core.export.from_checkpoint import export_checkpoint, plan_export
    from tests.helpers import in_process_trainers, iterate_in_process

    save = tmp_path / "run"
    trainers = in_process_trainers(load_args("minimax-h3", dict(
        CPU, hf_checkpoint=h3["url"], prompts=h3["prompts"], save=str(save), async_save=False, lora_rank=4,
        lora_alpha=8.0, student_modality_shifts={"audio": 1.0})))
    iterate_in_process(trainers, 1)
    run_export = trainers["actor"].save(1, export=True)["export_url"]
    export_checkpoint(plan_export(str(save), out=str(tmp_path / "peft"), export_format="peft"))
    said = [json.loads((tmp_path / d / "export.json").read_text())["schedule_shifts"] for d in (run_export, "peft")]
    assert said[0] == said[1] and said[0]["audio_scheduler"] == 1.0 and "shift=1)" in said[0]["note"]


@pytest.mark.multi_rank
def test_two_sharded_ranks_equal_one_rank_on_the_stand_in(ray_session, h3, tmp_path):
    """FSDP2 over 2 ranks (the fp32 modules as their own units, the root leaving its inputs' dtypes
    alone) trains the H3 stand-in to the weights 1 rank gets, student and fake score."""
    import secrets

    from dmd2_core.run.distill_run import DistillRun

    weights = {}
    for n in (1, 2):
        args = load_args("minimax-h3", dict(CPU, hf_checkpoint=h3["url"], prompts=h3["prompts"], num_devices=n,
                                            save=str(tmp_path / str(n)), run_name=f"h3-{n}-{secrets.token_hex(3)}",
                                            eval_interval=0, save_interval=0, lr=1e-4, critic_lr=1e-4))
        with DistillRun(args) as run:
            for i in (1, 2):
                run.iterate(i)
            weights[n] = {role: run.group_call(role, "weights")[0] for role in run.groups}
    for role in ("actor", "critic"):
        one, two = weights[1][role], weights[2][role]
        diff = max((one[k] - two[k]).abs().max().item() for k in one)
        assert diff < 2e-6, (role, diff)
    fresh = load_model_dir(h3["url"]).model.state_dict()
    assert max((fresh[k] - weights[1]["actor"][k]).abs().max().item() for k in fresh) > 1e-5


def test_prepare_prompts_encodes_with_the_qwen3_vl_conditioner(tmp_path):
    """prepare-prompts on a MiniMax-H3 repository: layer 50 of its conditioner per prompt, padded
    to the longest with the true lengths, and the same embeddings diffusers' own text step gives."""
    from dmd2_core.data import load_prompt_set
    from dmd2_core.models.h3_repository import run_t2va_with_prompt
    from dmd2_core.prepare.prompts import prepare_prompts

    url = build_h3_standin(str(tmp_path / "h3"), with_conditioner=True)
    out = str(tmp_path / "prompts.safetensors")
    prepare_prompts(url, ["a red cat", "a dog moving left"], out)
    got = load_prompt_set(out)
    assert got.embeds["prompt_lengths"].tolist() == [3, 4] and got.negative == {}
    assert got.embeds["prompt_embeds"].shape == (2, 4, 32)
    assert (got.embeds["prompt_embeds"][0, 3:] == 0).all()
    theirs = run_t2va_with_prompt(url, "a dog moving left", 2, 124, 32, 32, seed=0)["prompt_embeds"]
    torch.testing.assert_close(got.embeds["prompt_embeds"][1:2], theirs.float())


def _clip(path, fps, seconds, sample_rate, channels):
    """A clip whose frame i has brightness 8 * (i % 30) and a 440 Hz tone on the left channel only
    (mono: on its one channel)."""
    import numpy as np

    from dmd2_core.media.av_clips import write_mp4

    n = int(round(fps * seconds))
    frames = np.stack([np.full((32, 32, 3), 8 * (i % 30), np.uint8) for i in range(n)])
    t = np.arange(int(sample_rate * seconds)) / sample_rate
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    audio = tone[None] if channels == 1 else np.stack([tone, np.zeros_like(tone)])
    write_mp4(str(path), frames, audio, fps=fps, sample_rate=sample_rate, min_side=32)


def test_prepare_latents_encodes_clips_with_their_soundtrack_for_the_gan_head(h3, tmp_path):
    """Real clips (24 and 30 fps, stereo and mono sound at other rates) -> the clip's own seconds
    of video at 24 fps and stereo audio at the audio VAE's rate, encoded by both VAEs into the
    flat latents the model samples; the set passes preflight as the GAN head's real_data and a
    critic step trains the head on it. A clip without sound, or too short, is named in one line."""
    from dmd2_core.media.av_clips import stereo_balance
    from dmd2_core.prepare.latents import prepare_latents, read_clip_with_sound
    from dmd2_core.prepare.prompts import prepare_prompts
    from dmd2_core.train.trainer import Trainer

    url = build_h3_standin(str(tmp_path / "h3"), with_conditioner=True)  # captions need its conditioner
    prompts = str(tmp_path / "prompts.safetensors")
    prepare_prompts(url, ["a red cat", "a dog moving left", "rain", "a bell rings twice"], prompts)
    clips = tmp_path / "clips"
    clips.mkdir()
    _clip(clips / "a.mp4", 24, 5.5, 48000, 2)
    _clip(clips / "b.mp4", 30, 5.5, 44100, 1)
    (tmp_path / "captions.tsv").write_text("a\ta tone on the left\nb\ta tone in the middle\n")

    pixels, sound = read_clip_with_sound((clips / "b.mp4").read_bytes(), "b.mp4", 124, 32, 32, 24, 32000)
    assert pixels.shape == (3, 124, 32, 32) and sound.shape == (2, round(124 / 24 * 32000))
    brightness = (pixels.mean(dim=(0, 2, 3)) + 1) * 127.5
    want = torch.tensor([8.0 * ((k * 30 // 24) % 30) for k in range(124)])  # the frame showing at k / 24 s
    assert (brightness - want).abs().max() < 4
    torch.testing.assert_close(sound[0], sound[1])  # mono on both channels
    _, left = read_clip_with_sound((clips / "a.mp4").read_bytes(), "a.mp4", 124, 32, 32, 24, 32000)
    assert stereo_balance(left.numpy()) < -0.9

    out = str(tmp_path / "real.safetensors")
    real = prepare_latents(url, str(clips), str(tmp_path / "captions.tsv"), out, clip=(124, 32, 32))
    family = h3["family"]  # the same geometry
    assert real.latents.shape == (2, family.segments["audio"].stop) and torch.isfinite(real.latents).all()
    assert set(real.cond) == {"prompt_embeds", "prompt_lengths"}
    video, audio = family.split(real.latents)
    assert video.abs().sum() > 0 and audio.abs().sum() > 0

    args = load_args("minimax-h3", dict(CPU, hf_checkpoint=url, prompts=prompts, save=str(tmp_path / "run"),
                                        real_data=out, gan_weight=0.05, gan_critic_weight=0.1,
                                        eval_real_samples=0))  # 2 real clips: too few for the sound's yardstick
    roles = preflight(args)
    actor, critic = Trainer(roles["actor"], "actor"), Trainer(roles["critic"], "critic")
    pairs, _ = actor.rollout(1)
    head_before = {k: v.clone() for k, v in critic.disc.state_dict().items()}
    _, metrics = critic.train(1, pairs)
    assert metrics["gan_d_loss_real"] > 0 and metrics["gan_grad_norm"] > 0
    assert any(not torch.equal(head_before[k], v) for k, v in critic.disc.state_dict().items())

    silent = tmp_path / "silent"
    silent.mkdir()
    import numpy as np

    from dmd2_core.media.av_clips import write_mp4

    write_mp4(str(silent / "a.mp4"), np.zeros((132, 32, 32, 3), np.uint8), None, fps=24, sample_rate=32000, min_side=32)
    with pytest.raises(ArgsError, match=r"images: clip a.mp4 has no soundtrack"):
        prepare_latents(url, str(silent), str(tmp_path / "captions.tsv"), str(tmp_path / "x.safetensors"),
                        clip=(124, 32, 32))
    short = tmp_path / "short"
    short.mkdir()
    _clip(short / "a.mp4", 24, 3.0, 32000, 2)
    with pytest.raises(ArgsError, match=r"images: clip a.mp4 has 72 frames at 24 fps \(3.00 s\), the model's clips are 5.17 s"):
        prepare_latents(url, str(short), str(tmp_path / "captions.tsv"), str(tmp_path / "x.safetensors"),
                        clip=(124, 32, 32))
    assert not (tmp_path / "x.safetensors").exists()


def test_real_size_plan_from_the_shipped_config(tmp_path):
    """The shipped MiniMax-H3 configs are diffusers' own (33.1 B parameters, 50 blocks); the plan at
    5 s on 141 GiB devices fits 16 devices and is refused on 8 naming the device count; at 15 s
    on 24 GiB one clip's activations (at cp 8) alone exceed the device, and the refusal says so
    instead of offering more devices. Refusals are one line, exit 2."""
    import subprocess
    import sys
    from pathlib import Path

    from diffusers import MiniMaxH3Transformer3DModel

    from dmd2_core.run import preflight_checks
    from dmd2_core.memory import planner
    from dmd2_core.train.trainer_config import compute_trainer_args, compute_trainer_configs

    root = Path(__file__).resolve().parent.parent
    url = str(root / "deployments" / "model_configs" / "minimax-h3")
    shipped = json.loads((Path(url) / "transformer" / "config.json").read_text())
    default = dict(MiniMaxH3Transformer3DModel.load_config(url, subfolder="transformer"))
    with torch.device("meta"):
        reference = MiniMaxH3Transformer3DModel()
    assert {k: v for k, v in shipped.items() if not k.startswith("_")} == {
        k: list(v) if isinstance(v, tuple) else v for k, v in reference.config.items() if not k.startswith("_")}
    assert default["num_layers"] == 50
    size = planner.model_size(url)
    assert 33.0e9 < size.params < 33.2e9 and 645e6 < size.largest_block < 647e6  # 50 blocks of 646 M

    def plan(**overrides):
        args = load_args("minimax-h3", dict(hf_checkpoint=url, lora_rank=0, cp_size=1, **overrides))  # full FT
        args = preflight_checks.check_family_args(args, describe_model_dir(url))
        return planner.plan({c.role: compute_trainer_args(args, c) for c in compute_trainer_configs(args)}), args

    fits, args = plan(device_memory_gib=141, num_devices=16)
    assert args.latent_shape == [24, 37, 48, 84] and fits.fits
    tokens = 37 * 24 * 42 + 2 * 207
    assert 37_000 < tokens < 38_000
    refused, _ = plan(device_memory_gib=141, num_devices=8)
    with pytest.raises(ArgsError, match=r"memory plan: .* more than the 126.9 GiB of one device \(device_memory_gib less "
                                        r"the 10% headroom \(memory_headroom\)\); try more devices \(num_devices\)"):
        planner.check_fits(refused)
    cmd = [sys.executable, "-m", "dmd2_core", "plan", "--recipe", "minimax-h3", "--set", f"hf_checkpoint={url}",
           "--set", "num_frames=345", "--set", "device_memory_gib=24", "--set", "num_devices=64", "--set", "cp_size=8",
           "--set", "global_batch_size=64", "--set", "eval_interval=0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=root)
    assert done.returncode == 2
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: memory plan:") and "whatever the number of devices" in line
    assert "num_devices" not in line and "fsdp_cpu_offload" not in line


def _gan_args(h3, tmp_path, name, **extra):
    """A CPU run of the stand-in with the GAN head on 4 random real clips."""
    from dmd2_core.data import REAL_LATENTS, write_safetensors

    real = tmp_path / "real.safetensors"
    if not real.exists():
        g = torch.Generator().manual_seed(0)
        write_safetensors(str(real), {REAL_LATENTS: torch.randn(4, h3["family"].segments["audio"].stop, generator=g),
                                      **h3_prompt_set().cond(torch.tensor([0, 1, 2, 3]))})
    return load_args("minimax-h3", dict(CPU, hf_checkpoint=h3["url"], prompts=h3["prompts"], save=str(tmp_path / name),
                                        real_data=str(real), gan_critic_weight=0.1, eval_real_samples=0, lr=1e-4,
                                        critic_lr=1e-4, dmd2_update_ratio=1, num_frames=None, height=None, width=None,
                                        latent_shape=[24, 37, 2, 2], **extra))  # the clip, as the reference loop takes it


def test_a_gan_head_kept_off_the_sound_leaves_the_sounds_gradient_to_dmd_alone(h3, tmp_path):
    """``gan_modality_weights: {audio: 0}``: the head judges whole clips, but the gradient handed to
    the student's sound is the DMD gradient's to the bit (a run without the generator term hands
    over the same) while its picture gets the head's push; the reference loop (the bench's) takes
    the same step as the trainers."""
    from dmd2_core.train.reference import ReferenceLoop
    from tests.helpers import in_process_trainers, iterate_in_process

    family = h3["family"]

    def args(name, **extra):
        return _gan_args(h3, tmp_path, name, **extra)

    handed, metrics = {}, {}
    for name, extra in (("off_the_sound", {"gan_weight": 2.0, "gan_modality_weights": {"video": 1.0, "audio": 0.0}}),
                        ("no_generator_term", {"gan_weight": 0.0})):
        trainers = in_process_trainers(args(name, **extra))
        pairs, _ = trainers["actor"].rollout(1)
        out, metrics[name] = trainers["critic"].train(1, pairs)
        handed[name] = out["dmd2_grad"]
    audio, video = family.segments["audio"], family.segments["video"]
    assert torch.equal(handed["off_the_sound"][:, audio], handed["no_generator_term"][:, audio])
    assert not torch.equal(handed["off_the_sound"][:, video], handed["no_generator_term"][:, video])
    assert metrics["off_the_sound"]["gan_grad_norm_audio"] == 0 < metrics["off_the_sound"]["gan_grad_norm_video"]

    oracle = args("oracle", gan_weight=2.0, gan_modality_weights={"audio": 0.0})
    trainers, loop = in_process_trainers(oracle), ReferenceLoop(oracle)
    iterate_in_process(trainers, 1)
    loop.iterate(1)
    a, b = trainers["actor"].weights(), loop.student.state_dict()
    assert max((a[k] - b[k].detach()).abs().max().item() for k in b) < 1e-5


def test_a_modality_drawn_below_its_floor_leaves_the_dmd_gradient_and_the_other_keeps_its_part(h3, tmp_path):
    """``dmd2_modality_min_sigma: {video: 0.6}``: a sample scored below 0.6 hands the student no
    picture gradient, one above it the whole; the sound's part is the same to the bit as without
    a floor. The reference loop (the bench's) takes the same step as the trainers."""
    from dmd2_core.train import dmd2_iteration
    from dmd2_core.train.reference import ReferenceLoop
    from tests.helpers import in_process_trainers, iterate_in_process

    family = h3["family"]

    def floor_args(name, **extra):
        return load_args("minimax-h3", dict(CPU, hf_checkpoint=h3["url"], prompts=h3["prompts"], save=str(tmp_path / name),
                                            lr=1e-4, critic_lr=1e-4, dmd2_update_ratio=2, num_frames=None, height=None,
                                            width=None, latent_shape=[24, 37, 2, 2], **extra))

    handed = {}  # scored after one critic step (before it, the fake score is the teacher: no gradient at all)
    for name, extra in (("floored", {"dmd2_modality_min_sigma": {"video": 0.6}}), ("no_floor", {})):
        run = floor_args(name, **extra)
        trainers = in_process_trainers(run)
        pairs, _ = trainers["actor"].rollout(1)
        handed[name] = trainers["critic"].train(1, pairs)[0]["dmd2_grad"]
    run = trainers["critic"].args  # its shift resolved from the teacher
    sigma, _ = dmd2_iteration.noisy_inputs(run, 1, dmd2_iteration.critic_stream(run.dmd2_update_ratio - 1),
                                           tuple(handed["floored"].shape), slice(None))  # the fused scoring pass's
    audio, video = family.segments["audio"], family.segments["video"]
    assert torch.equal(handed["floored"][:, audio], handed["no_floor"][:, audio])
    below = sigma < 0.6
    assert 0 < int(below.sum()) < len(below), sigma  # both kinds of sample in the batch
    assert torch.equal(handed["floored"][below][:, video], torch.zeros_like(handed["floored"][below][:, video]))
    assert torch.equal(handed["floored"][~below][:, video], handed["no_floor"][~below][:, video])
    assert handed["no_floor"][below][:, video].norm(dim=1).min() > 0 < handed["no_floor"][:, audio].norm(dim=1).min()

    oracle = floor_args("oracle", dmd2_modality_min_sigma={"video": 0.6})
    trainers, loop = in_process_trainers(oracle), ReferenceLoop(oracle)
    iterate_in_process(trainers, 1)
    loop.iterate(1)
    a, b = trainers["actor"].weights(), loop.student.state_dict()
    assert max((a[k] - b[k].detach()).abs().max().item() for k in b) < 1e-5


def test_a_regression_pull_on_the_sound_alone_leaves_the_pictures_gradient_to_dmd(h3, tmp_path):
    """``dmd2_regression_modality_weights: {video: 0, audio: 1}``: the student's sound is pulled to the
    teacher's few-step sampler as by a pull on both (to the bit), its picture gets the DMD gradient
    alone (as without a pull). The reference loop (the bench's) takes the same step as the trainers."""
    from dmd2_core.train.reference import ReferenceLoop
    from tests.helpers import in_process_trainers, iterate_in_process

    family = h3["family"]

    def pull_args(name, **extra):
        return load_args("minimax-h3", dict(CPU, hf_checkpoint=h3["url"], prompts=h3["prompts"], save=str(tmp_path / name),
                                            lr=1e-4, critic_lr=1e-4, dmd2_update_ratio=2, num_frames=None, height=None,
                                            width=None, latent_shape=[24, 37, 2, 2], dmd2_student_steps=2, **extra))

    sound_only = {"dmd2_regression_weight": 0.5, "dmd2_regression_modality_weights": {"video": 0.0, "audio": 1.0}}
    handed = {}
    for name, extra in (("sound_pull", sound_only), ("both_pull", {"dmd2_regression_weight": 0.5}), ("no_pull", {})):
        trainers = in_process_trainers(pull_args(name, **extra))
        pairs, _ = trainers["actor"].rollout(1)
        handed[name] = trainers["critic"].train(1, pairs)[0]["dmd2_grad"]
    audio, video = family.segments["audio"], family.segments["video"]
    assert torch.equal(handed["sound_pull"][:, video], handed["no_pull"][:, video])
    assert torch.equal(handed["sound_pull"][:, audio], handed["both_pull"][:, audio])
    assert (handed["sound_pull"][:, audio] - handed["no_pull"][:, audio]).abs().max() > 1e-4
    assert (handed["both_pull"][:, video] - handed["no_pull"][:, video]).abs().max() > 1e-4

    oracle = pull_args("oracle", **sound_only)
    trainers, loop = in_process_trainers(oracle), ReferenceLoop(oracle)
    iterate_in_process(trainers, 1)
    loop.iterate(1)
    a, b = trainers["actor"].weights(), loop.student.state_dict()
    assert max((a[k] - b[k].detach()).abs().max().item() for k in b) < 1e-5


@pytest.mark.parametrize("setting, critic_shift, student_shift", [
    ({"dmd2_modality_shifts": {"audio": 1.0}, "student_modality_shifts": None}, 1.0, 3.0),
    ({"student_modality_shifts": {"audio": 1.0}}, 3.0, 1.0),
])
def test_the_critic_and_the_student_each_put_the_sound_at_its_own_shift(h3, tmp_path, monkeypatch, setting,
                                                                         critic_shift, student_shift):
    """``dmd2_modality_shifts: {audio: 1}``: every forward of the critic's steps and of the DMD
    scoring (the fake score's and the teacher's) carries the sound at shift(u, 1) = u beside the
    picture at shift(u, 12); every forward of the student's rollout and of its graded step carries
    the schedulers' pair (the sound at shift(u, 3)). ``student_modality_shifts: {audio: 1}`` the
    other way round, and the eval's teacher reference stays on the schedulers'. The reference loop
    (the bench's) takes the same step as the trainers."""
    from diffusers import MiniMaxH3Transformer3DModel

    from dmd2_core.models.minimax_h3 import shifted
    from dmd2_core.train.reference import ReferenceLoop
    from tests.helpers import in_process_trainers, iterate_in_process

    seen, phase = [], ["student"]
    forward = MiniMaxH3Transformer3DModel.forward

    def recording(self, *a, **kw):
        t, rows = kw["timestep"], kw["timestep_indices"]
        seen.append((phase[0], 1 - float(t[rows[kw["video_indices"][-1]]]), 1 - float(t[rows[kw["audio_indices"][-1]]])))
        return forward(self, *a, **kw)

    monkeypatch.setattr(MiniMaxH3Transformer3DModel, "forward", recording)
    args = load_args("minimax-h3", dict(CPU, hf_checkpoint=h3["url"], prompts=h3["prompts"], save=str(tmp_path / "run"),
                                        lr=1e-4, critic_lr=1e-4, dmd2_update_ratio=2, num_frames=None, height=None,
                                        width=None, latent_shape=[24, 37, 2, 2], **setting))
    trainers = in_process_trainers(args)
    pairs, _ = trainers["actor"].rollout(1)
    phase[0] = "critic"
    scores, _ = trainers["critic"].train(1, pairs)
    phase[0] = "student"
    trainers["actor"].train(1, pairs, scores)
    trainers["actor"].sample([0, 1], seed=3, decode=False)
    phase[0] = "teacher"
    trainers["critic"].teacher_reference([0, 1], seed=3, num_steps=4)

    def audio_shift_of(s_video, s_audio):  # the shift that puts the sound at s_audio where u puts the picture at s_video
        u = torch.tensor(s_video / (12 - 11 * s_video))
        return min((abs(float(shifted(u, k)) - s_audio), k) for k in (1.0, 3.0))

    def telling(s_video):  # at u = 1 (a rollout's first step) every shift puts the sound at 1
        u = torch.tensor(s_video / (12 - 11 * s_video))
        return abs(float(shifted(u, 1.0) - shifted(u, 3.0))) > 1e-3

    by_phase = {p: [audio_shift_of(v, a) for q, v, a in seen if q == p and telling(v)]
                for p in ("student", "critic", "teacher")}
    assert len(by_phase["critic"]) > 2 * args.global_batch_size and len(by_phase["student"]) >= 4
    assert len(by_phase["teacher"]) >= 3
    for p, shift in (("critic", critic_shift), ("student", student_shift), ("teacher", 3.0)):
        assert all(k == shift and gap < 1e-4 for gap, k in by_phase[p]), (p, by_phase[p])

    monkeypatch.setattr(MiniMaxH3Transformer3DModel, "forward", forward)
    trainers, loop = in_process_trainers(args), ReferenceLoop(args)
    iterate_in_process(trainers, 1)
    loop.iterate(1)
    a, b = trainers["actor"].weights(), loop.student.state_dict()
    assert max((a[k] - b[k].detach()).abs().max().item() for k in b) < 1e-5


def test_a_gan_head_told_to_judge_the_picture_reads_the_text_and_video_rows_alone(h3, tmp_path, monkeypatch):
    """``gan_judged_modalities: [video]``: every feature row the head reads, on real and student
    clips, is a text or generated video row of the packed sequence, all of them; none is audio."""
    from dmd2_core.models.gan_head import DiscriminatorHead
    from tests.helpers import in_process_trainers

    seen = []
    forward = DiscriminatorHead.forward

    def recording(self, features):
        seen.append(features.shape[1])
        return forward(self, features)

    monkeypatch.setattr(DiscriminatorHead, "forward", recording)
    trainers = in_process_trainers(_gan_args(h3, tmp_path, "video", gan_weight=2.0, gan_judged_modalities=["video"]))
    pairs, _ = trainers["actor"].rollout(1)
    trainers["critic"].train(1, pairs)
    family = trainers["critic"].family
    text = int(h3_prompt_set().embeds["prompt_lengths"].max())
    rows = family.judged_rows(text, (), ("video",))
    generated = family.feature_tokens(text)
    assert set(rows.tolist()) >= set(generated["video"].tolist())
    assert not set(rows.tolist()) & set(generated["audio"].tolist())
    assert seen and set(seen) <= {int(family.judged_rows(n, (), ("video",)).numel())
                                  for n in h3_prompt_set().embeds["prompt_lengths"].tolist()}, seen
