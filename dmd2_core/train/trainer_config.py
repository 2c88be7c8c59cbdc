"""Per-trainer args: a trainer config list names the run's trainers and what each overrides.

The trainer class is role-agnostic and reads the plain argument names (hf_checkpoint, lr, load,
save, num_steps_per_rollout, loss_type, train_input_hook_path, ...). One Args cannot hold the
actor's and the critic's values at once, so each trainer gets its own validated deep copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dmd2_core.args import Args, replace_args


@dataclass(frozen=True)
class TrainerConfig:
    role: str
    overrides: dict[str, Any] = field(default_factory=dict)


def critic_overrides(args: Args) -> dict[str, Any]:
    """The critic group (fake score + frozen teacher) from the actor's critic_* / dmd2_* flags."""
    return {
        "hf_checkpoint": args.critic_hf_checkpoint or args.hf_checkpoint,
        "teacher_checkpoint": args.teacher_checkpoint or args.hf_checkpoint,
        "lr": args.critic_lr or args.lr,
        # one run, one storage URL: every trainer checkpoints under {save}/trainers/{role}/
        "load": args.load,
        "save": args.save,
        "num_steps_per_rollout": args.dmd2_update_ratio,
        "train_input_hook_path": args.critic_train_input_hook_path,
        "gradient_checkpointing": _default(args.critic_gradient_checkpointing, args.gradient_checkpointing),
        "fsdp_cpu_offload": _default(args.critic_fsdp_cpu_offload, args.fsdp_cpu_offload),
        "cp_size": _default(args.critic_cp_size, args.cp_size),
        "loss_type": "dmd2_critic",
        "ema_decay": None,
        "lora_rank": _default(args.critic_lora_rank, args.lora_rank),
        "lora_alpha": _default(args.critic_lora_alpha, args.lora_alpha),
        "lora_target_modules": _default(args.critic_lora_target_modules, args.lora_target_modules),
        "lora_dropout": _default(args.critic_lora_dropout, args.lora_dropout),
        "export_merged": False,  # the critic is never exported
    }


def _default(value, fallback):
    return fallback if value is None else value


def optimizer_settings(args: Args) -> dict[str, Any]:
    """The AdamW settings a trainer builds its optimizer with (a resume keeps them, not the
    checkpoint's: the rerun's ``lr`` is the fix for a diverging run)."""
    return {"lr": args.lr, "betas": (args.adam_beta1, args.adam_beta2), "weight_decay": args.weight_decay}


def run_origin(args: Args) -> dict[str, Any]:
    """What a trainer's run started from, recorded in each checkpoint: ``load`` (None: the
    teacher's weights) and the model directory it was built from."""
    return {"load": args.load, "hf_checkpoint": args.hf_checkpoint}


def compute_trainer_configs(args: Args) -> list[TrainerConfig]:
    """The run's trainers, in the order their groups train within one iteration."""
    if args.loss_type == "dmd2":
        # The critic trains (and scores) on the actor's rollout before the actor trains.
        return [TrainerConfig("critic", critic_overrides(args)), TrainerConfig("actor")]
    return [TrainerConfig("actor")]


def compute_trainer_args(args: Args, trainer: TrainerConfig) -> Args:
    """A validated deep copy of ``args`` with the trainer's overrides; ``args`` is never changed.
    An override the argument model does not know is rejected (ArgsError)."""
    return replace_args(args, trainer.overrides, f"overrides of trainer '{trainer.role}'")
