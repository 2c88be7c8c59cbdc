"""The time plan of a run, beside its memory plan: seconds per iteration, per eval, per checkpoint
and per export, the teacher's reference once and the start, then iterations per night and nights
to ``num_iterations``, from the checkpoints' configs alone.

FLOPs: one transformer forward of each model (student, fake score, teacher, and the teacher
stopped at its feature block) at the run's sample, built on the meta device and counted with
torch's ``FlopCounterMode``; the GAN head's own forward likewise. A forward with a backward counts
3 forwards (the backward at twice the forward), 4 under gradient checkpointing (the blocks run
again); a LoRA's backward, through a frozen base, once the forward. Per iteration of
``global_batch_size`` samples:

- the rollout: the student's steps up to the drawn stop step, ``(K + 1) / 2`` forwards expected
  under backward simulation (k ~ U{0..K-1}, then the x0 at step k), else 1;
- the critic: ``num_steps_per_rollout`` trained forwards of the fake score, each with the GAN head
  on it and a trained forward of the real rows when there is a head, one more trained forward
  for the generator's GAN gradient at the last step; the scores: the teacher guided (2 forwards
  under CFG, 1 guidance-distilled or at scale 1), the fake score once more under ``original``
  scoring, and ``dmd2_regression_steps`` guided teacher forwards with a regression weight;
- the actor: one trained forward of the student.

An eval samples ``eval_num_samples`` quality samples at K student steps each, split over the
data-parallel ranks (each rank ``ceil(samples / dp)`` of them, ``parallel.EvalShare``; a context
group splits each), plus, for the ``teacher`` evaluator, the teacher's feature forward per sample,
split likewise; the media clips are the first quality samples, sampled again only where there are
more clips than quality samples. Its reference (once per teacher and settings) is
``eval_reference_steps`` guided teacher steps and the features, split likewise. Rank 0 decodes
alone (``eval_decodes``: the quality samples for their drift statistics, the media clips, the
reference's samples), each ``decode_flops`` at the device's rate or the decoder's measured one,
and the host's drift statistics and media encode cost seconds a decoded megapixel-frame where a
run measured them (``calibrate``). Seconds are
FLOPs / (MFU x the device's peak x devices); a checkpoint writes every group's trainable state
(``GroupPlan.saved`` on every shard); an export writes the student in its export dtype (and its
EMA; a LoRA not merged, its adapters alone) and the teacher's other components it copies beside a
whole student (their files, where the teacher directory holds them), then reads the student back
to verify it; the start reads every group's weights, each at ``storage_gbps``. A previous run of
the same save that measured its iterations (``iteration_s`` in its metrics log) sets the pace
instead of the assumed MFU; ``calibrate`` instead sets the rate from one measured iteration (its
FLOPs at the stop step it drew), the decoder's rate and the host's pace from the first eval, and
each save's fixed part from the first checkpoint and export.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Optional

import torch

from dmd2_core.args import Args
from dmd2_core.devices import DEFAULT_DEVICE, DEVICE_PEAK_TFLOPS
from dmd2_core.errors import ArgsError
from dmd2_core.memory import lora_terms
from dmd2_core.models import FAMILIES, describe_model_dir

DEFAULT_MFU = 0.4
DEFAULT_STORAGE_GBPS = 2.0  # GB/s to and from the save's storage, all ranks together
DEFAULT_NIGHT_HOURS = 10.0


@dataclass(frozen=True)
class ModelFlops:
    forward: int  # one sample's whole forward
    feature_forward: int  # one sample's forward stopped after the feature block
    head: int  # the GAN head on one sample's feature-block tokens
    params: int


def meta_cond(family, config: dict, text_tokens: int) -> dict:
    """One sample's conditions on the meta device, shaped as the family's forward takes them."""
    width = int(config.get("text_dim") or config.get("joint_attention_dim") or config.get("caption_channels") or 0)
    made = {}
    with torch.device("meta"):
        for key in family.cond_keys:
            if key == "prompt_embeds":
                made[key] = torch.randn(1, text_tokens, width)
            elif key == "pooled_prompt_embeds":
                made[key] = torch.randn(1, int(config["pooled_projection_dim"]))
            elif key == "prompt_lengths":  # read on the host (``.tolist()``): a CPU tensor
                made[key] = torch.tensor([text_tokens], device="cpu")
            else:
                raise NotImplementedError(f"{family.class_name}: no time plan for the condition '{key}'")
        keyframes = getattr(family, "keyframes", 0)
        if keyframes:  # fl2va: each keyframe a frame of condition rows in front of the video rows
            channels, _, height, width = family.video_shape
            made["keyframe_latents"] = torch.randn(1, keyframes, channels, 1, height, width)
            made["keyframe_anchors"] = torch.zeros(1, keyframes, dtype=torch.long, device="cpu")
        references = getattr(family, "references", ())
        if references:  # ref2va: each reference a block of condition rows (images and sounds in one shape each)
            from dmd2_core.models.minimax_h3 import AUDIO_LATENT_CHANNELS, REFERENCE_AUDIO, REFERENCE_KINDS

            images = [r for r in references if r[0] == "image"]
            sounds = [r for r in references if r[0] == "audio"]
            made["reference_latents"] = torch.randn(1, len(images), family.video_shape[0], *images[0][1:])
            made["reference_kinds"] = torch.tensor([[REFERENCE_KINDS.index(r[0]) for r in references]], device="cpu")
            made["text_token_tags"] = torch.ones(1, text_tokens, dtype=torch.long, device="cpu")
            if sounds:
                made[REFERENCE_AUDIO] = torch.randn(1, len(sounds), sounds[0][1], AUDIO_LATENT_CHANNELS)
    return made


def _count(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as flops:
        fn()
    return int(flops.get_total_flops())


@lru_cache(maxsize=16)
def model_flops(url: str, latent_shape: Optional[tuple[int, ...]], feature_block: Optional[int],
                text_tokens: Optional[int] = None, keyframes: int = 0, references: tuple = ()) -> ModelFlops:
    """One forward of checkpoint ``url``'s transformer at ``latent_shape`` and ``text_tokens``
    (default the family's) with ``keyframes`` condition frames (fl2va) or ``references`` (ref2va:
    ``reference_layout``'s tuple), whole and stopped at
    ``feature_block`` (default the middle one), and
    the GAN head on that block's tokens, counted on the meta device (cached per process: the
    configs do not change under a plan)."""
    from dmd2_core.memory.planner import family_shape
    from dmd2_core.models.feature_tap import FeatureTap
    from dmd2_core.models.gan_head import DiscriminatorHead

    model = lora_terms.meta_model(url)
    family = FAMILIES[describe_model_dir(url)["family"]]
    shape = family_shape(family, dict(model.config), list(latent_shape) if latent_shape else None)
    conditions = {k: v for k, v in (("keyframes", keyframes), ("references", references)) if v}
    family = family.bind(list(shape), model, **conditions)
    with torch.device("meta"):
        x = torch.randn(1, *family.sample_shape(model, list(shape)))
    cond = meta_cond(family, dict(model.config), family.default_text_tokens if text_tokens is None else text_tokens)
    sigma = torch.tensor([0.5])
    forward = _count(lambda: family.predict_velocity(model, x, sigma, cond))
    captured = {}

    def stopped():
        with FeatureTap(family, model, feature_block, stop=True) as tap:
            family.predict_velocity(model, x, sigma, cond)
        captured["features"] = tap.features

    feature = _count(stopped)
    with torch.device("meta"):
        head = DiscriminatorHead(family.feature_dim(model))
    head_flops = _count(lambda: head(captured["features"])) if captured.get("features") is not None else 0
    return ModelFlops(forward, feature, head_flops, sum(p.numel() for p in model.parameters()))


@lru_cache(maxsize=16)
def decode_flops(url: str, latent_shape: Optional[tuple[int, ...]]) -> tuple[int, int]:
    """(FLOPs, decoded pixel-frames) of decoding one sample of checkpoint ``url`` at
    ``latent_shape`` with its VAE (the family's ``decode_flops``: its config on the meta device,
    a video VAE's chunks and tiles each shape counted once); (0, 0) without a VAE (a model in pixel
    space). Cached per process, as ``model_flops``."""
    from dmd2_core.memory.planner import family_shape

    info = describe_model_dir(url)
    if not info["vae_url"]:
        return 0, 0
    model = lora_terms.meta_model(url)
    family = FAMILIES[info["family"]]
    shape = tuple(family_shape(family, dict(model.config), list(latent_shape) if latent_shape else None))
    family = family.bind(list(shape), model)
    return family.decode_flops(info["vae_url"], shape), family.decoded_pixel_frames(shape)


def eval_decodes(trainers: dict[str, Args], evaluator: str) -> dict[str, int]:
    """Samples the actor's rank 0 decodes in an eval, alone (the decode is not split over ranks):
    at each step count the teacher evaluator's quality samples (their drift statistics) and the
    media clips (decoded from the kept latents, then encoded); the reference's samples once.
    {"eval", "reference": decodes, "eval_drift", "reference_drift": samples measured for drift,
    "eval_encoded": media clips written}."""
    from dmd2_core.memory.terms import eval_clips

    actor = trainers["actor"]
    if not actor.eval_interval:
        return {"eval": 0, "reference": 0, "eval_drift": 0, "reference_drift": 0, "eval_encoded": 0}
    counts = len(actor.student_step_counts)
    drifted = actor.eval_num_samples if evaluator == "teacher" else 0
    clips = eval_clips(actor)
    return {"eval": counts * (drifted + clips), "reference": drifted, "eval_drift": counts * drifted,
            "reference_drift": drifted, "eval_encoded": counts * clips}


def copied_component_bytes(url: str) -> int:
    """Bytes of the teacher's files an export copies beside the student: every file of the
    teacher's directory outside its transformers (the VAEs, text encoders, tokenizers, the
    schedulers' configs). A directory of configs alone (a plan before the weights are at hand)
    counts only what it holds."""
    from dmd2_core.checkpoint.integrity import listing

    info = describe_model_dir(url)
    if info["transformer_url"].rstrip("/") == url.rstrip("/"):  # a bare transformer: nothing copied
        return 0
    return sum(size for name, size in listing(url).items() if not name.split("/", 1)[0].startswith("transformer"))


def _trained(args: Args) -> int:
    """Forwards a trained forward costs: the forward, its backward at twice it (the gradients of
    the inputs and of the weights), and under gradient checkpointing the blocks once more. A LoRA
    (``lora_rank``) freezes its base: the backward computes the inputs' gradients alone (its
    adapters' weight gradients are under 1% of a forward at rank 64), once the forward."""
    backward = 1 if args.lora_rank else 2
    return 1 + backward + (1 if args.gradient_checkpointing else 0)


