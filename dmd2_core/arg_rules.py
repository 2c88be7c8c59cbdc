"""The rules between a run's arguments (``Args``' validators call these): each refusal is a
ValueError "key: what is wrong", which ``args.load_args`` turns into one line naming the key."""

from __future__ import annotations


def one_or_a_set(value):
    """A set of step counts, ascending and without repeats; a set of one is that K (today's student)."""
    if isinstance(value, list):
        if not value:
            raise ValueError("a set of step counts needs at least one K")
        bad = [k for k in value if k < 1]
        if bad:
            raise ValueError(f"every K must be >= 1 (got {bad[0]})")
        value = sorted(set(value))
        return value[0] if len(value) == 1 else value
    if value < 1:
        raise ValueError(f"K must be >= 1 (got {value})")
    return value


def _check_per_k(args, key: str, what: str, valid) -> None:
    """A list with one value per K of a set of step counts (``key``), each ``valid``."""
    values = getattr(args, key)
    if values is None:
        return
    counts = args.student_step_counts
    if len(counts) == 1:
        raise ValueError(f"{key}: only a set of step counts (dmd2_student_steps: [1, 2, 4, 8]) has one value per K; "
                         "remove it or give a set")
    if len(values) != len(counts) or not all(valid(v) for v in values):
        raise ValueError(f"{key}: one {what} per K of {list(counts)} (got {values})")


def check_relations(args):
    """Cross-field rules of ``args`` (an ``Args`` being validated; returned); fills the defaults
    that depend on other fields (``sleep_after_train``)."""
    _check_per_k(args, "dmd2_student_steps_weights", "positive weight", lambda w: w > 0)
    _check_per_k(args, "dmd2_student_steps_guidance", "guidance scale (>= 0)", lambda g: g >= 0)
    if args.sleep_after_train is None:
        args.sleep_after_train = args.device == "cuda"
    if args.dmd2_min_sigma >= args.dmd2_max_sigma:
        raise ValueError("dmd2_min_sigma: must be below dmd2_max_sigma")
    if args.fsdp_shard_size is not None and args.num_devices % args.fsdp_shard_size:
        raise ValueError(f"fsdp_shard_size: {args.fsdp_shard_size} does not divide num_devices {args.num_devices}")
    shard = args.fsdp_shard_size or args.num_devices
    for key in ("cp_size", "critic_cp_size"):
        cp = getattr(args, key)
        if cp is not None and shard % cp:
            raise ValueError(f"{key}: {cp} does not divide the {shard} ranks a model is sharded over "
                             f"(fsdp_shard_size, default num_devices)")
    for key in ("fsdp_cpu_offload", "critic_fsdp_cpu_offload"):
        if getattr(args, key) and args.device != "cuda":
            raise ValueError(f"{key}: offloading to host memory needs device cuda (device is {args.device})")
    if (args.gan_weight or args.gan_critic_weight) and not args.real_data:
        raise ValueError("real_data: the GAN head needs real samples (gan_weight/gan_critic_weight > 0); "
                         "set real_data to a real set from `prepare-latents` or 'digits'")
    if args.export_interval and args.save_interval and args.export_interval % args.save_interval:
        raise ValueError(f"export_interval: {args.export_interval} is not a multiple of save_interval "
                         f"{args.save_interval} (exports are taken at checkpoints)")
    if args.loss_type == "dmd2" and args.num_steps_per_rollout != 1:
        raise ValueError(f"num_steps_per_rollout: the dmd2 actor takes one step per rollout (got "
                         f"{args.num_steps_per_rollout}); the critic's steps per rollout are dmd2_update_ratio")
    if args.export_merged and not args.lora_rank:
        raise ValueError("export_merged: only a LoRA student (lora_rank > 0) has adapters to merge")
    for key in ("lora_dropout", "critic_lora_dropout"):  # until its masks come from the run's seeded streams
        if getattr(args, key):
            raise ValueError(f"{key}: {getattr(args, key)} is not supported: peft's adapter dropout draws its masks "
                             "from torch's global generator, not the run's seeded streams, so a replay from a "
                             "checkpoint and N ranks against 1 would train on different masks; set it to 0")
    if args.micro_batch_size > args.global_batch_size:
        raise ValueError(f"micro_batch_size: {args.micro_batch_size} is above global_batch_size "
                         f"{args.global_batch_size}; set it to at most {args.global_batch_size}")
    if args.run_name in ("", ".", "..") or any(c in args.run_name for c in "/\\\0"):
        raise ValueError(f"run_name: {args.run_name!r} must be one path segment (no '/', not '.' or '..'): "
                         "it names the run's actors and files")
    from dmd2_core import size_schedule

    size_schedule.check_relations(args)
    if args.gan_weight and not args.gan_critic_weight:
        raise ValueError("gan_critic_weight: must be > 0 when gan_weight is (the discriminator would never train)")
    return args
