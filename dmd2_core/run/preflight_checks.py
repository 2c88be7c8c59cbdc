"""Preflight checks that need more than the argument model: the save URL is writable, the prompt
set's header is sound, the latent shape fits the model, the Ray cluster is reachable and has the
device resource. Each raises ArgsError with one line naming the key (or path) at fault; a storage
outage comes through as StorageUnavailableError (not bad input)."""

from __future__ import annotations

import contextlib

import json
import os
import socket
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

from dmd2_core import storage
from dmd2_core.args import Args
from dmd2_core.errors import ArgsError, SafetensorsHeaderError, StorageUnavailableError, one_line


# ---- save -------------------------------------------------------------------------------------

REACH_S = 15.0  # an endpoint that never answers is named within this (plus one attempt's timeouts)
_answered: set[tuple[str, str]] = set()  # (endpoint, bucket) that answered in this process


def check_reachable(urls: dict[str, Optional[str]]) -> None:
    """Each S3 URL (``key`` -> URL) whose endpoint has not answered yet in this process must
    answer (anything: an object, 'no such key', 'access denied') within REACH_S, else one line
    naming the key and the URL. The storage retry budget (DMD2_STORAGE_RETRY_S) is for outages of
    a store that answered before: a wrong endpoint or a store that is not there fails now."""
    import fsspec

    for key, url in urls.items():
        if not url or not str(url).startswith(("s3://", "s3a://")):
            continue
        path = str(url).split("://", 1)[1]
        endpoint = (os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "aws", path.split("/")[0])
        if endpoint in _answered:
            continue
        # one attempt at a time, short timeouts, no retries inside botocore or s3fs
        fs = fsspec.filesystem("s3", skip_instance_cache=True, config_kwargs={
            "connect_timeout": 3, "read_timeout": 5, "retries": {"max_attempts": 1}})
        fs.retries = 1
        deadline, last = time.monotonic() + REACH_S, None
        while True:
            try:
                fs.info(path)
                break
            except Exception as exc:  # noqa: BLE001 - any answer but a transient error is an answer
                if not storage.is_transient(exc):
                    break
                last = exc
            if time.monotonic() + 1.0 > deadline:
                raise ArgsError(f"{key}: {url}: the storage endpoint did not answer for {REACH_S:.0f} s "
                                f"({one_line(last)}); check AWS_ENDPOINT_URL and the network")
            time.sleep(1.0)
        _answered.add(endpoint)


def probe_write(save_url: str, key: str = "save") -> None:
    """Write and remove a small object under the URL of ``key``; on local storage also remove the
    directories the probe created, so a failed preflight leaves nothing behind. Only those, deepest
    first, and only while empty: a directory something else wrote into meanwhile stays, with what
    is in it."""
    probe = storage.join(save_url, f".dmd2-probe-{uuid.uuid4().hex[:8]}")
    created: list[Path] = []  # the directories missing before the probe, deepest first
    if storage.is_local(save_url):
        path = Path(storage.filesystem(save_url)[1])
        while not path.exists() and path.parent != path:
            created.append(path)
            path = path.parent
    try:
        storage.write_bytes(probe, b"probe")
        storage.remove(probe)
    except StorageUnavailableError:
        raise
    except Exception as exc:  # noqa: BLE001 - permission, no such bucket, read-only file system ...
        raise ArgsError(f"{key}: cannot write to {save_url} ({one_line(exc)})") from None
    finally:
        if storage.is_local(save_url):  # a write that failed after the probe landed leaves it: remove it too
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):  # never landed (a file on its path)
                Path(storage.filesystem(probe)[1]).unlink()
        for directory in created:
            try:
                directory.rmdir()  # refuses a directory that is not empty
            except FileNotFoundError:
                continue  # never made (the write failed first)
            except OSError:
                break  # another writer's files: this and every directory above it stay


# ---- prompts ----------------------------------------------------------------------------------

