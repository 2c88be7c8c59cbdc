"""Device bytes a trainer frees by sleeping, and what sleep and wake cost. Prints one JSON line:

  {"device", "params", "awake_bytes", "asleep_bytes", "freed_bytes", "sleep_s", "wake_s", "bitwise_equal"}

On CUDA the bytes are the allocator's (torch.cuda.memory_allocated); on CPU they are the bytes the
training state (weights, EMA, optimizer, teacher) holds. Uses an SD3 stand-in of the given width.

    python bench/sleep_wake.py [--device cuda] [--layers 8] [--heads 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    ns = parser.parse_args()
    torch.set_num_threads(1)

    from dmd2_core.args import load_args
    from dmd2_core.run.distill_run import preflight
    from dmd2_core.models import save_model_dir
    from dmd2_core.models.sd3 import SD3ImageFamily
    from dmd2_core.toys.standins import standin_prompt_set
    from dmd2_core.train.trainer import Trainer

    tmp = tempfile.mkdtemp(prefix="dmd2-sleep-")
    config = dict(sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=ns.layers,
                  attention_head_dim=64, num_attention_heads=ns.heads, joint_attention_dim=64,
                  caption_projection_dim=64 * ns.heads, pooled_projection_dim=64, pos_embed_max_size=16)
    torch.manual_seed(0)
    model = SD3ImageFamily().build(config)
    save_model_dir(model, f"{tmp}/teacher", shift=3.0)
    standin_prompt_set("sd3", dim=64).save(f"{tmp}/prompts.safetensors")
    args = load_args(None, dict(hf_checkpoint=f"{tmp}/teacher", prompts=f"{tmp}/prompts.safetensors", save=f"{tmp}/run",
                                device=ns.device, global_batch_size=4, micro_batch_size=4, dmd2_update_ratio=1,
                                ema_decay=0.99))
    roles = preflight(args)
    critic = Trainer(roles["critic"], "critic")
    actor = Trainer(roles["actor"], "actor")
    pairs, _ = actor.rollout(1)
    scores, _ = critic.train(1, pairs)  # optimizer state exists from here on
    digest = critic.state_digest()
    awake = critic.device_bytes()
    sleeps, wakes, asleep = [], [], 0
    for _ in range(ns.repeats):
        out = critic.sleep()
        asleep = critic.device_bytes()
        sleeps.append(out["sleep_s"])
        wakes.append(critic.wake_up()["wake_s"])
    print(json.dumps({
        "device": ns.device,
        "params": sum(p.numel() for p in critic.model.parameters()),
        "awake_bytes": awake,
        "asleep_bytes": asleep,
        "freed_bytes": awake - asleep,
        "sleep_s": round(statistics.median(sleeps), 4),
        "wake_s": round(statistics.median(wakes), 4),
        "bitwise_equal": critic.state_digest() == digest,
    }))


if __name__ == "__main__":
    main()
