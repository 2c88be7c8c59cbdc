"""The multi-rank harness itself (tests.helpers.spawn_ranks): a rank whose assertion fails fails
the test at once with its traceback, while the other rank waits in a collective it will never
see; it never hangs until the group's timeout. Ranks are forked from a fork server started once,
yet each sees the environment of the moment it was asked for, as a spawned process would."""

from __future__ import annotations

import os
import time

import pytest

from tests.helpers import RankFailure, spawn_ranks


def _rank_1_fails_its_assertion(rank: int, world: int) -> int:
    import torch
    import torch.distributed as dist

    assert rank == 0, "rank 1 disagrees"
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a rank that already left
    return rank


@pytest.mark.multi_rank
def test_a_failed_assertion_on_one_rank_fails_the_group_at_once():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 of 2 failed") as info:
        spawn_ranks(2, _rank_1_fails_its_assertion, timeout_s=120)
    assert "AssertionError: rank 1 disagrees" in str(info.value)
    assert time.monotonic() - start < 60  # not the 120 s timeout


def _what_the_rank_sees(rank: int, world: int) -> tuple:
    return os.environ.get("DMD2_SPAWN_PROBE"), os.environ.get("DMD2_SPAWN_GONE")


@pytest.mark.multi_rank
def test_each_group_sees_the_environment_of_its_call(monkeypatch):
    monkeypatch.setenv("DMD2_SPAWN_GONE", "set before")
    monkeypatch.setenv("DMD2_SPAWN_PROBE", "first")
    assert spawn_ranks(2, _what_the_rank_sees, timeout_s=120) == [("first", "set before")] * 2
    monkeypatch.setenv("DMD2_SPAWN_PROBE", "second")  # after the fork server started
    monkeypatch.delenv("DMD2_SPAWN_GONE")
    assert spawn_ranks(2, _what_the_rank_sees, timeout_s=120) == [("second", None)] * 2