def check_prompt_set(url: str, needs_negative: bool = True, cond_keys: tuple[str, ...] = ("prompt_embeds",)) -> None:
    """The safetensors header of a prompt set, read with bounded memory: an 8-byte length, a JSON
    header within the file, the model's condition keys and (for classifier-free guidance) a
    ``negative_`` entry for every key."""
    def bad(reason: str) -> ArgsError:
        return ArgsError(f"prompts: {url} is not a safetensors prompt set ({reason})")

    try:
        entries, _ = storage.read_safetensors_header(url)
    except SafetensorsHeaderError as exc:
        raise bad(str(exc)) from None
    except StorageUnavailableError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ArgsError(f"prompts: cannot read {url} ({one_line(exc)})") from None
    tensors = {k: v for k, v in entries.items() if k != "__metadata__"}
    embeds = {k for k in tensors if not k.startswith("negative_")}
    negative = {k.removeprefix("negative_") for k in tensors if k.startswith("negative_")}
    for key in ("prompt_embeds", *cond_keys):
        if key not in embeds:
            raise bad(f"no '{key}' tensor (has: {', '.join(sorted(tensors)) or 'none'})")
    if (needs_negative or negative) and negative != embeds:
        raise bad("needs a negative_ entry for each embedding key" + (
            " (classifier-free guidance: dmd2_guidance_scale != 1)" if needs_negative else ""))
    metadata = entries.get("__metadata__") or {}
    if "prompts" in metadata:
        try:
            json.loads(metadata["prompts"])
        except (TypeError, ValueError):
            raise bad("its 'prompts' metadata is not a JSON list") from None


# ---- the family's own rules ---------------------------------------------------------------------

def check_family_args(args: Args, teacher: dict[str, Any]) -> Args:
    """What the teacher's family fixes or needs: a guidance-distilled teacher takes no guidance
    scale, a family that maps sigma itself takes no ``dmd2_shift``, a joint model's clip geometry
    (num_frames, height, width) becomes its ``latent_shape``, modality weights name its modalities.
    Returns ``args`` with the derived values."""
    from dmd2_core.models import FAMILIES

    family = FAMILIES[teacher["family"]]
    name = teacher["family"]
    if family.guidance_distilled and args.uses_guidance:
        key, fix = ("dmd2_guidance_scale", "set dmd2_guidance_scale to 1") if args.dmd2_guidance_scale != 1.0 else \
            ("dmd2_student_steps_guidance", "remove dmd2_student_steps_guidance")
        raise ArgsError(f"{key}: {args.hf_checkpoint} ({name}) is guidance-distilled (one forward per step, no "
                        f"negative prompt); {fix} (got {getattr(args, key)})")
    if family.fixed_shift is not None and args.dmd2_shift not in (None, family.fixed_shift):
        raise ArgsError(f"dmd2_shift: {name} shifts each modality by its own scheduler {teacher.get('modality_shifts')}; "
                        f"leave dmd2_shift unset (got {args.dmd2_shift:g})")
    check_student_sampler(args, family, name)
    if args.workflow != "t2va" or not family.has_audio:
        check_workflow_name(args.workflow, family, name)
    geometry = [args.num_frames, args.height, args.width]
    if any(v is not None for v in geometry):
        if not family.has_audio:
            raise ArgsError(f"num_frames: clip geometry is for joint video + audio models; {name} takes latent_shape")
        missing = [k for k, v in zip(("num_frames", "height", "width"), geometry) if v is None]
        if missing:
            raise ArgsError(f"{missing[0]}: set num_frames, height and width together")
        latent_shape = family.clip_latent_shape((args.num_frames, args.height, args.width), args.latent_shape, teacher)
        args = args.model_copy(update={"latent_shape": latent_shape})
    elif family.has_audio and args.latent_shape:
        problem = family.latent_shape_problem(list(args.latent_shape), teacher)
        if problem:
            raise ArgsError(f"latent_shape: {list(args.latent_shape)} is no {name} clip ({problem}); "
                            "set num_frames, height and width instead")
    if args.size_schedule:
        args = args.model_copy(update={"size_schedule": resolve_stages(args, family, name, teacher)})
    for flag in ("dmd2_modality_weights", "gan_modality_weights", "dmd2_regression_modality_weights"):
        check_modality_weights(flag, getattr(args, flag), family, name)
    check_modality_floors(args, family, name)
    for flag in ("dmd2_modality_shifts", "student_modality_shifts"):
        check_modality_shifts(flag, getattr(args, flag), family, name)
    if args.gan_judged_modalities is not None:
        if not args.gan_judged_modalities:
            raise ArgsError("gan_judged_modalities: empty; name the modalities the GAN head judges, or leave it unset for all")
        check_modality_names("gan_judged_modalities", args.gan_judged_modalities, family, name)
    return args


