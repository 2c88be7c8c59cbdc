"""What the speed benchmarks run on, in one place."""

from __future__ import annotations

import tempfile


def random_digits_teacher(prefix: str) -> tuple[str, str]:
    """A digits-sized SD3 teacher with seeded random weights in a new temp dir: (dir, teacher)."""
    import torch

    from dmd2_core.models import save_model_dir
    from dmd2_core.models.sd3 import SD3ImageFamily
    from dmd2_core.toys.digits import tiny_digits_config

    tmp = tempfile.mkdtemp(prefix=prefix)
    torch.manual_seed(0)
    teacher = f"{tmp}/teacher"
    save_model_dir(SD3ImageFamily().build(tiny_digits_config()), teacher, shift=3.0)
    return tmp, teacher


def timed_tiny_overrides(teacher: str, batch: int, num_iterations: int) -> dict:
    """The tiny recipe as the throughput benchmarks time it: one batch of ``batch`` per step, no
    evals or saves, and the GAN head off (the workload bench/README.md's figures were measured on before
    tiny turned it on)."""
    return {"hf_checkpoint": teacher, "global_batch_size": batch, "micro_batch_size": batch,
            "eval_interval": 0, "save_interval": 0, "gan_weight": 0.0, "gan_critic_weight": 0.0,
            "num_iterations": num_iterations}
