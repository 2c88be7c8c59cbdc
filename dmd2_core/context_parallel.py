"""Context parallelism: one sample's sequence split over the ``cp_size`` consecutive ranks of a
context group (DeepSpeed-Ulysses attention: an all-to-all trades sequence for heads around each
attention), composed with FSDP2 on the trainer's mesh.

- The split follows the transformer's own diffusers ``_cp_plan`` (Wan and MiniMax-H3: the
  sequence is split at the first block and gathered after the output projection), enabled with
  ``enable_parallelism(ContextParallelConfig(ulysses_degree=cp_size, mesh=...))`` on the mesh
  ``parallel.context_mesh`` derives from FSDP's. Every rank of a context group gets the same rows,
  noise and conditions and sees the whole output, so losses and scores are the same on each.
- Each rank's backward covers its part of the sequence; the model's gradient is the sum over the
  context group. FSDP still shards over the whole shard dim (context peers hold different shards:
  less memory each, and the same checkpoint layout whatever cp), and reduces as a sum over all
  ranks divided by the data-parallel size (``parallel.average_over_data_parallel``). Clipping's
  global norm, the EMA and the non-finite vote then work on shards as without cp.
- Anything else computed from the split sequence is made whole here: the GAN head's features
  (``gather_sequence``) and gradients with respect to the model's inputs (``sum_over_context``).
"""

from __future__ import annotations

from typing import Optional
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dmd2_core import parallel


def enable(model: torch.nn.Module, mesh: DeviceMesh, cp_size: int, device: torch.device, trainable: bool,
           family) -> None:
    """Split ``model``'s sequence over context groups of ``cp_size`` ranks (after sharding);
    nothing for cp_size 1."""
    if cp_size == 1:
        return
    from diffusers import ContextParallelConfig

    problem = family.context_parallel_problem(model.config, cp_size)
    if problem:
        raise ValueError(f"cp_size: {problem}")
    cp_mesh = parallel.context_mesh(mesh, cp_size)
    config = ContextParallelConfig(ulysses_degree=cp_size, mesh=cp_mesh)
    if device.type == "cpu":  # diffusers picks the device as rank % device_count, 0 on a CPU host
        with mock.patch("torch.accelerator.device_count", return_value=1):
            model.enable_parallelism(config=config)
    else:
        model.enable_parallelism(config=config)
    first_block = getattr(model, family.blocks_attr)[0]  # where the plans split the sequence
    first_block.register_forward_pre_hook(_check_split(cp_size), with_kwargs=True)
    if trainable:
        parallel.average_over_data_parallel(model, mesh.size() // cp_size)


def _check_split(cp_size: int):
    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[1] % cp_size:
            raise ValueError(f"cp_size: a sequence of {hidden.shape[1]} tokens does not split over {cp_size} ranks "
                             f"(the latent shape and, for joint models, every prompt's text length decide it)")
    return hook


def _group(model: torch.nn.Module) -> Optional[dist.ProcessGroup]:
    config = getattr(model, "_parallel_config", None)
    cp = getattr(config, "context_parallel_config", None)
    return None if cp is None else cp._flattened_mesh.get_group()


def gather_sequence(model: torch.nn.Module, tokens: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """The whole sequence from each rank's part (differentiable: the backward keeps this rank's
    part of the gradient, as diffusers' own output gather does); ``tokens`` itself without cp."""
    group = _group(model)
    if group is None:
        return tokens
    from diffusers.hooks.context_parallel import AllGatherFunction

    return AllGatherFunction.apply(tokens.contiguous(), dim, group)


def sum_over_context(model: torch.nn.Module, grad: torch.Tensor) -> torch.Tensor:
    """A gradient with respect to the model's whole input, from each rank's part of it."""
    group = _group(model)
    if group is not None:
        dist.all_reduce(grad, group=group)
    return grad


def peer_index(rank: int, cp_size: int) -> int:
    """This rank's place in its context group (0: the one that counts the group's rows)."""
    return rank % cp_size
