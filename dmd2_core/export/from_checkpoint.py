"""Any checkpoint of a run, exported after the fact (``python -m dmd2_core export``): the student
(the ``actor`` trainer) of ``{load}/trainers/actor/iter_N`` written to ``out`` as

- ``pipeline``: a diffusers pipeline directory (for MiniMax-H3 its modular repository), exactly
  the run's own export at ``export_interval`` (``export.pipeline``; a LoRA merged into its base);
- ``merged``: the student's transformer directory alone (config.json and safetensors), a LoRA
  merged into its base;
- ``lora-diffusers``: the family's diffusers LoRA, as the run's LoRA export (``export.adapters``);
- ``peft``: a peft adapter directory that ``PeftModel.from_pretrained(base, out)`` loads;
- ``original``: the family's original (non-diffusers) LoRA layout, where diffusers converts it
  back (``export.lora_layouts.ORIGINAL_LAYOUTS``), in ``pytorch_lora_weights.safetensors``.

The weights are the EMA's where the checkpoint keeps one (``pipeline`` and ``lora-diffusers`` also
write the trained ones beside them, as the run does). Everything is decided before a weight is
read (``plan_export``): a bad format, a missing iteration, a format the checkpoint cannot give
is one line. Full weights stream tensor by tensor from the checkpoint's shards into the files
(``checkpoint.tensors``, ``export.stream``); a LoRA's base streams from the teacher's files.
``out`` is written beside itself and swapped in once complete (``files.staged_export``), so it
is never half-written; an existing ``out`` is replaced only when it is an export (has export.json),
never inside the save's checkpoints or its own exports; a symlinked ``out`` is resolved first.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import torch

from dmd2_core import storage
from dmd2_core.args import Args
from dmd2_core.checkpoint.integrity import check_files, read_current_marker
from dmd2_core.checkpoint.retention import saved_iterations
from dmd2_core.checkpoint.state import read_trainer_state
from dmd2_core.checkpoint.tensors import CheckpointTensors, dcp_sections
from dmd2_core.errors import ArgsError, CheckpointError, nearest
from dmd2_core.export import adapters, lora_layouts, pipeline, stream
from dmd2_core.export.files import (EXPORT_FORMAT, is_marked, resolved, staged_export, swap_record_url, total_bytes,
                                    writable_dir)
from dmd2_core.export.scheduler import StudentSteps, student_scheduler
from dmd2_core.models import FAMILIES, base_identity, describe_model_dir, lora, transformer_folder
from dmd2_core.models.weight_files import WeightFiles
from dmd2_core.save_layout import EXPORT_MARKER_NAME, STATE_FILES, exports_root, trainer_dir

FORMATS = ("pipeline", "merged", "lora-diffusers", "peft", "original")
LORA_FORMATS = ("lora-diffusers", "peft", "original")
STUDENT = "actor"
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ExportPlan:
    """What ``export_checkpoint`` writes, all of it read from small files (no weights)."""
    load: str
    iteration: int
    out: str
    format: str
    family: object
    teacher: str
    config: dict  # the transformer's config.json
    lora: Optional[dict]  # adapter_metadata of a LoRA student; None: full weights
    has_ema: bool
    num_steps: StudentSteps  # the step counts the student serves and its sampler
    shift: float
    dtype: torch.dtype
    workflow: str = "t2va"  # what the student was distilled on (MiniMax-H3's workflows), as its run records it
    schedule_shifts: Optional[dict] = None  # the shifts the student steps on where not the schedulers' (its run's)


def plan_export(load: str, out: str, export_format: str, iteration: Optional[int] = None,
                hf_checkpoint: Optional[str] = None, num_steps: Optional[int] = None, shift: Optional[float] = None,
                dtype: Optional[str] = None) -> ExportPlan:
    """Every check before a weight is read; ArgsError or CheckpointError, one line, if one fails."""
    if export_format not in FORMATS:
        raise ArgsError(f"format: unknown format '{export_format}' (one of {', '.join(FORMATS)})"
                        f"{nearest(export_format, FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise ArgsError(f"dtype: '{dtype}' is not one of {', '.join(DTYPES)}{nearest(dtype, DTYPES)}")
    iteration = pick_iteration(load, iteration)
    d = trainer_dir(load, STUDENT, iteration)
    check_files(d, read_current_marker(d), hashes=STATE_FILES)  # listing, sizes, the small files' hashes
    record = (read_trainer_state(load, STUDENT, iteration).get("extra") or {}).get("run") or {}
    sections = dcp_sections(load, STUDENT, iteration)
    is_lora = any(lora.is_adapter(n) for n in sections.get("model", {}))
    where = f"the checkpoint at {d}"
    if export_format in LORA_FORMATS and not is_lora:
        raise ArgsError(f"format: {export_format} is a LoRA format and {where} holds full weights (no LoRA); "
                        "use pipeline or merged")
    teacher = hf_checkpoint or record.get("hf_checkpoint")
    if not teacher:
        raise ArgsError(f"hf_checkpoint: {where} does not record its model directory; set --hf-checkpoint")
    folder = transformer_folder((record.get("student") or {}).get("workflow") or "t2va")  # the partition trained
    info = describe_model_dir(teacher, "hf_checkpoint", folder)
    family = FAMILIES[info["family"]]
    config = json.loads(storage.read_text(storage.join(info["transformer_url"], "config.json")))
    metadata = None
    if is_lora:
        if not record.get("lora"):
            raise CheckpointError(f"{d}: holds LoRA adapters but records no LoRA settings (rank, alpha, targets)")
        metadata = lora.metadata_of_record(record["lora"])
        if record.get("base") and base_identity(teacher, folder) != record["base"]:
            raise ArgsError(f"hf_checkpoint: {teacher} is not the base the adapters of {where} were trained on "
                            f"({record.get('hf_checkpoint')}); point --hf-checkpoint at that base")
    if export_format == "original":
        _check_original(family.class_name, lora_layouts.adapted_modules(sections["model"]))
    if not is_lora:
        _check_fits(d, family, config, sections["model"])
    out = _check_out(out, load)
    student = record.get("student") or {}
    if num_steps is None:
        num_steps = student.get("num_steps") or Args.model_fields["dmd2_student_steps"].default
    if shift is None:
        shift = student.get("shift") or info["shift"]
    num_steps, shift = StudentSteps.of(num_steps, student.get("euler", family.deterministic_student)), float(shift)
    try:
        student_scheduler(shift, num_steps)
    except ValueError as exc:
        raise ArgsError(f"num_steps / shift: {exc}") from None
    return ExportPlan(load=load, iteration=iteration, out=out, format=export_format, family=family, teacher=teacher,
                      config=config, lora=metadata, has_ema="ema" in sections, num_steps=num_steps, shift=shift,
                      dtype=getattr(torch, dtype or student.get("export_dtype") or "float32"),
                      workflow=student.get("workflow") or "t2va", schedule_shifts=student.get("modality_shifts"))


def pick_iteration(load: str, iteration: Optional[int]) -> int:
    """The student's newest complete checkpoint, or ``iteration`` when it has one there;
    CheckpointError naming the nearest complete ones if not."""
    complete = sorted(i for i, whole in saved_iterations(load, STUDENT).items() if whole)
    root = storage.join(load, "trainers", STUDENT)
    if not complete:
        if not storage.exists(load):
            raise CheckpointError(f"load: no complete checkpoint of the student at {load} (no such path)"
                                  f"{storage.nearest_sibling(load)}")
        raise CheckpointError(f"load: no complete checkpoint of the student at {root} (is --load the run's save URL?)")
    if iteration is None:
        return complete[-1]
    if iteration not in complete:
        below, above = [i for i in complete if i < iteration], [i for i in complete if i > iteration]
        close = below[-1:] + above[:1]  # the nearest on each side
        raise CheckpointError(f"iteration: {trainer_dir(load, STUDENT, iteration)}: no complete checkpoint at "
                              f"iteration {iteration}; nearest: {', '.join(map(str, close))}")
    return iteration


def _check_original(class_name: str, modules: list[str]) -> None:
    if class_name not in lora_layouts.ORIGINAL_LAYOUTS:
        known = ", ".join(FAMILIES[c].pipeline_class for c in lora_layouts.ORIGINAL_LAYOUTS)
        raise ArgsError(f"format: diffusers documents no original (non-diffusers) LoRA layout for {class_name} "
                        f"(only {known}); use lora-diffusers or peft")
    odd = lora_layouts.unmapped_module(class_name, modules)
    if odd is not None:
        raise ArgsError(f"format: the adapter on '{odd}' has no name in {class_name}'s original layout that diffusers "
                        "converts back; use lora-diffusers or peft")


def _check_fits(d: str, family, config: dict, saved: dict) -> None:
    """A full student's saved tensors are the family's model's, name for name and shape for shape."""
    with torch.device("meta"):
        wanted = {k: tuple(v.shape) for k, v in family.model_class.from_config(config).state_dict().items()}
    for name in sorted(set(wanted) | set(saved)):
        if wanted.get(name) != (saved[name][0] if name in saved else None):
            raise CheckpointError(f"{d}: '{name}' does not fit the model directory's {family.class_name} "
                                  f"(checkpoint {saved.get(name, (None,))[0]}, model {wanted.get(name)})")


