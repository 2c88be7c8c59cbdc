"""What splitting an eval over the data-parallel ranks and taking the media from the quality samples
save. Prints one JSON line:

  {"minimax_h3": {"before": {...}, "after": {...}}, "tiny_cpu": {"ranks": {"1": {"eval_s", "sampled_rows"},
   "2": {...}}, "eval_num_samples", "student_steps"}}

minimax_h3, from the recipe's counts (deployments/recipes/minimax-h3.yaml as shipped): the student
forwards (one sample through one step) each actor rank runs per eval, before (every rank all
``eval_num_samples`` quality samples and again the ``eval_prompts x eval_samples_per_prompt``
media clips) and after (``ceil(samples / data-parallel ranks)``, the clips being the first quality
samples), and the teacher's feature forwards per critic rank likewise.

tiny_cpu, measured: ``eval_step.run_eval`` (the ``teacher`` evaluator, its reference cached by a
first eval, then a second eval timed) of the tiny digits model, untrained, on 1 and on 2 gloo
ranks of this machine (one torch thread each, ``tests.helpers.spawn_ranks``), with the student
rows each rank's forwards ran.

    python bench/eval_split.py [--samples 64] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def recipe_forwards() -> dict:
    from dmd2_core.args import load_args
    from dmd2_core.memory.terms import eval_clips

    args = load_args("minimax-h3", {"hf_checkpoint": os.path.join(ROOT, "deployments", "model_configs", "minimax-h3"),
                                    "prompts": "digits", "save": "/tmp/unused"})
    dp = args.num_devices // args.cp_size
    samples, clips, steps = args.eval_num_samples, eval_clips(args), sum(args.student_step_counts)
    share = math.ceil(samples / dp)
    before = {"student_forwards_per_rank": (samples + clips) * steps, "feature_forwards_per_rank": samples}
    after = {"student_forwards_per_rank": (share + (math.ceil(clips / dp) if clips > samples else 0)) * steps,
             "feature_forwards_per_rank": share}
    return {"num_devices": args.num_devices, "cp_size": args.cp_size, "eval_num_samples": samples, "media_clips": clips,
            "student_steps": steps, "before": before, "after": after,
            "saved": round(1 - after["student_forwards_per_rank"] / before["student_forwards_per_rank"], 4)}


class RankRun:
    """A DistillRun's eval calls answered by this rank's trainers; rank 0's answer handed to every
    rank, so each rank's eval goes on alike as the driver's would."""

    def __init__(self, trainers: dict, args):
        self.trainers, self.args, self.has_critic = trainers, args, True

    @staticmethod
    def _everywhere(value):
        import torch.distributed as dist

        if dist.get_world_size() > 1:
            box = [value]
            dist.broadcast_object_list(box, src=0)
            return box[0]
        return value

    def sample(self, order, seed, num_steps=None):
        return self._everywhere(self.trainers["actor"].sample(order, seed, num_steps=num_steps))

    def eval_latents(self, order, seed, num_steps=None):
        return self._everywhere(self.trainers["actor"].sample(order, seed, decode=False, num_steps=num_steps))

    def decode(self, latents):
        return self._everywhere(self.trainers["actor"].decode(latents))

    def drift_stats(self, latents):
        return self._everywhere(self.trainers["actor"].drift_stats(latents))

    def teacher_reference(self, order, seed, num_steps):
        return self._everywhere(self.trainers["critic"].teacher_reference(order, seed, num_steps))

    def teacher_features(self, latents, order, u, seed):
        return self._everywhere(self.trainers["critic"].teacher_features(latents, order, u, seed))

    def real_features(self, rows, u, seed, index_offset):
        return self._everywhere(self.trainers["critic"].real_features(rows, u, seed, index_offset))


def _eval_on_rank(rank: int, world_size: int, trainer_args: dict) -> dict:
    import torch.distributed as dist

    from dmd2_core.evaluation.eval_step import run_eval
    from dmd2_core.train.trainer import Trainer

    trainers = {role: Trainer(a, role, rank, world_size) for role, a in trainer_args.items()}
    for trainer in trainers.values():
        trainer.init_process_group()
    args = trainer_args["actor"]
    args = args.model_copy(update={"save": f"{args.save}/rank{rank}"})  # each rank's own media and reference cache
    run = RankRun(trainers, args)
    run_eval(run, 0)  # makes the teacher's reference
    rows: list[int] = []
    trainers["actor"].model.register_forward_pre_hook(
        lambda module, a, kw: rows.append(int(kw.get("hidden_states", a[0] if a else None).shape[0])), with_kwargs=True)
    dist.barrier()
    start = time.perf_counter()
    run_eval(run, 1)
    return {"eval_s": time.perf_counter() - start, "sampled_rows": sum(rows)}


def tiny_cpu(samples: int, steps: int) -> dict:
    from dmd2_core.args import load_args
    from dmd2_core.models import save_model_dir
    from dmd2_core.models.sd3 import SD3ImageFamily
    from dmd2_core.run.preflight import preflight
    from dmd2_core.toys.digits import tiny_digits_config
    from tests.helpers import spawn_ranks

    out = {}
    with tempfile.TemporaryDirectory(prefix="eval-split-") as root:
        torch.manual_seed(0)
        teacher = os.path.join(root, "teacher")
        save_model_dir(SD3ImageFamily().build(tiny_digits_config()), teacher, shift=3.0)
        for n in (1, 2):
            args = load_args(None, dict(hf_checkpoint=teacher, prompts="digits", save=os.path.join(root, f"run{n}"),
                                        num_devices=n, global_batch_size=8, micro_batch_size=8, evaluator="teacher",
                                        eval_interval=1, eval_num_samples=samples, eval_reference_steps=8,
                                        dmd2_student_steps=steps, eval_prompts=[0, 1, 2, 3], eval_samples_per_prompt=2,
                                        torch_threads=1))
            per_rank = spawn_ranks(n, _eval_on_rank, preflight(args), timeout_s=600)
            out[str(n)] = {"eval_s": round(max(r["eval_s"] for r in per_rank), 3),
                           "sampled_rows": [r["sampled_rows"] for r in per_rank]}
    return {"eval_num_samples": samples, "student_steps": steps, "ranks": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=64, help="eval_num_samples of the tiny CPU eval")
    parser.add_argument("--steps", type=int, default=4, help="the student's steps")
    ns = parser.parse_args()
    print(json.dumps({"minimax_h3": recipe_forwards(), "tiny_cpu": tiny_cpu(ns.samples, ns.steps)}))


if __name__ == "__main__":
    main()
