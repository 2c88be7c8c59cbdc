"""Digits quality metrics and the teacher's pretraining (CPU, one torch thread)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from dmd2_core.toys import digits_metrics as ev
from dmd2_core import flow_matching as fm
from dmd2_core.toys import digits_teacher as teacher_mod
from dmd2_core.toys.digits import digits_prompt_set, digits_tensors
from dmd2_core.models import LoadedModel, describe_model_dir, load_model_dir
from dmd2_core.models.sd3 import SD3ImageFamily
from dmd2_core.sampling import euler_sample
from tests.helpers import SHORT_TEACHER_STEPS

torch.set_num_threads(1)

def test_classifier_is_cached_and_reloaded():
    images, _ = digits_tensors("test")
    feats = ev.features(images[:50])
    assert ev.classifier_path().is_file() and ev.classifier_path().parent == Path(os.environ["DMD2_CACHE_DIR"])
    ev._CLASSIFIERS.clear()  # force the reload from disk
    np.testing.assert_array_equal(ev.features(images[:50]), feats)
    assert feats.shape == (50, ev.FEATURE_DIM)


def test_real_digits_score_well_and_noise_badly():
    x_te, y_te = digits_tensors("test")
    x_tr, _ = digits_tensors("train")
    fd_real = ev.frechet_distance(ev.features(x_tr), ev.features(x_te))
    noise = torch.rand(1000, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1
    fd_noise = ev.frechet_distance(ev.features(noise), ev.features(x_te))
    assert fd_real < 0.5
    assert fd_noise > 10 * fd_real
    assert ev.class_accuracy(x_te, y_te) > 0.9
    # Accuracy must actually read the labels.
    assert ev.class_accuracy(x_te, (y_te + 1) % 10) < 0.1


def test_frechet_distance_formula():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(4000, 3))
    assert ev.frechet_distance(a, a) == pytest.approx(0.0, abs=1e-6)
    # Gaussians with covariance I and 4I, means 1 apart per dim: |dmu|^2 + 3 * (1 + 4 - 2 * 2) = 3 + 3.
    b = 2.0 * rng.normal(size=(4000, 3)) + 1.0
    assert ev.frechet_distance(a, b) == pytest.approx(6.0, rel=0.1)
    # Rank-deficient features (a constant dimension) stay finite.
    c = np.concatenate([a, np.zeros((4000, 1))], axis=1)
    assert np.isfinite(ev.frechet_distance(c, c + 1e-3))


def test_within_prompt_diversity_detects_collapse():
    x, y = digits_tensors("test")
    collapsed = torch.stack([x[(y == int(c)).nonzero()[0, 0]] for c in y])
    assert ev.within_prompt_diversity(collapsed, y) == pytest.approx(0.0, abs=1e-6)
    real = ev.within_prompt_diversity(x, y)
    assert real > 0.1
    noisy = ev.within_prompt_diversity(x + 0.5 * torch.randn(x.shape, generator=torch.Generator().manual_seed(0)), y)
    assert noisy > real


def test_sample_quality_passes_balanced_labels_and_fixed_noise():
    x, y = digits_tensors("test")
    seen = []

    def sampler(noise, cond, labels):
        seen.append((noise.clone(), labels.clone()))
        # Return a real test digit of each requested class: a perfect "sampler".
        return torch.stack([x[(y == int(c)).nonzero()[i % 40, 0]] for i, c in enumerate(labels)])

    prompts = digits_prompt_set()
    first = ev.sample_quality(sampler, num_samples=200, seed=3, prompts=prompts)
    second = ev.sample_quality(sampler, num_samples=200, seed=3, prompts=prompts)
    assert first == second
    assert torch.equal(seen[0][0], seen[1][0])
    assert torch.bincount(seen[0][1], minlength=10).tolist() == [20] * 10
    assert set(first) == {"fd", "acc", "diversity"}
    assert first["acc"] > 0.9


def test_short_trained_teacher_beats_untrained(short_teacher):
    url, info = short_teacher
    assert info["steps"] == SHORT_TEACHER_STEPS and np.isfinite(info["final_loss"])
    trained = ev.teacher_table(url, steps=(8,), num_samples=500, seed=0)["8"]
    untrained = ev.teacher_table(
        LoadedModel(teacher_mod.new_teacher_model(0).eval(), SD3ImageFamily(), 3.0), steps=(8,), num_samples=500, seed=0
    )["8"]
    assert trained["fd"] < 0.5 * untrained["fd"]
    assert trained["acc"] > 0.5 > untrained["acc"]


def test_training_is_deterministic(monkeypatch):
    a = teacher_mod.train_teacher(None, seed=1, num_steps=4, batch_size=16, log=None)["model"]
    b = teacher_mod.train_teacher(None, seed=1, num_steps=4, batch_size=16, log=None)["model"]
    # another seed from the same init: the seed drives the training draws, not only the init
    init = teacher_mod.new_teacher_model
    monkeypatch.setattr(teacher_mod, "new_teacher_model", lambda seed=0: init(1))
    c = teacher_mod.train_teacher(None, seed=2, num_steps=4, batch_size=16, log=None)["model"]
    monkeypatch.undo()
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    # Training moved the weights away from the init.
    init = teacher_mod.new_teacher_model(1).state_dict()
    assert not all(torch.equal(sa[k], init[k]) for k in sa)


def test_saved_teacher_reloads_with_identical_outputs(tmp_path):
    url = str(tmp_path / "teacher")
    info = teacher_mod.train_teacher(url, seed=0, num_steps=4, batch_size=16, log=None)
    assert describe_model_dir(url)["shift"] == 3.0
    loaded = load_model_dir(url)
    prompts = digits_prompt_set()
    labels = ev.balanced_labels(20)
    noise = ev.eval_noise(20, seed=5)
    sigmas = fm.euler_sigmas(4, 3.0)
    family = SD3ImageFamily()
    out_trained = euler_sample(family, info["model"], noise, prompts.cond(labels), sigmas, prompts.uncond(20), 1.5)
    out_loaded = euler_sample(family, loaded.model, noise, prompts.cond(labels), sigmas, prompts.uncond(20), 1.5)
    assert torch.equal(out_trained, out_loaded)


def test_ensure_teacher_reuses_an_existing_checkpoint(short_teacher, tmp_path, monkeypatch):
    url, _ = short_teacher
    calls = []
    monkeypatch.setattr(teacher_mod, "train_teacher", lambda *a, **k: calls.append(a))
    assert teacher_mod.ensure_teacher(url, log=None) == url
    assert calls == []
    missing = str(tmp_path / "missing")
    assert teacher_mod.ensure_teacher(missing, log=None) == missing
    assert calls == [(missing,)]


def test_cli_trains_and_prints_table(tmp_path, capsys):
    url = str(tmp_path / "cli")
    assert teacher_mod.main(["--save", url, "--steps", "3", "--table", "--num-samples", "50"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert result["steps"] == 3 and not result["reused"]
    assert list(result["table"]) == ["50", "8", "4", "2", "1"]
    assert all(set(row) == {"fd", "acc", "diversity"} for row in result["table"].values())
    describe_model_dir(url)
    assert teacher_mod.main(["--save", url, "--reuse"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["reused"]


def test_teacher_flow_reuses_and_publishes_the_table(short_teacher, prefect_harness):
    from prefect.artifacts import Artifact

    from flows.teacher import ARTIFACT_KEY, teacher

    url, _ = short_teacher
    table = teacher(save=url, reuse=True, num_samples=100)
    artifact = Artifact.get(ARTIFACT_KEY)
    assert list(table) == ["50", "8", "4", "2", "1"]
    assert artifact is not None and artifact.type == "table"
    rows = json.loads(artifact.data)
    assert [r["euler_steps"] for r in rows][:5] == list(table)
    assert rows[0]["fd"] == pytest.approx(table["50"]["fd"], abs=1e-4)
