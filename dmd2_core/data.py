"""Conditioning sets (precomputed prompt embeddings) and real sets, and the sets built in by name.

A prompt set is one safetensors file holding the tensors a real text-to-image pipeline's text
encoders produce: ``prompt_embeds`` [N, L, D], optionally ``pooled_prompt_embeds`` [N, P], and the
empty-prompt entry ``negative_prompt_embeds`` [1, L, D] (+ ``negative_pooled_prompt_embeds``) used
as the unconditional branch of classifier-free guidance; the prompt texts ride in its metadata.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from safetensors.torch import load, save

from dmd2_core import storage

DIGITS = "digits"
# A MiniMax-H3 fl2va set's keyframes as pictures, uint8 [N, K, 3, H, W]: the eval media show them
# beside the clip; no forward reads them, so a set's ``cond`` leaves them out.
KEYFRAME_PIXELS = "keyframe_pixels"
REFERENCE_PIXELS = "reference_pixels"  # and a ref2va set's image references, uint8 [N, I, 3, H, W], as encoded
SHOWN_ONLY_KEYS = (KEYFRAME_PIXELS, REFERENCE_PIXELS)
# Prompt and real sets built in by name: a toy world's module (``dmd2_core/toys``), imported only
# when a run names it, that gives ``prompt_set()``, ``real_set()`` and ``quality(sample, n, seed)``.
BUILTIN_SETS = {DIGITS: "dmd2_core.toys.digits_world"}


@dataclass
class PromptSet:
    prompts: list[str]
    embeds: dict[str, torch.Tensor]  # key -> [N, ...]
    negative: dict[str, torch.Tensor]  # key -> [1, ...]
    evaluator: Optional[str] = None  # a toy world's prompts name its evaluator (dmd2_core.evaluators)

    def __len__(self) -> int:
        return len(self.prompts)

    def cond(self, indices) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return {k: v[idx] for k, v in self.embeds.items() if k not in SHOWN_ONLY_KEYS}

    def uncond(self, n: int) -> dict[str, torch.Tensor]:
        return {k: v.expand(n, *v.shape[1:]).clone() for k, v in self.negative.items()}

    def save(self, url: str) -> None:
        write_safetensors(url, {**self.embeds, **{f"negative_{k}": v for k, v in self.negative.items()}},
                          {"prompts": json.dumps(self.prompts), **({"evaluator": self.evaluator} if self.evaluator else {})})


def write_safetensors(url: str, tensors: dict[str, torch.Tensor], metadata: Optional[dict[str, str]] = None) -> None:
    """Tensors as one safetensors file at any fsspec URL (a prompt set, a real set)."""
    storage.write_bytes(url, save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata))


def read_safetensors(url: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """What ``write_safetensors`` wrote: the tensors and the metadata (from the header: 8 bytes of
    its length, then its JSON), read straight from storage, no temp file."""
    data = storage.read_bytes(url)
    tensors = load(data)
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    return tensors, header.get("__metadata__") or {}


class StoredRows:
    """The tensors of a set file (a prompt or real set: one safetensors file, row i of each tensor
    the i-th sample's) whose rows are read only when asked for, and only those: one ranged read per
    run of consecutive rows (a seek locally, a Range request on an object store, as a trainer
    reads its weight shards), so a reader's host memory holds the rows it uses, not the set.
    Every read is of the file's version whose header gave the offsets: a file replaced at its URL
    meanwhile raises InputChangedError naming it, never rows of neither set."""

    def __init__(self, url: str):
        from dmd2_core.models.weight_files import WeightFiles, file_tensors

        tensors, self.metadata = file_tensors(url)
        self.url, self.files = url, WeightFiles.of_file(url, tensors)
        self.shapes = {k: t.shape for k, t in tensors.items()}

    def rows(self, keys: Sequence[str], index) -> dict[str, torch.Tensor]:
        """``{key: tensor[index]}`` for each key (``index``: row numbers, in any order, repeats allowed)."""
        index = torch.as_tensor(index, dtype=torch.long).reshape(-1)
        if not keys:
            return {}
        n = self.shapes[keys[0]][0]
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= n):
            raise IndexError(f"{self.url}: rows {index.tolist()} out of its {n}")
        unique, inverse = torch.unique(index, return_inverse=True)
        runs: list[list[int]] = []  # [start, stop) of each run of consecutive rows
        for row in unique.tolist():
            if runs and runs[-1][1] == row:
                runs[-1][1] += 1
            else:
                runs.append([row, row + 1])
        pieces = {(name, lo): rows for name, lo, _, rows in self.files.read_rows([(k, a, b) for k in keys for a, b in runs])}
        out = {}
        for key in keys:
            parts = [pieces[(key, a)] for a, _ in runs]
            whole = torch.cat(parts) if parts else torch.empty((0, *self.shapes[key][1:]),
                                                               dtype=self.files.tensor(key).dtype)
            out[key] = whole[inverse]
        return out

    def whole(self, key: str) -> torch.Tensor:
        return self.rows([key], torch.arange(self.shapes[key][0]))[key]


class StoredPromptSet:
    """A prompt set file as a trainer reads it: the negative entry and the texts at once (small),
    each row of the embeddings only when ``cond`` asks for it (``StoredRows``). Its ``cond`` and
    ``uncond`` give what a loaded ``PromptSet``'s give (neither reads ``SHOWN_ONLY_KEYS``: a
    training batch never fetches the keyframes' pictures)."""

    def __init__(self, url: str):
        self.stored = StoredRows(url)
        shapes, meta = self.stored.shapes, self.stored.metadata
        self.keys = [k for k in shapes if not k.startswith("negative_") and k not in SHOWN_ONLY_KEYS]
        negative_keys = [k for k in shapes if k.startswith("negative_")]
        if "prompt_embeds" not in self.keys or (negative_keys and {k.removeprefix("negative_") for k in negative_keys}
                                                != set(self.keys)):
            raise ValueError(f"{url}: a prompt set needs prompt_embeds and a negative_ entry for each key (or none: "
                             "a guidance-distilled model's set)")
        self.negative = {k.removeprefix("negative_"): self.stored.whole(k) for k in negative_keys}
        self.size = shapes["prompt_embeds"][0]
        self.prompts = json.loads(meta.get("prompts", "[]")) or [f"prompt {i}" for i in range(self.size)]
        self.evaluator = None

    def __len__(self) -> int:
        return self.size

    def cond(self, indices) -> dict[str, torch.Tensor]:
        return self.stored.rows(self.keys, indices)

    def uncond(self, n: int) -> dict[str, torch.Tensor]:
        return {k: v.expand(n, *v.shape[1:]).clone() for k, v in self.negative.items()}


def open_prompt_set(url: str):
    """The prompt set a trainer conditions on: a built-in set (in memory), or a set file read row
    by row as it is used (``StoredPromptSet``). ``load_prompt_set`` reads a file whole."""
    if url in BUILTIN_SETS:
        return builtin_set(url).prompt_set()
    return StoredPromptSet(url)


def builtin_set(name: Optional[str]):
    """The toy world a built-in set name stands for (its module), or None for a set's URL."""
    if name not in BUILTIN_SETS:
        return None
    import importlib

    return importlib.import_module(BUILTIN_SETS[name])


def load_prompt_set(url: str) -> PromptSet:
    if url in BUILTIN_SETS:
        return builtin_set(url).prompt_set()
    tensors, meta = read_safetensors(url)
    prompts = json.loads(meta.get("prompts", "[]"))
    embeds = {k: v for k, v in tensors.items() if not k.startswith("negative_")}
    negative = {k.removeprefix("negative_"): v for k, v in tensors.items() if k.startswith("negative_")}
    if "prompt_embeds" not in embeds or (negative and set(negative) != set(embeds)):
        raise ValueError(f"{url}: a prompt set needs prompt_embeds and a negative_ entry for each key (or none: "
                         "a guidance-distilled model's set)")
    if not prompts:
        prompts = [f"prompt {i}" for i in range(len(embeds["prompt_embeds"]))]
    return PromptSet(prompts, embeds, negative)


# ---- real data (the GAN head's real samples) ----------------------------------------------------
# A real set follows the prompt-set conventions (one safetensors file: the condition tensors of
# each sample, their negative_ entries, the captions in the metadata) plus ``latents`` [N, ...]:
# the samples in the model's latent space, row i conditioned on row i.
REAL_LATENTS = "latents"


@dataclass
class RealSet:
    latents: torch.Tensor  # [N, ...]
    cond: dict[str, torch.Tensor]  # key -> [N, ...]

    def __len__(self) -> int:
        return len(self.latents)

    def batch(self, index: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.latents[index], {k: v[index] for k, v in self.cond.items()}


def load_real_set(url: str) -> RealSet:
    """A built-in set by name ('digits': the digits training split, each image conditioned on its
    label's prompt) or a real-set file at any fsspec URL."""
    if url in BUILTIN_SETS:
        return builtin_set(url).real_set()
    tensors, _ = read_safetensors(url)
    latents = tensors.pop(REAL_LATENTS)
    return RealSet(latents.float(), {k: v.float() for k, v in tensors.items() if not k.startswith("negative_")})


class StoredRealSet:
    """A real set file as the critic's GAN head reads it: each batch's rows only (``StoredRows``),
    in float32 as ``load_real_set`` gives them."""

    def __init__(self, url: str):
        self.stored = StoredRows(url)
        self.keys = [k for k in self.stored.shapes if not k.startswith("negative_") and k != REAL_LATENTS]

    def __len__(self) -> int:
        return self.stored.shapes[REAL_LATENTS][0]

    def batch(self, index: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        rows = {k: v.float() for k, v in self.stored.rows([REAL_LATENTS, *self.keys], index).items()}
        return rows.pop(REAL_LATENTS), rows


def open_real_set(url: str):
    """The real set a critic reads: a built-in set (in memory), or a set file read batch by batch."""
    if url in BUILTIN_SETS:
        return builtin_set(url).real_set()
    return StoredRealSet(url)


def safetensors_shapes(url: str) -> dict[str, list[int]]:
    """Tensor name -> shape, from the header alone (one small read, also on S3)."""
    entries, _ = storage.read_safetensors_header(url)
    return {k: list(v["shape"]) for k, v in entries.items() if k != "__metadata__"}


def prompt_texts(prompts_url: Optional[str]) -> list[str]:
    """The prompt texts of a prompt set, read from the safetensors header alone (no tensors are
    loaded, so a large embedding file costs one small read)."""
    if prompts_url is None or prompts_url in BUILTIN_SETS:
        return list(builtin_set(prompts_url or DIGITS).prompt_set().prompts)
    header, _ = storage.read_safetensors_header(prompts_url)
    texts = json.loads((header.get("__metadata__") or {}).get("prompts", "[]"))
    if texts:
        return list(texts)
    shape = header.get("prompt_embeds", {}).get("shape") or [0]
    return [f"prompt {i}" for i in range(int(shape[0]))]


def real_set_shapes(url: str) -> dict[str, list[int]]:
    if url in BUILTIN_SETS:
        real = builtin_set(url).real_set()
        return {REAL_LATENTS: list(real.latents.shape), **{k: list(v.shape) for k, v in real.cond.items()}}
    return {k: v for k, v in safetensors_shapes(url).items() if not k.startswith("negative_")}


def prompt_set_shapes(url: str) -> dict[str, list[int]]:
    if url in BUILTIN_SETS:
        return {k: list(v.shape) for k, v in builtin_set(url).prompt_set().embeds.items()}
    return {k: v for k, v in safetensors_shapes(url).items() if not k.startswith("negative_")}


# a condition's token axis (dim 1), padded to each set's longest text where prompt_lengths rides along
TOKEN_KEYS = ("prompt_embeds", "text_token_tags")


def check_real_set(url: str, sample_shape: tuple, prompts_url: str, cond_keys) -> None:
    """Before any actor starts: the real set exists, its latents have the model's sample shape and
    it holds each of ``cond_keys`` (the run's workflow's: an fl2va critic's real clips carry their
    keyframes) in the prompt set's per-sample shape. Raises ValueError naming the path and key."""
    if url not in BUILTIN_SETS and not storage.exists(url):
        raise ValueError(f"real_data: no real set at {url}{storage.nearest_sibling(url)}")
    try:
        shapes = real_set_shapes(url)
    except Exception as exc:  # noqa: BLE001 - unreadable header: one line naming the path
        raise ValueError(f"real_data: {url} is not a safetensors real set ({type(exc).__name__}: {exc})") from None
    if REAL_LATENTS not in shapes:
        raise ValueError(f"real_data: {url} holds no '{REAL_LATENTS}' tensor (keys: {', '.join(shapes)})")
    n, got = shapes[REAL_LATENTS][0], tuple(shapes[REAL_LATENTS][1:])
    if got != tuple(sample_shape):
        raise ValueError(f"real_data: {url} latents are {list(got)} per sample, the model samples {list(sample_shape)}")
    want = prompt_set_shapes(prompts_url)
    padded = "prompt_lengths" in cond_keys  # token sequences padded per set: only their shape per token must agree
    for key in cond_keys:
        if key not in shapes:
            raise ValueError(f"real_data: {url} has no condition '{key}' (the run conditions each sample on "
                             f"{', '.join(cond_keys)})")
        if shapes[key][0] != n:
            raise ValueError(f"real_data: {url} '{key}' has {shapes[key][0]} rows for {n} latents")
        first = 2 if padded and key in TOKEN_KEYS else 1
        if key in want and shapes[key][first:] != want[key][first:]:
            what = "per token" if first == 2 else "per sample"
            raise ValueError(f"real_data: {url} '{key}' is {shapes[key][first:]} {what}, the prompt set's is "
                             f"{want[key][first:]}")


def keyframe_pictures(prompts_url: Optional[str], indices: Sequence[int]) -> dict[int, tuple[torch.Tensor, list[int]]]:
    """Prompt index -> its keyframes as pictures (uint8 [K, 3, H, W]) and their anchor codes (0
    first, 1 last), for the prompts ``indices`` of an fl2va set: those rows only. Empty for a set
    without pictures (a built-in or t2va set, or an fl2va set prepared before they were kept)."""
    rows = _prompt_rows(prompts_url, indices, [KEYFRAME_PIXELS, "keyframe_anchors"])
    return {p: (row[KEYFRAME_PIXELS], row["keyframe_anchors"].tolist()) for p, row in rows.items()}


def _prompt_rows(prompts_url: Optional[str], indices: Sequence[int], keys: list[str]) -> dict[int, dict]:
    """Prompt index -> its rows of ``keys`` in a stored set, for the prompts ``indices`` only; empty
    for a built-in set or one without every key."""
    if not prompts_url or prompts_url in BUILTIN_SETS:
        return {}
    stored = StoredRows(prompts_url)
    if any(key not in stored.shapes for key in keys):
        return {}
    unique = sorted(set(int(i) for i in indices))
    rows = stored.rows(keys, unique)
    return {p: {key: rows[key][i] for key in keys} for i, p in enumerate(unique)}


def reference_pictures(prompts_url: Optional[str], indices: Sequence[int]) -> dict[int, torch.Tensor]:
    """Prompt index -> its image references as pictures (uint8 [I, 3, H, W], as encoded), for the
    prompts ``indices`` of a ref2va set: those rows only. Empty for a set without them."""
    return {p: row[REFERENCE_PIXELS] for p, row in _prompt_rows(prompts_url, indices, [REFERENCE_PIXELS]).items()}


def references_per_sample(prompts_url: Optional[str], workflow: str) -> tuple:
    """The references each sample of a MiniMax-H3 ref2va run carries (``reference_layout``'s tuple
    of its first row; () otherwise), from its prompt set: the rows they add to every sequence,
    for the memory and time plans."""
    if workflow != "ref2va" or not prompts_url or prompts_url in BUILTIN_SETS:
        return ()
    from dmd2_core.models.minimax_h3 import REFERENCE_AUDIO, reference_layout

    shapes = safetensors_shapes(prompts_url)
    if "reference_latents" not in shapes:
        return ()
    kinds = StoredRows(prompts_url).rows(["reference_kinds"], [0])["reference_kinds"][0].tolist()
    return reference_layout(kinds, shapes["reference_latents"][2:], (shapes.get(REFERENCE_AUDIO) or [0, 0, 0])[2])


def workflow_conditions(prompts_url: Optional[str], workflow: str) -> dict:
    """The condition rows each sample of a MiniMax-H3 run carries, as ``family.bind`` takes them:
    {'keyframes': K} (fl2va), {'references': ...} (ref2va), {} otherwise; from its prompt set."""
    if workflow == "fl2va":
        return {"keyframes": keyframes_per_sample(prompts_url, workflow)}
    if workflow == "ref2va":
        return {"references": references_per_sample(prompts_url, workflow)}
    return {}


def keyframes_per_sample(prompts_url: Optional[str], workflow: str) -> int:
    """Keyframe condition frames each sample of a MiniMax-H3 fl2va run carries (0 for t2va), from
    its prompt set's header: the rows they add to every sequence, for the memory and time plans."""
    if workflow != "fl2va" or not prompts_url or prompts_url in BUILTIN_SETS:
        return 0
    shape = safetensors_shapes(prompts_url).get("keyframe_latents")
    return int(shape[1]) if shape else 0