def check_modality_names(flag: str, names, family, name: str) -> None:
    """Each of ``names`` a modality of the joint model (video, audio); a model of one modality has none."""
    known = ("video", "audio") if family.has_audio else ()
    for key in names:
        if key not in known:
            from dmd2_core.errors import nearest

            raise ArgsError(f"{flag}: unknown modality '{key}' for {name}{nearest(key, known)} "
                            f"(modalities: {', '.join(known) or 'none: one modality'})")


def check_modality_weights(flag: str, weights: Optional[dict], family, name: str) -> None:
    """A weight per modality of a joint model: known modality names, each >= 0."""
    check_modality_names(flag, weights or {}, family, name)
    for key, value in (weights or {}).items():
        if not value >= 0:
            raise ArgsError(f"{flag}: {key} weight must be >= 0 (got {value})")


def check_modality_shifts(flag: str, shifts: Optional[dict], family, name: str) -> None:
    """A schedule shift per modality of a joint model: known modality names, each > 0."""
    check_modality_names(flag, shifts or {}, family, name)
    for key, value in (shifts or {}).items():
        if not value > 0:
            raise ArgsError(f"{flag}: {key} shift must be > 0 (got {value})")


def check_modality_floors(args, family, name: str) -> None:
    """``dmd2_modality_min_sigma``: known modalities, each floor inside the range the draws span."""
    floors = args.dmd2_modality_min_sigma or {}
    check_modality_names("dmd2_modality_min_sigma", floors, family, name)
    for key, value in floors.items():
        if not args.dmd2_min_sigma <= value < args.dmd2_max_sigma:
            raise ArgsError(f"dmd2_modality_min_sigma: {key} floor {value} is outside the draws' range "
                            f"[dmd2_min_sigma {args.dmd2_min_sigma}, dmd2_max_sigma {args.dmd2_max_sigma})")


def check_workflow_name(workflow: str, family, name: str) -> None:
    """A workflow other than text-to-video is MiniMax-H3's, and one of those it distills."""
    if not family.has_audio:
        if workflow != "t2va":
            raise ArgsError(f"workflow: {workflow} is a MiniMax-H3 workflow; {name} distills text conditioning "
                            "alone (leave workflow unset)")
        return
    from dmd2_core.models.minimax_h3 import workflow_problem

    problem = workflow_problem(workflow)
    if problem:
        raise ArgsError(problem)


def check_workflow_prompts(url: str, workflow: str, latent_shape: Optional[list[int]]) -> None:
    """A MiniMax-H3 prompt set agrees with the run's workflow: an fl2va run needs a set prepared
    with keyframes (``prepare-prompts --keyframes``), each of the clip's frame size; a ref2va run
    one prepared with references (``--references``); a run is refused another workflow's set (it
    would train with conditions it never names). Reads the header and the small code and length
    tensors only."""
    from dmd2_core.data import KEYFRAME_PIXELS
    from dmd2_core.models.minimax_h3 import KEYFRAME_ANCHORS, KEYFRAME_KEYS

    entries, _ = storage.read_safetensors_header(url)
    held = {"fl2va": ("keyframe_latents", "keyframes", "--keyframes"),
            "ref2va": ("reference_latents", "references", "--references")}
    for other, (key, what, flag) in held.items():
        if other != workflow and key in entries:
            raise ArgsError(f"prompts: {url} holds {what} ('{key}': an {other} set); set workflow: {other} "
                            f"or prepare the prompts without {flag}")
    if workflow == "t2va":
        return
    if workflow == "ref2va":
        check_reference_prompts(url, entries, latent_shape)
        return
    n = _condition_keys(url, entries, KEYFRAME_KEYS, workflow, "keyframes")
    keyframes = entries["keyframe_latents"]["shape"]
    if len(keyframes) != 6 or keyframes[3] != 1:
        raise ArgsError(f"prompts: {url} 'keyframe_latents' is {keyframes}; it must be [N, K, C, 1, H, W]")
    if latent_shape and list(keyframes[4:]) != list(latent_shape[2:]):
        raise ArgsError(f"prompts: {url} keyframes encode to {keyframes[4]}x{keyframes[5]} latents, the clip's "
                        f"frames to {latent_shape[2]}x{latent_shape[3]}; prepare the keyframes at the clip's height "
                        "and width")
    pictures = entries.get(KEYFRAME_PIXELS)  # the eval media's; a set prepared before them has none
    if pictures and (pictures["dtype"] != "U8" or list(pictures["shape"][:3]) != [n, keyframes[1], 3]
                     or len(pictures["shape"]) != 5):
        raise ArgsError(f"prompts: {url} '{KEYFRAME_PIXELS}' is {pictures['dtype']} {pictures['shape']}; it must be "
                        f"uint8 [{n}, {keyframes[1]}, 3, H, W], a picture per keyframe")
    anchors = _tensor(url, "keyframe_anchors")
    bad = [i for i, row in enumerate(anchors.tolist()) if any(not 0 <= a < len(KEYFRAME_ANCHORS) for a in row)]
    if bad:
        raise ArgsError(f"prompts: {url} row {bad[0]} anchors a keyframe at {anchors[bad[0]].tolist()}; anchors are "
                        "0 (first) and 1 (last)")


