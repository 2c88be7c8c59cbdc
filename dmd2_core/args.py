"""The one typed argument model of a run: every flag, its type, default, group and help.

Recipes (YAML under ``deployments/recipes/``) and overrides are loaded into it; the CLI parser is
generated from it. Every validation error is one line naming the key and the closest valid name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator
from dmd2_core import arg_rules
from dmd2_core.devices import DEVICE_PEAK_TFLOPS
from dmd2_core.errors import ArgsError, nearest
from dmd2_core import evaluators
from dmd2_core import size_schedule
from dmd2_core.trackers.flags import TrackerFlags

RECIPES_DIR = Path(__file__).resolve().parent.parent / "deployments" / "recipes"


def _f(default, group: str, help: str, **kw):
    return Field(default, description=help, json_schema_extra={"group": group}, **kw)


class Args(TrackerFlags):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    # --- run -----------------------------------------------------------------------------------
    run_name: str = _f("dmd2", "run", "Name of the run, used for Ray namespaces and artifact keys.")
    seed: int = _f(0, "run", "Seed; every random draw of iteration i derives from (seed, i).", ge=0)
    num_iterations: int = _f(100, "run", "Number of DMD2 iterations (student updates).", ge=0)
    save: Optional[str] = _f(None, "run", "Storage URL of the run (path, file:// or s3://); required.")
    load: Optional[str] = _f(None, "run", "Storage URL to resume from; defaults to `save`.")
    save_interval: int = _f(0, "run", "Checkpoint every N iterations (0: only at the end).", ge=0)
    async_save: bool = _f(
        False, "run", "Write checkpoints in the background: the state is copied to host memory and training goes on "
        "while it is written and uploaded; the tracker moves once it is durable."
    )
    keep_last_n: int = _f(
        0, "run", "Keep this many newest checkpoints (the tracked one always); older ones are deleted once a newer "
        "one is tracked (0: keep all).", ge=0
    )
    export_interval: int = _f(
        0, "run", "Export the student as a diffusers pipeline at every N-th iteration that saves a checkpoint "
        "(0: at every save).", ge=0
    )
    export_dtype: Optional[Literal["float32", "bfloat16", "float16"]] = _f(
        None, "run", "Dtype of the exported student's weights; default the compute dtype."
    )
    keep_exports: int = _f(0, "run", "Keep this many newest student exports (0: keep all).", ge=0)
    export_merged: bool = _f(
        False, "run", "A LoRA student (lora_rank > 0) is exported merged into the base as a full diffusers pipeline, "
        "instead of as a LoRA in the family's diffusers LoRA format."
    )
    ray_address: Optional[str] = _f(None, "run", "Address of an existing Ray cluster; unset starts a local Ray.")
    device: Literal["cpu", "cuda"] = _f("cpu", "run", "Accelerator each trainer rank computes on.")
    num_devices: int = _f(1, "run", "Devices (placement-group bundles, ranks per group).", ge=1)
    colocate: bool = _f(True, "run", "Place every trainer group on the same bundles (fractional shares).")
    device_resource: Optional[str] = _f(
        None, "run", "Ray resource one bundle holds per device; default GPU on cuda, dmd2_device on cpu."
    )
    torch_threads: int = _f(1, "run", "torch intra-op threads per trainer process.", ge=1)
    dtype: Literal["float32", "bfloat16", "float16"] = _f(
        "float32", "run", "Compute dtype of forward and backward; trained weights, gradients, AdamW state and EMA stay "
        "float32 (master weights), the frozen teacher is stored in it."
    )
    ray_timeout_s: float = _f(1800.0, "run", "Seconds any Ray call may take before it counts as failed.", gt=0)
    fsdp_shard_size: Optional[int] = _f(
        None, "run", "Ranks one model is sharded over (FSDP2); below num_devices it shards within groups of this "
        "size and replicates across them (HSDP: shard inside a node, replicate across nodes). Default: all.", ge=1
    )
    cp_size: int = _f(
        1, "run", "Context parallelism: ranks one sample's sequence is split over (Ulysses attention); divides "
        "fsdp_shard_size. The data-parallel degree is num_devices / cp_size.", ge=1
    )
    device_memory_gib: Optional[float] = _f(
        None, "run", "Memory of one device the plan must fit in; default the device's own on cuda (unchecked on cpu).",
        gt=0,
    )
    device_kind: Optional[str] = _f(
        None, "run", "The kind of device the run is for (H100, H200; a recipe names its cluster: num_devices of "
        "device_kind with device_memory_gib each): the time plan prices it at that device's dense bf16 peak. "
        "Default H100.",
    )
    host_memory_gib: Optional[float] = _f(
        None, "run", "Host memory of one node the plan must fit in (load peak, sleep stash, async-save staging); "
        "unset: unchecked.", gt=0,
    )
    memory_headroom: float = _f(
        0.1, "run", "Fraction of device (and host) memory the plan leaves free: a plan above (1 - headroom) of it "
        "is refused.", ge=0, lt=1,
    )
    lease_timeout_s: float = _f(
        120.0, "run", "A run's lease on its save URL goes stale (a rerun may take it over) after this many seconds without a heartbeat.", gt=0
    )
    iterations_per_window: int = _f(
        100, "run", "Iterations per subflow run of the Prefect flow (one graph in the UI holds ~5 nodes per iteration).", ge=1
    )
    max_crash_reruns: int = _f(
        3, "run", "Times a crashed deployment run is rerun (from its checkpoint) before it is failed for good.", ge=0
    )
    time_budget_s: Optional[float] = _f(
        None, "run", "Seconds this run may take from its start (group start-up included): it stops training early "
        "enough to checkpoint, evaluate and export the iteration it stopped at inside them, ends Completed and "
        "continues when run again on the same save (a nightly deployment's window). Unset or 0: no budget.", ge=0
    )
    summary_interval: int = _f(
        25, "run", "Refresh the run summary artifact (plot, table, update time) at most every this many iterations "
        "between evals and checkpoints (0: only at evals and checkpoints).", ge=0
    )

    # --- model ---------------------------------------------------------------------------------
    hf_checkpoint: Optional[str] = _f(None, "model", "The teacher: a diffusers model directory (path or URL).")
    critic_hf_checkpoint: Optional[str] = _f(None, "model", "Fake-score initialisation; defaults to the teacher.")
    prompts: Optional[str] = _f(
        None, "model", "Prompt-embedding set (safetensors URL) of training conditions, or 'digits'; required."
    )

    latent_shape: Optional[list[int]] = _f(
        None, "model", "Sample shape [C, H, W] or [C, F, H, W]; default from the model config (required for video)."
    )
    num_frames: Optional[int] = _f(
        None, "model", "Clip length in frames of a joint video + audio model (MiniMax-H3: 17n + 5 at 24 fps, 5-15 s); "
        "with height and width it sets latent_shape.", ge=1)
    workflow: str = _f(
        "t2va", "model", "What a MiniMax-H3 student conditions on: 't2va' (text), 'fl2va' (text and the first "
        "and/or last keyframe: a prompt set prepared with --keyframes) or 'ref2va' (image and sound references: a "
        "prompt set prepared with --references; distills the repository's transformer_ref/).")
    height: Optional[int] = _f(None, "model", "Clip height in pixels (MiniMax-H3: a multiple of 32).", ge=1)
    width: Optional[int] = _f(None, "model", "Clip width in pixels (MiniMax-H3: a multiple of 32, aspect 1:4 to 4:1).", ge=1)
    size_schedule: Optional[list[dict[str, Any]]] = _f(
        None, "model", "Train the first iterations at a smaller sample, the last at the full size: a list of stages, "
        "each its until_iteration (the last stage runs to the end) and its size as the run names its own (latent_shape, "
        "or num_frames, height and width), e.g. [{until_iteration: 2000, num_frames: 124, height: 384, width: 672}, "
        "{num_frames: 124, height: 768, width: 1344}]. The last stage is the full size; the eval stays at it. "
        "Default: every iteration at the full size.")
    real_data: Optional[str] = _f(
        None, "model", "Real samples in the model's latent space with their conditions (a real set URL from "
        "`prepare-latents`, or 'digits'); the GAN head's real side."
    )

    # --- train ---------------------------------------------------------------------------------
    loss_type: Literal["flow_matching", "dmd2", "dmd2_critic"] = _f(
        "dmd2", "train", "Loss of this trainer; dmd2 on the actor adds the critic group."
    )
    lr: float = _f(1e-4, "train", "Learning rate.", gt=0)
    adam_beta1: float = _f(0.0, "train", "AdamW beta1 (DMD2 uses 0).", ge=0, lt=1)
    adam_beta2: float = _f(0.999, "train", "AdamW beta2.", ge=0, lt=1)
    weight_decay: float = _f(0.01, "train", "AdamW weight decay.", ge=0)
    clip_grad: float = _f(10.0, "train", "Gradient-norm clip (0 disables).", ge=0)
    global_batch_size: int = _f(64, "train", "Samples per iteration over all ranks.", ge=1)
    micro_batch_size: int = _f(64, "train", "Samples per forward/backward on one rank.", ge=1)
    num_steps_per_rollout: int = _f(1, "train", "Optimizer steps this trainer takes on one rollout.", ge=1)
    train_input_hook_path: Optional[str] = _f(
        None, "train", "Dotted path of a hook(args, pairs, external_data) -> pairs run before micro-batching."
    )
    ema_decay: Optional[float] = _f(None, "train", "EMA decay of the trained weights, used for eval when set.", gt=0, lt=1)
    gradient_checkpointing: bool = _f(
        False, "train", "Activation checkpointing per transformer block (recompute in backward; less memory)."
    )
    fsdp_cpu_offload: bool = _f(
        False, "train", "Keep this trainer's sharded weights, gradients and optimizer state in host memory (cuda only)."
    )
    max_nonfinite_steps: int = _f(
        10, "train", "Fail the run after this many non-finite (skipped) optimizer steps in a row of one trainer (0: never).", ge=0
    )
    lora_rank: int = _f(
        0, "train", "LoRA rank of this trainer (peft adapters over its frozen base, stored in dtype; only the adapters "
        "train, with fp32 masters and AdamW state); 0: full fine-tuning.", ge=0
    )
    lora_alpha: Optional[float] = _f(None, "train", "LoRA alpha (the update is scaled by alpha / rank); default the rank.", gt=0)
    lora_target_modules: Optional[list[str]] = _f(
        None, "train", "Module names (peft target_modules) that get adapters; default the attention projections "
        "to_q, to_k, to_v, to_out.0."
    )
    lora_dropout: float = _f(0.0, "train", "Dropout on the LoRA adapters' input: only 0 (its masks are not replayable).", ge=0, lt=1)

    # --- dmd2 ----------------------------------------------------------------------------------
    critic_lr: Optional[float] = _f(None, "dmd2", "Critic (fake score) learning rate; defaults to lr.", gt=0)
    teacher_checkpoint: Optional[str] = _f(None, "dmd2", "The frozen teacher (real score); defaults to hf_checkpoint.")
    critic_train_input_hook_path: Optional[str] = _f(None, "dmd2", "The critic group's train-input hook.")
    critic_gradient_checkpointing: Optional[bool] = _f(
        None, "dmd2", "The critic group's activation checkpointing; defaults to gradient_checkpointing."
    )
    critic_cp_size: Optional[int] = _f(
        None, "dmd2", "The critic group's context parallelism (cp_size); defaults to cp_size.", ge=1
    )
    critic_fsdp_cpu_offload: Optional[bool] = _f(
        None, "dmd2", "The critic group's CPU offload (fake score and teacher); defaults to fsdp_cpu_offload."
    )
    dmd2_update_ratio: int = _f(5, "dmd2", "Critic updates per student update (two time-scale rule).", ge=1)
    dmd2_student_steps: int | list[int] = _f(
        4, "dmd2", "Student sampling steps K, or a set of them (e.g. [1, 2, 4, 8]): one student for every K of the set, "
        "each iteration drawing its K (dmd2_student_steps_weights) and evaluated at each.")
    dmd2_student_steps_weights: Optional[list[float]] = _f(
        None, "dmd2", "With a set of step counts: how often each K is drawn, one weight per K in ascending order of K "
        "(default equal).")
    dmd2_student_sampler: Optional[Literal["renoise", "euler"]] = _f(
        None, "dmd2", "How the student moves between its steps: renoise (its x0 re-noised with fresh noise, LCM's) or "
        "euler (along its velocity, no fresh noise: one diffusers scheduler then serves every step count); default "
        "the family's (MiniMax-H3 euler, others renoise).")
    dmd2_critic_step_conditioning: bool = _f(
        True, "dmd2", "With a set of step counts: the fake score learns one vector per K, added to its time "
        "embedding, so it models each K's samples apart rather than their mixture (docs/design.md).")
    dmd2_critic_step_lr_scale: float = _f(
        30.0, "dmd2", "The fake score's step vectors (dmd2_critic_step_conditioning) learn at this times its lr.", gt=0)
    dmd2_guidance_scale: float = _f(1.0, "dmd2", "Teacher classifier-free guidance scale for the real score.", ge=0)
    dmd2_student_steps_guidance: Optional[list[float]] = _f(
        None, "dmd2", "With a set of step counts: the real score's guidance scale at each K, one per K in ascending "
        "order of K (default dmd2_guidance_scale at every K). Guidance narrows a student and fewer steps spread less: "
        "on the digits a set's 1 step is best at 0.95 with 1.05 at the rest (bench/README.md).")
    dmd2_critic_scoring: Literal["fused", "original"] = _f(
        "fused", "dmd2", "fused: score on the critic's last-step inputs; original: separate scoring pass before it."
    )
    dmd2_backward_simulation: bool = _f(True, "dmd2", "Stop the rollout at a random step k ~ U{0..K-1}.")
    dmd2_shift: Optional[float] = _f(None, "dmd2", "Sigma shift S; defaults to the teacher scheduler's shift.", gt=0)
    sleep_after_train: Optional[bool] = _f(
        None, "dmd2", "Sleep each trainer group right after its train (frees its device memory); default on for cuda, "
        "off for cpu (there the device memory is host memory: sleeping frees nothing and costs a copy).")
    dmd2_modality_weights: Optional[dict[str, float]] = _f(
        None, "dmd2", "Weight of each modality of a joint model (MiniMax-H3: video, audio) in the DMD gradient and the "
        "critic's loss; each modality has its own normaliser either way. Default 1 each.")
    dmd2_min_sigma: float = _f(0.02, "dmd2", "Lower clamp of DMD/critic sigmas.", ge=0, lt=1)
    dmd2_modality_min_sigma: Optional[dict[str, float]] = _f(
        None, "dmd2", "Per modality of a joint model (MiniMax-H3: video, audio), the lowest noise level its part of the "
        "DMD gradient comes from, on dmd2_min_sigma's scale (MiniMax-H3: the schedule position both modalities share): "
        "a sample drawn below it leaves that modality's part out, the other's kept. Default dmd2_min_sigma for each.")
    dmd2_max_sigma: float = _f(0.98, "dmd2", "Upper clamp of DMD/critic sigmas.", gt=0, le=1)
    student_modality_shifts: Optional[dict[str, float]] = _f(
        None, "dmd2", "Per modality of a joint model (MiniMax-H3: video, audio), the schedule shift the student steps "
        "on: its K steps at u = 1, (K-1)/K, .., 1/K, a modality at shift(u, its shift). The export's schedulers "
        "carry them, so the modular pipeline steps the student as it trained; the critic and the teacher keep the "
        "schedulers' pairs of noise levels. Default the schedulers' (MiniMax-H3: video 12, audio 3).")
    dmd2_modality_shifts: Optional[dict[str, float]] = _f(
        None, "dmd2", "Per modality of a joint model (MiniMax-H3: video, audio), the schedule shift its noise is drawn "
        "at where the critic trains and the DMD gradient is taken: both modalities share one schedule position u per "
        "clip, and a modality sits at shift(u, its shift). The student's steps, the teacher's samplers and the eval "
        "keep the schedulers' shifts. Default the schedulers' (MiniMax-H3: video 12, audio 3).")
    dmd2_regression_weight: float = _f(
        0.0, "dmd2", "Weight of DMD's regression loss (0: off): the student's x0 pulled towards the frozen teacher's own "
        "dmd2_regression_steps-step sample run on from the student's x_t, made by the critic group each iteration "
        "(no stored pairs). It copies the teacher's few-step sampler where DMD only matches its distribution.", ge=0)
    dmd2_regression_modality_weights: Optional[dict[str, float]] = _f(
        None, "dmd2", "Weight of each modality of a joint model (MiniMax-H3: video, audio) in the regression pull, "
        "times dmd2_regression_weight: {video: 0, audio: 1} anchors the sound to the teacher's few-step sampler "
        "while the picture learns by DMD alone. Default 1 each.")
    dmd2_regression_steps: int = _f(
        4, "dmd2", "Steps of the teacher's sampler that makes the regression target (its grid on the DMD schedule, "
        "continued from the student's stop step).", ge=1)
    gan_weight: float = _f(0.0, "dmd2", "GAN generator loss weight (softplus(-D(fake_t)), added to the DMD gradient; 0: off).", ge=0)
    gan_critic_weight: float = _f(0.0, "dmd2", "GAN discriminator loss weight in each critic step (0: no GAN head).", ge=0)
    gan_feature_block: Optional[int] = _f(None, "dmd2", "Fake-score block whose output feeds the GAN head; default the middle one.")
    gan_modality_weights: Optional[dict[str, float]] = _f(
        None, "dmd2", "Weight of each modality of a joint model (MiniMax-H3: video, audio) in the GAN head's generator "
        "gradient; the head still judges the whole clip. Default 1 each.")
    gan_judged_modalities: Optional[list[str]] = _f(
        None, "dmd2", "The modalities of a joint model (MiniMax-H3: video, audio) whose rows the GAN head judges (with the "
        "text rows); default all.")
    critic_lora_rank: Optional[int] = _f(
        None, "dmd2", "The fake score's LoRA rank; defaults to lora_rank. With a rank and the teacher as its "
        "checkpoint, the critic group holds one frozen base: the real score is it with the adapter off.", ge=0
    )
    critic_lora_alpha: Optional[float] = _f(None, "dmd2", "The fake score's LoRA alpha; defaults to lora_alpha.", gt=0)
    critic_lora_target_modules: Optional[list[str]] = _f(
        None, "dmd2", "The fake score's LoRA target modules; defaults to lora_target_modules."
    )
    critic_lora_dropout: Optional[float] = _f(None, "dmd2", "The fake score's LoRA dropout; defaults to lora_dropout (only 0).", ge=0, lt=1)

    # --- eval ----------------------------------------------------------------------------------
    eval_interval: int = _f(0, "eval", "Eval media and metrics every N iterations (0: never).", ge=0)
    eval_num_samples: int = _f(200, "eval", "Samples drawn for quality metrics.", ge=1)
    eval_prompts: Optional[list[int]] = _f(None, "eval", "Indices of prompts shown in eval media; default all.")
    eval_samples_per_prompt: int = _f(4, "eval", "Eval media samples per prompt.", ge=1)
    eval_seed: int = _f(1234, "eval", "Seed of eval noise (the same every eval).", ge=0)
    eval_fps: int = _f(8, "eval", "Frames per second of video eval media.", ge=1)
    evaluator: Optional[str] = _f(
        None, "eval", "How evals score the student: 'teacher' (the frozen teacher's own features and drift "
        "statistics against its reference samples; any model) or a toy world's metrics; default: the prompt set's.")
    eval_reference_url: Optional[str] = _f(
        None, "eval", "Where the teacher's reference samples and features are cached (one entry per teacher and "
        "eval settings); default {save}/eval_reference. Share one URL across nights to sample the teacher once.")
    eval_reference_steps: int = _f(50, "eval", "The teacher's sampling steps for its reference samples.", ge=1)
    eval_real_samples: int = _f(
        256, "eval", "Rows of real_data the teacher evaluator also measures the student against (real_kid; "
        "their teacher features are cached with the reference); 0: none.", ge=0)
    alert_regression_margin: float = _f(
        0.25, "eval", "A night whose best figure of a modality (picture, sound) exceeds the previous nights' median "
        "by more than this fraction and 2 standard errors (or whose drift leaves its band) is reported as a "
        "regression.", ge=0)

    @field_validator("dmd2_student_steps")
    @classmethod
    def _one_or_a_set(cls, value):
        return arg_rules.one_or_a_set(value)

    @field_validator("size_schedule", mode="before")
    @classmethod
    def _stages(cls, value):
        return size_schedule.normalise(value)

    @field_validator("evaluator")
    @classmethod
    def _registered_evaluator(cls, value):
        if value is not None and value not in evaluators.names():
            names = [repr(n) for n in evaluators.names()]
            raise ValueError(f"Input should be {', '.join(names[:-1])} or {names[-1]}{nearest(value, evaluators.names())}")
        return value

    @field_validator("device_kind")
    @classmethod
    def _priced_device_kind(cls, value):
        if value is not None and value not in DEVICE_PEAK_TFLOPS:
            names = [repr(n) for n in sorted(DEVICE_PEAK_TFLOPS)]
            raise ValueError(f"Input should be {', '.join(names[:-1])} or {names[-1]}{nearest(value, DEVICE_PEAK_TFLOPS)}"
                             " (or give the plan peak_tflops)")
        return value

    @model_validator(mode="after")
    def _check_relations(self) -> "Args":
        return arg_rules.check_relations(self)

    # ---- derived values (one place each) ------------------------------------------------------
    @property
    def student_step_counts(self) -> tuple[int, ...]:
        """The student's step counts, ascending: (K,) for one."""
        steps = self.dmd2_student_steps
        return tuple(steps) if isinstance(steps, list) else (steps,)

    @property
    def max_student_steps(self) -> int:
        return self.student_step_counts[-1]

    def guidance_at(self, num_steps: int) -> float:
        """The real score's guidance scale when the student samples with ``num_steps`` steps."""
        per_k = self.dmd2_student_steps_guidance
        return self.dmd2_guidance_scale if per_k is None else per_k[self.student_step_counts.index(num_steps)]

    @property
    def uses_guidance(self) -> bool:
        """Whether any real score is guided: the prompts then need negatives, the teacher a second row."""
        return any(g != 1.0 for g in (self.dmd2_guidance_scale, *(self.dmd2_student_steps_guidance or ())))

    @property
    def load_url(self) -> str:
        return self.load or self.save

    @property
    def resource_name(self) -> str:
        return self.device_resource or ("GPU" if self.device == "cuda" else "dmd2_device")


