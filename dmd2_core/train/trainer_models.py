"""A trainer rank's models from nothing to its filled shards, no process ever holding a whole model.

``TrainerModels(...)`` builds the trained model (fp32 masters) and, for the critic, the frozen
teacher (compute dtype) on the meta device from their configs: cheap, so a rank starts in
seconds. ``shard`` (once the rank is in its process group) casts, checkpoints and shards them
(``parallel.shard_model``), which gives each parameter storage for this rank's shard alone, then
fills the shards (``models.loading``): each rank reads only its rows of each tensor from the
safetensors files (ranged reads on S3, no local copy), the fake score and the teacher from one
read when they are the same checkpoint. On a resume (the run's latest pointer names a checkpoint) the
trained model is not read from the diffusers checkpoint at all: ``Trainer.load`` fills it from the
DCP checkpoint; until then it holds uninitialised memory, and ``check_filled`` refuses to run it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.device_mesh import DeviceMesh

from dmd2_core import parallel
from dmd2_core.models import lora, step_conditioning, transformer_folder
from dmd2_core.args import Args
from dmd2_core.models.loading import build_empty, fill, load_dtype, weight_files


class TrainerModels:
    def __init__(self, args: Args, compute_dtype: torch.dtype, teacher_url: Optional[str] = None,
                 resume: Optional[bool] = None):
        self.args, self.dtype = args, compute_dtype
        self.folder = transformer_folder(args.workflow)  # the repository partition the run distills
        # a LoRA (dmd2_core.models.lora): its frozen base built in the compute dtype, as the teacher is
        loaded = build_empty(args.hf_checkpoint, compute_dtype if args.lora_rank else parallel.MASTER_DTYPE,
                             self.folder)
        loaded.model = step_conditioning.attach_for(lora.attach(loaded.model, args), loaded.family, args)
        self.model, self.family, self.shift, self.modality_shifts = (loaded.model, loaded.family, loaded.shift,
                                                                     loaded.modality_shifts)
        self.teacher_url = teacher_url
        self.teacher = build_empty(teacher_url, compute_dtype, self.folder).model if teacher_url else None
        self.resume = _resuming(args) if resume is None else resume
        self.unfilled: Optional[str] = None
        self.bytes_read = 0

    def shard(self, mesh: DeviceMesh) -> None:
        """Shard both models over ``mesh`` and fill this rank's shards (see the module docstring)."""
        args, keep_fp32 = self.args, self.family.keep_fp32_modules
        parallel.shard_model(self.model, mesh, self.dtype, trainable=True, keep_fp32=keep_fp32,
                             gradient_checkpointing=args.gradient_checkpointing, cpu_offload=args.fsdp_cpu_offload)
        if self.teacher is not None:
            parallel.shard_model(self.teacher, mesh, self.dtype, trainable=False, keep_fp32=keep_fp32,
                                 cpu_offload=args.fsdp_cpu_offload)
        adapters = lora.has_adapters(self.model)  # a LoRA's base is never in the resume checkpoint: always read
        model_dtype = self.dtype if adapters else parallel.MASTER_DTYPE
        model_targets = [] if self.resume and not adapters else [(self.model, load_dtype(self.family.model_class, model_dtype))]
        teacher_targets = []
        if self.teacher is not None:
            teacher_targets = [(self.teacher, load_dtype(self.family.model_class, self.dtype))]
        if self.teacher_url == args.hf_checkpoint:  # one read of each slice for both models
            model_targets, teacher_targets = model_targets + teacher_targets, []
        if model_targets:
            self.bytes_read += fill(model_targets, weight_files(args.hf_checkpoint, self.folder))
        if teacher_targets:
            self.bytes_read += fill(teacher_targets, weight_files(self.teacher_url, self.folder))
        if self.resume:
            self.unfilled = (f"{args.hf_checkpoint}: the trained model was left for the resume checkpoint to fill, "
                             "and no checkpoint was loaded")
        else:
            if adapters:
                lora.init_adapters(self.model, args.seed)
            step_conditioning.init(self.model)

    def resumed(self) -> None:
        """The trained model is being filled from a DCP checkpoint."""
        self.unfilled = None

    def check_filled(self) -> None:
        if self.unfilled:
            raise RuntimeError(self.unfilled)


def _resuming(args: Args) -> bool:
    """Whether the driver will load a checkpoint into this trainer: the run's latest pointer names one
    (``checkpoint.resume_url``, as ``DistillRun.start`` decides)."""
    from dmd2_core import checkpoint
    if not (args.save or args.load):
        return False
    return checkpoint.read_latest(checkpoint.resume_url(args)) is not None
