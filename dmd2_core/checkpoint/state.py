"""A trainer's state as a checkpoint holds it: the flat dict of (distributed) tensors DCP saves
and loads in place, and the optimizer's settings keyed by parameter name."""

from __future__ import annotations

import io
from typing import Any, Optional, Sequence

import torch

from dmd2_core import storage
from dmd2_core.errors import CheckpointError, StorageUnavailableError, one_line
from dmd2_core.models import lora
from dmd2_core.save_layout import STATE_NAME, trainer_dir


def sharded_state(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
                  ema: Optional[Sequence[torch.Tensor]], init_optimizer: bool = False) -> dict[str, torch.Tensor]:
    """This rank's view of the trainer state as one flat dict of (distributed) tensors: DCP saves
    each rank's shards and loads into them in place. ``init_optimizer`` creates AdamW's state
    (zeros, step 0) where it does not exist yet, so a fresh trainer has tensors to load into."""
    state = {f"model.{k}": v for k, v in lora.saved_state(model).items()}  # a LoRA: its adapters alone
    names = [n for n, _ in lora.trained(model)]
    if ema is not None:
        state.update({f"ema.{n}": e for n, e in zip(names, ema)})
    if optimizer is not None:
        by_id = {id(p): n for n, p in model.named_parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p not in optimizer.state and init_optimizer:
                    optimizer.state[p] = _fresh_adam_state(optimizer, p)
                for key, value in optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        state[f"optim.{by_id[id(p)]}.{key}"] = value
    return state


def _fresh_adam_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise TypeError(f"cannot create the state of {type(optimizer).__name__} to load into")
    state = {"step": torch.tensor(0.0, dtype=torch.float32),
             "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
             "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    if optimizer.defaults.get("amsgrad"):
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def param_group_record(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> list[dict]:
    """The optimizer's parameter groups, settings and parameter names (no tensors)."""
    if optimizer is None:
        return []
    names = {id(p): n for n, p in model.named_parameters()}
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
            for g in optimizer.param_groups]


def check_param_groups(model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved_groups: list[dict]) -> None:
    """Check that the saved parameter groups are the optimizer's. Their settings (lr, betas,
    weight decay) stay the ones the optimizer was built with: a rerun's settings win over the
    saved ones (its ``lr`` is the usual fix for a diverging run); ``changed_optimizer_settings`` says which."""
    names = {id(p): n for n, p in model.named_parameters()}
    from dmd2_core.models import step_conditioning

    saved_vectors = step_conditioning.in_saved_groups(saved_groups)
    if saved_vectors != step_conditioning.is_conditioned(model):
        raise ValueError("the fake score's step vectors are " + ("in the checkpoint, not in this run" if saved_vectors
                         else "in this run, not in the checkpoint") + ": resume with dmd2_critic_step_conditioning "
                         f"{str(saved_vectors).lower()}, as it was saved")
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"{len(saved_groups)} parameter groups saved, the optimizer has {len(optimizer.param_groups)}")
    for saved, group in zip(saved_groups, optimizer.param_groups):
        if any(id(p) not in names for p in group["params"]):
            raise ValueError("the optimizer holds parameters that are not the model's")
        current = [names[id(p)] for p in group["params"]]
        if sorted(saved["params"]) != sorted(current):
            extra = sorted(set(saved["params"]) ^ set(current))
            raise ValueError(f"saved parameters do not match the model's (e.g. {extra[:2]})")


SETTINGS = ("lr", "betas", "weight_decay", "eps")


def changed_optimizer_settings(saved_groups: list[dict], settings: dict) -> dict[str, tuple]:
    """The optimizer settings that differ from the saved ones: name -> (saved, now)."""
    saved = saved_groups[0] if saved_groups else {}
    return {k: (_plain(saved[k]), _plain(settings[k])) for k in SETTINGS
            if k in saved and k in settings and _plain(saved[k]) != _plain(settings[k])}


def _plain(value):
    return list(value) if isinstance(value, (tuple, list)) else value


def torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def torch_load(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def read_trainer_state(load_url: str, role: str, iteration: int) -> dict:
    """A checkpoint's ``trainer_state.pt`` (param groups, extra) read in this process, before any
    actor: what the run that wrote it recorded. Raises CheckpointError naming the file."""
    url = storage.join(trainer_dir(load_url, role, iteration), STATE_NAME)
    try:
        state = torch_load(storage.read_bytes(url))
    except StorageUnavailableError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"{url}: cannot read ({one_line(exc)})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{url}: corrupt trainer state (not a dict)")
    return state
