"""The eval step of a run: the student's K-step samples of the eval prompts written as media
(``media.eval_files``), and the run's evaluator's figures at each of its step counts. No Prefect
here: the flow turns what ``run_eval`` returns into artifacts (tasks/eval.py)."""

from __future__ import annotations

import time
from typing import Any

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
    start = time.perf_counter()
    media = [m for k in counts for m in write_eval_media(run, iteration, indices, k if several else None, embed_limit,
                                                         INLINE_VIDEO_BYTES // len(counts))]
    metrics: dict[str, float] = {"eval_media_s": time.perf_counter() - start}
    t = time.perf_counter()
    quality = evaluator.evaluate(run, args, counts)
    for k, figures in quality["metrics"].items():
        metrics.update({at_steps(key, k) if several else key: v for key, v in figures.items()})
    if several:
        metrics.update(mean_over_steps(metrics, counts, evaluator.criteria))
    if any(quality["metrics"].values()):
        metrics["eval_quality_s"] = time.perf_counter() - t
    if "reference_s" in quality:  # this eval made its evaluator's reference (inside eval_quality_s)
        metrics["eval_reference_s"] = quality["reference_s"]
    return {"iteration": int(iteration), "metrics": metrics, "media": media, "reference": quality["reference"]}