def _condition_keys(url: str, entries: dict, keys, workflow: str, what: str, optional=()) -> int:
    """A workflow's prompt set holds each of its condition ``keys`` (``what``: keyframes or
    references, the ``prepare-prompts`` flag that writes them), and those and the ``optional`` keys
    it holds have a row per prompt; returns the prompts' count."""
    missing = [key for key in keys if key not in entries]
    if missing:
        raise ArgsError(f"prompts: {url} holds no '{missing[0]}' ({workflow} conditions on {what}); prepare it "
                        f"with prepare-prompts --{what}")
    n = entries["prompt_embeds"]["shape"][0]
    for key in (*keys, *optional):
        if entries[key]["shape"][0] != n:
            raise ArgsError(f"prompts: {url} '{key}' has {entries[key]['shape'][0]} rows for {n} prompts")
    return n


def check_reference_prompts(url: str, entries: dict, latent_shape: Optional[list[int]]) -> None:
    """A ref2va set: its references' keys, one row per prompt, image latents [N, I, C, 1, h, w],
    audio rows [N, A, 2 L, 32] no longer than the clip's soundtrack (diffusers truncates a
    reference to the generated duration), and each row's kinds (0 image, 1 audio) naming its
    images and sounds in number, at least one image (an audio reference never stands alone)."""
    from dmd2_core.models.minimax_h3 import (
        AUDIO_CHANNELS,
        AUDIO_LATENT_CHANNELS,
        REFERENCE_AUDIO,
        REFERENCE_KEYS,
        REFERENCE_KINDS,
        audio_latents,
        pixel_frames,
    )

    n = _condition_keys(url, entries, REFERENCE_KEYS, "ref2va", "references",
                        [REFERENCE_AUDIO] if REFERENCE_AUDIO in entries else [])
    images = entries["reference_latents"]["shape"]
    if len(images) != 6 or images[3] != 1 or not images[1]:
        raise ArgsError(f"prompts: {url} 'reference_latents' is {images}; it must be [N, I, C, 1, h, w], at least "
                        "one image per row (a sound never stands alone)")
    sounds = entries[REFERENCE_AUDIO]["shape"] if REFERENCE_AUDIO in entries else [n, 0, 0, AUDIO_LATENT_CHANNELS]
    if len(sounds) != 4 or sounds[3] != AUDIO_LATENT_CHANNELS or sounds[2] % AUDIO_CHANNELS:
        raise ArgsError(f"prompts: {url} '{REFERENCE_AUDIO}' is {sounds}; it must be [N, A, 2 L, "
                        f"{AUDIO_LATENT_CHANNELS}] (each reference's stereo rows)")
    if latent_shape and sounds[1]:
        longest = audio_latents(pixel_frames(latent_shape[1]))
        if sounds[2] // AUDIO_CHANNELS > longest:
            raise ArgsError(f"prompts: {url} audio references span {sounds[2] // AUDIO_CHANNELS} latents, the clip's "
                            f"soundtrack {longest}; prepare the references with the run's num_frames")
    kinds = _tensor(url, "reference_kinds")
    for row, codes in enumerate(kinds.tolist()):
        named = [REFERENCE_KINDS[c] if 0 <= c < len(REFERENCE_KINDS) else None for c in codes]
        if None in named or named.count("image") != images[1] or named.count("audio") != sounds[1]:
            raise ArgsError(f"prompts: {url} row {row} names references {codes} (0 image, 1 audio) for "
                            f"{images[1]} image and {sounds[1]} audio references")


