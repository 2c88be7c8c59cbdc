"""The evaluator ``'sounding-digits'`` (``dmd2_core.evaluators``): a run on the sounding-digits
prompts (their set names it) is scored by the toy world's own metrics of picture, sound and their
agreement (``sounding_digits_metrics``), and by the product's weight-free sound distance
(``sound_mel_kid``) against the world's held-out clips."""

from __future__ import annotations

from typing import Callable

import torch

from dmd2_core.evaluation.evaluator import Figure, GroundTruthEvaluator
from dmd2_core.evaluation.sound_distance import MIN_CLIPS, check_eval_clips
from dmd2_core.toys import sounding_digits_metrics


def quality(sample: Callable[[list[int], int], torch.Tensor], num_samples: int, seed: int) -> dict[str, float]:
    """The metrics of ``num_samples`` clips balanced over the ten digits (``sample(prompt_indices,
    seed)``: the student's eval sampler, flat H3 samples: the sounding-digits teacher has no VAE)."""
    labels = sounding_digits_metrics.balanced_labels(num_samples)
    return sounding_digits_metrics.evaluate_clips(sample(labels.tolist(), seed), labels)


class SoundingDigitsEvaluator(GroundTruthEvaluator):
    name = "sounding-digits"
    figures = (Figure("frame_fd", "frame FD", on_nights=False), Figure("sound_acc"), Figure("agreement"),
               Figure("sound_mel_kid", "sound mel KID"), Figure("sound_mel_kid_se", on_nights=False))
    table = ("sound_mel_kid",)
    criteria = ("frame_fd",)
    quality = staticmethod(quality)

    def preflight_check(self, args, trainer_args: dict) -> None:
        """Every eval measures ``eval_num_samples`` clips with ``sound_mel_kid``: at least ``MIN_CLIPS``."""
        if args.eval_interval:
            check_eval_clips("eval_num_samples", str(args.eval_num_samples), args.eval_num_samples, "clips",
                             f"set eval_num_samples to {MIN_CLIPS} or more")
