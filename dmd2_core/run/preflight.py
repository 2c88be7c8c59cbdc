"""Preflight: everything about a run that can be checked before an actor starts (checkpoints,
hooks, prompt and real sets, the memory plan, the resume point, the save URL's lease and
writability), and where a (re)start resumes from."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Optional

from dmd2_core import checkpoint, storage
from dmd2_core.run import preflight_checks
from dmd2_core.run import lease, resume_check
from dmd2_core.evaluation.evaluator import eval_prompt_indices
from dmd2_core.evaluation.evaluator import evaluator_of
from dmd2_core.memory import planner
from dmd2_core.args import Args
from dmd2_core.errors import ArgsError, CheckpointError
from dmd2_core.data import check_real_set, prompt_texts
from dmd2_core.train.input_hook import load_hook
from dmd2_core.models import FAMILIES, check_weight_files, describe_model_dir, transformer_folder
from dmd2_core.train.trainer_config import compute_trainer_args, compute_trainer_configs
from dmd2_core.trackers.sinks import check_trackers


def preflight(args: Args, owner: str | None = None) -> dict[str, Args]:
    """Everything that can be checked before an actor starts: checkpoints, hooks, prompts and the
    resume point. Returns each trainer's args (shift resolved). Raises ArgsError / StoredFilesError."""
    for key, what in (("hf_checkpoint", "the teacher's diffusers model directory"),
                      ("prompts", "a prompt-embedding set (safetensors) or 'digits'"),
                      ("save", "the run's storage URL")):
        if not getattr(args, key):
            raise ArgsError(f"{key} is not set: point it at {what}")
    check_trackers(args)
    preflight_checks.check_reachable({"save": args.save, "load": args.load, "hf_checkpoint": args.hf_checkpoint,
                                      "prompts": args.prompts})
    preflight_checks.check_ray_address(args.ray_address)
    folder = transformer_folder(args.workflow)  # the repository partition the run distills
    teacher = describe_model_dir(args.hf_checkpoint, "hf_checkpoint", folder)
    args = preflight_checks.check_family_args(args, teacher)
    if FAMILIES[teacher["family"]].is_video and not args.latent_shape:
        raise ArgsError(f"latent_shape: {args.hf_checkpoint} is a video model ({teacher['family']}); "
                        "set latent_shape to its latents' [C, F, H, W]")
    preflight_checks.check_latent_shape(args, teacher)
    preflight_checks.check_size_schedule(args, teacher)
    if args.dmd2_shift is None:
        args = args.model_copy(update={"dmd2_shift": teacher["shift"]})
    trainer_args = {}
    checkpoint_keys: dict[str, str] = {}  # each model directory -> the argument that named it
    for cfg in compute_trainer_configs(args):
        targs = compute_trainer_args(args, cfg)
        key = "critic_hf_checkpoint" if cfg.role == "critic" and args.critic_hf_checkpoint else "hf_checkpoint"
        checkpoint_keys.setdefault(targs.hf_checkpoint, key)
        describe_model_dir(targs.hf_checkpoint, key, folder)
        if targs.loss_type == "dmd2_critic":
            teacher_key = "teacher_checkpoint" if args.teacher_checkpoint else key
            checkpoint_keys.setdefault(targs.teacher_checkpoint or targs.hf_checkpoint, teacher_key)
            describe_model_dir(targs.teacher_checkpoint or targs.hf_checkpoint, teacher_key, folder)
        if targs.train_input_hook_path:
            flag = "critic_train_input_hook_path" if cfg.role == "critic" else "train_input_hook_path"
            load_hook(targs.train_input_hook_path, flag=flag)
        trainer_args[cfg.role] = targs
    preflight_checks.check_context_parallel(args, trainer_args)
    if args.prompts != "digits":
        if not storage.exists(args.prompts):
            raise ArgsError(f"prompts: no prompt set at {args.prompts}{storage.nearest_sibling(args.prompts)}")
        preflight_checks.check_prompt_set(args.prompts, needs_negative=args.uses_guidance,
                                cond_keys=FAMILIES[teacher["family"]].cond_keys)
        if FAMILIES[teacher["family"]].has_audio:
            preflight_checks.check_workflow_prompts(args.prompts, args.workflow, args.latent_shape)
    eval_prompt_indices(args, len(prompt_texts(args.prompts)))
    evaluator = evaluator_of(args)
    evaluator.preflight_check(args, trainer_args)
    for key, url in evaluator.writes(args, trainer_args).items():
        preflight_checks.probe_write(url, key)
    if "critic" in trainer_args and args.gan_critic_weight:
        _check_gan(trainer_args["critic"])
    if planner.device_limit(args) is not None or args.host_memory_gib:
        planner.check_fits(planner.plan(trainer_args))
    for url in sorted(checkpoint_keys):  # headers only: a cut-off download is named before any actor
        check_weight_files(url, checkpoint_keys[url], folder)
    source = checkpoint.resume_url(args)
    resumed = checkpoint.validate_resume(source, list(trainer_args))
    if resumed is not None:  # the start it recorded (load, model, LoRA and its base) is the one asked for
        resume_check.check_resume(args, trainer_args, source, resumed)
    if resumed is None and args.load and args.load != args.save:
        raise CheckpointError(
            f"load: no checkpoint at {args.load} (no {checkpoint.LATEST_NAME})"
            f"{storage.nearest_sibling(args.load)}")
    # a finished run rerun (its own save at num_iterations) completes at once; anything else that
    # starts at or past num_iterations would train nothing and report Completed
    if resumed is not None and (resumed > args.num_iterations or (resumed == args.num_iterations and source != args.save)):
        raise ArgsError(f"num_iterations: {args.num_iterations} does not go beyond iteration {resumed} of the checkpoint "
                        f"at {source}, where this run starts; iterations count on from it (set num_iterations to "
                        f"{resumed + max(args.num_iterations, 1)} for {max(args.num_iterations, 1)} more)")
    preflight_checks.check_local_devices(args, len(trainer_args))
    # last, these two: nothing is written for input that fails earlier. The probe first, so an
    # unwritable save (a missing bucket) is named as such, not as a store whose conditional writes fail
    preflight_checks.probe_write(args.save)
    lease.check_free(args.save, owner, args.lease_timeout_s)  # one run per save URL
    return trainer_args


