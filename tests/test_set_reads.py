"""Prompt and real sets as a trainer reads them (dmd2_core/data.py: StoredRows): per iteration,
only the rows a rank uses, by ranged reads (local or s3://), the same rows a whole load gives; so a
rank's host memory holds its rows, not the set."""

from __future__ import annotations

import pytest
import torch

from dmd2_core import storage
from dmd2_core.data import (REAL_LATENTS, PromptSet, load_prompt_set, load_real_set, open_prompt_set, open_real_set,
                            write_safetensors)
from dmd2_core.toys.digits import digits_prompt_set
from dmd2_core.toys.standins import h3_prompt_set

ROWS = [5, 1, 1, 2, 3, 0, 7]  # unordered, repeated, with gaps


def tiled_digits(n: int) -> PromptSet:
    """The digits prompt set grown to ``n`` prompts (row i: digit i % 10's, slightly moved)."""
    digits = digits_prompt_set()
    index = torch.arange(n) % 10
    embeds = {k: v[index] + 1e-3 * torch.arange(n).reshape(-1, *[1] * (v.dim() - 1)) for k, v in digits.embeds.items()}
    return PromptSet([f"prompt {i}" for i in range(n)], embeds, digits.negative)


class ReadCounter:
    """Bytes read from one URL through the storage layer (whole reads and ranged reads)."""

    def __init__(self, monkeypatch, url: str):
        self.url, self.bytes = url, 0
        read_bytes, read_ranges = storage.read_bytes, storage.read_ranges

        def counted_bytes(u):
            data = read_bytes(u)
            self.bytes += len(data) if u == self.url else 0
            return data

        def counted_ranges(ranges):
            out = read_ranges(ranges)
            self.bytes += sum(len(b) for (u, _, _), b in zip(ranges, out) if u == self.url)
            return out

        monkeypatch.setattr(storage, "read_bytes", counted_bytes)
        monkeypatch.setattr(storage, "read_ranges", counted_ranges)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_stored_set_gives_the_rows_a_whole_load_gives(tmp_path, request, where):
    root = request.getfixturevalue("s3_bucket") if where == "s3" else str(tmp_path)
    for name, prompt_set in (("digits", tiled_digits(12)), ("h3", h3_prompt_set(num_prompts=9))):
        url = f"{root}/{name}.safetensors"
        prompt_set.save(url)
        whole, stored = load_prompt_set(url), open_prompt_set(url)
        assert len(stored) == len(whole) and stored.prompts == whole.prompts
        for index in (ROWS, [4], []):
            got, want = stored.cond(torch.tensor(index, dtype=torch.long)), whole.cond(index)
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), (name, index)
        got, want = stored.uncond(3), whole.uncond(3)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        with pytest.raises(IndexError, match=f"{name}.safetensors"):
            stored.cond([len(whole)])

    real_url = f"{root}/real.safetensors"
    prompts = tiled_digits(8)
    write_safetensors(real_url, {REAL_LATENTS: torch.randn(8, 1, 4, 4).to(torch.bfloat16), **prompts.embeds,
                                 **{f"negative_{k}": v for k, v in prompts.negative.items()}})
    whole, stored = load_real_set(real_url), open_real_set(real_url)
    assert len(stored) == len(whole) == 8
    (x, cond), (x_want, cond_want) = stored.batch(torch.tensor(ROWS)), whole.batch(torch.tensor(ROWS))
    assert x.dtype == torch.float32 and torch.equal(x, x_want)
    assert cond.keys() == cond_want.keys() and all(torch.equal(cond[k], cond_want[k]) for k in cond)


def test_a_trainer_reads_only_the_rows_its_rollouts_use(tiny_teacher, tmp_path, monkeypatch):
    """A 512-prompt set file: the trainers' start (actor and critic: the negative entry each) and
    the actor's two rollouts (the rows of its two batches, 8 each) read that, not the set."""
    from tests.helpers import in_process_trainers, tiny_args

    url = str(tmp_path / "prompts.safetensors")
    big = tiled_digits(512)
    big.save(url)
    row_bytes = sum(v[0].numel() * v.element_size() for v in big.embeds.values())
    negative_bytes = sum(v.numel() * v.element_size() for v in big.negative.values())
    args = tiny_args(tiny_teacher, str(tmp_path / "run"), prompts=url, evaluator="digits")
    counter = ReadCounter(monkeypatch, url)
    actor = in_process_trainers(args)["actor"]
    for iteration in (1, 2):
        actor.rollout(iteration)
    batch = args.global_batch_size
    assert 0 < counter.bytes <= 2 * negative_bytes + 2 * batch * row_bytes < storage.filesystem(url)[0].size(url) / 10