def _guided(args: Args, family) -> int:
    return 1 if family.guidance_distilled or args.dmd2_guidance_scale == 1.0 else 2


def _rollout_forwards(args: Args, stop_step: Optional[int] = None) -> float:
    """Expected student forwards of one sample's rollout; at ``stop_step`` (what an iteration
    drew, its metrics row's ``stop_step``), that rollout's own."""
    if stop_step is not None:
        return stop_step + 1 if args.dmd2_backward_simulation else 1.0
    counts = args.student_step_counts
    weights = args.dmd2_student_steps_weights or [1.0] * len(counts)
    per = [(k + 1) / 2 if args.dmd2_backward_simulation else 1.0 for k in counts]
    return sum(w * f for w, f in zip(weights, per)) / sum(weights)


def _conditions(args: Args) -> dict:
    """The keyframe condition frames (fl2va) or the references (ref2va) a run's every forward
    carries: ``model_flops``' keyword arguments."""
    from dmd2_core.data import workflow_conditions

    return workflow_conditions(args.prompts, args.workflow)


def iteration_flops(trainers: dict[str, Args], stop_step: Optional[int] = None) -> dict[str, float]:
    """FLOPs of one iteration by part (rollout, critic, scores, actor), the whole global batch:
    the expected iteration, or the one whose rollout stopped at ``stop_step``."""
    actor = trainers["actor"]
    key = lambda a: tuple(a.latent_shape) if a.latent_shape else None  # noqa: E731
    student = model_flops(actor.hf_checkpoint, key(actor), actor.gan_feature_block, None, **_conditions(actor))
    batch = actor.global_batch_size
    parts = {"rollout": batch * _rollout_forwards(actor, stop_step) * student.forward,
             "actor": batch * _trained(actor) * student.forward}
    critic = trainers.get("critic")
    if critic is not None:
        fake = model_flops(critic.hf_checkpoint, key(critic), critic.gan_feature_block, None, **_conditions(critic))
        trained = _trained(critic) * fake.forward
        steps = critic.num_steps_per_rollout
        scoring = critic.loss_type == "dmd2_critic"
        head = scoring and bool(critic.gan_critic_weight)
        per_step = trained + (trained + 2 * 3 * fake.head if head else 0)  # the real rows, the head on both sides
        generator = trained + 3 * fake.head if head and critic.gan_weight else 0
        parts["critic"] = batch * (steps * per_step + generator)
        if scoring:
            teacher_url = critic.teacher_checkpoint or critic.hf_checkpoint
            teacher = model_flops(teacher_url, key(critic), critic.gan_feature_block, None, **_conditions(critic))
            family = FAMILIES[describe_model_dir(teacher_url)["family"]]
            guided = _guided(critic, family) * teacher.forward
            original = fake.forward if critic.dmd2_critic_scoring == "original" and not generator else 0
            regression = critic.dmd2_regression_steps * guided if critic.dmd2_regression_weight else 0
            parts["scores"] = batch * (guided + original + regression)
    return parts


