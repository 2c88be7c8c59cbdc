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

        def counted_ranges(ranges, pins=None):
            out = read_ranges(ranges, pins)
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


# ---- a set replaced at its URL while a run reads it -----------------------------------------------

def longer_header(prompt_set: PromptSet) -> PromptSet:
    """The same tensors under longer prompt texts: a header that ends further in, so every
    tensor's bytes lie further in than the first file's header said."""
    return PromptSet([f"{text}, now with a much longer caption" for text in prompt_set.prompts], prompt_set.embeds,
                     prompt_set.negative)


@pytest.fixture
def s3_ignoring_if_match(monkeypatch):
    """S3 calls with any If-Match condition dropped: a store that does not honour it."""
    from s3fs import S3FileSystem

    call = S3FileSystem._call_s3

    async def unconditional(self, method, *a, **kw):
        kw.pop("IfMatch", None)
        return await call(self, method, *a, **kw)

    monkeypatch.setattr(S3FileSystem, "_call_s3", unconditional)


@pytest.mark.parametrize("where", ["local", "s3", "s3-ignoring-if-match"])
def test_a_set_replaced_at_its_url_is_named_never_read_misaligned(tmp_path, request, where):
    """A prompt set and a real set read at the version they were opened at: unchanged, every
    read gives the whole load's rows; replaced by a file whose header is longer, the next read
    raises one line naming the URL (a StoredFilesError: the run stops, nothing is retried)."""
    from dmd2_core.errors import CheckpointError, InputChangedError, StoredFilesError

    if where == "s3-ignoring-if-match":
        request.getfixturevalue("s3_ignoring_if_match")
    root = request.getfixturevalue("s3_bucket") if where.startswith("s3") else str(tmp_path)
    prompts_url, real_url = f"{root}/prompts.safetensors", f"{root}/real.safetensors"
    prompts = tiled_digits(12)
    prompts.save(prompts_url)
    latents = torch.randn(12, 1, 4, 4)
    write_safetensors(real_url, {REAL_LATENTS: latents, **prompts.embeds})
    stored_prompts, stored_real = open_prompt_set(prompts_url), open_real_set(real_url)
    for _ in range(2):  # unchanged: the same rows on every read
        got, want = stored_prompts.cond(ROWS), prompts.cond(ROWS)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        assert torch.equal(stored_real.batch(torch.tensor(ROWS))[0], latents[ROWS])

    longer_header(prompts).save(prompts_url)
    write_safetensors(real_url, {REAL_LATENTS: latents, **prompts.embeds}, {"caption": "x" * 100})
    for read, url in ((lambda: stored_prompts.cond(ROWS), prompts_url),
                      (lambda: stored_real.batch(torch.tensor(ROWS)), real_url)):
        with pytest.raises(InputChangedError) as info:
            read()
        line = str(info.value)
        assert "\n" not in line and line.startswith(f"{url}: changed in storage since this run opened it"), line
        assert isinstance(info.value, StoredFilesError) and not isinstance(info.value, CheckpointError)
        if where == "s3":  # the store refused the read (If-Match): no request beyond the read itself
            assert "its ETag is no longer" in line, line
    reopened = open_prompt_set(prompts_url)  # a rerun opens the file as it is now
    got = reopened.cond(ROWS)
    assert all(torch.equal(got[k], prompts.cond(ROWS)[k]) for k in got) and reopened.prompts[0].endswith("caption")
    # a file of the very same size (other embeddings) is a new version too: its ETag, or locally its inode
    PromptSet(reopened.prompts, {k: v + 1 for k, v in prompts.embeds.items()}, prompts.negative).save(prompts_url)
    with pytest.raises(InputChangedError, match=f"^{prompts_url}: changed in storage"):
        reopened.cond(ROWS)


def test_a_run_whose_prompt_set_is_replaced_stops_in_one_line_and_a_rerun_resumes(tiny_teacher, tmp_path):
    """A trainer's rollout after its prompt set was replaced: InputChangedError naming the file,
    which reaches the driver as itself from a Ray actor and is never retried, its state untouched;
    trainers started again (a rerun) load the latest checkpoint and train on with the new file."""
    import ray
    from prefect.states import Failed

    from dmd2_core.errors import InputChangedError
    from dmd2_core.run.distill_run import _as_ray_error
    from tasks.common import retry_runtime_failures
    from tests.helpers import in_process_trainers, iterate_in_process, tiny_args

    url = str(tmp_path / "prompts.safetensors")
    prompts = tiled_digits(16)
    prompts.save(url)
    args = tiny_args(tiny_teacher, str(tmp_path / "run"), prompts=url, evaluator="digits")
    trainers = in_process_trainers(args)
    iterate_in_process(trainers, 1)
    for trainer in trainers.values():
        trainer.save(1)
        trainer.save_status(wait=True)
    before = trainers["actor"].state_digest()

    longer_header(prompts).save(url)
    with pytest.raises(InputChangedError, match=f"^{url}: changed in storage") as info:
        trainers["actor"].rollout(2)
    assert trainers["actor"].state_digest() == before
    remote = ray.exceptions.RayTaskError("rollout", "Traceback (most recent call last):\n  ...", info.value)
    assert _as_ray_error(remote) is info.value
    assert not retry_runtime_failures(None, None, Failed(data=info.value))

    rerun = in_process_trainers(args)
    for trainer in rerun.values():
        trainer.load(1)
    assert rerun["actor"].state_digest() == before
    iterate_in_process(rerun, 2)
