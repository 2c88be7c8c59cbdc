"""Dotted-path hooks. A train-input hook is ``hook(args, pairs, external_data) -> pairs``: it runs
on each rank before micro-batching, so it can join what an earlier group handed over (the DMD
gradient from the critic group) or preprocess the pairs."""

from __future__ import annotations

import importlib
import inspect
from typing import Callable, Optional

import torch

from dmd2_core.errors import ArgsError, nearest

TRAIN_INPUT_HOOK_PARAMS = ("args", "pairs", "external_data")


def batch_size(pairs: dict) -> int:
    sizes = {k: v.shape[0] for k, v in pairs.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"train pairs disagree on batch size: {sizes}")
    return next(iter(sizes.values()), 0)


def join_external_data(args, pairs: dict, external_data: Optional[dict]) -> dict:
    """The default train-input hook: join the external data's per-sample tensors to the pairs."""
    if not external_data:
        return pairs
    n = batch_size(pairs)
    for key, value in external_data.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] != n:
            raise ValueError(f"external data '{key}' has {value.shape[0]} rows for {n} train pairs")
        if key in pairs:
            raise ValueError(f"external data '{key}' would overwrite a train-pair key")
    return {**pairs, **external_data}


def load_hook(path: str, flag: str = "train_input_hook_path", params=TRAIN_INPUT_HOOK_PARAMS) -> Callable:
    """Import ``package.module.function`` (or ``package.module:function``) and check that it takes
    the hook's parameters. Raises ArgsError naming the flag and the path."""
    module_name, sep, attr = path.replace(":", ".").rpartition(".")
    if not sep or not module_name:
        raise ArgsError(f"{flag}: '{path}' is not a dotted path like package.module.function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ArgsError(f"{flag}: cannot import module '{module_name}' of '{path}' ({exc})") from None
    except BaseException as exc:  # noqa: BLE001 - the module itself raised (or exited) on import
        if isinstance(exc, KeyboardInterrupt):
            raise
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ArgsError(f"{flag}: importing module '{module_name}' of '{path}' raised "
                        f"{type(exc).__name__}: {first}"[:400]) from None
    if not hasattr(module, attr):
        names = [n for n in dir(module) if not n.startswith("_")]
        raise ArgsError(f"{flag}: module '{module_name}' has no '{attr}'{nearest(attr, names)}")
    hook = getattr(module, attr)
    if not callable(hook):
        raise ArgsError(f"{flag}: '{path}' is not callable")
    try:
        inspect.signature(hook).bind(*params)
    except TypeError:
        raise ArgsError(
            f"{flag}: '{path}' must take ({', '.join(params)}), it takes {inspect.signature(hook)}"
        ) from None
    return hook


def train_input_hook(path: Optional[str]) -> Callable:
    return load_hook(path) if path else join_external_data