_handed_over: list[tuple[Args, dict[str, Args]]] = []  # at most one: the CLI's check, for its own flow


def hand_over(args: Args) -> dict[str, Args]:
    """``preflight(args)`` now, its answer kept for this process's next ``DistillRun`` of the same
    args: the CLI checks before Prefect starts, and the flow it then runs does not check again."""
    trainer_args = preflight(args)
    _handed_over[:] = [(args, trainer_args)]
    return trainer_args


def handed_over(args: Args) -> Optional[dict[str, Args]]:
    """What ``hand_over`` checked, once, when ``args`` are the args it checked; else None."""
    kept = _handed_over.pop() if _handed_over else None
    return kept[1] if kept is not None and kept[0] == args else None


def _check_gan(critic: Args) -> None:
    """The GAN head's feature block exists and the real set fits the model and the prompts."""
    info = describe_model_dir(critic.hf_checkpoint)
    config = json.loads(storage.read_text(storage.join(info["transformer_url"], "config.json")))
    family = FAMILIES[info["family"]]
    blocks = int(config.get("num_layers", 0))
    if critic.gan_feature_block is not None and not -blocks <= critic.gan_feature_block < blocks:
        raise ArgsError(f"gan_feature_block: {critic.gan_feature_block} out of range for {blocks} blocks of {critic.hf_checkpoint}")
    shape = family.sample_shape(SimpleNamespace(config=SimpleNamespace(**config)), critic.latent_shape)
    try:
        check_real_set(critic.real_data, shape, critic.prompts, family.workflow_cond_keys(critic.workflow))
    except ValueError as exc:
        raise ArgsError(str(exc)) from None
