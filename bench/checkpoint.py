"""Sharded checkpoints: save time, the time an iteration is blocked (synchronous vs asynchronous
saves) and the bytes each rank writes, at 1 and 2 ranks, side by side in one run.

Prints one JSON line:

  {"model": {"params_m", ...}, "storage": "local" | "s3",
   "runs": {"<ranks>-<sync|async>": {"blocked_s", "save_s", "bytes_per_rank", "export_s"}},
   "async_vs_sync_blocked": {"1": ratio, "2": ratio}}

Each run is the digits recipe on a wider stand-in teacher (an SD3 MMDiT of ~--width x --layers,
random weights) with an EMA, so a checkpoint holds the actor's weights, EMA and AdamW moments and
the critic's weights and moments. Every configuration saves --saves times (one iteration between
saves, the student exported at each); figures are medians over those saves. ``blocked_s`` is how
long the checkpoint call held the run up; ``save_s`` is from the call to the save being durable
(its marker written).

    python bench/checkpoint.py [--width 512 --layers 6 --saves 3] [--s3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from statistics import median

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


def build_teacher(url: str, width: int, layers: int) -> dict:
    import torch

    from dmd2_core.models import save_model_dir
    from dmd2_core.models.sd3 import SD3ImageFamily
    from dmd2_core.toys.digits import tiny_digits_config

    torch.manual_seed(0)
    heads = max(1, width // 64)
    config = {**tiny_digits_config(), "num_layers": layers, "attention_head_dim": width // heads,
              "num_attention_heads": heads, "caption_projection_dim": width}
    model = SD3ImageFamily().build(config)
    save_model_dir(model, url, shift=3.0)
    return {"params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2), "width": width, "layers": layers}


def measure(teacher: str, save: str, ranks: int, asynchronous: bool, saves: int) -> dict:
    from dmd2_core.args import load_args
    from dmd2_core.run.distill_run import DistillRun

    args = load_args(None, dict(hf_checkpoint=teacher, prompts="digits", save=save, global_batch_size=4,
                                micro_batch_size=4, num_devices=ranks, dmd2_update_ratio=1, seed=3, ema_decay=0.99,
                                async_save=asynchronous, run_name=f"bench-ckpt-{ranks}-{int(asynchronous)}"))
    rows = []
    with DistillRun(args) as run:
        for i in range(1, saves + 1):
            run.iterate(i)
            start = time.perf_counter()
            out = run.checkpoint(i, export=True)
            while run.pending_save is not None:  # the durable time: poll as a later iteration would
                time.sleep(0.02)
                out.update(run.poll_saves())
            out["until_durable_s"] = time.perf_counter() - start
            rows.append(out)
    return {
        "blocked_s": round(median(r["checkpoint_blocked_s"] for r in rows), 3),
        "save_s": round(median(r["checkpoint_save_s"] for r in rows), 3),
        "bytes_per_rank": int(median(r["checkpoint_bytes_per_rank"] for r in rows)),
        "export_s": round(median(r["export_s"] for r in rows), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--s3", action="store_true", help="save to an S3-protocol server (moto, on loopback)")
    ns = parser.parse_args()

    import ray

    with tempfile.TemporaryDirectory(prefix="dmd2-bench-ckpt-") as tmp:
        model = build_teacher(os.path.join(tmp, "teacher"), ns.width, ns.layers)
        root, server = os.path.join(tmp, "runs"), None
        if ns.s3:
            import boto3
            from moto.server import ThreadedMotoServer

            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
            host, port = server.get_host_and_port()
            os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                              AWS_ENDPOINT_URL=f"http://{host}:{port}")
            boto3.client("s3").create_bucket(Bucket="bench")
            root = "s3://bench/runs"
        ray.init(num_cpus=4, resources={"dmd2_device": 4}, include_dashboard=False, logging_level="ERROR")
        try:
            runs = {}
            for ranks in (1, 2):
                for asynchronous in (False, True):
                    key = f"{ranks}-{'async' if asynchronous else 'sync'}"
                    runs[key] = measure(os.path.join(tmp, "teacher"), f"{root}/{key}", ranks, asynchronous, ns.saves)
        finally:
            ray.shutdown()
            if server is not None:
                server.stop()
    ratios = {str(n): round(runs[f"{n}-async"]["blocked_s"] / runs[f"{n}-sync"]["blocked_s"], 3) for n in (1, 2)}
    print(json.dumps({"model": model, "storage": "s3" if ns.s3 else "local", "runs": runs,
                      "async_vs_sync_blocked": ratios}))


if __name__ == "__main__":
    main()
