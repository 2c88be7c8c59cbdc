"""Student export: the distilled few-step student as a diffusers directory people can load.

Layout of one export (``{save}/exports/iter_{iteration:07d}/``, any fsspec URL)::

    model_index.json      the teacher's, transformer and scheduler entries updated (a bare
                          teacher: transformer + scheduler only, as save_model_dir writes it)
    transformer/          the weights the project evaluates with: the EMA when there is one,
                          else the trained weights, cast to the export dtype
    transformer_online/   with an EMA only: the trained (online) weights; not in model_index.json
    scheduler/            FlowMatchLCMScheduler, configured so set_timesteps(K) gives the
                          student's K sigmas (see ``export.scheduler.student_scheduler_config``)
    vae/, text_encoder/, tokenizer/, ...   the teacher's other components, copied file by file
    export.json           written last, after verification: the marker of a complete export

``DiffusionPipeline.from_pretrained(export)`` then builds the teacher's pipeline class (e.g.
WanPipeline) with the student inside. What a diffusers pipeline reproduces of the project's own
samples (``dmd2.eval_samples``), checked in tests/test_export.py on the Wan stand-in:

- the sigmas: WanPipeline (like most) calls ``scheduler.set_timesteps(num_inference_steps)``
  with no sigmas; with the scheduler config written here that gives the student's K sigmas
  (to float32 rounding), so ``num_inference_steps=K`` is the student's sampler. Calling
  ``set_timesteps(sigmas=[1, .75, .5, .25])`` on an exported scheduler is *wrong*: it would
  warp the given sigmas with the solved shift and terminal stretch.
- the noise: WanPipeline (diffusers 0.42) draws its initial latents from ``generator`` but
  calls ``scheduler.step(...)`` without it, so FlowMatchLCMScheduler's re-noising draws come
  from torch's global RNG. A pipeline call reproduces ``eval_samples(seed)`` (to 1e-5, float32,
  CPU) when the global RNG is seeded and no generator is passed: ``torch.manual_seed(seed);
  pipe(..., generator=None)`` draws the latents and then every step's noise from one CPU
  generator, in the order eval_samples draws them from ``torch.Generator().manual_seed(seed)``.
  With ``generator=torch.Generator().manual_seed(seed)`` only K=1 matches (its last step's
  noise is multiplied by sigma 0). On CUDA the global RNG is the device's: the draws differ.
- guidance: ``guidance_scale=1.0`` (no CFG branch), the student being conditional only.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import time
from pathlib import Path
from typing import Optional

import torch

from dmd2_core import flow_matching as fm
from dmd2_core import storage
from dmd2_core.export import adapters, stream
from dmd2_core.export.files import (EXPORT_FORMAT, LocalStaging, new_staging_url, resolved, staged_export, total_bytes,
                                    workflow_entry, writable_dir)
from dmd2_core.save_layout import EXPORT_MARKER_NAME
from dmd2_core.models import describe_model_dir, family_of, transformer_folder
from dmd2_core.errors import ModelDirError, StorageUnavailableError, one_line
from dmd2_core.export.scheduler import StudentSteps, student_scheduler, verify_written_scheduler, write_scheduler

ONLINE_DIR = "transformer_online"
MODULAR_INDEX = "modular_model_index.json"


# ---- the export ------------------------------------------------------------------------------
def export_student(
    url: str,
    model: torch.nn.Module,
    *,
    teacher_url: str,
    shift: float,
    num_steps: int,
    export_dtype: torch.dtype,
    ema=None,
    writer: bool = True,
    verify: bool = True,
    iteration: Optional[int] = None,
    run_write=None,
    lora_metadata: Optional[dict] = None,
    merged: bool = False,
    workflow: str = "t2va",
    schedule_shifts: Optional[dict] = None,
):
    """Export the student ``model`` (possibly FSDP2-sharded; ``ema``: its EMA tensors in
    parameter order, sharded like it) to ``url`` as a diffusers directory (layout in the module
    docstring). A collective: every rank of the trainer group calls it; the whole weights are
    gathered tensor by tensor and the ``writer`` rank writes each into its safetensors file as it
    arrives (``export.stream``: a local staging directory, uploaded after for an object store),
    so it never holds the model whole; the others return None.

    The export is written beside ``url`` and swapped in once complete (``files.staged_export``;
    on an object store with nothing at ``url``, straight at it, export.json last): whatever is at
    ``url`` stays whole until then, a failed export leaves it as it was. ``verify``
    reads every written tensor back, one at a time, and compares it with the checksum taken as it
    was gathered, and checks the names and shapes against the family's model class (built on the
    meta device) and the dtypes against ``export_dtype``; a mismatch raises ModelDirError naming
    the path, and export.json is not written.

    Returns {"url", "bytes" (all files), "export_s" (gather + write), "verify_s", "pipeline"
    (True when the teacher is a pipeline-style checkpoint whose other components were copied)}.
    ``run_write``: how the writer's rest (no collective: the other components, verification, the
    marker) runs, given it as a function of no arguments; its return value is returned instead
    (the trainer runs it in a background thread and gets a future). A LoRA student
    (``lora_metadata``: ``lora.adapter_metadata``) is written in the family's diffusers LoRA format
    (``dmd2_core.export.adapters``), or with ``merged`` merged into its base as a full export (that
    one merges on the writer's host: the merged model whole, once). ``workflow``: what the student
    was distilled on (MiniMax-H3's t2va or fl2va), recorded in export.json for the pipeline call
    that serves it (``workflow_entry``). ``schedule_shifts``: the schedule shift per modality the
    student steps on where it is not the teacher's scheduler's (``student_modality_shifts``),
    written into the export's schedulers.
    """
    started = time.perf_counter()
    if not family_of(model).modular_pipeline:
        student_scheduler(shift, num_steps)  # fails alike on every rank, before the gather
    if lora_metadata is not None:
        staged = adapters.gather(model, export_dtype, lora_metadata, ema=ema, writer=writer, merged=merged)
    else:
        staged = stream_student(url, model, export_dtype, ema=ema, writer=writer, folder=transformer_folder(workflow))
    if staged is None:
        return None
    write = functools.partial(write_export, url, model, staged, teacher_url=teacher_url, shift=shift,
                              num_steps=num_steps, export_dtype=export_dtype, verify=verify, iteration=iteration,
                              started=started, workflow=workflow, schedule_shifts=schedule_shifts)
    return write() if run_write is None else run_write(write)


def stream_student(url: str, model: torch.nn.Module, export_dtype: torch.dtype, ema=None,
                   writer: bool = True, values: Optional[dict] = None, folder: str = "transformer") -> Optional[dict]:
    """The collective half of a full export: the transformer (the EMA when there is one, then the
    trained weights as transformer_online; ``folder``: the repository partition the student is,
    ``transformer_ref`` for MiniMax-H3's ref2va, its online weights then ``transformer_ref_online``)
    streamed, tensor by tensor, into the writer's staging
    beside ``url`` (a local directory; for an object store a ``files.LocalStaging``, uploaded by
    ``write_export``). ``values``: whole states instead ({'online', 'ema'}: a merged LoRA's; no
    collective). Returns, on the writer, what ``write_export`` finishes ({'staging' (None for an
    object store: ``files.staged_export`` picks it), 'local', 'held' (the LocalStaging or None),
    'streamed': {directory: StreamedTransformer}}); None elsewhere."""
    skip = frozenset(stream.non_persistent(model))
    if values is not None:
        parts = {folder: values.get("ema") or values["online"],
                 **({online_dir(folder): values["online"]} if values.get("ema") else {})}
    else:
        parts = {folder: stream.model_tensors(model, ema),
                 **({online_dir(folder): stream.model_tensors(model)} if ema is not None else {})}
    staging = local = held = None
    if writer and storage.is_local(url):
        staging = new_staging_url(resolved(url))
        local = Path(storage.filesystem(staging)[1])
    elif writer:  # staged_export picks where it goes: straight to url when nothing is there
        held = LocalStaging()
        local = held.path
    try:
        streamed = {name: stream.stream_tensors(tensors, export_dtype, local / name if writer else None, skip)
                    for name, tensors in parts.items()}
    except BaseException:
        if writer:
            shutil.rmtree(local, ignore_errors=True)
            if held is not None:
                held.remove()
        raise
    return {"staging": staging, "local": local, "held": held, "streamed": streamed} if writer else None


def write_export(url: str, model: torch.nn.Module, staged: dict, *, teacher_url: str, shift: float,
                 num_steps: int, export_dtype: torch.dtype, verify: bool = True, iteration: Optional[int] = None,
                 started: Optional[float] = None, workflow: str = "t2va", schedule_shifts: Optional[dict] = None) -> dict:
    """The writer's half of an export (no collective: it may run in a background thread): from
    ``stream_student``'s staging (or a LoRA's gathered adapters, or a merged LoRA's whole
    states), the transformers' configs, the rest of the pipeline, verification, export.json last,
    then the swap into ``url``."""
    started = time.perf_counter() if started is None else started
    family = family_of(model)
    if staged.get("lora") is not None:  # the adapters alone, in the family's diffusers LoRA format
        return adapters.write(url, family, staged, teacher_url=teacher_url, shift=shift, num_steps=num_steps,
                              export_dtype=export_dtype, verify=verify, iteration=iteration, started=started,
                              workflow=workflow, schedule_shifts=schedule_shifts)
    if "streamed" not in staged:  # a merged LoRA's whole states
        staged = stream_student(url, model, export_dtype, values=staged)
    try:
        with staged_export(url, staging=staged["staging"]) as staging:
            teacher = describe_model_dir(teacher_url)
            if teacher["family"] != family.class_name:
                raise ModelDirError(f"{teacher_url}: the teacher is a {teacher['family']}, the student a "
                                    f"{family.class_name}")
            for name in staged["streamed"]:
                stream.write_config(family, model.config, staged["local"] / name)
                if not storage.is_local(staging):
                    storage.upload_dir(staged["local"] / name, storage.join(staging, name))
            marker = _finish(staging, model, family, teacher, staged["streamed"], teacher_url=teacher_url, shift=shift,
                             num_steps=num_steps, export_dtype=export_dtype, verify=verify, iteration=iteration,
                             started=started, workflow=workflow, schedule_shifts=schedule_shifts)
    finally:
        if staged.get("held") is not None:  # the local staging of an object store's export
            staged["held"].remove()
    return {"url": url, "bytes": marker["bytes"], "export_s": marker["export_s"], "verify_s": marker["verify_s"],
            "pipeline": marker["pipeline"]}


def _finish(staging: str, model, family, teacher: dict, streamed: dict, *, teacher_url: str, shift: float,
            num_steps: int, export_dtype: torch.dtype, verify: bool, iteration: Optional[int], started: float,
            workflow: str = "t2va", schedule_shifts: Optional[dict] = None) -> dict:
    """Beside the streamed transformers in ``staging``: the scheduler (or the teacher's modular
    index), the teacher's other components, the index, verification, then export.json."""
    modular = family.modular_pipeline  # the teacher's own (modular) pipeline steps the student
    steps = StudentSteps.of(num_steps)
    if modular:
        index, components = _modular_index(teacher_url, transformer_folder(workflow))
        storage.write_text(storage.join(staging, MODULAR_INDEX), json.dumps(index, indent=2) + "\n")
    else:
        with writable_dir(storage.join(staging, "scheduler")) as directory:
            scheduler_class, scheduler_config = write_scheduler(str(directory), shift, steps)
        index, components = _pipeline_index(teacher_url, teacher, family, scheduler_class)
        storage.write_text(storage.join(staging, "model_index.json"), json.dumps(index, indent=2) + "\n")
    for name in components:
        _copy_tree(storage.join(teacher_url, name), storage.join(staging, name))
    if modular:
        _student_schedulers(staging, schedule_shifts)
    export_s = time.perf_counter() - started
    verify_s = 0.0
    if verify:
        t0 = time.perf_counter()
        for name, transformer in streamed.items():
            stream.verify_streamed(storage.join(staging, name), family, transformer)
        if not modular:
            verify_written_scheduler(staging, num_steps, shift)
        verify_s = time.perf_counter() - t0
    online = online_dir(transformer_folder(workflow))
    averaged = online in streamed
    marker = {
        "format": EXPORT_FORMAT, "iteration": None if iteration is None else int(iteration),
        **steps.marker(shift), "shift": float(shift),
        "dtype": str(export_dtype).removeprefix("torch."),
        "transformer": "ema" if averaged else "online", "transformer_online": online if averaged else None,
    }
    if modular:  # its schedulers stay the teacher's: num_inference_steps = K + 1 steps the student's K sigmas
        counts = steps.counts
        one = len(counts) == 1
        marker.update(**workflow_entry(family, workflow),
                      num_inference_steps=counts[0] + 1 if one else [k + 1 for k in counts],
                      shift=float(family.fixed_shift or 1.0),
                      sigmas=steps.per_count(lambda k: fm.student_sigmas(k, 1.0)),
                      modality_sigmas=_modality_sigmas(staging, steps),
                      scheduler={"note": "the teacher's schedulers; run the pipeline with num_inference_steps = "
                                         + (f"{counts[0] + 1}" if one else f"K + 1 for K in {list(counts)}")})
    else:
        marker["scheduler"] = {"class": scheduler_class, **scheduler_config,
                               "note": "set_timesteps(num_steps) gives the student's sigmas; do not pass sigmas="}
    marker.update(teacher=teacher_url, pipeline=modular or teacher["transformer_url"] != teacher_url,
                  components=components, bytes=total_bytes(staging), export_s=round(export_s, 3),
                  verified=bool(verify), verify_s=round(verify_s, 3))
    storage.write_text(storage.join(staging, EXPORT_MARKER_NAME), json.dumps(marker, indent=2) + "\n")
    return marker


def online_dir(folder: str) -> str:
    """Where an export keeps the trained weights beside its EMA ``folder``."""
    return ONLINE_DIR if folder == "transformer" else f"{folder}_online"


def _modular_index(teacher_url: str, folder: str = "transformer") -> tuple[dict, list[str]]:
    """A student of a model whose sampler is its modular pipeline's (MiniMax-H3): the teacher's
    repository with the student's transformer in ``folder``, the partition it distilled (the
    other is not exported: a ref2va student serves ref2va; a t2va or fl2va one, those). Its
    schedulers stay the teacher's: the pipeline run
    with ``num_inference_steps = K + 1`` steps exactly the student's K sigmas of both modalities
    (the grid ``linspace(1, 0, K + 1)`` through each scheduler's shift), with the student's
    deterministic steps; ``ModularPipeline.from_pretrained(url)`` loads it. Returns the export's
    modular index and the teacher's folders to copy."""
    index_url = storage.join(teacher_url, MODULAR_INDEX)
    try:
        index = json.loads(storage.read_text(index_url))
    except StorageUnavailableError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ModelDirError(f"{index_url}: unreadable ({one_line(exc)})") from None
    components = []
    for key, value in index.items():
        spec = value[2] if isinstance(value, list) and len(value) == 3 and isinstance(value[2], dict) else None
        if key.startswith("_") or spec is None or key in ("transformer", "transformer_ref"):
            continue  # the student is one partition; the other is not distilled
        component = spec.get("subfolder") or key
        if value[0] is not None and storage.exists(storage.join(teacher_url, component)):
            components.append(component)
    index.pop("transformer_ref" if folder == "transformer" else "transformer", None)
    return index, components


def _student_schedulers(staging: str, shifts: Optional[dict]) -> None:
    """The copied schedulers at the shifts the student steps on (``student_modality_shifts``), so
    the pipeline steps it as it trained."""
    from dmd2_core.models.minimax_h3 import MODALITY_SCHEDULERS

    for modality, value in (shifts or {}).items():
        path = storage.join(staging, MODALITY_SCHEDULERS[modality], "scheduler_config.json")
        config = json.loads(storage.read_text(path))
        storage.write_text(path, json.dumps({**config, "shift": float(value)}, indent=2) + "\n")


def _modality_sigmas(staging: str, steps: StudentSteps):
    """Each modality's K sigmas through its scheduler's shift (the configs read once), per K."""
    from dmd2_core.models.minimax_h3 import MODALITY_SCHEDULERS

    shifts = {name: json.loads(storage.read_text(storage.join(staging, name, "scheduler_config.json")))["shift"]
              for name in MODALITY_SCHEDULERS.values()}

    def at(num_steps: int) -> dict[str, list[float]]:
        base = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float32)
        return {name: [float(s) for s in shift * base / (1 + (shift - 1) * base)][:-1] for name, shift in shifts.items()}

    return steps.per_count(at)


# ---- helpers ---------------------------------------------------------------------------------
def _pipeline_index(teacher_url: str, teacher: dict, family, scheduler_class: str) -> tuple[dict, list[str]]:
    """The export's model_index.json and the teacher components to copy along."""
    import diffusers

    student = {"transformer": ["diffusers", family.class_name], "scheduler": ["diffusers", scheduler_class]}
    if teacher["transformer_url"] == teacher_url:  # a bare transformer directory
        return {"_class_name": family.pipeline_class, "_diffusers_version": diffusers.__version__, **student}, []
    index_url = storage.join(teacher_url, "model_index.json")
    try:
        index = json.loads(storage.read_text(index_url))
        if not isinstance(index, dict):
            raise ValueError("not a JSON object")
    except StorageUnavailableError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ModelDirError(f"{index_url}: unreadable ({one_line(exc)})") from None
    components = []
    for key, value in list(index.items()):
        if key.startswith("_") or key in student or not _is_component(value):
            continue
        if re.fullmatch(r"transformer_\d+", key):  # a second expert (Wan 2.2): the student is one model
            index[key] = [None, None]
            if "boundary_ratio" in index:
                index["boundary_ratio"] = None
            continue
        if not storage.exists(storage.join(teacher_url, key)):
            raise ModelDirError(f"{storage.join(teacher_url, key)}: listed in model_index.json but missing")
        components.append(key)
    index.update(student)
    return index, components


def _is_component(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value)


def _copy_tree(src: str, dst: str) -> None:
    """Copy a directory file by file: locally, server-side within one object store, else
    through a local copy."""
    src_fs, src_path = storage.filesystem(src)
    dst_fs, dst_path = storage.filesystem(dst)
    if storage.is_local(src) and storage.is_local(dst):
        shutil.copytree(src_path, dst_path, dirs_exist_ok=True)
    elif storage.is_local(dst):
        storage.download_dir(src, dst_path)
    elif storage.is_local(src):
        storage.upload_dir(src_path, dst)
    elif type(src_fs) is type(dst_fs):
        root = src_path.rstrip("/")
        for file in storage.retrying(lambda: storage.filesystem(src)[0].find(root), f"list {src}"):
            target = f"{dst_path.rstrip('/')}/{file[len(root):].lstrip('/')}"
            storage.retrying(lambda: storage.filesystem(src)[0].copy(file, target), f"copy {src}")
    else:
        with storage.local_copy(src) as local:
            storage.upload_dir(local, dst)


