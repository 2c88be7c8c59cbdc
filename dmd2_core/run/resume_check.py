"""Resume is explicit: what a checkpoint recorded of the run that wrote it (``trainer_state.pt``'s
``extra['run']``: ``load``, the model directory, a LoRA's adapters and base identity) against what
a (re)start asks, before any actor.

- A save URL that holds a checkpoint resumes it (a crash rerun) when the run asks for the same
  start (``load``, ``hf_checkpoint``); asked for another, it is refused in one line naming both
  (silently winning over ``load`` would train something other than what was asked).
- A LoRA checkpoint loads only onto the base it was trained on, with the same rank, alpha and
  targets; otherwise one line naming the key and both values.
- A fake score told the step count (``dmd2_critic_step_conditioning``) holds one vector (and GAN
  head) per K of the set it was saved with: it resumes only with that set and the flag on, and a
  fake score without them only with the flag off or one K; otherwise one line naming the key.
- The optimizer settings (lr, betas, weight decay) are the run's own, not the checkpoint's;
  ``resumed_with`` lists the ones that differ, for the log and the summary.
"""

from __future__ import annotations

from typing import Optional

from dmd2_core.args import Args
from dmd2_core.checkpoint.state import changed_optimizer_settings, read_trainer_state
from dmd2_core.errors import ArgsError
from dmd2_core.models import base_identity, lora, step_conditioning, transformer_folder
from dmd2_core.train.trainer_config import optimizer_settings

ADAPTER_KEYS = {"rank": "lora_rank", "alpha": "lora_alpha", "targets": "lora_target_modules"}


def check_resume(args: Args, trainer_args: dict[str, Args], source: str, iteration: int) -> None:
    """Raise ArgsError when the checkpoint at ``source`` (``iteration``) is not what this run
    asks to start from (see the module docstring)."""
    for role, targs in trainer_args.items():
        state = read_trainer_state(source, role, iteration)
        record = (state.get("extra") or {}).get("run")
        where = f"the checkpoint at {source} ({role}, iteration {iteration})"
        if source == args.save:
            _check_origin(args, targs, record, where)
        if record is not None:
            _check_adapters(role, targs, record, where)
        if role == "critic":
            _check_step_vectors(targs, state.get("param_groups") or [], record, where)


def _check_origin(args: Args, targs: Args, record: Optional[dict], where: str) -> None:
    if args.load and args.load != args.save and (record or {}).get("load") != args.load:
        started = (record or {}).get("load") or ("the teacher's weights" if record else "not recorded")
        raise ArgsError(f"load: {args.load} is not what {where} started from ({started}); a save URL that holds a "
                        f"checkpoint resumes it: set load to {started if record and record.get('load') else 'nothing'} "
                        f"to resume, or pick a new save URL to start from {args.load}")
    if record is not None and record.get("hf_checkpoint") != targs.hf_checkpoint:
        raise ArgsError(f"hf_checkpoint: {targs.hf_checkpoint} is not the model {where} was trained from "
                        f"({record.get('hf_checkpoint')}); set it to that model to resume, or pick a new save URL")


def _check_adapters(role: str, targs: Args, record: dict, where: str) -> None:
    prefix = "critic_" if role == "critic" else ""
    saved, now = record.get("lora"), lora.adapter_record(targs)
    if saved != now:
        key = next((ADAPTER_KEYS[k] for k in ADAPTER_KEYS if (saved or {}).get(k) != (now or {}).get(k)), "lora_rank")
        raise ArgsError(f"{prefix}{key}: {where} holds {_adapters(saved)}, this run asks for {_adapters(now)}; "
                        "set the LoRA settings to the checkpoint's, or pick a new save URL")
    if now is not None and record.get("base"):
        identity = base_identity(targs.hf_checkpoint, transformer_folder(targs.workflow))
        if identity != record["base"]:
            raise ArgsError(f"hf_checkpoint: {targs.hf_checkpoint} (weights {identity}) is not the base the adapters of "
                            f"{where} were trained on ({record.get('hf_checkpoint')}, weights {record['base']}); "
                            "point hf_checkpoint at that base")


def _check_step_vectors(targs: Args, param_groups: list[dict], record: Optional[dict], where: str) -> None:
    saved = step_conditioning.in_saved_groups(param_groups)
    wanted = step_conditioning.wanted(targs)
    steps = ((record or {}).get("student") or {}).get("num_steps")  # dmd2_student_steps as validated
    if saved and steps is not None and steps != targs.dmd2_student_steps:
        raise ArgsError(f"dmd2_student_steps: {where} holds a fake score with a step vector per K of {steps}, "
                        f"this run asks for {targs.dmd2_student_steps}; resume with dmd2_student_steps {steps}, "
                        "or pick a new save URL")
    if saved != wanted:
        has = "with a step vector per K" if saved else "without step vectors"
        raise ArgsError(f"dmd2_critic_step_conditioning: {where} holds a fake score {has}, this run asks for one "
                        f"{'with' if wanted else 'without'}; resume with dmd2_critic_step_conditioning "
                        f"{str(saved).lower()}, or pick a new save URL")


def _adapters(record: Optional[dict]) -> str:
    if record is None:
        return "full weights (no LoRA)"
    return f"LoRA rank {record['rank']}, alpha {record['alpha']:g}, targets {','.join(record['targets'])}"


def resumed_with(trainer_args: dict[str, Args], source: str, iteration: int) -> list[str]:
    """This run's optimizer settings that differ from the checkpoint's (this run's win), one
    'role key saved -> now' each."""
    out = []
    for role, targs in trainer_args.items():
        groups = read_trainer_state(source, role, iteration).get("param_groups") or []
        for key, (saved, now) in changed_optimizer_settings(groups, optimizer_settings(targs)).items():
            out.append(f"{role} {key} {saved} -> {now}")
    return out
