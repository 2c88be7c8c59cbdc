"""What the teacher evaluator costs for minimax-h3: the teacher's reference (made once per teacher
and eval settings) and each eval, counted in transformer forwards on the MiniMax-H3 stand-in and
priced at real size in FLOPs and H100-GPU-seconds. Prints one JSON line:

  {"standin": {"reference" | "eval" | "media" | "iteration": {"wall_s", "forwards": {model: {...}}, ...}, ...},
   "real_size": {"flops_pflop": {"forward", "feature_forward", "decode", ...}, "mfu", "drift_on_actor_rank0",
                 "groups": {group: {"reference" | "eval" | "media" | "iteration": {"pflop", "wall_s", "gpu_s"},
                                    "nights": {eval_interval: {"evals", "eval_gpu_h", ...}}}}}}

Stand-in (CPU, fp32, one rank per group, in process): the minimax-h3 recipe's eval settings as
shipped (eval_num_samples 32 of eval_prompts 0-3, eval_reference_steps 50, 4 student steps, EMA),
the stand-in's geometry (124 frames of 32 x 32). "reference" is ``evaluators.teacher_reference``
on an empty cache (the teacher's 50-step samples, their teacher features, their decode), "eval" is
``evaluators.evaluate`` hitting that cache (the student's 4-step samples, features, decode),
"media" the eval's clips of ``eval_step.run_eval`` (eval_prompts x eval_samples_per_prompt, 4
steps, decoded), "iteration" one DMD2 iteration (rollout, the critic's train, the actor's train)
at the recipe's batch, averaged over the four stop steps. Every transformer call is counted (rows,
whole or stopped at the feature block, with a graph for a backward or not) and timed, and so is
every decode; "s_per_forward" is a separately timed batch-1 forward of the teacher; "explained"
is rows x that over the wall time (and over the wall time less the decode), "counted_share" the
forwards' and decodes' own timed seconds over it, "other_s" the rest (noise, Euler updates, KID,
the drift statistics).

Real size: FLOPs of one MiniMax-H3 transformer forward at the recipe's clip (124 frames of
768 x 1344: 37,296 video + 414 audio rows, plus ``text_tokens`` of text), built from
deployments/model_configs/minimax-h3 on the meta device and counted with torch's FlopCounterMode;
the feature forward stopped at the middle block; the video VAE's decode (one temporal chunk,
times the chunks of a clip) and the audio VAE's. The stand-in's row counts times these FLOPs give
the reference, an eval and an iteration; seconds at ``mfu`` of the H100's dense bf16 peak, per
group of devices (``GROUPS``): an eval's forwards run on every rank of the group (a sharded
forward is a collective, and the eval's samples are not split over data-parallel ranks), so its
GPU-seconds are the group's devices times the wall time; an iteration's rows are split. Apart:
the CPU seconds (the actor's rank 0, while its group waits) for the drift statistics of one real-size decoded clip (this process's
CPU time on one thread, at half the height and width, times 4) and the bytes of a decoded clip
(float32).

    python bench/eval_cost.py [--mfu 0.4] [--text-tokens 256] [--iterations 4000]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H3_CONFIG = os.path.join(ROOT, "deployments", "model_configs", "minimax-h3")
H100_BF16_TFLOPS = 989.4  # dense, no sparsity (dmd2_core/memory/time_plan.py's DEVICE_PEAK_TFLOPS)
INTERVALS = (50, 100, 200)
# (num_devices, cp_size): the recipe as written, and where the memory plan fits full fine-tuning
# of MiniMax-H3 at 5 s on 80 GiB devices (docs/scale.md: 32 x 80 GiB at cp 2)
GROUPS = {"recipe 8 x H100, cp 1": (8, 1), "32 x H100, cp 2 (fits 80 GiB)": (32, 2)}


# ---- counting the stand-in's forwards -------------------------------------------------------------

class ForwardCounter:
    """Wraps transformers' ``forward``: per (phase, model) the calls, rows, rows of forwards that
    stopped at the feature block, rows with grad, and seconds inside."""

    def __init__(self):
        self.phase = "setup"
        self.seen: dict = defaultdict(lambda: defaultdict(float))

    def wrap(self, model: torch.nn.Module, name: str) -> None:
        inner = model.forward

        def forward(*args, **kwargs):
            rows = int((kwargs.get("hidden_states") if "hidden_states" in kwargs else args[0]).shape[0])
            row = self.seen[(self.phase, name)]
            start = time.perf_counter()
            stopped, grad = True, False
            try:
                out = inner(*args, **kwargs)
                stopped = False
                # a backward will run through it: its output carries a graph
                grad = any(t.requires_grad for t in (out if isinstance(out, tuple) else [out]) if torch.is_tensor(t))
                return out
            finally:
                row["calls"] += 1
                row["rows"] += rows
                row["stopped_rows"] += rows if stopped else 0
                row["grad_rows"] += rows if grad else 0
                row["seconds"] += time.perf_counter() - start

        model.forward = forward

    def of(self, phase: str) -> dict:
        return {name: {k: round(v, 3) if k == "seconds" else int(v) for k, v in row.items()}
                for (p, name), row in sorted(self.seen.items()) if p == phase}


class InProcessRun:
    """What an eval asks of a DistillRun, answered by in-process trainers; decodes are counted."""

    def __init__(self, actor, critic, counter: ForwardCounter):
        self.actor, self.critic, self.counter, self.has_critic = actor, critic, counter, True
        self.decoded: dict = defaultdict(lambda: {"clips": 0, "seconds": 0.0})

    def sample(self, prompt_index, seed, num_steps=None):
        latents = self.eval_latents(prompt_index, seed, num_steps)
        return self.decode(latents)

    def eval_latents(self, prompt_index, seed, num_steps=None):
        return self.actor.sample(prompt_index, seed, decode=False, num_steps=num_steps)

    def decode(self, latents):
        return self._decoding(self.actor.decode, latents)

    def drift_stats(self, latents):
        return self._decoding(self.actor.drift_stats, latents)

    def _decoding(self, call, latents):
        """``call(latents)``, its clips and seconds counted as decodes of the current phase."""
        start = time.perf_counter()
        out = call(latents)
        row = self.decoded[self.counter.phase]
        row["clips"] += latents.shape[0]
        row["seconds"] += time.perf_counter() - start
        return out

    def teacher_reference(self, prompt_index, seed, num_steps):
        return self.critic.teacher_reference(prompt_index, seed, num_steps)

    def teacher_features(self, latents, prompt_index, u, seed):
        return self.critic.teacher_features(latents, prompt_index, u, seed)


@contextlib.contextmanager
def phase(counter: ForwardCounter, name: str, walls: dict):
    counter.phase = name
    start = time.perf_counter()
    yield
    walls[name] = walls.get(name, 0.0) + time.perf_counter() - start
    counter.phase = "setup"


def seconds_per_forward(family, model, cond: dict, shape, repeats: int = 20) -> float:
    """The median seconds of one batch-1 forward (a 4-step sample's step on 8 ranks is one)."""
    x = torch.randn(1, *shape)
    times = []
    with torch.no_grad():
        for _ in range(repeats + 2):
            start = time.perf_counter()
            family.predict_velocity(model, x, torch.tensor([0.5]), cond)
            times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def standin(tmp: str) -> tuple[dict, object]:
    from dmd2_core.args import load_args
    from dmd2_core.evaluation import teacher_evaluator as evaluators
    from dmd2_core.run.distill_run import preflight
    from dmd2_core.toys.standins import H3_GEOMETRY, build_h3_standin, h3_prompt_set
    from dmd2_core.train.dmd2_iteration import draw_stop_step
    from dmd2_core.train.trainer import Trainer

    url = build_h3_standin(f"{tmp}/h3")
    prompts = h3_prompt_set()
    prompts.save(f"{tmp}/prompts.safetensors")
    args = load_args("minimax-h3", dict(
        hf_checkpoint=url, prompts=f"{tmp}/prompts.safetensors", save=f"{tmp}/run", device="cpu", num_devices=1,
        cp_size=1, lora_rank=0, dtype="float32", torch_threads=1, run_name="bench-eval-cost", **H3_GEOMETRY))
    roles = preflight(args)
    critic, actor = Trainer(roles["critic"], "critic"), Trainer(roles["actor"], "actor")
    counter = ForwardCounter()
    counter.wrap(actor.model, "student")
    counter.wrap(critic.teacher, "teacher")
    counter.wrap(critic.model, "fake_score")
    run, walls = InProcessRun(actor, critic, counter), {}

    order = evaluators.eval_order(args, len(prompts.prompts))
    with phase(counter, "reference", walls):
        made = evaluators.teacher_reference(run, args, order)
    assert not made["hit"]
    with phase(counter, "eval", walls):
        quality = evaluators.evaluate(run, args)
    assert quality["metrics"] and critic.args.eval_reference_steps == 50
    indices = evaluators.eval_prompt_indices(args, len(prompts.prompts))
    media_order = [p for _ in range(args.eval_samples_per_prompt) for p in indices]
    with phase(counter, "media", walls):
        run.sample(media_order, args.eval_seed)
    # one iteration per stop step (k ~ U{0..K-1}): their mean is the expected iteration
    by_step = {}
    for i in range(1, 200):
        by_step.setdefault(draw_stop_step(args, i, args.dmd2_student_steps), i)
        if len(by_step) == args.dmd2_student_steps:
            break
    with phase(counter, "iteration", walls):
        for i in sorted(by_step.values()):
            pairs, _ = actor.rollout(i)
            scores, _ = critic.train(i, pairs)
            actor.train(i, pairs, scores)

    family = critic.family
    cond = {k: prompts.embeds[k][:1] for k in ("prompt_embeds", "prompt_lengths")}
    s_forward = seconds_per_forward(family, critic.teacher, cond, actor.shape)
    out = {"settings": {"eval_num_samples": args.eval_num_samples, "eval_reference_steps": args.eval_reference_steps,
                        "student_steps": args.dmd2_student_steps, "eval_prompts": list(indices),
                        "eval_samples_per_prompt": args.eval_samples_per_prompt,
                        "global_batch_size": args.global_batch_size, "micro_batch_size": args.micro_batch_size,
                        "dmd2_update_ratio": args.dmd2_update_ratio, "iterations_timed": sorted(by_step.values()),
                        "standin_transformer_params": sum(p.numel() for p in critic.teacher.parameters())},
           "s_per_forward": round(s_forward, 5)}
    per = {"iteration": len(by_step)}
    for name in ("reference", "eval", "media", "iteration"):
        forwards = counter.of(name)
        if name == "iteration":
            forwards = {m: {k: round(v / per[name], 3) for k, v in row.items()} for m, row in forwards.items()}
        rows = sum(r["rows"] for r in forwards.values())
        inside = sum(r["seconds"] for r in forwards.values())
        wall = walls[name] / per.get(name, 1)
        decoded = run.decoded.get(name, {"clips": 0, "seconds": 0.0})
        out[name] = {
            "wall_s": round(wall, 3), "forwards": forwards, "rows": rows, "decoded_clips": decoded["clips"],
            "decode_s": round(decoded["seconds"], 3), "transformer_s": round(inside, 3),
            "explained": round(rows * s_forward / wall, 3),  # rows x s_per_forward over the wall time
            "explained_without_decode": round(rows * s_forward / max(wall - decoded["seconds"], 1e-9), 3),
            "transformer_share": round(inside / wall, 3),
            "counted_share": round((inside + decoded["seconds"]) / wall, 3),  # forwards and decodes, as timed
            "s_per_row_in_place": round(inside / rows, 5) if rows else None,
            "other_s": round(wall - inside - decoded["seconds"], 3)}  # the evaluator's own: noise, KID, drift
    return out, args


def drift_seconds(args, frames: int, height: int, width: int, audio_samples: int, scale: int = 2) -> dict:
    """CPU seconds (this process's, one thread: the 2-core machine is shared) of the evaluator's
    drift statistics (``drift.media_stats``, on the actor's rank 0) per decoded clip at real size: one clip at
    1/scale of the height and width (its pictures' statistics are per pixel), times scale squared,
    and the stereo sound as it is."""
    from dmd2_core.evaluation import drift

    g = torch.Generator().manual_seed(0)
    video = torch.rand(1, 3, frames, height // scale, width // scale, generator=g) * 2 - 1
    audio = (torch.rand(1, 2, audio_samples, generator=g) * 2 - 1) * 0.3
    start = time.process_time()
    drift.media_stats({"video": video, "audio": audio, "sample_rate": 32000, "fps": 24})
    small = time.process_time() - start
    start = time.process_time()
    drift.media_stats({"video": video[:, :, :2, :2, :2], "audio": audio, "sample_rate": 32000, "fps": 24})
    sound = time.process_time() - start
    return {"per_clip_s": round((small - sound) * scale ** 2 + sound, 2), "measured_at": [frames, height // scale,
            width // scale], "measured_s": round(small, 2)}


# ---- real size ----------------------------------------------------------------------------------

def real_flops(text_tokens: int) -> dict:
    """FLOPs of MiniMax-H3's forward (whole and to the feature block) at the recipe's clip, and of
    decoding one clip, on the meta device."""
    import diffusers
    from torch.utils.flop_counter import FlopCounterMode

    from dmd2_core.args import load_args
    from dmd2_core.memory import lora_terms, time_plan
    from dmd2_core.models import FAMILIES, describe_model_dir
    from dmd2_core.models.minimax_h3 import clip_latent_shape

    recipe = load_args("minimax-h3", {"hf_checkpoint": H3_CONFIG, "prompts": "digits", "save": "/tmp/unused"})
    info = describe_model_dir(H3_CONFIG)
    shape = clip_latent_shape(recipe.num_frames, recipe.height, recipe.width, info)
    model = lora_terms.meta_model(H3_CONFIG)
    family = FAMILIES[info["family"]].bind(shape, model)

    def count(fn) -> int:
        with torch.no_grad(), FlopCounterMode(display=False) as flops:
            fn()
        return flops.get_total_flops()

    counted = time_plan.model_flops(H3_CONFIG, tuple(shape), None, text_tokens)  # the product's time plan
    forward, feature = counted.forward, counted.feature_forward
    vae_config, audio_config = (json.loads(Path(H3_CONFIG, part, "config.json").read_text())
                                for part in ("vae", "audio_vae"))
    with torch.device("meta"):
        vae = diffusers.AutoencoderKLMiniMaxH3.from_config(vae_config).eval()
        audio_vae = diffusers.AutoencoderKLMiniMaxH3Audio.from_config(audio_config).eval()
        video_latents = torch.randn(1, *shape)
        audio_latents = torch.randn(*family.audio_shape)  # the mono VAE takes the two channels as items
    # AutoencoderKLMiniMaxH3._decode: equal temporal chunks of tokens_chunk_size + token_overlap latents
    chunk = vae.tokens_chunk_size + vae.token_overlap
    num_tokens = shape[1] + vae.config.token_drop
    padded = num_tokens + (-num_tokens) % vae.tokens_chunk_size
    chunks = padded // vae.tokens_chunk_size - int(vae.config.token_drop > 0)
    video_decode = chunks * count(lambda: vae._decode_clip(video_latents[:, :, :chunk]))
    audio_decode = count(lambda: audio_vae.decode(audio_latents, return_dict=False))
    tokens = family.tokens(dict(model.config), shape)
    return {"forward": forward, "feature_forward": feature, "video_decode": video_decode, "audio_decode": audio_decode,
            "decode": video_decode + audio_decode, "video_decode_chunks": chunks,
            "rows": {"video_audio": tokens, "text": text_tokens},
            "feature_block": f"{len(model.transformer_blocks) // 2} of {len(model.transformer_blocks)}",
            "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 2),
            "clip": [recipe.num_frames, recipe.height, recipe.width], "video_latents": shape,
            "audio_latents": list(family.audio_shape)}


def phase_flops(counts: dict, flops: dict, sharded: bool) -> dict:
    """A stand-in phase's counts at real size: whole rows cost a forward, stopped rows a feature
    forward (whole on a sharded group: ``stop`` is off there), grad rows 4 forwards (forward,
    backward at twice it, and the blocks' recompute under gradient checkpointing)."""
    forward = stopped = grad = 0.0
    for row in counts["forwards"].values():
        forward += row["rows"] - row["stopped_rows"] - row["grad_rows"]
        stopped += row["stopped_rows"]
        grad += row["grad_rows"]
    transformer = (forward * flops["forward"] + grad * 4 * flops["forward"]
                   + stopped * (flops["forward"] if sharded else flops["feature_forward"]))
    return {"transformer": transformer, "decode": counts["decoded_clips"] * flops["decode"]}


def priced(stand: dict, flops: dict, mfu: float, iterations: int, drift_per_clip_s: float) -> dict:
    """Each phase on each group at ``mfu`` (``gpu_s``: the group's devices times the wall time);
    apart (``drift_s``), the drift statistics the actor's rank 0 computes on its CPU meanwhile, at
    ``drift_per_clip_s`` per decoded clip of the reference and the eval."""
    rate = H100_BF16_TFLOPS * 1e12 * mfu
    out = {}
    for name, (devices, cp) in GROUPS.items():
        sharded = devices > 1
        cost = {}
        for phase_name in ("reference", "eval", "media", "iteration"):
            f = phase_flops(stand[phase_name], flops, sharded)
            if phase_name == "iteration":  # data-parallel: the batch's rows spread over the group
                wall = (f["transformer"] + f["decode"]) / rate / devices
            else:
                # every rank of the group runs all of the eval's forwards (a sharded forward is a
                # collective; the samples are not split over data-parallel ranks), a context group
                # of cp ranks splitting each; rank 0 decodes alone while the others wait
                wall = f["transformer"] / rate / cp + f["decode"] / rate
            drifted = phase_name in ("reference", "eval")  # the media clips are written, not measured
            drift = drift_per_clip_s * stand[phase_name]["decoded_clips"] if drifted else 0.0
            cost[phase_name] = {"pflop": round((f["transformer"] + f["decode"]) / 1e15, 1),
                                "decode_pflop": round(f["decode"] / 1e15, 1), "wall_s": round(wall, 1),
                                "gpu_s": round(wall * devices, 1), "drift_s": round(drift, 1)}
        eval_gpu_s = cost["eval"]["gpu_s"] + cost["media"]["gpu_s"]
        eval_wall = cost["eval"]["wall_s"] + cost["media"]["wall_s"]
        nights = {}
        for interval in INTERVALS:
            evals = iterations // interval + 1 + (iterations % interval != 0)  # the start, every interval, the final
            evals_h = evals * eval_gpu_s / 3600
            train_h = iterations * cost["iteration"]["gpu_s"] / 3600
            ref_h = cost["reference"]["gpu_s"] / 3600
            nights[str(interval)] = {
                "evals": evals, "eval_gpu_h": round(evals_h, 1), "eval_wall_h": round(evals * eval_wall / 3600, 1),
                "train_gpu_h": round(train_h, 1), "reference_gpu_h": round(ref_h, 1),
                # the groups wait while the actor's rank 0 computes the drift statistics (1 thread, as measured)
                "drift_wait_gpu_h": round(evals * cost["eval"]["drift_s"] * devices / 3600, 1),
                "reference_share_of_eval_first_night": round(ref_h / (ref_h + evals_h), 3),
                "reference_share_of_eval_later_nights": 0.0,  # a hit under eval_reference_url: read, not made
                "eval_share_of_night_first": round((evals_h + ref_h) / (evals_h + ref_h + train_h), 3),
                "eval_share_of_night_later": round(evals_h / (evals_h + train_h), 3)}
        out[name] = {"num_devices": devices, "cp_size": cp, **cost, "eval_with_media_gpu_s": round(eval_gpu_s, 1),
                     "nights": nights}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mfu", type=float, default=0.4, help="no bf16 MFU measured yet (bench/README.md)")
    parser.add_argument("--text-tokens", type=int, default=256, help="the family's default_text_tokens")
    parser.add_argument("--iterations", type=int, default=4000, help="a night (the recipe's num_iterations)")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dmd2-eval-cost-") as tmp:
        stand, args = standin(tmp)
    standin_s = time.perf_counter() - start
    flops = real_flops(ns.text_tokens)
    clip = flops["clip"]
    audio_samples = flops["audio_latents"][2] * 800  # the audio VAE's hop: 40 latents a second at 32 kHz
    drift = drift_seconds(args, *clip, audio_samples)
    decoded_bytes = 4 * (3 * clip[0] * clip[1] * clip[2] + 2 * audio_samples)  # float32, a media eval's clips at a time
    result = {"standin": stand, "standin_total_s": round(standin_s, 1),
              "real_size": {"flops_pflop": {k: round(v / 1e15, 3) if isinstance(v, int) and v > 1e9 else v
                                            for k, v in flops.items()},
                            "mfu": ns.mfu, "peak_tflops": H100_BF16_TFLOPS, "text_tokens": ns.text_tokens,
                            "s_per_forward_at_mfu": round(flops["forward"] / (H100_BF16_TFLOPS * 1e12 * ns.mfu), 2),
                            "drift_on_actor_rank0": drift,
                            "decoded_gb_per_clip": round(decoded_bytes / 1e9, 2),
                            "decoded_gb_per_eval": round(stand["eval"]["decoded_clips"] * decoded_bytes / 1e9, 1),
                            "groups": priced(stand, flops, ns.mfu, ns.iterations, drift["per_clip_s"])},
              "total_s": round(time.perf_counter() - start, 1)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
