"""One bf16 DMD2 iteration of a real-size transformer on one GPU: time, TFLOP/s, MFU, peak
allocator bytes against the memory plan, and the bytes sleep frees. Prints one JSON line:

  {"config", "params_b", "latent_shape", "micro_batch", "iteration_s_median", "iteration_s",
   "tflop_per_iteration", "tflops", "mfu", "peak_tflops", "device", "peak_allocated_gib",
   "planned_peak_gib", "plan_ratio", "sleep_freed_gib": {role: GiB}, "bitwise_after_wake"}

The model is built from its config with random weights (nothing is downloaded): by default a
Wan2.1-1.3B-shaped video transformer at 81 frames of 240x416 (latents [16, 21, 30, 52]), run as
minimax-h3 runs it (bf16 compute, fp32 master weights, gradient checkpointing, the critic's 5
updates and scoring with the frozen teacher, each group sleeping after its train) on one GPU.
FLOPs of an iteration are the time plan's (``time_plan.iteration_flops``: the figure its assumed
MFU prices), so ``mfu`` is the pace to give the plan; on the CPU the iteration is also counted live
by torch's FlopCounterMode (``counted_tflop_per_iteration``, recomputation included), which on a GPU
keeps what activation checkpointing frees and runs out of memory. ``--num-layers`` builds the
transformer that deep: the real width and sequence at a depth one GPU holds (MiniMax-H3: 1 layer).

Runs only where CUDA exists; elsewhere it prints a skip line and exits 0 (``--device cpu`` with a
small ``--config`` runs the same code on the CPU, to check the script itself).

    python bench/gpu_step.py [--config deployments/model_configs/wan2.1-t2v-1.3b]
        [--latent-shape 16 21 30 52] [--micro-batch 1] [--iterations 4] [--peak-tflops 989] [--num-layers N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1024 ** 3
# dense bf16 tensor-core peaks (no sparsity), by device name
PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "H800": 989.4, "B200": 2250.0, "A100": 312.0, "L40S": 362.1, "A10": 125.0}


def peak_tflops(name: str, override: float | None) -> float | None:
    if override:
        return override
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def build(tmp: str, config_dir: str, device: str, text_tokens: int,
          num_layers: int | None = None) -> tuple[str, str, float]:
    """A random-weight checkpoint of the config (initialised on the device: fast), ``num_layers``
    deep when given (the real width and sequence at a depth one GPU holds), and a prompt set of
    the pipeline's text length. Returns (checkpoint, prompts, params in billions)."""
    from dmd2_core.data import PromptSet
    from dmd2_core.models import FAMILIES, describe_model_dir, save_model_dir
    from dmd2_core import storage

    info = describe_model_dir(config_dir)
    family = FAMILIES[info["family"]]
    config = json.loads(storage.read_text(storage.join(info["transformer_url"], "config.json")))
    if num_layers:
        config["num_layers"] = num_layers
    torch.manual_seed(0)
    with torch.device(device):
        model = family.model_class.from_config(config).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters()) / 1e9
    save_model_dir(model.cpu(), f"{tmp}/teacher", shift=5.0 if family.is_video else 3.0)
    del model
    dim = config.get("text_dim") or config.get("joint_attention_dim")
    g = torch.Generator().manual_seed(0)
    embeds = {"prompt_embeds": torch.randn(3, text_tokens, dim, generator=g)}
    if "pooled_prompt_embeds" in family.cond_keys:
        embeds["pooled_prompt_embeds"] = torch.randn(3, config["pooled_projection_dim"], generator=g)
    if "prompt_lengths" in family.cond_keys:  # MiniMax-H3: every prompt its full length
        embeds["prompt_lengths"] = torch.full((3,), text_tokens)
    PromptSet([f"prompt {i}" for i in range(2)], {k: v[:2] for k, v in embeds.items()},
              {k: v[2:] for k, v in embeds.items()}).save(f"{tmp}/prompts.safetensors")
    return f"{tmp}/teacher", f"{tmp}/prompts.safetensors", params


