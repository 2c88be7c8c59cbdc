"""Tiny SD3 models, their optimizers and trainer checkpoints: shared by the checkpoint tests."""

from __future__ import annotations

from pathlib import Path

import torch

from dmd2_core import checkpoint as ckpt
from dmd2_core import storage
from dmd2_core.models.sd3 import SD3ImageFamily
from dmd2_core.toys.digits import tiny_digits_config

FAMILY = SD3ImageFamily()
SHIFT = 2.5


def tiny_model(seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    return FAMILY.build({**tiny_digits_config(), **overrides})


def batch(seed: int = 1, n: int = 4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    cond = {"prompt_embeds": torch.randn(n, 5, 32, generator=g), "pooled_prompt_embeds": torch.randn(n, 32, generator=g)}
    sigma = torch.rand(n, generator=g)
    return x, sigma, cond


def output(model, seed: int = 1) -> torch.Tensor:
    x, sigma, cond = batch(seed)
    with torch.no_grad():
        return FAMILY.predict_velocity(model, x, sigma, cond)


def optimizer_of(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.0, 0.999), weight_decay=0.01)


def train_step(model, optimizer, seed: int) -> None:
    x, sigma, cond = batch(seed)
    optimizer.zero_grad(set_to_none=True)
    loss = FAMILY.predict_velocity(model, x, sigma, cond).square().mean()
    loss.backward()
    optimizer.step()


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def assert_same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys() and len(sa["state"]) > 0
    for idx in sa["state"]:
        assert sa["state"][idx].keys() == sb["state"][idx].keys()
        for k, v in sa["state"][idx].items():
            assert torch.equal(v, sb["state"][idx][k]), (idx, k)


def local_path(url: str) -> Path:
    return Path(storage.filesystem(url)[1])


def save(root, role, iteration, model, opt, **kw) -> str:
    return ckpt.save_trainer(root, role, iteration, model, opt, **kw).result()["url"]


def saved(root, role="student", iteration=1):
    model = tiny_model(0)
    opt = optimizer_of(model)
    train_step(model, opt, seed=4)
    return save(root, role, iteration, model, opt)


def weights_url(d: str) -> str:
    return storage.join(d, "dcp", "__0_0.distcp")


def fresh():
    model = tiny_model(3)
    return model, optimizer_of(model)