def _check_out(out: str, load: str) -> str:
    """``out`` resolved (a symlink's target: the export is swapped in where its files are), once it
    is neither in the save's checkpoints or its own exports (retention deletes and replaces what is
    there) nor a directory that is not an export (an export whose swap a kill interrupted is one)."""
    where = resolved(out)
    save = resolved(load)
    for owned, what in ((storage.join(save, "trainers"), "the save's checkpoints"),
                        (exports_root(save), "the run's own exports, which the run replaces and retention deletes")):
        if where == owned or where.startswith(owned + "/"):
            shown = out if where == out.rstrip("/") else f"{out} (that is {where})"
            raise ArgsError(f"out: {shown} is inside {owned}, {what}; pick a path outside {owned}")
    if (storage.exists(where) and storage.list_names(where) and not is_marked(where)
            and not storage.exists(swap_record_url(where))):
        raise ArgsError(f"out: {out} exists and is not an export (no {EXPORT_MARKER_NAME}); pick a new path")
    return where


# ---- writing ------------------------------------------------------------------------------------
def export_checkpoint(plan: ExportPlan) -> dict:
    """Write ``plan``'s export; returns {'out', 'format', 'iteration', 'bytes', 'export_s'}."""
    started = time.perf_counter()
    if plan.lora is not None:
        online = dict(CheckpointTensors(plan.load, STUDENT, plan.iteration, "model"))  # adapters: small
        ema = dict(CheckpointTensors(plan.load, STUDENT, plan.iteration, "ema")) if plan.has_ema else None
    else:
        online = CheckpointTensors(plan.load, STUDENT, plan.iteration, "model")
        ema = _Overlay(CheckpointTensors(plan.load, STUDENT, plan.iteration, "ema"), online) if plan.has_ema else None
    if plan.format == "lora-diffusers":
        adapters.write(plan.out, plan.family, {"online": online, "ema": ema, "lora": plan.lora}, teacher_url=plan.teacher,
                       shift=plan.shift, num_steps=plan.num_steps, export_dtype=plan.dtype, iteration=plan.iteration,
                       workflow=plan.workflow, schedule_shifts=plan.schedule_shifts)
    elif plan.format in ("peft", "original"):
        _write_adapter_layout(plan, ema if ema is not None else online)
    else:
        model = _meta_model(plan)
        if plan.lora is not None:  # merged into the base, tensor by tensor
            files = WeightFiles(describe_model_dir(plan.teacher, transformer=transformer_folder(plan.workflow))
                                ["transformer_url"])
            names = list(model.state_dict())
            online = lora_layouts.MergedTensors(files, names, online, plan.lora)
            ema = lora_layouts.MergedTensors(files, names, ema, plan.lora) if ema is not None else None
        if plan.format == "pipeline":
            staged = pipeline.stream_student(plan.out, model, plan.dtype, values={"online": online, "ema": ema},
                                             folder=transformer_folder(plan.workflow))
            pipeline.write_export(plan.out, model, staged, teacher_url=plan.teacher, shift=plan.shift,
                                  num_steps=plan.num_steps, export_dtype=plan.dtype, iteration=plan.iteration,
                                  started=started, workflow=plan.workflow, schedule_shifts=plan.schedule_shifts)
        else:
            _write_transformer(plan, model, ema if ema is not None else online)
    return {"out": plan.out, "format": plan.format, "iteration": plan.iteration, "bytes": total_bytes(plan.out),
            "export_s": round(time.perf_counter() - started, 3)}


