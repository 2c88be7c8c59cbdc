"""What both export writers share: the format number in ``export.json``, the state a diffusers
directory holds, a writable directory for a local or object-store URL, and the staging beside an
export's URL that a finished export is swapped in from."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from dmd2_core import storage
from dmd2_core.errors import ModelDirError
from dmd2_core.save_layout import EXPORT_MARKER_NAME, EXPORT_STAGING_SEP

EXPORT_FORMAT = 1


def persistent(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop non-persistent buffers (e.g. Wan's rope tables): not in a diffusers state dict."""
    skip = {f"{prefix}.{name}" if prefix else name
            for prefix, module in model.named_modules() for name in module._non_persistent_buffers_set}
    return {k: v for k, v in state.items() if k not in skip}


def cast(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


@contextmanager
def writable_dir(url: str) -> Iterator[Path]:
    """A directory to write into: ``url`` itself when local, else staged and uploaded."""
    if storage.is_local(url):
        _, path = storage.filesystem(url)
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    with storage.staged_dir(url) as tmp:
        yield tmp


def total_bytes(url: str) -> int:
    def run():
        fs, path = storage.filesystem(url)
        return sum(int(info.get("size") or 0) for info in fs.find(path, detail=True).values())
    return storage.retrying(run, f"list {url}")


def new_staging_url(url: str) -> str:
    """A fresh directory beside ``url`` to write an export into: ``{url}.staging-{nonce}``."""
    return f"{url.rstrip('/')}{EXPORT_STAGING_SEP}{uuid.uuid4().hex[:8]}"


@contextmanager
def staged_export(url: str, staging: str | None = None) -> Iterator[str]:
    """A fresh directory beside ``url`` (``staging``, or a ``new_staging_url``) to write a whole
    export into, export.json last; once the block exits cleanly it is swapped in at ``url``
    (``swap_in``). Whatever was at ``url`` stays whole until then: a failure or a kill while
    writing leaves it as it was (the staging is removed on a failure; a killed one's by retention)."""
    staging = staging or new_staging_url(url)
    try:
        yield staging
    except BaseException as exc:
        with contextlib.suppress(Exception):
            storage.remove(staging)
        if isinstance(exc, ModelDirError) and staging in str(exc):  # named as the export it was to become
            raise ModelDirError(str(exc).replace(staging, url.rstrip("/"))) from None
        raise
    swap_in(staging, url)


def swap_in(staging: str, url: str) -> None:
    """Put the complete export at ``staging`` in place at ``url``. Locally two renames: the old
    directory aside, the new one in, then the old one deleted (an export is never deleted before
    its replacement is whole). An object store has no rename: the old export's marker goes, the
    files are copied server-side, stale ones deleted, the marker copied last, and the staging
    deleted; a kill meanwhile leaves ``url`` unmarked (incomplete) and the staging whole. The
    checkpoint path never swaps over a tracked export (run/save_tracker.py reuses it)."""
    if storage.is_local(url):
        target, source = storage.filesystem(url)[1], storage.filesystem(staging)[1]
        if not os.path.exists(target):
            os.rename(source, target)
            return
        aside = f"{target}{EXPORT_STAGING_SEP}replaced-{uuid.uuid4().hex[:8]}"
        os.rename(target, aside)
        os.rename(source, target)
        shutil.rmtree(aside)
        return
    new, old = relative_files(staging), relative_files(url)
    storage.remove(storage.join(url, EXPORT_MARKER_NAME))
    for rel in sorted(new, key=lambda r: r == EXPORT_MARKER_NAME):  # the marker last
        if rel == EXPORT_MARKER_NAME:
            for stale in sorted(set(old) - set(new)):
                storage.remove(storage.join(url, stale))
        source, target = storage.filesystem(storage.join(staging, rel))[1], storage.filesystem(storage.join(url, rel))[1]
        storage.retrying(lambda s=source, t=target: storage.filesystem(url)[0].copy(s, t), f"copy to {url}")
    storage.remove(staging)


def relative_files(url: str) -> list[str]:
    """Every file under the directory ``url``, as paths relative to it ([] when there is none)."""
    def run():
        fs, path = storage.filesystem(url)
        root = path.rstrip("/")
        if not fs.exists(root):
            return []
        return [f[len(root):].lstrip("/") for f in fs.find(root)]
    return storage.retrying(run, f"list {url}")
