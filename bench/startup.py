"""A trainer group's start: time to ready and peak host memory per rank, the old path (every rank
loads the whole model in fp32, then shards it) against dmd2_core.train.trainer_models (built on the meta device,
sharded, each rank reading only its rows), side by side.

Prints one JSON line:

  {"model": {"params_b", "file_gib", "layers"},
   "local" | "s3": {"<ranks>": {"old" | "new": {"ready_s", "peak_rss_gib", "grew_gib", "shard_gib"}}}}

The model is a Wan transformer of ~0.5 B parameters (the Wan2.1 1.3B block shape, 10 blocks)
with random weights, written once (fp32 safetensors in files of 32 MB and an index) to a
temporary directory and, for "s3", to a moto S3 server on loopback. moto answers a ranged GET by
reading the whole object and slicing it, so on moto each range costs a whole file's read (real S3
serves the range alone): hence the small files, and even so the "s3" times of the new path are
moto's more than the loader's. Each group of 1, 2 and 4 gloo ranks starts the trained model (fp32
masters, bf16 compute, FSDP2) in fresh processes (torch.multiprocessing, not Ray) with the
project's own start code: ``models.load_model_dir`` + ``parallel.shard_model`` (old) and
``startup.TrainerModels`` (new). ``ready_s``: from the moment every rank has its runtime imported
(the baseline) until the last rank holds its filled shards. ``peak_rss_gib``: the highest peak
resident set of any rank while it starts (VmHWM, reset at the baseline), ``grew_gib`` that peak
less the rank's baseline, ``shard_gib`` the bytes of the rank's shards.

    python bench/startup.py [--layers 10] [--ranks 1 2 4] [--where local s3] [--stored-dtype float32]

With fp32 files loaded in fp32, the old path's tensors are views of safetensors' memory maps, so
its resident set grows by the whole model only while the files it maps are in use (with small
files, little more than its shards); with bf16 files (``--stored-dtype bfloat16``, as many
released checkpoints are) ``from_pretrained`` makes fp32 copies, and every rank holds the whole
model in fp32 before it shards it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GIB = 1024 ** 3
FILE_SIZE = "32MB"


def wan_config(layers: int) -> dict:
    return dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=layers, rope_max_seq_len=1024)


def write_model(url: str, layers: int, stored_dtype: str) -> dict:
    import torch

    from dmd2_core.models import FAMILIES, save_model_dir, write_transformer

    torch.manual_seed(0)
    family = FAMILIES["WanTransformer3DModel"]
    model = family.build(wan_config(layers))
    params = sum(p.numel() for p in model.parameters())
    model.to(getattr(torch, stored_dtype))
    save_model_dir(model, url, shift=5.0)
    transformer = Path(url) / "transformer"  # sharded, as real checkpoints are (several files and an index)
    for f in transformer.glob("*.safetensors"):
        f.unlink()
    write_transformer(family, model.config, model.state_dict(), transformer, max_shard_size=FILE_SIZE)
    size = params * getattr(torch, stored_dtype).itemsize
    return {"params_b": round(params / 1e9, 3), "stored": stored_dtype, "file_gib": round(size / GIB, 2), "layers": layers,
            "files": len(list(transformer.glob("*.safetensors")))}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _rank(rank: int, world: int, port: int, path: str, url: str, save: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from dmd2_core import parallel
    from dmd2_core.args import load_args
    from dmd2_core.models import load_model_dir
    from dmd2_core.models.loading import build_empty
    from dmd2_core.train.trainer_models import TrainerModels

    torch.set_num_threads(1)
    parallel.ensure_process_group(rank, world, torch.device("cpu"), "127.0.0.1", port)
    mesh = parallel.build_mesh(torch.device("cpu"), world, None)
    args = load_args(None, dict(hf_checkpoint=url, prompts="digits", save=save, dtype="bfloat16",
                                num_devices=world, global_batch_size=4 * world, micro_batch_size=4))
    build_empty(url)  # the runtime's baseline: diffusers, the model class and s3fs imported
    dist.barrier()
    baseline = _status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    start = time.perf_counter()
    if path == "old":
        model = load_model_dir(url, "cpu", parallel.MASTER_DTYPE).model
        parallel.shard_model(model, mesh, torch.bfloat16, trainable=True)
    else:
        model = TrainerModels(args, torch.bfloat16, resume=False)
        model.shard(mesh)
        model = model.model
    ready = time.perf_counter() - start
    peak = _status("VmHWM:")
    shard = sum(parallel.local(t).nbytes for t in [*model.parameters(), *model.buffers()])
    dist.barrier()
    with open(os.path.join(out, f"{path}-{rank}.json"), "w") as f:
        json.dump({"ready_s": ready, "peak": peak, "grew": peak - baseline, "shard": shard,
                   "done": time.perf_counter() - start}, f)
    dist.destroy_process_group()


def start_group(path: str, world: int, url: str, tmp: str) -> dict:
    import torch.multiprocessing as mp

    out = tempfile.mkdtemp(dir=tmp)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(world, port, path, url, os.path.join(out, "run"), out), nprocs=world, join=True)
    ranks = [json.load(open(os.path.join(out, f"{path}-{r}.json"))) for r in range(world)]
    return {"ready_s": round(max(r["done"] for r in ranks), 2),
            "peak_rss_gib": round(max(r["peak"] for r in ranks) / GIB, 3),
            "grew_gib": round(max(r["grew"] for r in ranks) / GIB, 3),
            "shard_gib": round(max(r["shard"] for r in ranks) / GIB, 3)}


def s3_copy(local: str) -> tuple[str, object]:
    """The checkpoint on a moto S3 server on loopback (the environment points every child at it)."""
    import boto3
    from moto.server import ThreadedMotoServer

    from dmd2_core import storage

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://{host}:{port}"})
    boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1").create_bucket(Bucket="bench")
    storage.upload_dir(local, "s3://bench/wan")
    return "s3://bench/wan", server


def main() -> None:
    import logging

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--where", nargs="+", default=["local", "s3"], choices=["local", "s3"])
    parser.add_argument("--stored-dtype", default="float32", choices=["float32", "bfloat16"])
    opts = parser.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    result: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        local = os.path.join(tmp, "wan")
        result["model"] = write_model(local, opts.layers, opts.stored_dtype)
        server = None
        for where in opts.where:
            url = local
            if where == "s3":
                url, server = s3_copy(local)
            result[where] = {str(n): {path: start_group(path, n, url, tmp) for path in ("old", "new")}
                             for n in opts.ranks}
        if server is not None:
            server.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
