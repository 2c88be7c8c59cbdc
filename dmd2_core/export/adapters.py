"""The export of a LoRA student: its adapters in the family's diffusers LoRA format, to load onto
the teacher's pipeline; or, merged, a full export (``dmd2_core.export.pipeline``).

Layout of a LoRA export (``{save}/exports/iter_{iteration:07d}/``)::

    pytorch_lora_weights.safetensors         the adapters the project evaluates with (the EMA's
                                             when there is one), ``transformer.<module>.lora_A.weight``
                                             keys and the adapter config (rank, alpha, targets) as
                                             metadata, written by the family's ``save_lora_weights``
    pytorch_lora_weights_online.safetensors  with an EMA only: the trained (online) adapters
    scheduler/                               the student's FlowMatchLCMScheduler (not for families
                                             whose modular pipeline steps the student itself)
    export.json                              written last, after verification

Loading it: the teacher's pipeline, then ``pipe.load_lora_weights(export)`` and, where there is
one, ``pipe.scheduler = FlowMatchLCMScheduler.from_pretrained(export, subfolder="scheduler")``;
sampling as for a full export (``dmd2_core.export.pipeline``). The base is the teacher's checkpoint: it is
never gathered for a LoRA export, only the adapters are (a few MB where the base is 33 B).
"""

from __future__ import annotations

import json
import time
from typing import Optional

import torch

from dmd2_core import parallel, storage
from dmd2_core.models import lora
from dmd2_core.save_layout import EXPORT_MARKER_NAME
from dmd2_core.models import describe_model_dir, transformer_folder
from dmd2_core.errors import ModelDirError
from dmd2_core.export.files import (EXPORT_FORMAT, cast, persistent, staged_export, total_bytes, workflow_entry,
                                    writable_dir)
from dmd2_core.export.scheduler import StudentSteps, verify_written_scheduler, write_scheduler

ONLINE_WEIGHT_NAME = "pytorch_lora_weights_online.safetensors"


def _gather(named, keep: bool, dtype: Optional[torch.dtype]) -> dict[str, torch.Tensor]:
    """Whole tensors on the host, one at a time (a collective for distributed ones)."""
    out = {}
    for name, value in named:
        whole = parallel.full(value).detach()
        if keep:
            out[name] = whole.to("cpu", dtype=dtype if dtype is not None and whole.is_floating_point() else whole.dtype,
                                 copy=True)
    return out


def gather(model: torch.nn.Module, export_dtype: torch.dtype, metadata: dict, ema=None, writer: bool = True,
           merged: bool = False) -> Optional[dict]:
    """The collective half of a LoRA student's export, kept on the ``writer`` rank: the adapters
    (and their EMA) in fp32, ``{'online', 'ema', 'lora': metadata}``; ``merged``: the whole model
    with the adapters merged into the base, cast to ``export_dtype`` (``{'online', 'ema'}``, plain
    diffusers names, which ``pipeline.write_export`` streams to files as it does a full student's)."""
    names = [n for n, _ in lora.trained(model)]
    online = _gather(lora.trained(model), writer, torch.float32)
    averaged = _gather(zip(names, ema), writer, torch.float32) if ema is not None else None
    if merged:
        base = persistent(model, _gather(((n, t) for n, t in model.state_dict().items() if not lora.is_adapter(n)),
                                          writer, None))
        if not writer:
            return None
        return {"online": lora.merged_state({**base, **online}, metadata, export_dtype),
                "ema": lora.merged_state({**base, **averaged}, metadata, export_dtype) if averaged is not None else None}
    if not writer:
        return None
    return {"online": online, "ema": averaged, "lora": metadata}


