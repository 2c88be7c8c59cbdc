"""The device stash behind a trainer's sleep and wake, on its own (CPU tensors)."""

from __future__ import annotations

import torch

from dmd2_core.train.device_stash import DeviceStash, distinct_storages


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().view(torch.int32)


def test_sleep_frees_every_storage_and_wake_restores_it_bit_for_bit():
    shared = torch.randn(16)
    shared[0], shared[1] = float("nan"), -0.0  # compared by their bits, not their values
    view = shared[4:8]  # as FSDP views its flat storage
    state = {"exp_avg": torch.randn(3, 3), "step": torch.tensor(7.0)}
    ema = [torch.randn(5)]
    before = {"shared": _bits(shared), "view": _bits(view), "exp_avg": _bits(state["exp_avg"]), "ema": _bits(ema[0])}
    storages = distinct_storages([shared, view, state["step"]], "cpu")
    assert len(storages) == 1  # the view shares its base's storage; a scalar is left where it is

    stash = DeviceStash()
    stash.swap_out([(state, "exp_avg"), (ema, 0)])
    stash.resize_out(storages)
    assert shared.untyped_storage().nbytes() == 0 and view.untyped_storage().nbytes() == 0
    assert state["exp_avg"].untyped_storage().nbytes() == 0 and ema[0].untyped_storage().nbytes() == 0
    assert state["step"].item() == 7.0

    stash.restore()
    assert torch.equal(_bits(shared), before["shared"]) and torch.equal(_bits(view), before["view"])
    assert torch.equal(_bits(state["exp_avg"]), before["exp_avg"]) and torch.equal(_bits(ema[0]), before["ema"])
    assert state["exp_avg"].shape == (3, 3) and ema[0].shape == (5,)
    view.fill_(2.0)  # the view still aliases its base
    assert torch.equal(shared[4:8], torch.full((4,), 2.0))