def resolve_stages(args: Args, family, name: str, teacher: dict[str, Any]) -> list[dict]:
    """Each stage of ``size_schedule`` with its ``latent_shape``: a clip (num_frames, height,
    width) becomes its latents as the run's own does, by the family's rules; a joint model's
    latents must be a clip it makes. A refusal names the stage's key."""
    from dmd2_core.size_schedule import stage_name

    stages = []
    for index, stage in enumerate(args.size_schedule):
        where = stage_name(index)
        shape = stage.get("latent_shape")
        try:
            if stage.get("num_frames") is not None:
                if not family.has_audio:
                    raise ArgsError(f"num_frames: clip geometry is for joint video + audio models; {name} takes "
                                    "latent_shape")
                shape = family.clip_latent_shape((stage["num_frames"], stage["height"], stage["width"]), shape, teacher)
            elif family.has_audio:
                problem = family.latent_shape_problem(list(shape), teacher)
                if problem:
                    raise ArgsError(f"latent_shape: {list(shape)} is no {name} clip ({problem}); set num_frames, "
                                    "height and width instead")
        except ArgsError as exc:
            raise ArgsError(f"{where}.{exc}") from None
        stages.append({**stage, "latent_shape": list(shape)})
    return stages


def check_size_schedule(args: Args, teacher: dict[str, Any]) -> None:
    """``size_schedule`` (resolved by ``check_family_args``) against the model: each stage's
    latents fit it as ``latent_shape`` must (rank, channels, patch, positional table), are no larger
    than the full size in any dimension (the memory plan and the eval are the full size's), and
    the last stage is the full size; a GAN head's real set, stored at the full size, has no rows
    for a smaller stage (refused rather than resampled: a latent set downsampled is not the latents
    of smaller clips)."""
    if not args.size_schedule:
        return
    from dmd2_core.memory.planner import family_shape
    from dmd2_core.models import FAMILIES
    from dmd2_core.size_schedule import stage_name

    config = _model_config(teacher)
    family = FAMILIES[teacher["family"]]
    full = list(family_shape(family, config, args.latent_shape))
    last = len(args.size_schedule) - 1
    for index, stage in enumerate(args.size_schedule):
        where = stage_name(index)
        shape = list(stage["latent_shape"])
        _check_shape(shape, f"{where}.latent_shape", teacher, config)
        if index == last and shape != full:
            raise ArgsError(f"size_schedule: its last stage ({where}) trains at {shape}, not the run's full size {full} "
                            "(latent_shape, or num_frames/height/width); a schedule ends at the full size, where the "
                            "student is evaluated and served")
        larger = next((i for i, (d, f) in enumerate(zip(shape, full)) if d > f), None)
        if larger is not None:
            raise ArgsError(f"{where}.latent_shape: {shape} is larger than the full size {full} in dimension {larger}; "
                            "a stage trains at the full size or below (the memory plan and the eval are the full size's)")
        if index != last and args.gan_critic_weight and shape != full:
            raise ArgsError(f"{where}: the GAN head's real set (real_data {args.real_data}) holds samples of the full "
                            f"size {full}, none of this stage's {shape}; set gan_weight and gan_critic_weight to 0 "
                            "for a size schedule, or train at the full size throughout")


def check_student_sampler(args: Args, family, name: str) -> None:
    """The student's sampler is one its export can step: a modular pipeline (MiniMax-H3) steps by
    Euler only, and only an Euler student serves a set of step counts from one diffusers
    scheduler (export/scheduler.py)."""
    from dmd2_core.train.dmd2_iteration import student_is_euler

    euler = student_is_euler(family, args)
    if family.modular_pipeline and not euler:
        raise ArgsError(f"dmd2_student_sampler: {name}'s pipeline steps the student by Euler; set it to euler or "
                        "leave it unset (got renoise)")
    if len(args.student_step_counts) > 1 and not euler:
        raise ArgsError(f"dmd2_student_sampler: a set of step counts {list(args.student_step_counts)} needs "
                        f"dmd2_student_sampler=euler for {name}: one diffusers scheduler serves every step count only "
                        "for a student that steps by Euler (FlowMapEulerDiscreteScheduler); the re-noising one's "
                        "(FlowMatchLCMScheduler) serves one")


# ---- latent shape -----------------------------------------------------------------------------

def check_latent_shape(args: Args, teacher: dict[str, Any]) -> None:
    """``latent_shape`` against the teacher's transformer config: rank, channels, patch size."""
    if not args.latent_shape:
        return
    _check_shape(list(args.latent_shape), "latent_shape", teacher, _model_config(teacher))