def eval_flops(trainers: dict[str, Args], evaluator: str) -> dict[str, float]:
    """FLOPs of one eval (the quality samples, the teacher's features; the media clips only where
    there are more of them than quality samples: else they are the first quality samples) and of
    the teacher's reference, on one rank: each data-parallel rank runs its share of the rows."""
    from dmd2_core.memory.terms import eval_clips

    actor = trainers["actor"]
    if not actor.eval_interval:
        return {"eval": 0.0, "reference": 0.0}
    key = lambda a: tuple(a.latent_shape) if a.latent_shape else None  # noqa: E731
    share = lambda n, a: math.ceil(n / (a.num_devices // a.cp_size))  # noqa: E731 - one rank's rows (EvalShare)
    student = model_flops(actor.hf_checkpoint, key(actor), actor.gan_feature_block, None, **_conditions(actor))
    steps = sum(actor.student_step_counts)  # an eval of a set samples at each of its K
    samples, clips = actor.eval_num_samples, eval_clips(actor)
    flops = (share(samples, actor) + (share(clips, actor) if clips > samples else 0)) * steps * student.forward
    reference = 0.0
    if evaluator == "teacher":
        critic = trainers.get("critic") or actor
        teacher_url = critic.teacher_checkpoint or critic.hf_checkpoint
        teacher = model_flops(teacher_url, key(critic), critic.gan_feature_block, None, **_conditions(critic))
        family = FAMILIES[describe_model_dir(teacher_url)["family"]]
        features = share(samples, critic) * teacher.feature_forward
        flops += features
        reference = share(samples, critic) * actor.eval_reference_steps * _guided(actor, family) * teacher.forward \
            + features
    return {"eval": float(flops), "reference": float(reference)}


def measured_pace(rows: list[dict], url: str, full_size_stage: Optional[int] = None) -> Optional[dict]:
    """The pace a previous run of this save measured, from its metrics log's ``rows`` (at
    ``url``): the median ``iteration_s`` (its first iteration left out when there are others: it
    compiles and warms up), or None. Under a size schedule only the full-size iterations count
    (``size_stage`` equal to ``full_size_stage``, the schedule's last): a smaller stage's pace is
    not the full size's."""
    if full_size_stage is not None:
        rows = [r for r in rows if r.get("size_stage", full_size_stage) == full_size_stage]
    timed = [float(r["iteration_s"]) for r in rows if isinstance(r.get("iteration_s"), (int, float))]
    if len(timed) > 1:
        timed = timed[1:]
    if not timed:
        return None
    return {"iteration_s": statistics.median(timed), "iterations": len(timed), "url": url}


@dataclass
class TimePlan:
    num_devices: int
    cp_size: int
    mfu: float
    peak_flops: float  # per device
    storage_gbps: float
    night_s: float
    num_iterations: int
    eval_interval: int
    save_interval: int
    export_interval: int
    iteration_flops: dict[str, float]
    eval_flops: float
    reference_flops: float
    checkpoint_bytes: int
    export_bytes: int
    start_bytes: int
    measured: Optional[dict] = None  # measured_pace, when a previous run set the pace
    notes: list[str] = field(default_factory=list)
    calibrated: Optional[dict] = None  # calibrate's figures, when one measured iteration set the rates
    # a size schedule's stages: {stage, first, last, latent_shape, iteration_flops}; the last is the full size
    stages: list[dict] = field(default_factory=list)
    # the eval's decoder and host work (eval_decodes), on the actor's rank 0 alone
    decode_flops: float = 0.0  # one sample's decode
    pixel_frames: int = 0  # one decoded sample's pixels over its frames
    decodes: dict[str, int] = field(default_factory=dict)
    decode_flops_per_s: Optional[float] = None  # measured (calibrate); None: the device's rate
    drift_s_per_mpf: Optional[float] = None  # host seconds a decoded megapixel-frame; None: not priced
    encode_s_per_mpf: Optional[float] = None
    # the teacher's reference sampling, FLOP/s of one device, where a run measured it (calibrate); None:
    # the iteration's rate (no-grad guided forwards run at another efficiency than a training step)
    reference_flops_per_s: Optional[float] = None
    # a save's fixed seconds (its files, hashes, marker) beside its bytes at storage_gbps (calibrate)
    checkpoint_fixed_s: float = 0.0
    export_fixed_s: float = 0.0

    @property
    def rate(self) -> float:
        """FLOP/s of one device at the assumed MFU."""
        return self.mfu * self.peak_flops

    @property
    def assumed_iteration_s(self) -> float:
        return sum(self.iteration_flops.values()) / (self.rate * self.num_devices)

    @property
    def iteration_s(self) -> float:
        return self.measured["iteration_s"] if self.measured else self.assumed_iteration_s

    @property
    def implied_mfu(self) -> float:
        """The MFU the pace implies (the assumed one, or what the measured pace comes to)."""
        return sum(self.iteration_flops.values()) / (self.iteration_s * self.peak_flops * self.num_devices)

    @property
    def decode_rate(self) -> float:
        """FLOP/s of the decoder on rank 0: as measured (``calibrate``), else the device's rate."""
        return self.decode_flops_per_s or self.implied_mfu * self.peak_flops

    def _decoder_and_host_s(self, part: str) -> float:
        """Rank 0's decodes of an eval (``part`` 'eval') or of the reference, and the host's work on
        them (drift statistics, the media encode) where a run measured its pace."""
        mpf = self.pixel_frames / 1e6
        decodes = self.decodes.get(part, 0)
        seconds = decodes * self.decode_flops / self.decode_rate if decodes else 0.0
        seconds += self.decodes.get(f"{part}_drift", 0) * mpf * (self.drift_s_per_mpf or 0.0)
        seconds += self.decodes.get(f"{part}_encoded", 0) * mpf * (self.encode_s_per_mpf or 0.0)
        return seconds

    @property
    def eval_s(self) -> float:
        # eval_flops are one rank's: its share of the samples, a context group splitting each sample
        return self.eval_flops / (self.implied_mfu * self.peak_flops * self.cp_size) + self._decoder_and_host_s("eval")

    @property
    def reference_s(self) -> float:
        rate = self.reference_flops_per_s or self.implied_mfu * self.peak_flops
        return self.reference_flops / (rate * self.cp_size) + self._decoder_and_host_s("reference")

    @property
    def checkpoint_s(self) -> float:
        return self.checkpoint_fixed_s + self.checkpoint_bytes / (self.storage_gbps * 1e9)

    @property
    def export_s(self) -> float:
        return self.export_fixed_s + self.export_bytes / (self.storage_gbps * 1e9)

    @property
    def start_s(self) -> float:
        return self.start_bytes / (self.storage_gbps * 1e9)

    def per_iteration_s(self, iteration_s: Optional[float] = None) -> float:
        """An iteration (of ``iteration_s``, default the full size's) with its share of the evals,
        checkpoints and exports."""
        share = lambda interval: 1 / interval if interval else 0.0  # noqa: E731
        exports = share(self.save_interval) if self.export_interval == 0 else share(self.export_interval)
        return ((self.iteration_s if iteration_s is None else iteration_s) + share(self.eval_interval) * self.eval_s
                + share(self.save_interval) * self.checkpoint_s + exports * self.export_s)

    def stage_iteration_s(self, stage: dict) -> float:
        """Seconds of an iteration of a size schedule's stage: its FLOPs at the pace's MFU (a
        smaller sample runs at the full size's utilisation: optimistic where it is too small to
        fill the devices)."""
        return sum(stage["iteration_flops"].values()) / (self.implied_mfu * self.peak_flops * self.num_devices)

    def stage_iterations_per_night(self, stage: dict) -> int:
        """Iterations of ``stage``'s size a night holds after its start and closing (as ``iterations_per_night``)."""
        closing = self.start_s + self.checkpoint_s + self.export_s + (self.eval_s if self.eval_interval else 0)
        return max(0, int((self.night_s - closing) / self.per_iteration_s(self.stage_iteration_s(stage))))

    def _staged_nights(self) -> Optional[int]:
        """``nights`` through a size schedule: nights filled in order with each iteration at its
        stage's cost; a first night that trains nothing (its reference alone) is not counted, as
        in ``nights``."""
        closing = self.start_s + self.checkpoint_s + self.export_s + (self.eval_s if self.eval_interval else 0)
        costs = [(stage["last"], self.per_iteration_s(self.stage_iteration_s(stage))) for stage in self.stages]
        if self.num_iterations <= 0:
            return 1
        nights, trained, budget, index = 1, 0, self.night_s - self.reference_s - closing, 0
        for iteration in range(1, self.num_iterations + 1):
            while index < len(costs) - 1 and iteration > costs[index][0]:
                index += 1
            cost = costs[index][1]
            if budget < cost:
                if trained == 0 and nights > 1:
                    return None  # a whole night holds no iteration of this size
                nights, trained, budget = nights + (1 if trained else 0), 0, self.night_s - closing
                if budget < cost:
                    return None
            budget -= cost
            trained += 1
        return nights

    @property
    def iterations_per_night(self) -> int:
        """Iterations a night holds after its start, a final checkpoint, eval and export (the first
        night also makes the teacher's reference)."""
        closing = self.start_s + self.checkpoint_s + self.export_s + (self.eval_s if self.eval_interval else 0)
        return max(0, int((self.night_s - closing) / self.per_iteration_s()))

    @property
    def nights(self) -> Optional[int]:
        """Nights to ``num_iterations`` at this pace (the first night's reference included),
        through the size schedule's stages when there is one."""
        if self.stages:
            return self._staged_nights()
        return self.nights_at_full_size

    @property
    def nights_at_full_size(self) -> Optional[int]:
        """Nights to ``num_iterations`` with every iteration at the full size."""
        per_night = self.iterations_per_night
        if not per_night:
            return None
        first = max(0, int((self.night_s - self.reference_s - self.start_s - self.checkpoint_s - self.export_s
                            - (self.eval_s if self.eval_interval else 0)) / self.per_iteration_s()))
        left = max(0, self.num_iterations - first)
        return (1 if first else 0) + math.ceil(left / per_night) if left else 1

    def as_dict(self) -> dict:
        out = asdict(self)
        for name in ("iteration_s", "assumed_iteration_s", "implied_mfu", "eval_s", "reference_s", "checkpoint_s",
                     "export_s", "start_s", "iterations_per_night", "nights", "nights_at_full_size"):
            out[name] = getattr(self, name)
        for stage, row in zip(self.stages, out["stages"]):
            row.update(iteration_s=self.stage_iteration_s(stage), iterations_per_night=self.stage_iterations_per_night(stage))
        out["pace"] = "measured" if self.measured else "calibrated" if self.calibrated else "assumed"
        return out


def nightly_intervals(tp: TimePlan) -> dict[str, int]:
    """A night's intervals from its time plan: ``eval_interval`` E the largest whose night holds 2E
    iterations or more, so that every night, wherever it starts, evaluates in its first half and
    again at its end (a time-boxed leg's final eval); a checkpoint and an export at each eval
    (``save_interval`` and ``export_interval`` E: a crash loses at most E iterations, and every
    evaluated student can be kept). 0 each when a night holds fewer than 2 iterations."""
    most = dataclasses.replace(tp, eval_interval=0, save_interval=0, export_interval=0).iterations_per_night
    for every in range(max(1, most // 2), 0, -1):
        night = dataclasses.replace(tp, eval_interval=every, save_interval=every, export_interval=every)
        if night.iterations_per_night >= 2 * every:
            return {"eval_interval": every, "save_interval": every, "export_interval": every}
    return {"eval_interval": 0, "save_interval": 0, "export_interval": 0}


def device_peak_flops(device: str) -> float:
    """The dense bf16 peak FLOP/s of one device of a kind in ``DEVICE_PEAK_TFLOPS``."""
    if device not in DEVICE_PEAK_TFLOPS:
        from dmd2_core.errors import nearest

        raise ArgsError(f"device_kind: no peak for '{device}'{nearest(device, sorted(DEVICE_PEAK_TFLOPS))} "
                        f"(known: {', '.join(sorted(DEVICE_PEAK_TFLOPS))}; or give peak_tflops)")
    return DEVICE_PEAK_TFLOPS[device] * 1e12


def implied_mfu(flops_per_iteration: float, iteration_s: float, peak_flops: float, num_devices: int) -> float:
    """The MFU a measured pace implies: an iteration's FLOPs over what ``num_devices`` devices of
    ``peak_flops`` could do in ``iteration_s`` (as ``TimePlan.implied_mfu``)."""
    return flops_per_iteration / (iteration_s * peak_flops * num_devices)


def cluster_peak_flops() -> Optional[float]:
    """The dense bf16 peak FLOP/s of one device of the Ray cluster this process is connected to:
    its GPUs' accelerator type (Ray's ``accelerator_type:<kind>`` resource, e.g. H100) when it is
    one of ``DEVICE_PEAK_TFLOPS``; None on CPUs, for an unknown kind or a mix of kinds, and when
    this process is connected to no cluster (a driver whose groups run elsewhere or are stood in)."""
    import ray

    if not ray.is_initialized():
        return None
    kinds = {key.split(":", 1)[1] for key in ray.cluster_resources() if key.startswith("accelerator_type:")}
    peaks = {peak for name, peak in DEVICE_PEAK_TFLOPS.items() for kind in kinds if name in kind}
    return peaks.pop() * 1e12 if len(kinds) == 1 and len(peaks) == 1 else None


def time_plan(trainers: dict[str, Args], memory_plan, evaluator: str, mfu: float = DEFAULT_MFU,
              peak_flops: Optional[float] = None, storage_gbps: float = DEFAULT_STORAGE_GBPS,
              night_hours: float = DEFAULT_NIGHT_HOURS, measured: Optional[dict] = None) -> TimePlan:
    """The time plan of a run's trainers and their memory plan (``planner.plan``)."""
    if not 0 < mfu <= 1:
        raise ArgsError(f"assumed_mfu: {mfu} is not in (0, 1]")
    if storage_gbps <= 0 or night_hours <= 0:
        raise ArgsError(f"{'storage_gbps' if storage_gbps <= 0 else 'night_hours'}: must be above 0")
    actor = trainers["actor"]
    peak = peak_flops if peak_flops is not None else device_peak_flops(DEFAULT_DEVICE)
    evals = eval_flops(trainers, evaluator)
    shards = memory_plan.shard_size
    # each shard group holds the whole state once; every group's shards written, every weight read
    checkpoint = sum(g.saved for g in memory_plan.groups) * shards
    start = sum(g.loaded for g in memory_plan.groups) * shards
    export_dtype = torch.empty(0, dtype=getattr(torch, actor.export_dtype or actor.dtype)).element_size()
    student = model_flops(actor.hf_checkpoint, tuple(actor.latent_shape) if actor.latent_shape else None,
                          actor.gan_feature_block)
    # a LoRA student is exported as its adapters (the family's diffusers LoRA format) unless merged
    adapters_only = bool(actor.lora_rank and not actor.export_merged)
    exported = lora_terms.size_of(actor).adapters if adapters_only else student.params
    transformers = exported * export_dtype * (2 if actor.ema_decay else 1)
    # written: the student (and its EMA) and the teacher's components copied beside it; read back: the student
    export = 2 * transformers + (0 if adapters_only else copied_component_bytes(actor.hf_checkpoint))
    decoded, pixel_frames = decode_flops(actor.hf_checkpoint, tuple(actor.latent_shape) if actor.latent_shape else None)
    notes = ["eval: each data-parallel rank samples its share; the media clips are the first quality samples"]
    if decoded:
        notes.append("the decodes (rank 0 alone) at the device's rate; the host's drift statistics and media encode "
                     "not priced (calibrate_from a run measures both)")
    full = iteration_flops(trainers)
    return TimePlan(actor.num_devices, memory_plan.cp_size, mfu, peak, storage_gbps, night_hours * 3600,
                    actor.num_iterations, actor.eval_interval, actor.save_interval, actor.export_interval,
                    full, evals["eval"], evals["reference"], checkpoint, export, start,
                    measured, notes, stages=stage_flops(trainers, full), decode_flops=float(decoded),
                    pixel_frames=pixel_frames, decodes=eval_decodes(trainers, evaluator) if decoded else {})


def stage_flops(trainers: dict[str, Args], full: dict[str, float]) -> list[dict]:
    """A size schedule's stages with the FLOPs of one iteration at each one's size (the last, the
    full size, is ``full``); [] without a schedule."""
    from dmd2_core.size_schedule import stage_spans

    spans = stage_spans(trainers["actor"])
    stages = []
    for index, (first, last, stage) in enumerate(spans):
        flops = full
        if index < len(spans) - 1:
            flops = iteration_flops({role: targs.model_copy(update={"latent_shape": list(stage["latent_shape"])})
                                     for role, targs in trainers.items()})
        stages.append({"stage": index + 1, "first": first, "last": last, "latent_shape": list(stage["latent_shape"]),
                       "iteration_flops": flops})
    return stages


def calibrate(plan: TimePlan, trainers: dict[str, Args], rows: list[dict], url: str) -> TimePlan:
    """``plan`` at the rates one measured iteration and one checkpoint of a previous run imply
    (its metrics log's ``rows``, at ``url``): the FIRST row with ``iteration_s`` gives the effective
    FLOP/s per device (that iteration's FLOPs, at the stop step it drew, over its seconds and the
    devices: the plan's MFU becomes what it implies), the checkpoints and exports their fixed
    seconds (``_save_fixed``), the first eval that split its seconds the decoder's FLOP/s and the
    host's pace (``_decoder_and_host``); every other cost follows from the model. The first
    iteration is taken, not a median: it is what a team has after one short try. The eval that made
    the teacher's reference prices the reference's sampling (``_reference_rate``)."""
    timed = next((r for r in rows if isinstance(r.get("iteration_s"), (int, float)) and r["iteration_s"] > 0), None)
    if timed is None:
        raise ArgsError(f"calibrate_from: no measured iteration (iteration_s) in {url}")
    stop = timed.get("stop_step")
    stop_step = int(stop) if isinstance(stop, (int, float)) else None
    flops = sum(iteration_flops(trainers, stop_step).values())
    flops_per_s = flops / (float(timed["iteration_s"]) * plan.num_devices)
    figures = {"url": url, "iteration": int(timed["iteration"]), "iteration_s": float(timed["iteration_s"]),
               "stop_step": stop_step, "iteration_flops": flops, "flops_per_s": flops_per_s}
    saves = _save_fixed(plan, rows, figures)
    figures.update(storage_gbps=plan.storage_gbps, **saves)
    decoder = _decoder_and_host(plan, _first(rows, "eval_decode_s"), figures)
    plan = replace(plan, mfu=flops_per_s / plan.peak_flops, measured=None, calibrated=figures, **saves, **decoder)
    return replace(plan, **_reference_rate(plan, _first(rows, "eval_reference_s"), figures))


def _first(rows: list[dict], key: str) -> Optional[dict]:
    """The first row that measured ``key`` (a positive number)."""
    return next((r for r in rows if isinstance(r.get(key), (int, float)) and r[key] > 0), None)


def _save_fixed(plan: TimePlan, rows: list[dict], figures: dict) -> dict:
    """Each kind of save's fixed seconds (a checkpoint's: DCP's planning, its files, hashes and
    marker; an export's: its files and read-back set up): a save's seconds less its bytes at
    ``storage_gbps``, from the median of the run's saves of that kind after its first, or from the
    first where the run made one. A trainer process's first save runs every code path cold (the
    MiniMax-H3 stand-in in one process: checkpoint 0.31 s, then 0.08 s and 0.09 s; export 23 ms, then
    7 and 8 ms), and a night's saves after its first are the many. One save of a kind cannot tell
    its fixed part from its bandwidth; the bandwidth is the storage's (the flag), and a small save
    (the stand-in's MB) measures its fixed part alone, which a real-size save's bytes then dwarf."""
    out = {}
    for kind, seconds, size in (("checkpoint", "checkpoint_save_s", plan.checkpoint_bytes),
                                ("export", "export_s", plan.export_bytes)):
        measured = [r for r in rows if isinstance(r.get(seconds), (int, float)) and r[seconds] > 0]
        if measured:
            warm = measured[1:] or measured
            typical = statistics.median(float(r[seconds]) for r in warm)
            out[f"{kind}_fixed_s"] = max(0.0, typical - size / (plan.storage_gbps * 1e9))
            figures.update({f"{kind}_iterations": [int(r["iteration"]) for r in warm], seconds: typical})
    return out


def _reference_rate(plan: TimePlan, made: Optional[dict], figures: dict) -> dict:
    """The teacher reference's sampling FLOP/s per device from the eval that made it (its
    ``eval_reference_s`` less its decodes and drift statistics as ``plan`` prices them): 50 guided
    no-grad steps in large batches, not a training step's pace (the MiniMax-H3 stand-in: priced at
    the iteration's rate the reference came out 1.2-1.33x its measured seconds)."""
    if made is None or not plan.reference_flops:
        return {}
    sampling_s = float(made["eval_reference_s"]) - plan._decoder_and_host_s("reference")
    if sampling_s <= 0:
        return {}
    rate = plan.reference_flops / (sampling_s * plan.cp_size)
    figures.update(reference_iteration=int(made["iteration"]), reference_flops_per_s=rate)
    return {"reference_flops_per_s": rate}


def _decoder_and_host(plan: TimePlan, evaluated: Optional[dict], figures: dict) -> dict:
    """The decoder's FLOP/s and the host's seconds a decoded megapixel-frame (the drift statistics,
    the media encode) from the first eval that measured them (its ``eval_decode_s`` over
    ``eval_decoded_clips``, ``eval_drift_s`` over ``eval_drift_clips``, ``eval_encode_s`` over
    ``eval_encoded_clips``: ``eval_step.SampledOnce.timings``): the decoder runs 3-D convolutions
    and, alone on rank 0, at another efficiency than the transformers' matmuls the iteration
    measured; the host's work is CPU time the FLOP count does not see."""
    if evaluated is None or not plan.decode_flops or not plan.pixel_frames:
        return {}
    mpf = plan.pixel_frames / 1e6
    out = {"decode_flops_per_s": plan.decode_flops * evaluated["eval_decoded_clips"] / evaluated["eval_decode_s"]}
    for kind, seconds, clips in (("drift", "eval_drift_s", "eval_drift_clips"),
                                 ("encode", "eval_encode_s", "eval_encoded_clips")):
        if evaluated.get(clips) and isinstance(evaluated.get(seconds), (int, float)):
            out[f"{kind}_s_per_mpf"] = float(evaluated[seconds]) / (evaluated[clips] * mpf)
    figures.update(eval_iteration=int(evaluated["iteration"]), **out)
    return out


def _seconds(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    return f"{s:.1f} s" if s >= 1 else f"{s * 1000:.1f} ms"


def table(tp: TimePlan) -> str:
    """The time plan as a few lines, under the memory plan's table."""
    cal = tp.calibrated
    pace = (f"measured {tp.measured['iteration_s']:.3f} s an iteration over {tp.measured['iterations']} iterations "
            f"of {tp.measured['url']} (implies MFU {tp.implied_mfu:.3g}; assumed {tp.mfu:g} would give "
            f"{_seconds(tp.assumed_iteration_s)})" if tp.measured else
            f"calibrated from iteration {cal['iteration']} of {cal['url']}: {cal['iteration_s']:.3f} s at stop step "
            f"{cal['stop_step']} is {cal['flops_per_s'] / 1e12:.4g} TFLOP/s per device (MFU {tp.mfu:.3g})"
            + (f", its checkpoints at iterations {', '.join(map(str, cal['checkpoint_iterations']))} "
               f"{cal['checkpoint_fixed_s']:.3g} s fixed" if "checkpoint_iterations" in cal else "")
            + (f", its eval at iteration {cal['eval_iteration']}: the decoder {cal['decode_flops_per_s'] / 1e9:.3g} "
               f"GFLOP/s, the host {cal.get('drift_s_per_mpf', 0):.3g} s (drift) and "
               f"{cal.get('encode_s_per_mpf', 0):.3g} s (encode) a megapixel-frame" if "eval_iteration" in cal else "")
            if cal else
            f"assumed MFU {tp.mfu:g} of {tp.peak_flops / 1e12:g} TFLOP/s per device (assumed_mfu, peak_tflops)")
    flops = ", ".join(f"{k} {v / 1e12:.4g}" for k, v in tp.iteration_flops.items())
    nights = tp.nights
    lines = [
        f"time plan ({tp.num_devices} devices; {pace})",
        f"  iteration      {_seconds(tp.iteration_s):>10}   {sum(tp.iteration_flops.values()) / 1e12:.4g} TFLOP ({flops})",
        f"  eval           {_seconds(tp.eval_s):>10}   {tp.eval_flops / 1e12:.4g} TFLOP"
        + ("" if tp.eval_interval else " (eval_interval 0: none)")
        + (f"; rank 0 decodes {tp.decodes.get('eval', 0)} samples of {tp.decode_flops / 1e12:.4g} TFLOP"
           if tp.decode_flops and tp.eval_interval else ""),
        f"  reference      {_seconds(tp.reference_s):>10}   {tp.reference_flops / 1e12:.4g} TFLOP, once per teacher and settings",
        f"  checkpoint     {_seconds(tp.checkpoint_s):>10}   {tp.checkpoint_bytes / 1e9:.3g} GB at {tp.storage_gbps:g} GB/s (storage_gbps)",
        f"  export         {_seconds(tp.export_s):>10}   {tp.export_bytes / 1e9:.3g} GB written and read back",
        f"  start          {_seconds(tp.start_s):>10}   {tp.start_bytes / 1e9:.3g} GB read, every group",
        f"  a night of {tp.night_s / 3600:g} h (night_hours): {tp.iterations_per_night} iterations; "
        + (f"{nights} night(s) to num_iterations {tp.num_iterations}" if nights else "no iteration fits")
        + f" ({'; '.join(tp.notes)})",
    ]
    for stage in tp.stages:
        lines.append(f"  size stage {stage['stage']} (iterations {stage['first']}-{stage['last']}, latents "
                     f"{stage['latent_shape']}): {_seconds(tp.stage_iteration_s(stage))} an iteration, "
                     f"{sum(stage['iteration_flops'].values()) / 1e12:.4g} TFLOP; a night holds "
                     f"{tp.stage_iterations_per_night(stage)} of them")
    if tp.stages:
        full = tp.nights_at_full_size
        lines.append(f"  with the size schedule: {nights or 'no'} night(s) to num_iterations {tp.num_iterations}; "
                     f"every iteration at the full size: {full or 'no'} (the eval is the full size's in every stage)")
    nightly = nightly_intervals(tp)
    ours = {k: getattr(tp, k) for k in nightly}
    lines.append("  a night's intervals by this plan (an eval in every night's first half and at its end): "
                 + ", ".join(f"{k} {v}" for k, v in nightly.items())
                 + ("" if ours == nightly else " (this run: " + ", ".join(f"{k} {v}" for k, v in ours.items()) + ")"))
    return "\n".join(lines)
