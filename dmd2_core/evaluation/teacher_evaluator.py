"""The evaluator ``teacher`` (any model, no weights but the teacher's): the student's K-step samples of
  ``eval_num_samples`` eval prompts and noises compared in the teacher's own features per modality
  (``kernel.projected_kid``, an unbiased kernel distance) with two references:
  - the teacher's own ``eval_reference_steps``-step samples of the same prompts and noises
    (``teacher_kid_<modality>``, their mean ``teacher_kid``);
  - with a real set (``real_data``), ``eval_real_samples`` of its rows under their own conditions
    (``real_kid_<modality>``, ``real_kid``): what a run with a GAN head distils towards, and the
    run's criterion for its best student when present (``TeacherEvaluator.criteria``). Its level carries a
    constant offset where the eval prompts and the real set's captions differ: compare it across
    evals and nights, not with 0.
  Each per-modality KID has its standard error over draws of the student's samples
  (``<key>_se``, ``kernel.projected_kid_se``): the joint criterion (``evaluation.criterion``) picks
  the best student and calls a regression per modality, each within its own noise.
  With sound (MiniMax-H3), the weight-free ``sound_mel_kid`` (and its standard error
  ``sound_mel_kid_se``; ``sound_distance``): the clips' log-mel band statistics against the
  teacher's reference clips, with or without a real set: against the real set's clips it did not
  rank students that all sit far from the real floor (bench/README.md, 2026-12-06). It ranks the
  sound; the teacher-feature audio KIDs stay as its alarm (working against broken): at their
  noise level the teacher cannot hear a noise floor.
  Drift statistics of the decoded media (``drift_<statistic>_<modality>``) and the within-prompt
  diversity of the features (``diversity_<modality>``) are judged by ``drift_flags`` against the
  run's first eval and a yardstick: the real set's samples when there is one, else the teacher's
  reference samples. Both references are made once per teacher and settings and cached
  (``reference_url``).
The trainer groups do the model work (``DistillRun.eval_latents``, ``teacher_reference``,
``teacher_features``, ``real_features``, ``drift_stats``); this module decides, caches and compares.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import time
from typing import Any, Optional

import torch

from dmd2_core import storage
from dmd2_core.args import Args
from dmd2_core.data import (BUILTIN_SETS, REAL_LATENTS, open_real_set, prompt_texts, read_safetensors, real_set_shapes,
                            write_safetensors)
from dmd2_core.evaluation.evaluator import Evaluator, Figure, Panel, eval_order
from dmd2_core.evaluation.drift import paired_se, pooled, within_prompt_diversity
from dmd2_core.evaluation.criterion import Criterion
from dmd2_core.evaluation.kernel import SE_MIN_SAMPLES, projected_kid, projected_kid_se
from dmd2_core.evaluation.sound_distance import (MIN_CLIPS, check_eval_clips, sound_mel_kid, split_sound_features,
                                                 why_unmeasured)
from dmd2_core.checkpoint.integrity import listing
from dmd2_core.errors import ArgsError
from dmd2_core.evaluators import TEACHER
from dmd2_core.step_counts import at_steps, split_steps
from dmd2_core.save_layout import drift_start_url, eval_reference_root

REFERENCE_FORMAT = 3  # bump when what a reference holds or how it is made changes: old entries are not hits
FEATURE_U = 0.5  # the schedule position the teacher sees the samples at (evaluation.teacher_features)
FEATURE_SEED = 0
SOUND_MEL = "sound_mel"  # the references' clip features for ``sound_mel_kid``, beside the teacher's per modality
PROJECTION_DIM = 64
REAL_ROWS_SEED = 0
REAL_NOISE_OFFSET = 1 << 30  # the real rows' re-noising noise: indices no eval sample uses
# A drift statistic leaves its band when it moved from the run's first eval by more than
# max(BAND_K * sqrt(2) * its standard error over the reference's samples, its floor) and away from
# the reference; floors: (kind, width), "abs" in the statistic's own units, "rel" a fraction of
# the reference's value: the smallest change that matters whatever the sample count.
BAND_K = 3.0
DRIFT_FLOORS = {
    "brightness": ("abs", 0.01), "saturation": ("abs", 0.01), "contrast": ("abs", 0.01), "flicker": ("abs", 0.01),
    "loudness": ("abs", 1.0), "peak": ("abs", 0.02), "clipping": ("abs", 0.01), "centroid": ("rel", 0.05),
    "silence": ("abs", 0.02), "av_align": ("abs", 0.05),
    "floor": ("abs", 3.0),  # dB: the hiss's power doubled
}
# Statistics judged against their own start clip by clip where the run kept its first eval's clips
# (``drift_start``): the band is then max(BAND_K * the standard error of the clips' mean change,
# this width). A clip's floor follows its tone (a leakage floor 5-6 dB apart between prompts), a
# spread that swamps a rise every clip shows together; 0.5 dB (12% more hiss power) is the
# smallest rise judged, on the recipe's students the rise that came with a sound FD 22-45% worse.
PAIRED_FLOORS = {"floor": 0.5}
PAIRED_SE = "paired_se_"  # metrics key prefix: "paired_se_floor_audio", the paired standard error of drift_floor_audio
DIVERSITY_DROP = 0.10  # a within-prompt diversity this fraction below the first eval's: collapsing

log = logging.getLogger("dmd2")


def evaluate(run, args: Args, num_steps: Optional[int] = None) -> dict[str, Any]:
    """The run's quality figures at this eval, of the student's ``num_steps``-step samples
    (default its largest step count): {metrics: {key: float}, reference: the drift yardstick
    ({"value", "se"}: ``drift.pooled``; "source": 'real' or 'teacher'), which ``drift_flags``
    judges the eval's drift with}."""
    k = num_steps or args.max_student_steps
    out = evaluate_each(run, args, [k])
    return {"metrics": out["metrics"][k], "reference": out["reference"]}


def evaluate_each(run, args: Args, step_counts: list[int]) -> dict[str, Any]:
    """``evaluate`` at each of ``step_counts``: {metrics: {K: {key: float}}, reference, and
    ``reference_s`` when this eval made a reference (the seconds it took: the time plan prices
    the reference apart from an eval)}. The references do not depend on the step count: they are
    read (or made) once, and every K is measured against them."""
    if not run.has_critic:  # no group holds the frozen teacher: no quality figures
        return {"metrics": {k: {} for k in step_counts}, "reference": {}}
    order = eval_order(args, len(prompt_texts(args.prompts)))
    started = time.perf_counter()
    identity = teacher_identity(args)  # one listing and config read an eval, shared by both references' keys
    reference = teacher_reference(run, args, order, identity)
    real = real_reference(run, args, identity)
    reference_s = time.perf_counter() - started
    metrics = {k: _student_figures(run, args, order, reference, real, k) for k in step_counts}
    yardstick = real["drift"] if real else reference["drift"]
    made = not reference["hit"] or (real and not real["hit"])
    return {"metrics": metrics, "reference": {**yardstick, "source": "real" if real else "teacher"},
            **({"reference_s": reference_s} if made else {})}


def _student_figures(run, args: Args, order: list[int], reference: dict[str, Any], real: dict[str, Any],
                     num_steps: int) -> dict[str, float]:
    """The student's ``num_steps``-step samples against both references, its diversity and drift."""
    latents = run.eval_latents(order, args.eval_seed, num_steps=num_steps)
    features = run.teacher_features(latents, order, FEATURE_U, FEATURE_SEED)
    metrics = {}
    for source, ref in (("teacher", reference), ("real", real)):
        if not ref:
            continue
        for m, f in sorted(features.items()):
            metrics[f"{source}_kid_{m}"] = projected_kid(ref["features"][m], f, dim=PROJECTION_DIM)
            metrics[f"{source}_kid_{m}_se"] = projected_kid_se(ref["features"][m], f, dim=PROJECTION_DIM)
        metrics[f"{source}_kid"] = sum(metrics[f"{source}_kid_{m}"] for m in features) / len(features)
    metrics.update({f"diversity_{m}": v for m, v in within_prompt_diversity(features, order).items()})
    stats, sound = split_sound_features(run.drift_stats(latents))
    metrics.update(sound_figures(reference["features"].get(SOUND_MEL), sound, "teacher"))
    metrics.update({f"drift_{k}": v for k, v in pooled(stats)["value"].items()})
    start = drift_start(args, num_steps, order, stats)
    if start is not None:
        metrics.update(paired_figures(stats, start))
    return metrics


def paired_figures(stats: list[dict[str, float]], start: list[dict[str, float]]) -> dict[str, float]:
    """``paired_se_<statistic>_<modality>`` of each ``PAIRED_FLOORS`` statistic: the standard error
    of the clips' mean change from ``start``, the same clips' statistics at the run's first eval."""
    return {f"{PAIRED_SE}{k}": v for k, v in paired_se(stats, start).items() if _statistic(k) in PAIRED_FLOORS}


def drift_start(args: Args, num_steps: int, order: list[int], stats: list[dict[str, float]]) -> Optional[list[dict]]:
    """The per-clip drift statistics of the run's first eval of ``num_steps`` steps, kept in its save
    (``save_layout.drift_start_url``) so that every later eval, a resumed or next night's too, judges
    its change clip by clip against the same clips: None when this eval is the first (its clips are
    written) or when the start was of other clips (another eval seed, prompts or count: the band
    falls back to the yardstick's spread, ``drift_band``)."""
    if not stats:
        return None
    url = drift_start_url(args.save, num_steps)
    identity = {"eval_seed": args.eval_seed, "order": list(order)}
    if not storage.exists(url):
        storage.write_text(url, json.dumps({**identity, "clips": stats}))
        return None
    kept = json.loads(storage.read_text(url))
    if {k: kept.get(k) for k in identity} != identity:
        log.info("drift from the start judged by the yardstick's spread: %s holds another eval's clips", url)
        return None
    return kept["clips"]


def sound_figures(yardstick: Optional[torch.Tensor], sound: Optional[torch.Tensor], source: str) -> dict[str, float]:
    """``sound_mel_kid`` of the student's clip features ``sound`` against the ``source`` reference's
    ``yardstick``; {} for pictures alone (neither has clip features). Where the run has sound but
    this eval cannot measure it, what preflight (``check_sound_clips``) cannot know (a cached
    reference made without clip features or with fewer of them, clips decoded without sound), the
    figure is left out with a warning saying why: the eval's sound criterion lacks its mel figure."""
    if yardstick is None and sound is None:
        return {}
    why = why_unmeasured(yardstick, sound)
    if why is None:
        return sound_mel_kid(yardstick, sound)
    log.warning("sound_mel_kid left out of this eval (against the %s reference): %s", source, why)
    return {}


def check_sound_clips(args: Args) -> None:
    """Pre-flight of an eval with sound: ``sound_mel_kid`` gets at least ``MIN_CLIPS`` clips a side,
    the student's ``eval_num_samples`` against as many of the teacher's (``teacher_reference``),
    and a real set (which the eval's KID and drift yardstick read) of at least as many rows.
    ArgsError naming the key that falls short. The checkpoint is read only where it decides (a run
    of pictures alone passes whatever its counts)."""
    from dmd2_core.models import FAMILIES, describe_model_dir

    @functools.cache
    def has_sound() -> bool:
        return FAMILIES[describe_model_dir(args.hf_checkpoint, "hf_checkpoint")["family"]].has_audio

    n = args.eval_num_samples
    check_eval_clips("eval_num_samples", str(n), n, "clips a side", f"set eval_num_samples to {MIN_CLIPS} or more",
                     has_sound)
    if not args.real_data or not args.eval_real_samples or not has_sound():
        return  # a run of pictures alone: its real set is left to the GAN head's checks, as before
    try:
        rows = real_set_shapes(args.real_data).get(REAL_LATENTS, [0])[0]
    except (OSError, ValueError) as exc:
        raise ArgsError(f"real_data: {args.real_data}: cannot read its header ({type(exc).__name__}: {exc})") from None
    if rows < MIN_CLIPS:  # the KID to the real set and the drift yardstick it decodes
        raise ArgsError(f"real_data: {args.real_data} holds {rows} rows: the KID to the real set needs at least "
                        f"{MIN_CLIPS} real samples; give a real set of {MIN_CLIPS} rows or more, or set "
                        "eval_real_samples to 0 for none")


def check_picture_samples(args: Args) -> None:
    """Pre-flight of any run's eval in the teacher's features: each KID and its standard error
    (which the regression call weighs) get at least ``SE_MIN_SAMPLES`` samples a side, the
    student's ``eval_num_samples`` and the real set's ``eval_real_samples`` (when it has one);
    else an eval's figures would be NaN-weighted or, at 1, fail mid-run. ArgsError naming the key."""
    least = SE_MIN_SAMPLES
    if args.eval_num_samples < least:
        raise ArgsError(f"eval_num_samples: {args.eval_num_samples}: the teacher-feature KID and its standard error "
                        f"need at least {least} samples an eval; set eval_num_samples to {least} or more")
    if args.real_data and 0 < args.eval_real_samples < least:
        raise ArgsError(f"eval_real_samples: {args.eval_real_samples}: the KID to the real set needs at least {least} "
                        f"real samples; set eval_real_samples to {least} or more, or 0 for none")


# ---- the teacher's side, made once ----------------------------------------------------------------

def teacher_identity(args: Args) -> dict[str, Any]:
    """What names the teacher whose eyes (and samples) a reference holds: its URL, the bytes of
    its transformer config and its weight files' names and sizes (of the partition the run
    distills: ref2va's ``transformer_ref/``; a retrained teacher at the same URL changes them), and
    the features' settings."""
    from dmd2_core.models import describe_model_dir, transformer_folder

    teacher_url = args.teacher_checkpoint or args.hf_checkpoint
    transformer = describe_model_dir(teacher_url, transformer=transformer_folder(args.workflow))["transformer_url"]
    files = {name: size for name, size in listing(transformer).items() if name.endswith((".safetensors", ".json"))}
    return {"format": REFERENCE_FORMAT, "teacher": teacher_url,
            "config": storage.read_text(storage.join(transformer, "config.json")), "files": files,
            "u": FEATURE_U, "feature_seed": FEATURE_SEED, "dtype": args.dtype}


def settings_key(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def set_file_identity(url: Optional[str]) -> dict[str, Any]:
    """What names a set file's content (a prompt or real set) in a reference's key: its header
    (tensor names, dtypes, shapes and offsets; the texts in its metadata), the byte span of its
    tensors and its version in storage (``storage.FileVersion``'s tag: an object's ETag, a local
    file's mtime). A set rewritten at its URL with other tensors of the same shapes and the same
    texts has the header and span it had, not the version: it keys another reference, and the
    file as it was keeps its key (a rerun hits). A local file's inode is left out: a copy that
    keeps its mtime (cp -p, rsync -a: a set synced to each node every night) is the same content,
    and its reference took hours to make at real size. One stat and one small read. {} for a
    built-in set (its content is the code's)."""
    if url is None or url in BUILTIN_SETS:
        return {}
    header, span, _, version = storage.pinned_safetensors_layout(url)
    return {"header": header, "span": span, "version": storage.content_stamp(url, version)}


def reference_key(args: Args, order: list[int], identity: Optional[dict[str, Any]] = None) -> str:
    """What a cached reference must match to be a hit: the teacher (``teacher_identity``), the
    prompts (URL, texts and the file's content, ``set_file_identity``: the teacher's samples are
    of the set's tensors, embeddings and fl2va's keyframes), the eval prompts and noise seed, the
    sample shape, the teacher's sampler (steps, guidance, shift) and a workflow other than t2va
    (MiniMax-H3's fl2va: its entries made before the teacher's features saw the keyframes are not
    hits)."""
    return settings_key({
        **(identity or teacher_identity(args)), "prompts": args.prompts, "texts": prompt_texts(args.prompts),
        "prompt_set": set_file_identity(args.prompts), "order": order,
        "seed": args.eval_seed, "latent_shape": args.latent_shape, "steps": args.eval_reference_steps,
        "guidance": args.dmd2_guidance_scale, "shift": args.dmd2_shift,
        **({"workflow": args.workflow} if args.workflow != "t2va" else {})})


def real_rows(args: Args) -> list[int]:
    """The real rows an eval compares with: ``eval_real_samples`` of ``real_data``, a fixed random
    subset (the same for every eval and night), sorted; [] without a real set."""
    if not args.real_data or not args.eval_real_samples:
        return []
    total = real_set_shapes(args.real_data)[REAL_LATENTS][0]
    chosen = torch.randperm(total, generator=torch.Generator().manual_seed(REAL_ROWS_SEED))[:args.eval_real_samples]
    return sorted(chosen.tolist())


def real_key(args: Args, rows: list[int], identity: Optional[dict[str, Any]] = None) -> str:
    """What a cached real reference must match: the teacher (``teacher_identity``), the real set
    (its URL and its file's content, ``set_file_identity``) and the rows."""
    return settings_key({**(identity or teacher_identity(args)), "real_data": args.real_data,
                         "real_set": set_file_identity(args.real_data), "rows": rows})


def reference_url(args: Args) -> str:
    return args.eval_reference_url or eval_reference_root(args.save)


def teacher_reference(run, args: Args, order: list[int], identity: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The teacher's features, drift statistics and (with sound) clip features (``SOUND_MEL``) of
    its own samples: read from the cache when
    an entry of the same key is there (complete: its JSON is written last), else made by the
    critic group and written."""
    url = storage.join(reference_url(args), reference_key(args, order, identity))
    marker = storage.join(url, "reference.json")
    if storage.exists(marker):
        meta = json.loads(storage.read_text(marker))
        tensors, _ = read_safetensors(storage.join(url, "features.safetensors"))
        return {"features": tensors, "drift": meta["drift"], "url": url, "hit": True}
    latents = run.teacher_reference(order, args.eval_seed, args.eval_reference_steps)
    features = run.teacher_features(latents, order, FEATURE_U, FEATURE_SEED)
    stats, sound = split_sound_features(run.drift_stats(latents))
    drift = pooled(stats)
    features = {**features, **({SOUND_MEL: sound} if sound is not None else {})}
    write_safetensors(storage.join(url, "features.safetensors"), {m: f.contiguous() for m, f in features.items()})
    storage.write_text(marker, json.dumps({"format": REFERENCE_FORMAT, "teacher": args.teacher_checkpoint or args.hf_checkpoint,
                                           "samples": len(order), "steps": args.eval_reference_steps,
                                           "drift": drift}, indent=1))
    return {"features": features, "drift": drift, "url": url, "hit": False}


def real_reference(run, args: Args, identity: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The second reference, from ``real_rows``: the teacher's features of them, and the drift
    statistics of the first ``eval_num_samples`` of them, the clips it decodes ({features,
    drift}); cached as the teacher's reference is, made on a miss; {} without a real set."""
    rows = real_rows(args)
    if not rows:
        return {}
    url = storage.join(reference_url(args), f"real-{real_key(args, rows, identity)}")
    marker = storage.join(url, "reference.json")
    if storage.exists(marker):
        features, _ = read_safetensors(storage.join(url, "features.safetensors"))
        return {"features": features, "drift": json.loads(storage.read_text(marker))["drift"], "hit": True}
    features = run.real_features(rows, FEATURE_U, FEATURE_SEED, REAL_NOISE_OFFSET)
    latents, _ = open_real_set(args.real_data).batch(torch.tensor(rows[:args.eval_num_samples]))
    stats, _ = split_sound_features(run.drift_stats(latents))
    drift = pooled(stats)
    write_safetensors(storage.join(url, "features.safetensors"), {m: f.contiguous() for m, f in features.items()})
    storage.write_text(marker, json.dumps({"format": REFERENCE_FORMAT, "real_data": args.real_data,
                                           "rows": len(rows), "drift": drift}, indent=1))
    return {"features": features, "drift": drift, "hit": False}


# ---- drift ----------------------------------------------------------------------------------------

def _statistic(name: str) -> str:
    """``floor_audio`` -> ``floor``: a drift key's statistic without its modality."""
    return name if name == "av_align" else name.rsplit("_", 1)[0]


def paired_key(drift_key: str) -> str:
    """``drift_floor_audio@4`` -> ``paired_se_floor_audio@4``: where an eval keeps the paired
    standard error of a drift figure (``drift_start``)."""
    name, k = split_steps(drift_key)
    key = PAIRED_SE + name.removeprefix("drift_")
    return key if k is None else at_steps(key, k)


def drift_band(name: str, reference: dict[str, Any], paired: Optional[float] = None) -> Optional[float]:
    """The half-width of drift statistic ``name``'s band (``brightness_video``, ``av_align``; in its
    own units, ``drift.DRIFT_UNITS``): max(BAND_K * sqrt(2) * the reference's standard error, its
    ``DRIFT_FLOORS`` floor), sqrt(2) for a difference of two draws of that size; for a statistic of
    ``PAIRED_FLOORS`` with its ``paired`` standard error (the eval's clips against the same clips at
    the start), max(BAND_K * paired, its paired floor). None for a statistic without a floor or
    without a finite reference value (not judged)."""
    statistic = _statistic(name)
    floor = DRIFT_FLOORS.get(statistic)
    ref = (reference.get("value") or {}).get(name)
    se = (reference.get("se") or {}).get(name)
    if floor is None or not isinstance(ref, (int, float)) or not math.isfinite(ref):
        return None
    if statistic in PAIRED_FLOORS and isinstance(paired, (int, float)) and math.isfinite(paired):
        return max(BAND_K * paired, PAIRED_FLOORS[statistic])
    kind, width = floor
    return max(BAND_K * math.sqrt(2) * se if isinstance(se, (int, float)) and math.isfinite(se) else 0.0,
               width * abs(ref) if kind == "rel" else width)


def drifted(value: float, start: float, ref: float, half_width: float) -> bool:
    """Whether a statistic at ``value`` drifted: out of its band (``start`` +- ``half_width``) and
    farther from the reference ``ref`` than the start was (towards it is an improving student)."""
    return abs(value - start) > half_width and abs(value - ref) > abs(start - ref)


def drift_flags(latest: dict[str, float], start: dict[str, float], reference: dict[str, Any]) -> list[str]:
    """The metrics keys of ``latest`` (an eval's metrics) whose drift left its band, judged against
    the run's first eval ``start`` and ``reference`` ({"value", "se"}: ``drift.pooled`` of the
    real set's samples when the run has one, else of the teacher's reference samples; what the
    run distils towards):

    - ``drift_<statistic>_<modality>``: moved from the start by more than its band (``drift_band``)
      and farther from the reference than the start was (``drifted``).
      Judged from the start, a sampler's own offset (a 4-step sampler against 50 steps) is not a
      drift, and a student moving towards the reference is not one either.
    - ``diversity_<modality>``: fell by more than ``DIVERSITY_DROP`` of the start's (collapse).
    """
    values = reference.get("value") or {}
    flagged = []
    for key, value in sorted(latest.items()):
        first = start.get(key)
        if not isinstance(value, (int, float)) or not isinstance(first, (int, float)) \
                or not math.isfinite(value) or not math.isfinite(first):
            continue
        if key.startswith("diversity_"):
            if value < (1 - DIVERSITY_DROP) * first:
                flagged.append(key)
            continue
        name = split_steps(key)[0].removeprefix("drift_")  # each step count's, against the one yardstick
        half_width = drift_band(name, reference, latest.get(paired_key(key)))
        if key.startswith("drift_") and half_width is not None and drifted(value, first, values[name], half_width):
            flagged.append(key)
    return flagged


# ---- the evaluator ------------------------------------------------------------------------------

_MODALITIES = ("video", "audio", "image")
# the teacher-feature sound KIDs keep their keys (old metrics logs read as before) and are read as
# the alarm they are (working against broken); sound_mel_kid ranks the sound
_LABELS = {"real_kid_audio": "sound alarm: real-set KID, teacher features",
           "teacher_kid_audio": "sound alarm: teacher KID, teacher features"}


class TeacherEvaluator(Evaluator):
    name = TEACHER
    figures = (Figure("real_kid", "real-set KID"), *(Figure(f"real_kid_{m}", _LABELS.get(f"real_kid_{m}", "")) for m in _MODALITIES),
               Figure("teacher_kid", "teacher KID"),
               *(Figure(f"teacher_kid_{m}", _LABELS.get(f"teacher_kid_{m}", "")) for m in _MODALITIES),
               Figure("sound_mel_kid", "sound mel KID"), Figure("sound_mel_kid_se", "sound mel KID's standard error", on_nights=False),
               Figure("drift_out", "drift statistics out of band", on_nights=False))
    # with a real set the run distils towards it (its GAN head's data): the real-set KID comes first
    criteria = ("real_kid", "teacher_kid")
    # the picture and the sound each judged in its own noise (``evaluation.criterion``); the sound by
    # its weight-free mel distance where the eval has it, else by the teacher-feature audio KID
    modality_criteria = (
        Criterion("picture", ("real_kid_video", "teacher_kid_video", "real_kid_image", "teacher_kid_image")),
        Criterion("sound", ("sound_mel_kid", "real_kid_audio", "teacher_kid_audio")))
    panels = (Panel("KID to the real set, teacher features (lower is better)", tuple(f"real_kid_{m}" for m in _MODALITIES)),
              Panel("KID to the teacher's samples (lower is better)", tuple(f"teacher_kid_{m}" for m in _MODALITIES)),
              Panel("sound: mel-band KID, no weights (lower is better)", ("sound_mel_kid",)),
              Panel("drift statistics out of band", ("drift_out",)))
    table = ("sound_mel_kid",)
    drift_statistics = tuple(DRIFT_FLOORS)

    def preflight_check(self, args: Args, trainer_args: dict) -> None:
        if not args.eval_interval:
            return
        if args.evaluator == TEACHER and "critic" not in trainer_args:
            raise ArgsError("evaluator: 'teacher' compares in the frozen teacher's features, which the critic group "
                            f"holds; loss_type {args.loss_type} has none (leave evaluator unset: no quality figures)")
        if "critic" in trainer_args:  # the run has quality figures
            check_sound_clips(args)
            check_picture_samples(args)

    def writes(self, args: Args, trainer_args: dict) -> dict[str, str]:
        shared_cache = args.eval_interval and "critic" in trainer_args and args.eval_reference_url
        return {"eval_reference_url": args.eval_reference_url} if shared_cache else {}

    def evaluate(self, run, args: Args, step_counts: list[int]) -> dict[str, Any]:
        return evaluate_each(run, args, step_counts)

    def drift_flags(self, latest: dict[str, float], start: dict[str, float], reference: dict[str, Any]) -> list[str]:
        return drift_flags(latest, start, reference)