def _model_config(teacher: dict[str, Any]) -> dict:
    url = storage.join(teacher["transformer_url"], "config.json")
    try:
        return json.loads(storage.read_text(url))
    except StorageUnavailableError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ArgsError(f"{url}: unreadable model config ({one_line(exc)})") from None


def _check_shape(shape: list[int], key: str, teacher: dict[str, Any], config: dict) -> None:
    """One sample's latents (``key``) against the model's config."""
    from dmd2_core.models import FAMILIES

    url = storage.join(teacher["transformer_url"], "config.json")
    video = FAMILIES[teacher["family"]].is_video
    names = "[C, F, H, W]" if video else "[C, H, W]"
    where = f"{key}: {shape}"
    if len(shape) != (4 if video else 3) or any(int(d) <= 0 for d in shape):
        raise ArgsError(f"{where} does not fit {teacher['family']}: expected {names} of positive sizes")
    channels = config.get("in_channels")
    if channels is not None and shape[0] != int(channels):
        raise ArgsError(f"{where}: {shape[0]} channels, the model ({url}) takes in_channels={channels}")
    patch = config.get("patch_size") or 1
    patch = list(patch) if isinstance(patch, (list, tuple)) else [1] * (len(shape) - 3) + [patch, patch]
    dims = shape[1:]
    for dim, p, name in zip(dims, patch[-len(dims):], names.strip("[]").split(", ")[1:]):
        if int(dim) % int(p):
            from dmd2_core.models.minimax_h3 import nearest_multiples

            raise ArgsError(f"{where}: {name}={dim} is not a multiple of the model's patch size {p}; nearest: "
                            f"{nearest_multiples(int(dim), int(p))}")
    max_size = config.get("pos_embed_max_size")
    if max_size and any(int(d) // int(patch[-1]) > int(max_size) for d in dims[-2:]):
        raise ArgsError(f"{where}: larger than the model's pos_embed_max_size {max_size} patches")


# ---- context parallelism ------------------------------------------------------------------------

def check_context_parallel(args: Args, trainer_args: dict[str, Args]) -> None:
    """Each trainer's ``cp_size`` against its batch, its models and its sequences: the
    data-parallel size (num_devices / cp) divides global_batch_size; with cp > 1 the family has a
    context-parallel plan, the heads split over cp, and every sequence the trainer runs (the latent
    shape's tokens, plus each prompt's text for a joint model) splits evenly. The critic scores the
    actor's rows rank by rank, so both split a batch alike."""
    from dmd2_core.data import workflow_conditions
    from dmd2_core.models import FAMILIES, describe_model_dir, transformer_folder

    keys = {"actor": "cp_size", "critic": "cp_size" if args.critic_cp_size is None else "critic_cp_size"}
    sizes = {role: targs.cp_size for role, targs in trainer_args.items()}
    if len(set(sizes.values())) > 1:
        raise ArgsError(f"critic_cp_size: {sizes['critic']} differs from cp_size {sizes['actor']}; the critic takes "
                        "the actor's rollout rows rank by rank, so both groups must split the batch alike")
    for role, targs in trainer_args.items():
        key, cp = keys[role], targs.cp_size
        dp = targs.num_devices // cp
        if targs.global_batch_size % dp:
            raise ArgsError(f"global_batch_size: {targs.global_batch_size} is not divisible by the {role}'s "
                            f"data-parallel size {dp} (num_devices {targs.num_devices} / {key} {cp})")
        if cp == 1:
            continue
        urls = [targs.hf_checkpoint] + ([targs.teacher_checkpoint or targs.hf_checkpoint]
                                        if targs.loss_type == "dmd2_critic" else [])
        # a MiniMax-H3 workflow's condition rows (keyframes, references) lengthen every sequence
        conditions = workflow_conditions(targs.prompts, targs.workflow)
        for url in dict.fromkeys(urls):
            info = describe_model_dir(url, transformer=transformer_folder(targs.workflow))
            config = json.loads(storage.read_text(storage.join(info["transformer_url"], "config.json")))
            family = FAMILIES[info["family"]]
            problem = family.context_parallel_problem(config, cp)
            if problem:
                raise ArgsError(f"{key}: {problem}")
            model = SimpleNamespace(config=SimpleNamespace(**config))
            # every size the trainer runs: the full one, and a size schedule's smaller stages
            smaller = [stage["latent_shape"] for stage in (targs.size_schedule or [])[:-1]]
            for latent_shape in (targs.latent_shape, *smaller):
                sized = targs if latent_shape == targs.latent_shape else targs.model_copy(
                    update={"latent_shape": latent_shape})
                bound = family.bind(latent_shape, model, **conditions)
                shape = bound.sample_shape(model, latent_shape)
                for tokens, source in _split_lengths(bound, config, shape, sized):
                    if tokens % cp:
                        raise ArgsError(f"{key}: {cp} ranks do not split the {tokens}-token sequence of {source}; "
                                        f"choose a cp_size that divides it")


def _split_lengths(family, config, shape, targs: Args):
    """(tokens context parallelism splits, what they come from) for the trainer's sequences."""
    where = f"latent_shape {list(targs.latent_shape or shape)}"
    if getattr(family, "keyframes", 0) or getattr(family, "references", ()):
        where += f" and its {'keyframes' if family.keyframes else 'references'}"
    if "prompt_lengths" not in family.cond_keys:
        yield family.split_tokens(config, shape, 0), where
        return
    sets = [("prompts", targs.prompts)]
    if targs.loss_type == "dmd2_critic" and targs.gan_critic_weight:
        sets.append(("real_data", targs.real_data))
    for name, url in sets:
        lengths = _tensor(url, "prompt_lengths")
        for length in sorted(set(lengths.tolist() if lengths is not None else ())):
            yield family.split_tokens(config, shape, length), f"{where} with a {length}-token prompt of {name} {url}"


_DTYPES = {"I64": "int64", "I32": "int32", "I16": "int16", "U8": "uint8", "F32": "float32"}


def _tensor(url: str, name: str):
    """One (small) tensor of a safetensors file, read alone (a byte range, also on S3); None when
    the file has none of that name."""
    import torch

    entries, data_size = storage.read_safetensors_header(url)
    info = entries.get(name)
    if info is None:
        return None
    start, end = info["data_offsets"]
    fs, path = storage.filesystem(url)

    def read():
        with fs.open(path, "rb") as f:
            f.seek(int(fs.size(path)) - data_size + start)
            return f.read(end - start)
    raw = storage.retrying(read, f"read {url}")
    return torch.frombuffer(bytearray(raw), dtype=getattr(torch, _DTYPES[info["dtype"]])).reshape(info["shape"])


# ---- Ray --------------------------------------------------------------------------------------

def check_ray_address(address: Optional[str], timeout_s: float = 5.0) -> None:
    """An explicit ``host:port`` (or ray://host:port) must accept a TCP connection within
    ``timeout_s``: an unreachable address fails here instead of hanging ray.init."""
    if not address or address in ("auto", "local"):
        return
    target = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ArgsError(f"ray_address: '{address}' is not host:port (e.g. ray-head:6379)")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ArgsError(f"ray_address: cannot reach {address} within {timeout_s:.0f} s ({one_line(exc)})") from None


def bundles_needed(args: Args, num_groups: int) -> int:
    return args.num_devices * (1 if args.colocate else num_groups)


def check_local_devices(args: Args, num_groups: int) -> None:
    """Before a local Ray starts: ``device: cuda`` needs that many visible GPUs."""
    if args.ray_address or args.device != "cuda" or args.resource_name != "GPU":
        return
    import torch

    need, have = bundles_needed(args, num_groups), torch.cuda.device_count()
    if have < need:
        raise ArgsError(f"device: cuda needs {need} GPU(s) for num_devices={args.num_devices}, "
                        f"this machine has {have}; set device: cpu or fewer num_devices")


def check_cluster_resources(args: Args, num_groups: int) -> None:
    """After joining Ray, before a placement group is requested (which would wait out
    ray_timeout_s): the cluster must hold the device resource for every bundle."""
    import ray

    need = bundles_needed(args, num_groups)
    resources = ray.cluster_resources()
    have = resources.get(args.resource_name, 0.0)
    if have < need:
        from dmd2_core.errors import nearest

        known = sorted(k for k in resources if not k.startswith(("node:", "accelerator_type:")))
        key = "device" if args.device_resource is None else "device_resource"
        raise ArgsError(f"{key}: the Ray cluster has {have:g} '{args.resource_name}' of the {need} needed "
                        f"(resources: {', '.join(known)}){nearest(args.resource_name, known)}")