def _meta_model(plan: ExportPlan) -> torch.nn.Module:
    with torch.device("meta"):
        return plan.family.model_class.from_config(plan.config)


def _write_transformer(plan: ExportPlan, model: torch.nn.Module, tensors) -> None:
    with staged_export(plan.out) as staging:
        with writable_dir(staging) as directory:
            streamed = stream.stream_tensors(tensors, plan.dtype, directory, stream.non_persistent(model))
            stream.write_config(plan.family, model.config, directory)
        stream.verify_streamed(staging, plan.family, streamed)
        _write_marker(staging, plan, {"weights": sorted({entry.file for entry in streamed.entries})})


def _write_adapter_layout(plan: ExportPlan, adapter_state: dict) -> None:
    from safetensors.torch import save_file

    with staged_export(plan.out) as staging:
        with writable_dir(staging) as directory:
            if plan.format == "peft":
                state = {k: v.to(plan.dtype).contiguous() for k, v in lora_layouts.peft_state(adapter_state).items()}
                save_file(state, str(directory / lora_layouts.PEFT_WEIGHT_NAME), metadata={"format": "pt"})
                lora_layouts.peft_config(plan.lora, plan.teacher).save_pretrained(str(directory))
                files = {"weights": [lora_layouts.PEFT_WEIGHT_NAME], "config": lora_layouts.PEFT_CONFIG_NAME}
            else:
                state = lora_layouts.original_state(plan.family.class_name, adapter_state, plan.lora, plan.dtype)
                save_file(state, str(directory / lora.LORA_WEIGHT_NAME), metadata={"format": "pt"})
                lora_layouts.check_original(str(directory), lora.lora_loader(plan.family), adapter_state, plan.lora,
                                            plan.dtype)
                files = {"weights": [lora.LORA_WEIGHT_NAME], "loader": lora.lora_loader(plan.family).__name__}
        _write_marker(staging, plan, files)


def _write_marker(staging: str, plan: ExportPlan, files: dict) -> None:
    marker = {"format": EXPORT_FORMAT, "layout": plan.format, "iteration": plan.iteration, "checkpoint": plan.load,
              "teacher": plan.teacher, **plan.num_steps.marker(plan.shift), "shift": plan.shift,
              "dtype": str(plan.dtype).removeprefix("torch."), "transformer": "ema" if plan.has_ema else "online",
              "lora": plan.lora, **files, "bytes": total_bytes(staging),
              **({"schedule_shifts": adapters.schedule_note(plan.schedule_shifts)} if plan.schedule_shifts else {})}
    storage.write_text(storage.join(staging, EXPORT_MARKER_NAME), json.dumps(marker, indent=2) + "\n")


class _Overlay(Mapping):
    """A full student's EMA: its parameters' averages over the model section (the buffers)."""

    def __init__(self, ema: CheckpointTensors, model: CheckpointTensors):
        self.ema, self.model = ema, model
        self.specs = {n: ema.specs.get(n, spec) for n, spec in model.specs.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.ema[name] if name in self.ema.specs else self.model[name]

    def __iter__(self):
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)