def write(url: str, family, gathered: dict, *, teacher_url: str, shift: float, num_steps: int,
          export_dtype: torch.dtype, verify: bool = True, iteration: Optional[int] = None,
          started: Optional[float] = None, workflow: str = "t2va", schedule_shifts: Optional[dict] = None) -> dict:
    """The writer's half (no collective): the adapters at ``url`` through the family's
    ``save_lora_weights``, the student's scheduler, a read-back check, export.json last.
    ``schedule_shifts`` (``student_modality_shifts``): the marker says which schedulers to set."""
    started = time.perf_counter() if started is None else started
    teacher = describe_model_dir(teacher_url)
    if teacher["family"] != family.class_name:
        raise ModelDirError(f"{teacher_url}: the teacher is a {teacher['family']}, the student a {family.class_name}")
    metadata, loader = gathered["lora"], lora.lora_loader(family)
    online = cast(lora.diffusers_lora_state(gathered["online"]), export_dtype)
    averaged = cast(lora.diffusers_lora_state(gathered["ema"]), export_dtype) if gathered.get("ema") is not None else None
    files = {lora.LORA_WEIGHT_NAME: averaged if averaged is not None else online,
             **({ONLINE_WEIGHT_NAME: online} if averaged is not None else {})}
    with staged_export(url) as staging:
        size, scheduler, export_s, verify_s = _write_files(staging, family, files, metadata, shift=shift,
                                                           num_steps=num_steps, verify=verify, started=started,
                                                           folder=transformer_folder(workflow))
        marker = {
            "format": EXPORT_FORMAT, "iteration": None if iteration is None else int(iteration),
            **StudentSteps.of(num_steps).marker(shift), "shift": float(shift),
            "dtype": str(export_dtype).removeprefix("torch."), **workflow_entry(family, workflow),
            "lora": {**metadata, "weight_name": lora.LORA_WEIGHT_NAME, "loader": loader.__name__,
                     "note": "load onto the teacher's pipeline: pipe.load_lora_weights(export)",
                     **({"partition": transformer_folder(workflow)} if workflow != "t2va" else {})},
            "transformer": "ema" if averaged is not None else "online",
            "transformer_online": ONLINE_WEIGHT_NAME if averaged is not None else None,
            "scheduler": None if scheduler is None else {
                "class": scheduler[0], **scheduler[1], "note": "set_timesteps(num_steps) gives the student's sigmas"},
            **({"schedule_shifts": schedule_note(schedule_shifts)} if schedule_shifts else {}),
            "teacher": teacher_url, "pipeline": False, "components": [], "bytes": size,
            "export_s": round(export_s, 3), "verified": bool(verify), "verify_s": round(verify_s, 3),
        }
        storage.write_text(storage.join(staging, EXPORT_MARKER_NAME), json.dumps(marker, indent=2) + "\n")
    return {"url": url, "bytes": size, "export_s": export_s, "verify_s": verify_s, "pipeline": False}


def schedule_note(shifts: dict) -> dict:
    """The schedulers a pipeline loaded with these adapters must step the student on."""
    from dmd2_core.models.minimax_h3 import MODALITY_SCHEDULERS

    folders = {MODALITY_SCHEDULERS[m]: float(s) for m, s in shifts.items()}
    calls = "; ".join(f"pipe.{f} = type(pipe.{f}).from_config(pipe.{f}.config, shift={s:g})" for f, s in folders.items())
    return {**folders, "note": f"the student steps on these shifts, not the teacher's: {calls}"}


def _write_files(staging: str, family, files: dict, metadata: dict, *, shift: float, num_steps: int,
                 verify: bool, started: float, folder: str = "transformer") -> tuple[int, Optional[tuple[str, dict]], float, float]:
    """Every file of a LoRA export but its marker, into ``staging``, verified: (bytes, the
    scheduler's (class, config) or None, export_s, verify_s). ``folder``: the partition the
    adapters are for; MiniMax-H3's loader routes a ``transformer_ref.``-keyed file (a ref2va
    student's) into ``transformer_ref``, as two partitions share module names."""
    loader = lora.lora_loader(family)
    with writable_dir(staging) as directory:
        for weight_name, state in files.items():
            loader.save_lora_weights(str(directory), weight_name=weight_name,
                                     **{f"{folder}_lora_layers": state, f"{folder}_lora_adapter_metadata": dict(metadata)})
    scheduler = None
    if not family.modular_pipeline:  # a modular pipeline (MiniMax-H3) steps the student with its own
        with writable_dir(storage.join(staging, "scheduler")) as directory:
            scheduler = write_scheduler(str(directory), shift, num_steps)
    export_s = time.perf_counter() - started
    verify_s = 0.0
    if verify:
        t0 = time.perf_counter()
        for weight_name, state in files.items():
            _verify(storage.join(staging, weight_name), state, folder)
        if scheduler is not None:
            verify_written_scheduler(staging, num_steps, shift)
        verify_s = time.perf_counter() - t0
    return total_bytes(staging), scheduler, export_s, verify_s


def _verify(url: str, expected: dict[str, torch.Tensor], folder: str = "transformer") -> None:
    """The written LoRA file holds every adapter exactly, under diffusers' ``{folder}.`` keys."""
    from safetensors.torch import load

    written = load(storage.read_bytes(url))
    want = {f"{folder}.{k}": v for k, v in expected.items()}
    if set(written) != set(want):
        odd = sorted(set(written) ^ set(want))
        raise ModelDirError(f"{url}: the LoRA file's keys differ from the adapters' (e.g. '{odd[0]}')")
    for key, value in want.items():
        if written[key].dtype != value.dtype or not torch.equal(written[key], value):
            raise ModelDirError(f"{url}: '{key}' differs from the gathered adapter")
