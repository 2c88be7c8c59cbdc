"""Sounding digits with references (MiniMax-H3's ref2va, issue 56): a prompt that names no digit and,
as each clip's picture reference, the glyph of another clip of its digit; a teacher trained with
them (in transformer_ref/, as H3's ref2va partition) draws the digit its reference shows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dmd2_core.data import REFERENCE_PIXELS
from dmd2_core.errors import ArgsError
from dmd2_core.run.preflight_checks import check_workflow_prompts
from dmd2_core.toys import sounding_digits as sd, sounding_digits_teacher
from tests.helpers import assert_same_prompt_set, world_teacher

REF_FIXTURE = Path(__file__).parent / "fixtures" / "av_ref_teacher"
FOLLOWS = 0.3  # the share of clips drawing the reference's digit at 8 steps (measured .40; chance .10)


def test_each_clips_reference_is_another_clip_of_its_digit_and_its_prompt_names_none():
    clips = sd.make_clips("test")
    rows = sd.reference_prompt_set(clips)
    cond = rows.cond(torch.arange(len(clips)))
    partners = sd.reference_partners(clips.labels)
    assert torch.equal(clips.labels[partners], clips.labels) and not (partners == torch.arange(len(clips))).any()
    glyphs = sd.glyphs(clips)
    assert torch.equal(cond["reference_latents"][:, 0, 0, 0], glyphs[partners])  # an 8x8 picture: its own size
    assert torch.equal(glyphs[0], clips.frames[0, 0, :, clips.columns[0, 0]:clips.columns[0, 0] + sd.DIGIT])
    assert cond["reference_kinds"].tolist() == [[0]] * len(clips)
    assert (cond["prompt_embeds"] == cond["prompt_embeds"][:1]).all()  # one prompt for every digit
    assert REFERENCE_PIXELS not in cond
    pixels = rows.embeds[REFERENCE_PIXELS]
    assert pixels.dtype == torch.uint8 and pixels.shape == (len(clips), 1, 3, sd.DIGIT, sd.DIGIT)
    assert torch.allclose(pixels[:, 0, 0].float() / 127.5 - 1, glyphs[partners], atol=0.5 / 127.5 + 1e-6)


@pytest.fixture(scope="module")
def ref_teacher(tmp_path_factory):
    """The committed ref2va teacher (``make av-ref-teacher`` trains it: ~26 min of a core), its
    prompt and real sets rebuilt beside a copy of it."""
    return world_teacher(tmp_path_factory, REF_FIXTURE)


def test_the_reference_teacher_fixture_is_the_recipes_weights_in_transformer_ref(ref_teacher):
    t = sounding_digits_teacher
    assert t.weights_sha256(str(REF_FIXTURE)) == t.recorded_sha256(str(REF_FIXTURE))
    assert t.weights_file(str(REF_FIXTURE)).startswith("transformer_ref/") and not (REF_FIXTURE / "transformer").exists()
    assert t.differs(str(REF_FIXTURE), workflow="ref2va") is None
    assert_same_prompt_set(t.prompts_url(ref_teacher), sd.reference_prompt_set(sd.make_clips("train")))
    check_workflow_prompts(t.prompts_url(ref_teacher), "ref2va", sd.VIDEO_LATENT_SHAPE)
    with pytest.raises(ArgsError, match="holds references"):
        check_workflow_prompts(t.prompts_url(ref_teacher), "t2va", sd.VIDEO_LATENT_SHAPE)
    assert json.loads((REF_FIXTURE / "training.json").read_text())["workflow"] == "ref2va"


def test_the_reference_teacher_draws_the_digit_its_held_out_reference_shows(ref_teacher):
    """Eight steps from held-out references: the picture is the reference's digit four times in
    ten (chance: one). Given another digit's reference instead, the clips follow it and leave
    their own: the reference rows condition the forward (the prompt is the same for every digit,
    so nothing else could). Its tone does not follow (at chance: bench/README)."""
    loaded = sounding_digits_teacher.load_teacher(ref_teacher)
    family = sounding_digits_teacher.bound_family(loaded.model)
    clips = sounding_digits_teacher.EvalClips("ref2va", 100)
    own = clips.figures(clips.sample(family, loaded.model.eval(), 8, seed=0))
    assert own["frame_acc"] >= FOLLOWS, own
    # each clip given the reference of a clip of digit + 5 (mod 10): another digit, the same prompt
    members = {d: torch.nonzero(clips.labels == d).flatten().tolist() for d in range(10)}
    order = torch.tensor([members[(int(y) + 5) % 10][i % len(members[(int(y) + 5) % 10])]
                          for i, y in enumerate(clips.labels)])
    swapped = dict(clips.cond, reference_latents=clips.cond["reference_latents"][order])
    from dmd2_core.toys import sounding_digits_metrics

    theirs = sounding_digits_teacher.sample_clips(family, loaded.model.eval(), clips.labels, 8, 0, swapped)
    against_given = sounding_digits_metrics.evaluate_clips(theirs, clips.labels[order])
    against_own = sounding_digits_metrics.evaluate_clips(theirs, clips.labels)
    assert against_given["frame_acc"] >= FOLLOWS and against_own["frame_acc"] < 0.15, (against_given, against_own)
