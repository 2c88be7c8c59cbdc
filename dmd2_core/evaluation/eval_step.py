"""The eval step of a run: the run's evaluator's figures at each of its step counts, and the
student's K-step samples of the eval prompts written as media (``media.eval_files``), the media
being the first quality samples (``SampledOnce``), not sampled again. No Prefect here: the flow
turns what ``run_eval`` returns into artifacts (tasks/eval.py)."""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import torch

from dmd2_core.data import prompt_texts
from dmd2_core.evaluation.evaluator import EvalRun, eval_prompt_indices, evaluator_of
from dmd2_core.media.eval_files import INLINE_VIDEO_BYTES, write_eval_media
from dmd2_core.step_counts import at_steps, mean_over_steps


def run_eval(run: EvalRun, iteration: int, embed_limit: int = 512 * 1024) -> dict[str, Any]:
    """Eval of a run at ``iteration``, at each of the student's step counts K: K-step samples of
    the eval prompts saved as media under the run's save URL, and the run's evaluator's figures.
    A student of one K has its figures under their own names; one of several has each K's under
    ``step_counts.at_steps(name, K)`` and the mean over K of each criterion under its name (what
    chooses its best eval). Returns {iteration, metrics, media: [{url, browser_url, src, link,
    full, caption, bytes}], reference}."""
    args = run.args
    evaluator = evaluator_of(args)
    counts = list(args.student_step_counts)
    several = len(counts) > 1
    indices = eval_prompt_indices(args, len(prompt_texts(args.prompts)))
    once = SampledOnce(run)
    metrics: dict[str, float] = {}
    t = time.perf_counter()
    quality = evaluator.evaluate(once, args, counts)
    for k, figures in quality["metrics"].items():
        metrics.update({at_steps(key, k) if several else key: v for key, v in figures.items()})
    if several:
        metrics.update(mean_over_steps(metrics, counts, evaluator.criteria))
    if any(quality["metrics"].values()):
        metrics["eval_quality_s"] = time.perf_counter() - t
    if "reference_s" in quality:  # this eval made its evaluator's reference (inside eval_quality_s)
        metrics["eval_reference_s"] = quality["reference_s"]
    decoded_for_quality = dict(once.decoding)
    start = time.perf_counter()
    media = [m for k in counts for m in write_eval_media(once, iteration, indices, k if several else None, embed_limit,
                                                         INLINE_VIDEO_BYTES // len(counts))]
    metrics["eval_media_s"] = time.perf_counter() - start
    metrics.update(once.timings(decoded_for_quality, metrics["eval_media_s"]))
    return {"iteration": int(iteration), "metrics": metrics, "media": media, "reference": quality["reference"]}


class SampledOnce:
    """The run as one eval sees it: the student samples once. Its samples of each (seed, step
    count) are kept as they are drawn, and a later request for the first rows of them (the media
    clips: the eval prompts in turn, as the quality samples begin) is served from them, decoded
    from the kept latents where the evaluator kept latents, instead of sampled again. The same
    seed, noise and rows: the media are the quality samples' first. Any other request goes to the
    run; everything else is the run's."""

    def __init__(self, run: EvalRun):
        self._run = run
        self._kept: dict[tuple[int, int, bool], tuple[list[int], Any]] = {}  # (seed, K, decoded) -> (order, samples)
        # where the eval's seconds went outside the transformers: the decoder's (rank 0's, a decode
        # call timed here with its transfer) and the drift statistics' (the rank's own split)
        self.decoding = {"decode_s": 0.0, "decoded_clips": 0, "drift_s": 0.0, "drift_clips": 0}

    def decode(self, latents: Any) -> Any:
        started = time.perf_counter()
        out = self._run.decode(latents)
        self.decoding["decode_s"] += time.perf_counter() - started
        self.decoding["decoded_clips"] += _rows(latents)
        return out

    def drift_stats(self, latents: Any) -> Any:
        """The run's drift statistics; a ``drift.TimedStats`` answer splits its seconds into the
        decoder's and the statistics'."""
        out = self._run.drift_stats(latents)
        if hasattr(out, "decode_s"):
            self.decoding["decode_s"] += out.decode_s
            self.decoding["decoded_clips"] += out.clips
            self.decoding["drift_s"] += out.stats_s
            self.decoding["drift_clips"] += out.clips
        return out

    def timings(self, before_media: dict, media_s: float) -> dict[str, float]:
        """The eval's decoder and host work for its metrics row (where a run measured them):
        ``eval_decode_s`` over ``eval_decoded_clips`` (the quality samples', the reference's and
        the media's decodes), ``eval_drift_s`` over ``eval_drift_clips`` (the drift statistics),
        ``eval_encode_s`` over ``eval_encoded_clips`` (the media written: ``media_s`` less their
        decode)."""
        if not self.decoding["decoded_clips"]:
            return {}
        out = {"eval_decode_s": self.decoding["decode_s"], "eval_decoded_clips": self.decoding["decoded_clips"],
               "eval_drift_s": self.decoding["drift_s"], "eval_drift_clips": self.decoding["drift_clips"]}
        media_clips = self.decoding["decoded_clips"] - before_media["decoded_clips"]
        if media_clips:  # the media were decoded here from kept latents: the rest of their seconds is the writing
            out.update(eval_encode_s=max(0.0, media_s - (self.decoding["decode_s"] - before_media["decode_s"])),
                       eval_encoded_clips=media_clips)
        return out

    def __getattr__(self, name: str):
        return getattr(self._run, name)

    def sample(self, order: Sequence[int], seed: int, num_steps: Optional[int] = None) -> Any:
        return self._serve(order, seed, num_steps, decoded=True)

    def eval_latents(self, order: Sequence[int], seed: int, num_steps: Optional[int] = None) -> Any:
        return self._serve(order, seed, num_steps, decoded=False)

    def _serve(self, order: Sequence[int], seed: int, num_steps: Optional[int], decoded: bool) -> Any:
        order, k = list(order), num_steps or self._run.args.max_student_steps
        for kept_decoded in ((True, False) if decoded else (False,)):
            kept = self._kept.get((seed, k, kept_decoded))
            if kept is not None and kept[0][:len(order)] == order:
                rows = _first_rows(kept[1], len(order))
                return rows if kept_decoded == decoded else self.decode(rows)
        samples = (self._run.sample if decoded else self._run.eval_latents)(order, seed, num_steps=num_steps)
        self._kept[(seed, k, decoded)] = (order, samples)
        return samples


def _rows(samples: Any) -> int:
    """How many samples a batch holds (a tensor, or a joint model's dict of them)."""
    if isinstance(samples, dict):
        return next(int(v.shape[0]) for v in samples.values() if isinstance(v, torch.Tensor) and v.dim())
    return int(samples.shape[0])


def _first_rows(samples: Any, n: int) -> Any:
    """The first ``n`` samples of a batch: a tensor, or a dict of them beside per-batch facts
    (a joint model's {'video', 'audio', 'sample_rate', 'fps'})."""
    if isinstance(samples, dict):
        return {key: _first_rows(v, n) if isinstance(v, torch.Tensor) and v.dim() else v for key, v in samples.items()}
    return samples[:n]