ARG_NAMES: tuple[str, ...] = tuple(Args.model_fields)


def check_keys(keys, where: str) -> None:
    for key in keys:
        if key not in Args.model_fields:
            raise ArgsError(f"unknown key '{key}' in {where}{nearest(key, ARG_NAMES)}")


def _one_line(err: ValidationError, where: str) -> ArgsError:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "args"
    msg = first["msg"]
    if not first["loc"] and ":" in msg:  # model validator: "key: message"
        loc, msg = msg.split(":", 1)
        loc = loc.removeprefix("Value error, ")
    msg = msg.removeprefix("Value error, ")
    got = first.get("input")
    got_s = "" if isinstance(got, (dict, BaseModel)) else f" (got {got!r})"
    return ArgsError(f"invalid value for '{loc}' in {where}: {msg.strip()}{got_s}")


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def resolve_recipe(recipe: str | Path) -> Path:
    path = Path(recipe)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ArgsError(f"recipe file not found: {path}")
        return path
    candidate = RECIPES_DIR / f"{recipe}.yaml"
    if not candidate.is_file():
        raise ArgsError(f"unknown recipe '{recipe}'{nearest(recipe, recipe_names())} (known: {', '.join(recipe_names())})")
    return candidate


def read_recipe(recipe: str | Path) -> dict[str, Any]:
    path = resolve_recipe(recipe)
    try:
        from dmd2_core.strict_yaml import load_unique

        data = load_unique(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ArgsError(f"recipe {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ArgsError(f"recipe {path} must be a mapping of flag names to values")
    check_keys(data, f"recipe {path.name}")
    return data


def build_args(values: dict[str, Any], where: str = "args") -> Args:
    check_keys(values, where)
    try:
        return Args(**values)
    except ValidationError as err:
        raise _one_line(err, where) from None


def load_args(recipe: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Args:
    """Recipe values, then overrides on top; validated. Raises ArgsError with one clear line."""
    values: dict[str, Any] = read_recipe(recipe) if recipe is not None else {}
    overrides = dict(overrides or {})
    check_keys(overrides, "overrides")
    values.update(overrides)
    where = f"recipe {recipe}" if recipe is not None else "args"
    if overrides:
        where += " with overrides"
    return build_args(values, where)


def replace_args(args: Args, overrides: dict[str, Any], where: str) -> Args:
    """A validated deep copy of ``args`` with ``overrides`` applied; ``args`` is left untouched."""
    check_keys(overrides, where)
    values = args.model_dump()
    values.update(overrides)
    return build_args(values, where)


def parse_set(items: list[str]) -> dict[str, Any]:
    """``--set key=value`` items (values parsed as YAML) -> overrides."""
    return {key: value for key, (value, _) in parse_set_spelled(items).items()}


def parse_set_spelled(items: list[str]) -> dict[str, tuple[Any, str]]:
    """``--set key=value`` items -> {key: (value parsed as YAML, how it was written)}. A key set
    twice to different values is refused (``given_twice``) rather than the last one winning."""
    out: dict[str, tuple[Any, str]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ArgsError(f"--set expects key=value (got {item!r})")
        key = key.strip().replace("-", "_")
        parsed = yaml.safe_load(value) if value.strip() else None
        spelling = f"--set {item}"
        if key in out and not same_value(key, out[key][0], parsed):
            raise given_twice(key, out[key][1], spelling)
        out[key] = (parsed, spelling)
    return out


def given_twice(key: str, first: str, second: str) -> ArgsError:
    """The one line for one key given twice with two values: neither is picked silently."""
    return ArgsError(f"{key}: given twice with different values ('{first}' and '{second}'); give it once")


def same_value(key: str, a: Any, b: Any) -> bool:
    """Whether two spellings of ``key`` say the same: equal as written, as YAML (a flag's string
    ``1`` and ``--set``'s ``1``), or once validated as the field's type (``1e-4`` and ``0.0001``)."""
    a, b = _as_yaml(a), _as_yaml(b)
    if a == b:
        return True
    if key not in Args.model_fields:
        return False
    adapter = TypeAdapter(Args.model_fields[key].annotation)
    try:
        return adapter.validate_python(a) == adapter.validate_python(b)
    except ValidationError:
        return False


def _as_yaml(value: Any) -> Any:
    """A command line's string (or list of them) read as ``--set`` reads its value."""
    if isinstance(value, list):
        return [_as_yaml(v) for v in value]
    if isinstance(value, str):
        try:
            return yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError:
            return value
    return value
