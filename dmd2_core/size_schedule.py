"""A size schedule (``size_schedule``): a run's first iterations at a smaller sample (fewer frames,
a lower resolution), its last at the full size (FastWan trains at 448 x 832 and serves 720p; a
student that never trained at the size it serves shows artifacts there, hence the full-size finish).

Each stage is a mapping: ``until_iteration`` (the last iteration it covers; the last stage runs to
the end and may leave it out) and its size, named as the run names its own: ``latent_shape``, or
a joint model's clip ``num_frames``, ``height`` and ``width``. Preflight resolves every stage to its
latents with the family's rules (``run.preflight_checks.check_size_schedule``) and refuses a
schedule whose last stage is not the run's full size. The stage of an iteration is a function of
the iteration alone, so a resume mid-schedule continues at the right size. Only the training
samples change size: the eval, the memory plan's eval and a GAN head's real set stay at the full size
(a GAN head with a smaller stage is refused: its real set holds full-size latents, and latents
downsampled are not the latents of smaller clips).

What each family's positions make of a smaller sample: SD3 crops its positional table to the
sample (``pos_embed_max_size`` is checked per stage), Wan's rope tables cover up to
``rope_max_seq_len`` positions an axis and a stage is no larger than the full size, MiniMax-H3's
rope is computed from the packed sequence's position ids at each forward; the family is bound to
each stage's geometry (its packed layout, its audio length) by the trainers.
"""

from __future__ import annotations

from typing import Any, Optional

STAGE_KEYS = ("until_iteration", "latent_shape", "num_frames", "height", "width")
GEOMETRY = ("num_frames", "height", "width")


def stage_name(index: int) -> str:
    """How a refusal names stage ``index`` (0-based) of the schedule."""
    return f"size_schedule[{index}]"


def normalise(value: Optional[list]) -> Optional[list[dict[str, Any]]]:
    """The schedule as written, each stage checked on its own (``Args``' field validator): a
    mapping of known keys with positive integers, its size named one way. Raises ValueError
    "stage N: ..." (the caller names the key)."""
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise ValueError("a list of stages, e.g. [{until_iteration: 1000, height: 384, width: 672, num_frames: 124}, "
                         "{num_frames: 124, height: 768, width: 1344}]")
    stages = []
    for index, stage in enumerate(value):
        where = stage_name(index)
        if isinstance(stage, str):  # the command line's --size-schedule '{until_iteration: 100, ...}' ...
            stage = _yaml(stage)
        if not isinstance(stage, dict):
            raise ValueError(f"{where}: a mapping of {', '.join(STAGE_KEYS)} (got {stage!r})")
        for key in stage:
            if key not in STAGE_KEYS:
                from dmd2_core.errors import nearest

                raise ValueError(f"{where}: unknown key '{key}'{nearest(key, STAGE_KEYS)} (keys: {', '.join(STAGE_KEYS)})")
        for key in ("until_iteration", *GEOMETRY):
            if key in stage and stage[key] is not None and not _positive_int(stage[key]):
                raise ValueError(f"{where}.{key}: a positive integer (got {stage[key]!r})")
        shape = stage.get("latent_shape")
        if shape is not None and not (isinstance(shape, list) and shape and all(_positive_int(d) for d in shape)):
            raise ValueError(f"{where}.latent_shape: a list of positive integers (got {shape!r})")
        geometry = [k for k in GEOMETRY if stage.get(k) is not None]
        if geometry and len(geometry) < len(GEOMETRY):
            missing = next(k for k in GEOMETRY if k not in geometry)
            raise ValueError(f"{where}.{missing}: set num_frames, height and width together")
        if not geometry and shape is None:
            raise ValueError(f"{where}: no size; give latent_shape, or num_frames, height and width")
        stages.append({k: stage[k] for k in STAGE_KEYS if stage.get(k) is not None})
    return stages


def _yaml(text: str):
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_relations(args) -> None:
    """The stages against each other and the run: every stage but the last ends at an
    ``until_iteration`` above the one before and below ``num_iterations``; the last runs to the
    end. ValueError "size_schedule: ..." (``arg_rules`` turns it into one line)."""
    stages = args.size_schedule
    if not stages:
        return
    previous = 0
    for index, stage in enumerate(stages[:-1]):
        until = stage.get("until_iteration")
        if until is None:
            raise ValueError(f"size_schedule: {stage_name(index)} has no until_iteration (every stage but the last "
                             "ends at one)")
        if until <= previous:
            raise ValueError(f"size_schedule: {stage_name(index)}.until_iteration {until} does not come after "
                             f"{previous}; stages run in order of their until_iteration")
        if until >= args.num_iterations:
            raise ValueError(f"size_schedule: {stage_name(index)}.until_iteration {until} leaves no iteration to the "
                             f"stages after it (num_iterations {args.num_iterations}); the last stage, at the full "
                             "size, trains the run's last iterations")
        previous = until
    last = stages[-1].get("until_iteration")
    if last is not None and last < args.num_iterations:
        raise ValueError(f"size_schedule: the last stage ({stage_name(len(stages) - 1)}) runs to the end, at the full "
                         f"size; its until_iteration {last} is below num_iterations {args.num_iterations} (leave it out)")


def stage_index(args, iteration: int) -> Optional[int]:
    """The stage (0-based) that trains ``iteration``; None without a schedule."""
    stages = args.size_schedule
    if not stages:
        return None
    for index, stage in enumerate(stages[:-1]):
        if iteration <= stage["until_iteration"]:
            return index
    return len(stages) - 1


def latent_shape_at(args, iteration: int) -> Optional[list[int]]:
    """The latents ``iteration`` trains at, when a smaller stage of the schedule trains it; None at
    the full size (the run's own ``latent_shape``): without a schedule and in its last stage."""
    index = stage_index(args, iteration)
    if index is None or index == len(args.size_schedule) - 1:
        return None
    shape = args.size_schedule[index].get("latent_shape")
    if shape is None:
        raise ValueError(f"{stage_name(index)}: its clip is not resolved to latents (preflight resolves num_frames, "
                         "height and width with the teacher's VAE)")
    return list(shape)


def stage_spans(args) -> list[tuple[int, int, dict]]:
    """(first, last iteration, stage) of each stage, up to ``num_iterations``."""
    spans, first = [], 1
    for stage in args.size_schedule or ():
        last = min(stage.get("until_iteration") or args.num_iterations, args.num_iterations)
        spans.append((first, last, stage))
        first = last + 1
    return spans
