"""The built-in set ``'digits'`` (``data.BUILTIN_SETS``): a run that names it as ``prompts`` and
``real_data`` trains on the digits, and its evals measure their quality."""

from __future__ import annotations

from typing import Callable

import torch

from dmd2_core.data import PromptSet, RealSet
from dmd2_core.evaluation.evaluator import Figure, GroundTruthEvaluator, Panel
from dmd2_core.toys import digits_metrics
from dmd2_core.toys.digits import digits_prompt_set, digits_tensors


def prompt_set() -> PromptSet:
    return digits_prompt_set()


def real_set() -> RealSet:
    """The training split, each image conditioned on its label's prompt."""
    x, y = digits_tensors("train")
    return RealSet(x, digits_prompt_set().cond(y))


def quality(sample: Callable[[list[int], int], torch.Tensor], num_samples: int, seed: int) -> dict[str, float]:
    """{fd, acc, diversity} of ``num_samples`` samples balanced over the ten digits
    (``sample(prompt_indices, seed)``: the student's eval sampler)."""
    labels = digits_metrics.balanced_labels(num_samples, 10)
    return digits_metrics.evaluate_digits(sample(labels.tolist(), seed), labels)


class DigitsEvaluator(GroundTruthEvaluator):
    """The evaluator ``'digits'``: the world's own ground truth of the student's samples."""
    name = "digits"
    figures = (Figure("fd", "FD", on_nights=False), Figure("acc"), Figure("diversity"))
    criteria = ("fd",)
    panels = (Panel("FD", ("fd",)), Panel("accuracy, diversity", ("acc", "diversity")))
    table = ("fd",)
    quality = staticmethod(quality)
