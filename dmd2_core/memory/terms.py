"""The memory plan's terms besides sharded state and activations: per-process reserves, context
parallelism's all-to-all buffers, the teacher's guidance transient, rollout buffers, the eval
decoder, and host memory per node. Each is an estimate from sizes (named constants below), except
where ``memory.py`` says it reads the calibration; README and docs/scale.md say which is which.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dmd2_core.args import Args

GIB = 1024 ** 3
# per process on a device: the CUDA context with its kernels and cuBLAS / cuDNN workspaces (~0.5-1 GiB
# on H100/H200); per NCCL communicator the process joins: its channel buffers (a few hundred MiB on
# 8 NVLink peers). The allocator's fragmentation is the headroom's to cover.
CUDA_CONTEXT = GIB
NCCL_COMMUNICATOR = GIB // 2
# per process on the host: Python, torch, CUDA's pinned staging and Ray's worker
HOST_PROCESS = 4 * GIB
DEVICES_PER_NODE = 8
# the eval decoder: the live elements per decoded pixel of one temporal chunk (a few feature maps of
# ~128 channels at full resolution); its VAE, spatial ratio and chunk are the family's (decoder_facts)
DECODE_ELEMENTS_PER_PIXEL = 4 * 128


def communicators(args: Args, shard_size: int) -> int:
    """NCCL communicators of one rank: the shard group, the replicas (HSDP), the cp group."""
    cp = args.cp_size or 1
    return 1 + (args.num_devices > shard_size) + (cp > 1)


def process_reserve(args: Args, shard_size: int) -> int:
    return CUDA_CONTEXT + communicators(args, shard_size) * NCCL_COMMUNICATOR if args.device == "cuda" else 0


def cp_buffers(args: Args, tokens: int, text_tokens: int, inner: int, compute: int) -> int:
    """Ulysses all-to-all of one block: q, k, v (sequence-split -> head-split) and the attention
    output back, each a send and a receive buffer of the rank's (tokens + text) / cp rows."""
    cp = args.cp_size or 1
    if cp == 1:
        return 0
    rows = -(-(tokens + text_tokens) // cp)
    return 2 * 4 * rows * inner * compute


def guidance_transient(args: Args, guidance_distilled: bool, no_grad_forward: int, sample_bytes: int) -> int:
    """The critic's teacher forward while the fake score's activations are live: cond and uncond
    batched (2 x micro rows) under classifier-free guidance, else micro rows; plus its velocities
    (fp32)."""
    rows = args.micro_batch_size * (2 if args.uses_guidance and not guidance_distilled else 1)
    return rows * (no_grad_forward + sample_bytes)


def rollout_buffers(args: Args, sample_elements: int, cond_bytes: int) -> int:
    """The rank's rows (of the data-parallel degree num_devices / cp_size) on the device, fp32: the
    rollout's noise and K renoise draws, the pairs (x_t, x0), and the critic's noise and scores
    (grad, x0_real, x0_fake) -- K + 3 samples each at most at once -- and the conditions."""
    dp = max(1, args.num_devices // (args.cp_size or 1))
    rows = -(-args.global_batch_size // dp)
    return rows * ((args.max_student_steps + 3) * sample_elements * 4 + cond_bytes)


def set_rows(args: Args, cond_bytes: int, sample_bytes: int) -> int:
    """Host bytes of the sets one step of a rank reads (data.StoredRows: only the rows it uses,
    never the set): its rows' conditions and the negative entry, and with the GAN head its real
    rows (latents and conditions)."""
    dp = max(1, args.num_devices // (args.cp_size or 1))
    rows = -(-args.global_batch_size // dp)
    real = rows * (sample_bytes + cond_bytes) if args.loss_type == "dmd2_critic" and args.gan_critic_weight else 0
    return rows * cond_bytes + cond_bytes + real


EXPORT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def export_writer(args: Args, size) -> int:
    """Rank 0 of the actor while it exports the student (export/stream.py): one whole tensor at a
    time, gathered (fp32) and cast, and one read back while verifying; a merged LoRA export merges
    on the host: the model whole in the export dtype, twice with an EMA. ``size``: the student's
    ``planner.ModelSize``."""
    dtype = EXPORT_BYTES.get(args.export_dtype or args.dtype, 4)
    streamed = size.largest_tensor * (4 + 2 * dtype)
    if args.lora_rank and args.export_merged:
        return size.params * dtype * (2 if args.ema_decay else 1) + streamed
    return streamed


def eval_clips(args: Args) -> int:
    return len(args.eval_prompts or [0]) * args.eval_samples_per_prompt


def eval_decoder(args: Args, family, latent_shape: tuple[int, ...], compute: int) -> int:
    """Rank 0 of the actor at eval: the VAE, one chunk's working set and the decoded clips (fp32)."""
    if not args.eval_interval:
        return 0
    vae_params, scale, chunk = family.decoder_facts()
    height, width = latent_shape[-2] * scale, latent_shape[-1] * scale
    frames = family.pixel_frames(latent_shape[-3]) if len(latent_shape) == 4 else 1
    working = DECODE_ELEMENTS_PER_PIXEL * min(chunk, frames) * height * width * compute
    decoded = eval_clips(args) * 3 * frames * height * width * 4
    return vae_params * compute + working + decoded


@dataclass
class HostPlan:
    ranks_per_node: int
    load: int  # per node, while the groups load
    steady: int  # per node, while training
    parts: dict[str, int] = field(default_factory=dict)  # per rank
    limit: int | None = None
    usable: int | None = None

    @property
    def peak(self) -> int:
        return max(self.load, self.steady)

    @property
    def phase(self) -> str:
        return "loading" if self.load >= self.steady else "training"

    @property
    def fits(self) -> bool:
        return self.usable is None or self.peak <= self.usable


def host_plan(args: Args, groups: list, largest_block_bytes: int, export: int = 0) -> HostPlan:
    """Host memory of one node (``DEVICES_PER_NODE`` ranks, fewer in a smaller run). Per rank:
    the load peak (load once, shard on arrival: each process's weight shards + the largest block
    whole; the optimizer state of a resume is restored shard by shard, never whole), the
    sleep stash (each sleeping group's device state), async-save staging (a copy of the trainable
    shards), offloaded shards, the set rows a step reads, and a fixed share per process; once per
    node, the export writer (``export``: rank 0 of the actor, ``export_writer``)."""
    ranks = min(args.num_devices, DEVICES_PER_NODE)
    processes = len(groups) * HOST_PROCESS
    load = sum(g.loaded for g in groups) + len(groups) * largest_block_bytes + processes
    stash = sum(g.resident for g in groups) if args.sleep_after_train else 0
    staging = sum(g.saved for g in groups) if args.async_save else 0
    offloaded = sum(g.offloaded for g in groups)
    sets = sum(g.set_rows for g in groups)
    steady = stash + staging + offloaded + processes + sets
    parts = {"load": load, "sleep_stash": stash, "async_save_staging": staging, "offloaded": offloaded,
             "processes": processes, "set_rows": sets, "export_writer": export}
    limit = int(args.host_memory_gib * GIB) if args.host_memory_gib else None
    usable = int(limit * (1 - args.memory_headroom)) if limit else None
    return HostPlan(ranks, ranks * load, ranks * steady + export, parts, limit, usable)
