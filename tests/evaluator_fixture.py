"""A new evaluator as a contributor writes one (the test of the seam, tests/test_evaluators.py):
this file and one registry line. It scores the student's samples by how far their mean brightness
is from a target, a figure no other evaluator writes."""

from __future__ import annotations

import torch

from dmd2_core.evaluation.evaluator import Figure, GroundTruthEvaluator, Panel


def brightness_quality(sample, num_samples: int, seed: int) -> dict[str, float]:
    images = torch.as_tensor(sample(list(range(num_samples)), seed)).float()
    brightness = images.mean().item()
    return {"brightness_gap": abs(brightness - 0.5), "brightness": brightness}


class BrightnessEvaluator(GroundTruthEvaluator):
    name = "brightness"
    figures = (Figure("brightness_gap", "brightness gap", on_nights=False), Figure("brightness"))
    criteria = ("brightness_gap",)
    panels = (Panel("brightness", ("brightness_gap", "brightness")),)
    table = ("brightness_gap",)
    quality = staticmethod(brightness_quality)
