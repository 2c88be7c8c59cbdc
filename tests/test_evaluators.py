"""The run's evaluator: the default follows the prompt set, a bad name is refused in one line, and
the teacher evaluator scores a student in the teacher's own features against the teacher's own
samples, made once and cached."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from dmd2_core import evaluators as registry
from dmd2_core.evaluation.evaluator import evaluator_name
from dmd2_core.evaluation import teacher_evaluator as evaluators
from tests.helpers import in_process_trainers, tiny_args


class InProcessRun:
    """What an eval asks of a DistillRun, answered by in-process trainers (one rank each)."""

    def __init__(self, trainers: dict):
        self.trainers, self.has_critic, self.references, self.real_references = trainers, "critic" in trainers, 0, 0

    def sample(self, prompt_index, seed, num_steps=None):
        return self.trainers["actor"].sample(prompt_index, seed, num_steps=num_steps)

    def eval_latents(self, prompt_index, seed, num_steps=None):
        return self.trainers["actor"].sample(prompt_index, seed, decode=False, num_steps=num_steps)

    def drift_stats(self, latents):
        return self.trainers["actor"].drift_stats(latents)

    def teacher_reference(self, prompt_index, seed, num_steps):
        self.references += 1
        return self.trainers["critic"].teacher_reference(prompt_index, seed, num_steps)

    def teacher_features(self, latents, prompt_index, u, seed):
        return self.trainers["critic"].teacher_features(latents, prompt_index, u, seed)

    def real_features(self, rows, u, seed, index_offset):
        self.real_references += 1
        return self.trainers["critic"].real_features(rows, u, seed, index_offset)


def _args(teacher, save, **overrides):
    values = dict(evaluator="teacher", eval_interval=1, eval_num_samples=20, eval_reference_steps=8,
                  dmd2_student_steps=4, eval_prompts=[0, 1, 2, 3, 4])
    values.update(overrides)
    return tiny_args(teacher, save, **values)


def test_the_default_evaluator_follows_the_prompt_set(tiny_teacher, tmp_path):
    from dmd2_core.toys import sounding_digits as sd

    assert evaluator_name(tiny_args(tiny_teacher, str(tmp_path))) == "digits"
    prompts = str(tmp_path / "sounding.safetensors")
    sd.prompt_set().save(prompts)
    assert evaluator_name(tiny_args(tiny_teacher, str(tmp_path), prompts=prompts)) == "sounding-digits"
    plain = str(tmp_path / "plain.safetensors")
    from dmd2_core.toys.digits import digits_prompt_set

    digits_prompt_set().save(plain)
    assert evaluator_name(tiny_args(tiny_teacher, str(tmp_path), prompts=plain)) == "teacher"


def test_a_bad_evaluator_name_is_one_line_naming_the_key(tiny_teacher, tmp_path):
    from dmd2_core.errors import ArgsError

    with pytest.raises(ArgsError, match=r"^invalid value for 'evaluator' .*'teacher', 'digits' or 'sounding-digits'; "
                                        r"did you mean 'teacher'\? \(got 'teachr'\)$"):
        tiny_args(tiny_teacher, str(tmp_path), evaluator="teachr")


def test_the_teacher_evaluator_ranks_a_broken_student_below_the_teacher_and_caches_its_reference(tiny_teacher, tmp_path):
    args = _args(tiny_teacher, str(tmp_path / "run"))
    run = InProcessRun(in_process_trainers(args))
    first = evaluators.evaluate(run, args)
    m = first["metrics"]
    assert {"teacher_kid_image", "teacher_kid", "diversity_image", "drift_brightness_image"} <= set(m)
    assert m["teacher_kid"] == m["teacher_kid_image"] and run.references == 1
    assert set(first["reference"]["value"]) == set(first["reference"]["se"]) == {
        "brightness_image", "saturation_image", "contrast_image"}
    again = evaluators.evaluate(run, args)  # the reference comes from the cache: the teacher samples once
    assert run.references == 1 and again["metrics"]["teacher_kid"] == pytest.approx(m["teacher_kid"])
    assert again["reference"] == first["reference"]
    with torch.no_grad():  # a student whose weights are noise: far from the teacher in its own eyes
        for p in run.trainers["actor"].model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
        if run.trainers["actor"].ema is not None:
            for e in run.trainers["actor"].ema:
                e.add_(torch.randn_like(e) * 0.5)
    broken = evaluators.evaluate(run, args)["metrics"]
    assert broken["teacher_kid"] > m["teacher_kid"] + 0.05, (m["teacher_kid"], broken["teacher_kid"])


def test_another_eval_setting_misses_the_cache(tiny_teacher, tmp_path):
    shared = str(tmp_path / "shared-reference")
    args = _args(tiny_teacher, str(tmp_path / "a"), eval_reference_url=shared, eval_num_samples=10)
    run = InProcessRun(in_process_trainers(args))
    evaluators.evaluate(run, args)
    evaluators.evaluate(run, args.model_copy(update={"save": str(tmp_path / "b")}))  # another night, same cache
    assert run.references == 1
    evaluators.evaluate(run, args.model_copy(update={"eval_seed": 7}))
    assert run.references == 2


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_set_rewritten_at_its_url_with_other_tensors_keys_another_reference(where, tiny_teacher, tmp_path, request):
    """The teacher's cached reference is of the prompt set's tensors, not its texts: the set
    rewritten at its URL with other embeddings of the same shapes and the same texts (its header
    and size unchanged) keys another reference, and a real set so rewritten another real
    reference; the same file keeps both keys, so a rerun hits."""
    from dmd2_core import storage
    from dmd2_core.data import PromptSet, REAL_LATENTS, prompt_texts, write_safetensors
    from dmd2_core.toys.digits import digits_prompt_set

    root = request.getfixturevalue("s3_bucket") if where == "s3" else str(tmp_path)
    prompts_url, real_url = f"{root}/prompts.safetensors", f"{root}/real.safetensors"
    prompts = digits_prompt_set()

    def write_sets(shift: float) -> None:
        PromptSet(prompts.prompts, {k: v + shift for k, v in prompts.embeds.items()}, prompts.negative).save(prompts_url)
        write_safetensors(real_url, {REAL_LATENTS: torch.full((4, 1, 8, 8), shift), **prompts.cond([0, 1, 2, 3])},
                          {"prompts": "[]"})

    write_sets(0.0)
    args = _args(tiny_teacher, str(tmp_path / "run"), prompts=prompts_url).model_copy(update={"real_data": real_url})
    identity, order, rows = evaluators.teacher_identity(args), [0, 1, 2], [0, 2]
    keys = (evaluators.reference_key(args, order, identity), evaluators.real_key(args, rows, identity))
    headers = [storage.read_safetensors_header(url) for url in (prompts_url, real_url)]
    assert (evaluators.reference_key(args, order, identity), evaluators.real_key(args, rows, identity)) == keys
    if where == "local":  # the same set copied in with its mtime kept (cp -p, rsync -a): another inode, the same key
        for url in (prompts_url, real_url):
            shutil.copy2(url, url + ".copy")
            os.replace(url + ".copy", url)
        assert (evaluators.reference_key(args, order, identity), evaluators.real_key(args, rows, identity)) == keys

    write_sets(1.0)
    assert prompt_texts(prompts_url) == prompts.prompts
    assert [storage.read_safetensors_header(url) for url in (prompts_url, real_url)] == headers
    assert evaluators.reference_key(args, order, identity) != keys[0]
    assert evaluators.real_key(args, rows, identity) != keys[1]


def test_a_real_set_is_a_second_reference_and_the_drift_yardstick(tiny_teacher, tmp_path):
    """With real_data, the student is also measured against real rows in the teacher's eyes
    (real_kid, their features made once and cached) and drift is judged against the real samples."""
    args = _args(tiny_teacher, str(tmp_path / "run"), real_data="digits", eval_real_samples=40)
    run = InProcessRun(in_process_trainers(args))
    first = evaluators.evaluate(run, args)
    m = first["metrics"]
    assert m["real_kid"] == m["real_kid_image"] and run.real_references == 1
    assert first["reference"]["source"] == "real" and set(first["reference"]["value"]) == {
        "brightness_image", "saturation_image", "contrast_image"}
    again = evaluators.evaluate(run, args)
    assert run.real_references == 1 and again["metrics"]["real_kid"] == pytest.approx(m["real_kid"])
    with torch.no_grad():
        for p in run.trainers["actor"].model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    broken = evaluators.evaluate(run, args)["metrics"]
    assert broken["real_kid"] > m["real_kid"] + 0.05, (m["real_kid"], broken["real_kid"])
    without = evaluators.evaluate(run, args.model_copy(update={"eval_real_samples": 0}))
    assert "real_kid" not in without["metrics"] and without["reference"]["source"] == "teacher"


def test_drift_is_judged_from_the_runs_start_against_the_reference():
    reference = {"value": {"contrast_image": 0.374, "brightness_image": 0.31, "centroid_audio": 1000.0},
                 "se": {"contrast_image": 0.002, "brightness_image": 0.002, "centroid_audio": 5.0}}
    start = {"drift_contrast_image": 0.355, "drift_brightness_image": 0.308, "drift_centroid_audio": 1100.0,
             "diversity_image": 1.0}
    # the start's own offset (a few-step sampler against the reference) is no drift
    assert evaluators.drift_flags(start, start, reference) == []
    # towards the reference, however far: an improving student
    assert evaluators.drift_flags({**start, "drift_contrast_image": 0.379}, start, reference) == []
    # within the band (3 sqrt(2) standard errors, at least the floor): noise
    assert evaluators.drift_flags({**start, "drift_brightness_image": 0.300}, start, reference) == []
    # away from the reference beyond the band: over-saturating, darkening, a centroid off by 30%
    flagged = {**start, "drift_contrast_image": 0.398, "drift_brightness_image": 0.29, "drift_centroid_audio": 1400.0}
    assert evaluators.drift_flags(flagged, start, reference) == [
        "drift_brightness_image", "drift_centroid_audio", "drift_contrast_image"]
    # a within-prompt diversity a tenth below the start's: collapsing (none to compare: not judged)
    assert evaluators.drift_flags({**start, "diversity_image": 0.85}, start, reference) == ["diversity_image"]
    assert evaluators.drift_flags({**start, "diversity_image": 0.95}, start, reference) == []
    assert evaluators.drift_flags({"drift_contrast_image": 0.9}, {}, reference) == []


def test_retention_keeps_the_best_students_export(tmp_path):
    """Three later exports under keep_exports 1: the best eval's export (best_student.json) stays,
    the others older than the newest go."""
    import json
    from types import SimpleNamespace

    from dmd2_core import checkpoint
    from dmd2_core.export.retention import list_exports
    from dmd2_core.run.checkpoint_commits import CheckpointCommits
    from dmd2_core.save_layout import best_student_url, complete_url, export_url

    save = str(tmp_path / "run")
    for i in (1, 2, 3, 4):
        (tmp_path / "run" / "exports" / f"iter_{i:07d}").mkdir(parents=True)
        (tmp_path / "run" / "exports" / f"iter_{i:07d}" / "export.json").write_text("{}")
    for role in ("actor", "critic"):
        marker = tmp_path / complete_url(save, role, 4).removeprefix(str(tmp_path) + "/")
        marker.parent.mkdir(parents=True)
        marker.write_text("{}")
    (tmp_path / "run" / "best_student.json").write_text(json.dumps({"iteration": 2, "export_url": export_url(save, 2)}))
    tracker = CheckpointCommits(SimpleNamespace(save=save, keep_last_n=0, keep_exports=1))
    lease = SimpleNamespace(ensure=lambda: None, expires=lambda: float("inf"))
    done = {"actor": [{"url": "a", "save_s": 1.0, "bytes": 1, "export_url": export_url(save, 4)}],
            "critic": [{"url": "c", "save_s": 1.0, "bytes": 1}]}
    tracker.track(lease, 4, done)
    assert [e["iteration"] for e in list_exports(checkpoint.exports_root(save))] == [2, 4]
    assert best_student_url(save).endswith("best_student.json")


def test_an_unwritable_reference_cache_is_refused_before_any_actor(tiny_teacher, tmp_path):
    from dmd2_core.errors import ArgsError
    from dmd2_core.run.distill_run import DistillRun

    (tmp_path / "afile").write_text("")
    with pytest.raises(ArgsError, match=r"^eval_reference_url: cannot write to .*afile/ref "):
        DistillRun(_args(tiny_teacher, str(tmp_path / "run"), eval_reference_url=str(tmp_path / "afile" / "ref")))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, line", [
    ({"eval_num_samples": 2}, r"eval_num_samples: 2: the teacher-feature KID and its standard error need at least 3 "
                              r"samples an eval; set eval_num_samples to 3 or more$"),
    ({"eval_num_samples": 1}, r"eval_num_samples: 1: .* at least 3 samples an eval"),
    ({"real_data": "digits", "eval_real_samples": 2}, r"eval_real_samples: 2: the KID to the real set needs at least 3 "
                                                       r"real samples; set eval_real_samples to 3 or more, or 0 for none$"),
])
def test_an_eval_too_small_for_a_kid_and_its_standard_error_is_refused_before_any_actor(tiny_teacher, tmp_path,
                                                                                         overrides, line):
    """A picture run's eval of fewer than 3 samples a side: its KID's standard error would be NaN
    (the regression call then weighs nothing), and at 1 the eval fails mid-run; refused in one line
    naming the key, before any actor; 3 passes."""
    from dmd2_core.errors import ArgsError
    from dmd2_core.run.distill_run import DistillRun

    with pytest.raises(ArgsError, match=f"^{line}") as refused:
        DistillRun(_args(tiny_teacher, str(tmp_path / "run"), **overrides))
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "run").exists()
    DistillRun(_args(tiny_teacher, str(tmp_path / "ok"), **{k: 3 if isinstance(v, int) else v for k, v in overrides.items()}))


def test_a_new_evaluator_is_one_file_and_one_registry_line(tiny_teacher, tmp_path, monkeypatch):
    """The seam: an evaluator registered by name is accepted by Args, scores an eval, and its
    figure reaches the run summary, the metrics table and the nights view with its criterion."""
    from types import SimpleNamespace

    from dmd2_core import report
    from dmd2_core.report import nights_view
    from dmd2_core.evaluation.eval_step import run_eval

    monkeypatch.setitem(registry.EVALUATORS, "brightness", "tests.evaluator_fixture:BrightnessEvaluator")
    args = tiny_args(tiny_teacher, str(tmp_path / "run"), evaluator="brightness", eval_num_samples=4,
                     eval_prompts=[0], eval_samples_per_prompt=1)
    run = SimpleNamespace(args=args, sample=lambda order, seed, num_steps=None: torch.full((len(order), 1, 8, 8), 0.75))
    out = run_eval(run, 3)
    assert out["metrics"]["brightness_gap"] == pytest.approx(0.25) and out["metrics"]["brightness"] == pytest.approx(0.75)

    rows = [{"iteration": 0, "dmd2_loss": 1.0, "brightness_gap": 0.4, "brightness": 0.9},
            {"iteration": 3, "dmd2_loss": 0.5, **out["metrics"]}]
    summary = report.summary_markdown({"name": "n", "evaluator": "brightness", "iteration": 3, "final": 3, "start": 0,
                                       "evals": rows})
    assert "Best eval so far (the campaign's): iteration 3 (brightness_gap 0.25, brightness 0.75)" in summary
    assert "| iteration | brightness_gap | brightness | dmd2_loss |" in summary
    table = report.metrics_table(rows, report.table_columns(registry.get("brightness")))
    assert table[0] == {"iteration": 3, "dmd2_loss": 0.5, "brightness_gap": 0.25}
    row = nights_view.night_row({"name": "n", "evaluator": "brightness", "iteration": 3, "final": 3, "start": 0,
                                 "evals": rows}, "Completed", 1.0, "id", None, "2026-12-06")
    assert row["criterion"] == "brightness_gap" and row["best"] == pytest.approx(0.25) and row["brightness"] == 0.75
    view = nights_view.nights_markdown("dmd2/x", [row], nights_view.nights_plot([row]))
    assert "| date | run | outcome | final brightness gap | best brightness gap | brightness |" in view