def cast_recomputed_inputs_on_older_torch() -> None:
    """FSDP2 before torch 2.13 (the project pins 2.13) skips casting a block's inputs to the compute
    dtype when activation checkpointing recomputes the block in the backward, so the recompute runs
    in fp32 and checkpointing refuses it (saved bf16, recomputed fp32). A GPU image with an older
    torch gets 2.13's behaviour here, before any model is sharded (the hook is bound at sharding)."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState, TrainingState
    from torch.utils._pytree import tree_map

    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13):
        return
    original = FSDPState._pre_forward

    def pre_forward(self, module, args, kwargs):
        recomputing = self._training_state == TrainingState.PRE_BACKWARD
        args, kwargs = original(self, module, args, kwargs)
        policy = self._mp_policy
        if recomputing and policy.cast_forward_inputs and policy.param_dtype is not None:
            def cast(t):
                return t.to(policy.param_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        return args, kwargs

    FSDPState._pre_forward = pre_forward


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=os.path.join(ROOT, "deployments", "model_configs", "wan2.1-t2v-1.3b"))
    parser.add_argument("--latent-shape", type=int, nargs="+", default=[16, 21, 30, 52])
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--text-tokens", type=int, default=None, help="default: the pipeline's own length")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="the transformer's depth (default: the config's); the width and sequence stay real")
    ns = parser.parse_args()
    if ns.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device here: bench/gpu_step.py measures a GPU; "
                          "run it where one is (or --device cpu with a small --config to check the script)"}))
        return

    from torch.utils.flop_counter import FlopCounterMode

    cast_recomputed_inputs_on_older_torch()

    from dmd2_core.memory import planner, time_plan
    from dmd2_core.args import load_args
    from dmd2_core.run.distill_run import preflight
    from dmd2_core.models import FAMILIES, describe_model_dir
    from dmd2_core.train.trainer import Trainer

    family = FAMILIES[describe_model_dir(ns.config)["family"]]
    text_tokens = ns.text_tokens or family.default_text_tokens
    with tempfile.TemporaryDirectory(prefix="dmd2-gpu-step-") as tmp:
        url, prompts, params_b = build(tmp, ns.config, ns.device, text_tokens, ns.num_layers)
        args = load_args("minimax-h3", dict(
            hf_checkpoint=url, prompts=prompts, save=f"{tmp}/run", device=ns.device, num_devices=1,
            cp_size=1, lora_rank=0,  # one device, fully fine-tuned: the iteration this bench measures
            global_batch_size=ns.micro_batch, micro_batch_size=ns.micro_batch, latent_shape=ns.latent_shape,
            num_frames=None, height=None, width=None,  # the recipe's clip gives way to --latent-shape
            eval_interval=0, save_interval=0, eval_prompts=[0, 1], torch_threads=max(1, os.cpu_count() // 2),
            device_memory_gib=1e6))
        roles = preflight(args)
        plan = planner.plan(roles)
        critic, actor = Trainer(roles["critic"], "critic"), Trainer(roles["actor"], "actor")
        sleeps: dict[str, list[int]] = {"critic": [], "actor": []}

        def iteration(i: int) -> None:
            pairs, _ = actor.rollout(i)
            scores, _ = critic.train(i, pairs)
            sleeps["critic"].append(critic.sleep()["bytes_freed"])
            actor.train(i, pairs, scores)
            sleeps["actor"].append(actor.sleep()["bytes_freed"])

        iteration(1)  # warm-up: kernels, allocator
        # the time plan's FLOPs of an iteration (the figure its assumed MFU prices); counted live too
        # where memory allows: FlopCounterMode keeps what checkpointing frees and runs a GPU out of it
        plan_flops = sum(time_plan.iteration_flops(roles).values())
        counted = None
        if ns.device != "cuda":
            with FlopCounterMode(display=False) as counter:
                iteration(2)
            counted = counter.get_total_flops()
        flops = plan_flops
        if ns.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for i in range(3, 3 + ns.iterations):
            sync(ns.device)
            start = time.perf_counter()
            iteration(i)
            sync(ns.device)
            times.append(time.perf_counter() - start)
        peak_alloc = torch.cuda.max_memory_allocated() if ns.device == "cuda" else None
        digest = critic.state_digest()  # wakes it: sleep -> wake is bitwise
        critic.sleep()
        bitwise = critic.state_digest() == digest

    median = statistics.median(times)
    name = torch.cuda.get_device_name() if ns.device == "cuda" else "cpu"
    peak = peak_tflops(name, ns.peak_tflops)
    planned = plan.device_peak - (planner.CUDA_RESERVE if ns.device == "cuda" else 0)
    print(json.dumps({
        "config": os.path.basename(ns.config.rstrip("/")), "num_layers": ns.num_layers, "params_b": round(params_b, 3),
        "latent_shape": ns.latent_shape, "text_tokens": text_tokens, "micro_batch": ns.micro_batch,
        "iteration_s_median": round(median, 3), "iteration_s": [round(t, 3) for t in times],
        "tflop_per_iteration": round(flops / 1e12, 2),
        "counted_tflop_per_iteration": round(counted / 1e12, 2) if counted is not None else None, "tflops": round(flops / median / 1e12, 1),
        "mfu": round(flops / median / 1e12 / peak, 3) if peak else None, "peak_tflops": peak, "device": name,
        "peak_allocated_gib": round(peak_alloc / GIB, 2) if peak_alloc is not None else None,
        "planned_peak_gib": round(planned / GIB, 2),
        "plan_ratio": round(peak_alloc / planned, 3) if peak_alloc is not None else None,
        "sleep_freed_gib": {role: round(statistics.median(v) / GIB, 2) for role, v in sleeps.items()},
        "bitwise_after_wake": bitwise,
    }))


if __name__ == "__main__":
    main()
