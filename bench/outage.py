"""A run rides out an S3 outage in the middle of a checkpoint. Prints one JSON line:

  {"outage_s", "checkpoint_during_outage_s", "bitwise_equal", "tracker", "resume_check"}

A tiny untrained teacher, 3 DMD2 iterations with a checkpoint after each, saved to a moto S3 server
on loopback; the server is stopped as checkpoint 2 starts and restarted on the same port
``--outage-s`` later (connections refused meanwhile). The final trainer states are compared with
an uninterrupted run saved locally, and the S3 checkpoint's files with their sha256.
Needs the test extras (moto[server]).

    python bench/outage.py [--outage-s 60]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--outage-s", type=float, default=60.0)
    ns = parser.parse_args()

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = {"s": ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)}
    server["s"].start()
    host, port = server["s"].get_host_and_port()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://{host}:{port}", RAY_ENABLE_UV_RUN_RUNTIME_ENV="0")
    import boto3
    import ray
    import torch

    from dmd2_core import checkpoint as ckpt
    from dmd2_core.args import load_args
    from dmd2_core.run.distill_run import DistillRun
    from bench.workload import random_digits_teacher

    torch.set_num_threads(1)
    boto3.client("s3").create_bucket(Bucket="outage")
    tmp, teacher = random_digits_teacher("dmd2-outage-")
    ray.init(address="local", namespace="dmd2-bench-outage", resources={"dmd2_device": 2.0},
             include_dashboard=False, log_to_driver=False)

    def outage() -> threading.Thread:
        server["s"].stop()

        def restart():
            time.sleep(ns.outage_s)
            s = ThreadedMotoServer(ip_address=host, port=port, verbose=False)
            s.start()
            server["s"] = s

        thread = threading.Thread(target=restart)
        thread.start()
        return thread

    def run(save: str, name: str, with_outage: bool):
        args = load_args(None, dict(hf_checkpoint=teacher, prompts="digits", save=save, run_name=name,
                                    global_batch_size=8, micro_batch_size=8, dmd2_update_ratio=2, seed=3,
                                    num_iterations=3))
        took = None
        with DistillRun(args) as r:
            for i in (1, 2, 3):
                r.iterate(i)
                start = time.monotonic()
                thread = outage() if with_outage and i == 2 else None
                r.checkpoint(i)
                if thread is not None:
                    took = time.monotonic() - start
                    thread.join()
            return {role: r.group_call(role, "state_digest")[0] for role in r.groups}, took

    reference, _ = run(f"{tmp}/reference", "reference", False)
    digests, took = run("s3://outage/run", "outage", True)
    print(json.dumps({"outage_s": ns.outage_s, "checkpoint_during_outage_s": round(took, 1),
                      "bitwise_equal": digests == reference, "tracker": ckpt.read_latest("s3://outage/run"),
                      "resume_check": ckpt.validate_resume("s3://outage/run", list(digests))}))
    ray.shutdown()
    server["s"].stop()


if __name__ == "__main__":
    main()
