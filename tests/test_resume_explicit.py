"""Resume never silently changes the run: a rerun's optimizer settings win over the saved ones
(and the summary says so), a save URL holding a checkpoint resumes only the start it recorded, and
a LoRA checkpoint loads only onto its own base with its own adapter settings."""

from __future__ import annotations

import shutil

import pytest
import torch

from dmd2_core import checkpoint as ckpt
from dmd2_core.errors import ArgsError
from dmd2_core.run import resume_check
from dmd2_core.run.preflight import preflight
from tests.helpers import in_process_trainers, iterate_in_process, tiny_args


def _saved_run(args, iterations: int, start: int = 0) -> dict:
    """In-process trainers of ``args`` (loading ``start`` from args.load_url when given) that
    train ``iterations`` more and checkpoint the last one."""
    trainers = in_process_trainers(args)
    for trainer in trainers.values():
        if start:
            trainer.load(start)
    for i in range(start + 1, start + iterations + 1):
        iterate_in_process(trainers, i)
    for trainer in trainers.values():
        trainer.save(start + iterations)
        trainer.save_status(wait=True)
    ckpt.write_latest(args.save, start + iterations)
    return trainers


def _other_model(url: str) -> None:
    """A model directory with the tiny teacher's architecture and other weights, at ``url``."""
    from dmd2_core.models import save_model_dir
    from dmd2_core.models.sd3 import SD3ImageFamily
    from dmd2_core.toys.digits import tiny_digits_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = SD3ImageFamily().build(tiny_digits_config())
    save_model_dir(model, url, shift=3.0)


def test_a_rerun_trains_with_its_own_lr_and_the_summary_says_so(ray_session, tiny_teacher, tmp_path):
    """Saved at 2 with lr 1e-4, resumed to 4 with lr 3e-5 (the fix for a diverging night): the
    resumed trainers step with 3e-5, and the run (its log and summary) names the change."""
    from dmd2_core.report import summary_markdown
    from dmd2_core.run.distill_run import DistillRun

    save = str(tmp_path / "run")
    _saved_run(tiny_args(tiny_teacher, save, lr=1e-4, num_iterations=2), 2)
    with DistillRun(tiny_args(tiny_teacher, save, lr=3e-5, num_iterations=4, run_name="dmd2-new-lr")) as run:
        assert run.start_iteration == 2
        row = run.iterate(3)
        changes = run.resumed_with
    assert row["actor_lr"] == 3e-5 and row["critic_lr"] == 3e-5
    assert changes == ["critic lr 0.0001 -> 3e-05", "actor lr 0.0001 -> 3e-05"]
    summary = summary_markdown({"name": "run", "iteration": 3, "final": 4, "start": 2, "resumed_with": changes})
    assert "Resumed with this run's optimizer settings, not the checkpoint's: critic lr 0.0001 -> 3e-05" in summary
    same = tiny_args(tiny_teacher, save, lr=1e-4, num_iterations=4)
    assert resume_check.resumed_with(preflight(same), save, 2) == []


def test_a_save_url_holding_a_checkpoint_resumes_only_the_start_it_recorded(tiny_teacher, tmp_path):
    """A run fine-tuned from ``pretrained`` checkpoints at 2; its crash rerun (the same command)
    resumes its save. The same save URL asked to start from elsewhere, or with another model, is
    refused in one line naming both, before any actor."""
    pretrained, save = str(tmp_path / "pretrained"), str(tmp_path / "run")
    _saved_run(tiny_args(tiny_teacher, pretrained, num_iterations=1), 1)
    first = tiny_args(tiny_teacher, save, load=pretrained, num_iterations=3)
    _saved_run(first, 1, start=1)
    assert ckpt.resume_url(first) == save
    preflight(first)  # the crash rerun
    preflight(tiny_args(tiny_teacher, save, num_iterations=3))  # no load asked: its own save

    elsewhere = str(tmp_path / "elsewhere")
    with pytest.raises(ArgsError) as info:
        preflight(tiny_args(tiny_teacher, save, load=elsewhere, num_iterations=3))
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"load: {elsewhere} is not what the checkpoint at {save}"), msg
    assert f"started from ({pretrained})" in msg

    other = str(tmp_path / "other-model")
    _other_model(other)
    with pytest.raises(ArgsError) as info:
        preflight(tiny_args(other, save, load=pretrained, num_iterations=3))
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"hf_checkpoint: {other} is not the model") and tiny_teacher in msg, msg


def test_a_lora_checkpoint_loads_only_onto_its_base_with_its_adapters(tiny_teacher, tmp_path):
    """A LoRA run saved at 1 records its adapters (rank, alpha, targets) and its base's identity:
    another alpha, or other weights at the base's path, is refused in one line naming both."""
    base, save = str(tmp_path / "base"), str(tmp_path / "run")
    shutil.copytree(tiny_teacher, base)
    lora_run = tiny_args(base, save, lora_rank=2, num_iterations=3)
    _saved_run(lora_run, 1)
    preflight(lora_run)  # its own rerun

    with pytest.raises(ArgsError) as info:
        preflight(tiny_args(base, save, lora_rank=2, lora_alpha=4.0, num_iterations=3))
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("critic_lora_alpha: ") and "holds LoRA rank 2, alpha 2," in msg, msg
    assert "asks for LoRA rank 2, alpha 4," in msg

    shutil.rmtree(base)
    _other_model(base)  # the base directory replaced in place: same path, other weights
    with pytest.raises(ArgsError) as info:
        preflight(lora_run)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"hf_checkpoint: {base} (weights ") and "is not the base" in msg, msg


def test_a_sets_fake_score_resumes_only_with_its_step_counts_and_vectors(tiny_teacher, tmp_path):
    """A set's fake score holds a vector (and GAN head) per K: a rerun asking for another set, or
    for a fake score without the vectors, is refused in one line naming the key and the saved
    value, before any actor (the load would fail only once the groups had started)."""
    save = str(tmp_path / "run")
    set_run = tiny_args(tiny_teacher, save, dmd2_student_steps=[1, 2], dmd2_student_sampler="euler", num_iterations=3)
    _saved_run(set_run, 1)
    preflight(set_run)  # its own rerun

    cases = [(dict(dmd2_student_steps=[1, 2, 4]), "dmd2_student_steps: ",
              "resume with dmd2_student_steps [1, 2], or pick a new save URL"),
             (dict(dmd2_critic_step_conditioning=False), "dmd2_critic_step_conditioning: ",
              "resume with dmd2_critic_step_conditioning true, or pick a new save URL")]
    for change, key, fix in cases:
        with pytest.raises(ArgsError) as info:
            preflight(set_run.model_copy(update=change))
        msg = str(info.value)
        assert "\n" not in msg and msg.startswith(key) and msg.endswith(fix), msg
        assert f"the checkpoint at {save} (critic, iteration 1)" in msg, msg
