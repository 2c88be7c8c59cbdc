"""Sounding digits with keyframes (MiniMax-H3's fl2va, issue 56): each clip conditioned on its own
first and last frames; a teacher trained with them keeps them, and the figure that says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dmd2_core.data import KEYFRAME_PIXELS
from dmd2_core.errors import ArgsError
from dmd2_core.run.preflight_checks import check_workflow_prompts
from dmd2_core.models import load_model_dir
from dmd2_core.toys import sounding_digits as sd, sounding_digits_metrics, sounding_digits_teacher
from tests.helpers import assert_same_prompt_set, world_teacher

KF_FIXTURE = Path(__file__).parent / "fixtures" / "av_kf_teacher"


def test_each_clip_is_conditioned_on_its_own_first_and_last_frames():
    clips = sd.make_clips("test")
    rows = sd.keyframe_prompt_set(clips)
    cond = rows.cond(torch.arange(len(clips)))
    assert torch.equal(cond["keyframe_latents"][:, 0, 0, 0], clips.frames[:, 0])
    assert torch.equal(cond["keyframe_latents"][:, 1, 0, 0], clips.frames[:, -1])
    assert cond["keyframe_anchors"].tolist() == [[0, 1]] * len(clips)
    assert torch.equal(cond["prompt_embeds"], sd.prompt_set().embeds["prompt_embeds"][clips.labels])
    assert KEYFRAME_PIXELS not in cond  # shown in the eval media, read by no forward
    pixels = rows.embeds[KEYFRAME_PIXELS]
    assert pixels.dtype == torch.uint8 and pixels.shape == (len(clips), 2, 3, sd.HEIGHT, sd.WIDTH)
    assert torch.allclose(pixels[:, 1, 2].float() / 127.5 - 1, clips.frames[:, -1], atol=0.5 / 127.5 + 1e-6)  # the last frame


def test_keyframe_agreement_is_whether_the_clips_ends_show_the_digit_where_its_keyframes_do():
    """Real clips keep their own keyframes (agreement 1, no pixel off); the same clips played
    backwards start where they should end: every digit moves 6 columns, so none agrees."""
    clips = sd.heldout_clips(60)
    keyframes = clips.frames[:, sd.keyframe_frames(sd.KEYFRAME_ANCHORS)]
    real = sounding_digits_metrics.keyframe_figures(sd.encode(clips.frames, clips.audio), keyframes, sd.KEYFRAME_ANCHORS)
    assert real == {"keyframe_agreement": 1.0, "keyframe_l1": 0.0}
    backwards = sd.encode(clips.frames.flip(1), clips.audio)
    reversed_figures = sounding_digits_metrics.keyframe_figures(backwards, keyframes, sd.KEYFRAME_ANCHORS)
    assert reversed_figures["keyframe_agreement"] == 0.0 and reversed_figures["keyframe_l1"] > 0.1
    first_only = sounding_digits_metrics.keyframe_figures(backwards, clips.frames[:, -1:], ("first",))
    assert first_only["keyframe_agreement"] == 1.0  # the reversed clip's first frame is the clip's last
    blank = sd.encode(torch.full_like(clips.frames, -1.0), clips.audio)
    assert sounding_digits_metrics.keyframe_figures(blank, keyframes, sd.KEYFRAME_ANCHORS)["keyframe_agreement"] == 0.0
    shifted = torch.cat([torch.full_like(clips.frames[..., :1], -1.0), clips.frames[..., :-1]], dim=-1)
    one_column_off = sd.encode(shifted, clips.audio)  # one column to the right: within the tolerance
    assert sounding_digits_metrics.keyframe_figures(one_column_off, keyframes, sd.KEYFRAME_ANCHORS)["keyframe_agreement"] == 1.0


@pytest.fixture(scope="module")
def kf_teacher(tmp_path_factory):
    """The committed fl2va teacher (``make av-kf-teacher`` trains it: ~15 min of a core), its prompt
    and real sets rebuilt beside a copy of it (3 MB not committed)."""
    return world_teacher(tmp_path_factory, KF_FIXTURE)


def test_the_keyframe_teacher_fixture_is_the_recipes_weights(kf_teacher):
    t = sounding_digits_teacher
    assert t.weights_sha256(str(KF_FIXTURE)) == t.recorded_sha256(str(KF_FIXTURE))
    assert t.differs(str(KF_FIXTURE), workflow="fl2va") is None  # DEFAULT_STEPS from seed 0, with keyframes
    assert t.differs(str(KF_FIXTURE)) == "trained for fl2va, not t2va"
    assert_same_prompt_set(t.prompts_url(kf_teacher), sd.keyframe_prompt_set(sd.make_clips("train")))
    assert json.loads((KF_FIXTURE / "training.json").read_text())["workflow"] == "fl2va"
    # what an fl2va run's preflight asks of its prompt set; a t2va run is refused it
    check_workflow_prompts(t.prompts_url(kf_teacher), "fl2va", sd.VIDEO_LATENT_SHAPE)
    with pytest.raises(ArgsError, match="holds keyframes"):
        check_workflow_prompts(t.prompts_url(kf_teacher), "t2va", sd.VIDEO_LATENT_SHAPE)


def test_the_keyframe_teacher_puts_the_digit_where_its_held_out_keyframes_say(kf_teacher):
    """Eight steps from held-out keyframes: the digit starts and ends where they show it. Given
    another clip's keyframes instead, the clips follow those, not their own: the keyframe rows
    condition the forward (a teacher that ignored them would agree by chance either way)."""
    loaded = load_model_dir(kf_teacher)
    family = sounding_digits_teacher.bound_family(loaded.model)
    clips = sounding_digits_teacher.EvalClips("fl2va", 40)
    own = clips.figures(clips.sample(family, loaded.model.eval(), 8, seed=0))
    assert own["keyframe_agreement"] >= 0.9, own
    others = dict(clips.cond, keyframe_latents=clips.cond["keyframe_latents"].roll(1, 0))
    theirs = sounding_digits_teacher.sample_clips(family, loaded.model.eval(), clips.labels, 8, 0, others)
    against_own = sounding_digits_metrics.keyframe_figures(theirs, clips.keyframes, clips.anchors)
    against_given = sounding_digits_metrics.keyframe_figures(theirs, clips.keyframes.roll(1, 0), clips.anchors)
    assert against_own["keyframe_agreement"] < 0.5 < against_given["keyframe_agreement"], (against_own, against_given)


def test_a_keyframe_teacher_reused_is_said_to_be_trained_for_its_workflow(kf_teacher):
    logs = []
    sounding_digits_teacher.ensure_av_teacher(kf_teacher, log=logs.append)
    assert logs == [f"reusing av teacher at {kf_teacher} (trained for fl2va, not t2va; its figures are not the "
                    "bench's: remove it to train this one)"]
    logs.clear()
    sounding_digits_teacher.ensure_av_teacher(kf_teacher, log=logs.append, workflow="fl2va")
    assert logs == [f"reusing av teacher at {kf_teacher}"]

