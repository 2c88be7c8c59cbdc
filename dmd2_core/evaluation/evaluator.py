"""The seam every evaluator plugs into: what an evaluator declares (its figures, its criterion,
the drift statistics it owns, its own pre-flight check) and the run side it calls (``EvalRun``).

The report, the nights view, the driver's columns, ``Args`` and pre-flight read names and
columns from the run's evaluator (``evaluator_of``), never from a list of their own: a
new evaluator is one module with an ``Evaluator`` subclass and one line in ``evaluators.EVALUATORS``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Protocol, Sequence

import torch

from dmd2_core import evaluators, storage
from dmd2_core.data import BUILTIN_SETS
from dmd2_core.errors import ArgsError
from dmd2_core.evaluation.criterion import Criterion


@dataclass(frozen=True)
class Figure:
    """One quality figure an evaluator writes into an eval's metrics (lower or higher is better:
    only the criteria need a direction, and they are lower-is-better)."""
    key: str
    label: str = ""  # how a person reads it (the nights view, the plot's axis); default the key
    on_nights: bool = True  # a column of the nights view (beside the criterion's final and best)

    @property
    def name(self) -> str:
        return self.label or self.key


@dataclass(frozen=True)
class Panel:
    """One panel of the run's metrics plot: a title and the keys drawn on one scale."""
    title: str
    keys: tuple[str, ...]


class EvalRun(Protocol):
    """What an evaluator may ask of the run: the trainer groups do the model work."""
    args: Any
    has_critic: bool

    def sample(self, prompt_indices: Sequence[int], seed: int, num_steps: Optional[int] = None) -> Any:
        """The student's decoded samples of the prompts (media: images, video, or a dict with sound)."""

    def eval_latents(self, order: Sequence[int], seed: int, num_steps: Optional[int] = None) -> Any:
        """The same samples as latents."""

    def teacher_reference(self, order: Sequence[int], seed: int, steps: int) -> Any:
        """The teacher's own ``steps``-step samples of the prompts (latents)."""

    def teacher_features(self, latents: Any, order: Sequence[int], u: float, seed: int) -> dict[str, torch.Tensor]:
        """The frozen teacher's features of ``latents`` per modality."""

    def real_features(self, rows: Sequence[int], u: float, seed: int, noise_offset: int) -> dict[str, torch.Tensor]:
        """The frozen teacher's features of the real set's ``rows`` per modality."""

    def decode(self, latents: Any) -> Any:
        """Latents -> the decoded samples ``sample`` returns."""

    def drift_stats(self, latents: Any) -> dict:
        """The decoded media's drift statistics (``drift.pooled`` reads them)."""


class Evaluator:
    """How an eval scores the student. Subclasses set the class attributes and ``evaluate``."""
    name: ClassVar[str]
    figures: ClassVar[tuple[Figure, ...]]  # every quality figure it writes, in the order a table shows them
    criteria: ClassVar[tuple[str, ...]]  # the figures that pick the best student, the first an eval has; lower is better
    panels: ClassVar[tuple[Panel, ...]] = ()  # its panels of the metrics plot
    table: ClassVar[tuple[str, ...]] = ()  # its columns of the short metrics table
    drift_statistics: ClassVar[tuple[str, ...]] = ()  # the drift statistics it owns (``drift_<statistic>_<modality>``)
    # the criterion per modality (figure, standard error, direction) that picks the best student and
    # calls a regression (``evaluation.criterion``); none declared: ``criteria`` as one modality
    modality_criteria: ClassVar[tuple[Criterion, ...]] = ()

    @property
    def joint_criteria(self) -> tuple[Criterion, ...]:
        """``modality_criteria``, then ``criteria`` as one figure for evals without any of theirs."""
        return (*self.modality_criteria, Criterion("quality", tuple(self.criteria), fallback=bool(self.modality_criteria)))

    @property
    def quality_keys(self) -> tuple[str, ...]:
        return tuple(f.key for f in self.figures)

    def label(self, key: Optional[str]) -> str:
        return next((f.name for f in self.figures if f.key == key), key or "quality")

    def preflight_check(self, args: Any, trainer_args: dict) -> None:
        """Pre-flight: raise ``ArgsError`` (one line naming the key) when this run cannot be scored."""

    def writes(self, args: Any, trainer_args: dict) -> dict[str, str]:
        """The URLs outside the save it writes to, by key: pre-flight probes each is writable."""
        return {}

    def evaluate(self, run: EvalRun, args: Any, step_counts: list[int]) -> dict[str, Any]:
        """The figures of the student's samples at each of ``step_counts``: {metrics: {K: {key:
        float}}, reference: the drift yardstick ({} when the evaluator judges no drift)}."""
        raise NotImplementedError

    def drift_flags(self, latest: dict[str, float], start: dict[str, float], reference: dict[str, Any]) -> list[str]:
        """The metrics keys of ``latest`` whose drift left its band (none for an evaluator without drift)."""
        return []


class GroundTruthEvaluator(Evaluator):
    """A toy world's evaluator: its own metrics of the student's decoded samples, class-based
    ground truth, no reference and no drift. ``quality(sample, num_samples, seed)`` with
    ``sample(prompt_indices, seed)`` the student's eval sampler."""
    quality: ClassVar[Callable[..., dict[str, float]]]

    def evaluate(self, run: EvalRun, args: Any, step_counts: list[int]) -> dict[str, Any]:
        return {"metrics": {k: self.quality(functools.partial(run.sample, num_steps=k), args.eval_num_samples,
                                            args.eval_seed) for k in step_counts}, "reference": {}}


def eval_prompt_indices(args: Any, num_prompts: int) -> list[int]:
    """The prompt indices an eval samples: ``eval_prompts``, or every prompt of the set."""
    indices = list(args.eval_prompts) if args.eval_prompts else list(range(num_prompts))
    bad = [i for i in indices if not 0 <= i < num_prompts]
    if bad:
        raise ArgsError(f"eval_prompts: index {bad[0]} out of range for {num_prompts} prompts")
    return indices


def eval_order(args: Any, num_prompts: int) -> list[int]:
    """The prompt of each quality sample: the eval prompts in turn, ``eval_num_samples`` in all."""
    prompts = eval_prompt_indices(args, num_prompts)
    return [prompts[i % len(prompts)] for i in range(args.eval_num_samples)]


def evaluator_name(args: Any) -> str:
    """The run's evaluator: ``evaluator`` when set, else a built-in set's own (``'digits'``), else
    what the prompt set's metadata names (``evaluator``, as the sounding-digits teacher writes it),
    else ``teacher``."""
    if args.evaluator:
        return args.evaluator
    if args.prompts in BUILTIN_SETS:
        return args.prompts
    if args.prompts:
        header, _ = storage.read_safetensors_header(args.prompts)
        named = (header.get("__metadata__") or {}).get("evaluator")
        if named in evaluators.names():
            return named
    return evaluators.TEACHER


def evaluator_of(args: Any):
    """The run's evaluator object (``evaluator_name``)."""
    return evaluators.get(evaluator_name(args))
