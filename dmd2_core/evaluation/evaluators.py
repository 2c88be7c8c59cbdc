"""How an eval scores the student: one evaluator per run (``evaluator``; default the prompt set's).

- ``teacher`` (any model, no weights but the teacher's): the student's K-step samples of
  ``eval_num_samples`` eval prompts and noises against the teacher's own ``eval_reference_steps``-step
  samples of the same prompts and noises, compared in the teacher's features per modality
  (``teacher_kid_<modality>``, an unbiased kernel distance: ``kernel.projected_kid``; their mean is
  ``teacher_kid``, the run's criterion for its best student), and drift statistics of the decoded
  media (``drift_<statistic>_<modality>``) against the teacher's, each within a band
  (``drift_out``: how many left theirs). The teacher's side is made once per teacher and eval
  settings and cached (``reference_url``).
- ``digits`` and ``sounding-digits``: the toy worlds' own metrics (class-based ground truth),
  named in ``TOY_EVALUATORS`` and imported only by a run that uses them.

The trainer groups do the model work (``DistillRun.eval_latents``, ``teacher_reference``,
``teacher_features``, ``decode``); this module decides, caches and compares.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
from typing import Any

import torch

from dmd2_core import storage
from dmd2_core.args import Args
from dmd2_core.data import BUILTIN_SETS, prompt_texts, read_safetensors, write_safetensors
from dmd2_core.evaluation.drift import drift_stats, within_prompt_diversity
from dmd2_core.evaluation.kernel import projected_kid
from dmd2_core.checkpoint.integrity import listing
from dmd2_core.errors import ArgsError
from dmd2_core.save_layout import eval_reference_root

TEACHER = "teacher"
TOY_EVALUATORS = {"digits": "dmd2_core.toys.digits_world", "sounding-digits": "dmd2_core.toys.sounding_digits_world"}
REFERENCE_FORMAT = 1  # bump when what a reference holds or how it is made changes: old entries are not hits
FEATURE_U = 0.5  # the schedule position the teacher sees the samples at (evaluation.teacher_features)
FEATURE_SEED = 0
PROJECTION_DIM = 64
# How far a drift statistic may move from the teacher's before the eval flags it: (kind, width),
# "abs" in the statistic's own units, "rel" a fraction of the teacher's value.
DRIFT_BANDS = {
    "brightness": ("abs", 0.08), "saturation": ("abs", 0.08), "contrast": ("abs", 0.06), "flicker": ("abs", 0.03),
    "loudness": ("abs", 6.0), "peak": ("abs", 0.2), "clipping": ("abs", 0.01), "centroid": ("rel", 0.3),
    "silence": ("abs", 0.2), "av_align": ("abs", 0.2),
}


def evaluator_of(args: Args) -> str:
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
        if named in TOY_EVALUATORS:
            return named
    return TEACHER


def eval_prompt_indices(args: Args, num_prompts: int) -> list[int]:
    """The prompt indices an eval samples: ``eval_prompts``, or every prompt of the set."""
    indices = list(args.eval_prompts) if args.eval_prompts else list(range(num_prompts))
    bad = [i for i in indices if not 0 <= i < num_prompts]
    if bad:
        raise ArgsError(f"eval_prompts: index {bad[0]} out of range for {num_prompts} prompts")
    return indices


def eval_order(args: Args, num_prompts: int) -> list[int]:
    """The prompt of each quality sample: the eval prompts in turn, ``eval_num_samples`` in all."""
    prompts = eval_prompt_indices(args, num_prompts)
    return [prompts[i % len(prompts)] for i in range(args.eval_num_samples)]


def evaluate(run, args: Args) -> dict[str, Any]:
    """The run's quality figures at this eval: {metrics: {key: float}, flags: [drift keys out of
    band], reference: {statistic: the teacher's value}}."""
    name = evaluator_of(args)
    if name == TEACHER and not run.has_critic:  # no group holds the frozen teacher: no quality figures
        return {"metrics": {}, "flags": [], "reference": {}}
    if name != TEACHER:
        world = importlib.import_module(TOY_EVALUATORS[name])
        return {"metrics": world.quality(run.sample, args.eval_num_samples, args.eval_seed), "flags": [], "reference": {}}
    order = eval_order(args, len(prompt_texts(args.prompts)))
    reference = teacher_reference(run, args, order)
    latents = run.eval_latents(order, args.eval_seed)
    features = run.teacher_features(latents, order, FEATURE_U, FEATURE_SEED)
    metrics = {f"teacher_kid_{m}": projected_kid(reference["features"][m], f, dim=PROJECTION_DIM)
               for m, f in sorted(features.items())}
    metrics["teacher_kid"] = sum(metrics.values()) / len(metrics)
    metrics.update({f"diversity_{m}": v for m, v in within_prompt_diversity(features, order).items()})
    drift = media_drift(run.decode(latents), args)
    metrics.update({f"drift_{k}": v for k, v in drift.items()})
    flags = out_of_band(drift, reference["drift"])
    metrics["drift_out"] = float(len(flags))
    return {"metrics": metrics, "flags": [f"drift_{k}" for k in flags], "reference": reference["drift"]}


# ---- the teacher's side, made once ----------------------------------------------------------------

def reference_key(args: Args, order: list[int]) -> str:
    """What a cached reference must match to be a hit: the teacher (its URL and the bytes of its
    transformer config and weight index), the prompts (URL and texts), the eval prompts and noise
    seed, the sample shape, the teacher's sampler (steps, guidance, shift) and how features are
    taken. A retrained teacher at the same URL changes its files' listing, so it misses."""
    from dmd2_core.models import describe_model_dir

    teacher_url = args.teacher_checkpoint or args.hf_checkpoint
    info = describe_model_dir(teacher_url)
    transformer = info["transformer_url"]
    files = {name: size for name, size in listing(transformer).items() if name.endswith((".safetensors", ".json"))}
    settings = {
        "format": REFERENCE_FORMAT, "teacher": teacher_url,
        "config": storage.read_text(storage.join(transformer, "config.json")), "files": files,
        "prompts": args.prompts, "texts": prompt_texts(args.prompts), "order": order, "seed": args.eval_seed,
        "latent_shape": args.latent_shape, "steps": args.eval_reference_steps,
        "guidance": args.dmd2_guidance_scale, "shift": args.dmd2_shift, "u": FEATURE_U, "feature_seed": FEATURE_SEED,
        "dtype": args.dtype,
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def reference_url(args: Args) -> str:
    return args.eval_reference_url or eval_reference_root(args.save)


def teacher_reference(run, args: Args, order: list[int]) -> dict[str, Any]:
    """The teacher's features and drift statistics of its own samples: read from the cache when
    an entry of the same key is there (complete: its JSON is written last), else made by the
    critic group and written."""
    url = storage.join(reference_url(args), reference_key(args, order))
    marker = storage.join(url, "reference.json")
    if storage.exists(marker):
        meta = json.loads(storage.read_text(marker))
        tensors, _ = read_safetensors(storage.join(url, "features.safetensors"))
        return {"features": tensors, "drift": meta["drift"], "url": url, "hit": True}
    latents = run.teacher_reference(order, args.eval_seed, args.eval_reference_steps)
    features = run.teacher_features(latents, order, FEATURE_U, FEATURE_SEED)
    drift = media_drift(run.decode(latents), args)
    write_safetensors(storage.join(url, "features.safetensors"), {m: f.contiguous() for m, f in features.items()})
    storage.write_text(marker, json.dumps({"format": REFERENCE_FORMAT, "teacher": args.teacher_checkpoint or args.hf_checkpoint,
                                           "samples": len(order), "steps": args.eval_reference_steps,
                                           "drift": drift}, indent=1))
    return {"features": features, "drift": drift, "url": url, "hit": False}


# ---- drift ----------------------------------------------------------------------------------------

def media_drift(decoded, args: Args) -> dict[str, float]:
    """Drift statistics of decoded samples, keyed ``<statistic>_<modality>`` (and ``av_align``):
    pictures [N, C, H, W] ('image'), videos [N, C, F, H, W] ('video'), a joint model's
    {'video', 'audio', 'sample_rate'}; latents without a decoder (a flat sample) have none."""
    from dmd2_core.models.minimax_h3 import FPS

    if isinstance(decoded, dict):
        raw = drift_stats(decoded["video"], decoded["audio"], int(decoded["sample_rate"]), FPS)
    elif torch.is_tensor(decoded) and decoded.dim() in (4, 5) and decoded.shape[1] in (1, 3):
        raw = drift_stats(decoded)
    else:
        return {}
    visual = "video" if isinstance(decoded, dict) or decoded.dim() == 5 else "image"
    out = {}
    for key, value in raw.items():
        if key == "av_align":
            out[key] = value
        elif key.startswith("audio_"):
            out[f"{key.removeprefix('audio_')}_audio"] = value
        else:
            out[f"{key}_{visual}"] = value
    return out


def out_of_band(student: dict[str, float], teacher: dict[str, float]) -> list[str]:
    """The drift keys whose student value left its band around the teacher's (``DRIFT_BANDS``)."""
    flagged = []
    for key, value in sorted(student.items()):
        stat = key if key == "av_align" else key.rsplit("_", 1)[0]
        band, ref = DRIFT_BANDS.get(stat), teacher.get(key)
        if band is None or ref is None or not all(map(math.isfinite, (value, ref))):
            continue
        kind, width = band
        if abs(value - ref) > (width * abs(ref) if kind == "rel" else width):
            flagged.append(key)
    return flagged
