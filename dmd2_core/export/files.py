"""What both export writers share: the format number in ``export.json``, the state a diffusers
directory holds, a writable directory for a local or object-store URL, and the staging beside an
export's URL that a finished export is swapped in from.

How an export lands at its URL, so that a reader never takes a half-written export for a complete
one (``export.json`` is what says complete) and a kill at any point loses nothing whole:

- locally it is written in ``{url}.staging-{nonce}/`` and renamed in; over an existing export the
  old one is renamed aside first;
- on an object store (no rename) it is written straight at ``url`` when nothing is there (uploaded
  once); over an existing export it is written in the staging, then the old marker is deleted,
  the files copied server-side, stale ones deleted, the marker copied last;
- every step that leaves ``url`` changing is announced first in ``{url}.swap.json`` (the swap
  record: the staging it completes from), removed once ``url`` is whole. The next writer of
  ``url`` (and retention, before it judges exports) reads a record a kill left behind first:
  ``finish_swap`` completes the swap from the complete staging, or rolls back a direct write that
  never got its marker (``url`` held nothing whole before it);
- an object store's export is streamed into a local directory under ``$TMPDIR`` first
  (``LocalStaging``, ``dmd2-export-*``), locked while it lives: one that a killed export left is
  swept when the next one starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from dmd2_core import storage
from dmd2_core.errors import ModelDirError, one_line
from dmd2_core.save_layout import EXPORT_MARKER_NAME, EXPORT_STAGING_SEP, EXPORT_SWAP_SUFFIX

log = logging.getLogger("dmd2")

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
    """A directory to write into: ``url`` itself when local, else a ``LocalStaging`` uploaded to
    ``url`` when the block exits cleanly."""
    if storage.is_local(url):
        _, path = storage.filesystem(url)
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    local = LocalStaging()
    try:
        yield local.path
        storage.upload_dir(local.path, url)
    finally:
        local.remove()


def total_bytes(url: str) -> int:
    def run():
        fs, path = storage.filesystem(url)
        return sum(int(info.get("size") or 0) for info in fs.find(path, detail=True).values())
    return storage.retrying(run, f"list {url}")


def resolved(url: str) -> str:
    """``url`` with a local path's symlinks and ``..`` resolved (an export is swapped in where its
    files really are, beside the real directory, not over a link); an object store's as given."""
    if not storage.is_local(url):
        return str(url).rstrip("/")
    return os.path.realpath(storage.filesystem(url)[1])


def new_staging_url(url: str) -> str:
    """A fresh directory beside ``url`` to write an export into: ``{url}.staging-{nonce}``."""
    return f"{url.rstrip('/')}{EXPORT_STAGING_SEP}{uuid.uuid4().hex[:8]}"


def swap_record_url(url: str) -> str:
    """Where a swap into ``url`` is announced while it runs: ``{url}.swap.json``."""
    return f"{url.rstrip('/')}{EXPORT_SWAP_SUFFIX}"


def is_marked(url: str) -> bool:
    """Whether ``url`` holds a complete export (its export.json, written last)."""
    return storage.exists(storage.join(url, EXPORT_MARKER_NAME))


@contextmanager
def staged_export(url: str, staging: str | None = None) -> Iterator[str]:
    """A directory to write a whole export into, export.json last; once the block exits cleanly
    the export is in place at ``url``. Locally (or given ``staging``) a fresh directory beside
    ``url`` (``new_staging_url``), swapped in (``swap_in``); on an object store with nothing at
    ``url``, ``url`` itself (no second copy). Whatever was at ``url`` stays whole until the swap: a
    failure or a kill while writing leaves it as it was (the staging, or the unmarked direct write,
    is removed on a failure; a killed one's by retention or the next writer). A swap a kill
    interrupted is finished first (``finish_swap``)."""
    url = resolved(url)
    finish_swap(url)
    direct = staging is None and not storage.is_local(url) and not relative_files(url)
    if direct:  # announced, so that a kill's unmarked files are known for a write to roll back
        staging = url
        _write_record(url, {"staging": url})
    staging = staging or new_staging_url(url)
    try:
        yield staging
    except BaseException as exc:
        with contextlib.suppress(Exception):
            storage.remove(staging)
            if direct:
                storage.remove(swap_record_url(url))
        if isinstance(exc, ModelDirError) and staging in str(exc):  # named as the export it was to become
            raise ModelDirError(str(exc).replace(staging, url.rstrip("/"))) from None
        raise
    if direct:
        storage.remove(swap_record_url(url))
    else:
        swap_in(staging, url)


def swap_in(staging: str, url: str) -> None:
    """Put the complete export at ``staging`` in place at ``url``. Locally a rename, or over an
    existing export two (the old directory aside, the new one in) and the old one deleted. An
    object store has no rename: the old export's marker goes, the files are copied server-side,
    stale ones deleted, the marker copied last, and the staging deleted. Either way a swap over an
    export is announced in ``{url}.swap.json`` first and the record removed last: a kill meanwhile
    leaves ``url`` unmarked (incomplete, or absent) and the staging whole, and the next writer
    completes the swap (``finish_swap``). The checkpoint path never swaps over a tracked export
    (run/checkpoint_commits.py reuses it)."""
    if storage.is_local(url):
        target = storage.filesystem(url)[1]
        if not os.path.lexists(target):
            os.rename(storage.filesystem(staging)[1], target)
            return
        record = {"staging": staging, "aside": f"{target}{EXPORT_STAGING_SEP}replaced-{uuid.uuid4().hex[:8]}"}
    else:
        record = {"staging": staging}
    _write_record(url, record)
    _swap(url, record)
    storage.remove(swap_record_url(url))


def finish_swap(url: str) -> str | None:
    """Complete, or roll back, a swap into ``url`` that a kill interrupted (its ``{url}.swap.json``
    remains): from a complete staging the swap is done again (each step is idempotent); a direct
    write killed before its marker is removed (nothing whole was at ``url`` before it); a swap
    that got as far as the new marker only loses its leftovers. Returns 'completed', 'rolled back'
    or None (no record), and says which in a warning naming ``url``."""
    record_url = swap_record_url(url)
    if not storage.exists(record_url):
        return None
    try:
        record = json.loads(storage.read_text(record_url))
        staging = str(record["staging"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelDirError(f"{record_url}: unreadable swap record ({one_line(exc)}); delete it once "
                            f"{url} is checked") from None
    if staging.rstrip("/") == url.rstrip("/"):  # a direct write
        done = "completed" if is_marked(url) else "rolled back"
        if done == "rolled back":
            storage.remove(url)
    elif is_marked(staging):
        _swap(url, record)
        done = "completed"
    else:  # the staging's marker was moved (local) or the staging deleted after the copy (object store)
        storage.remove(staging)
        aside = record.get("aside")
        if aside and not os.path.lexists(storage.filesystem(url)[1]) and os.path.isdir(aside):
            os.rename(aside, storage.filesystem(url)[1])  # nothing new to put in: the old one back
            done = "rolled back"
        else:
            if aside and os.path.lexists(aside):
                shutil.rmtree(aside)
            done = "completed"
    storage.remove(record_url)
    log.warning(f"export: {url}: a swap interrupted by a kill was {done} ({'whole' if is_marked(url) else 'empty'} now)")
    return done


def _write_record(url: str, record: dict) -> None:
    storage.write_text(swap_record_url(url), json.dumps(record) + "\n")


def _swap(url: str, record: dict) -> None:
    """The steps of a swap from ``record['staging']`` into ``url``, each safe to run again."""
    staging = record["staging"]
    if storage.is_local(url):
        target, source, aside = storage.filesystem(url)[1], storage.filesystem(staging)[1], record["aside"]
        if os.path.lexists(target) and not os.path.lexists(aside):
            os.rename(target, aside)
        os.rename(source, target)
        if os.path.lexists(aside):
            shutil.rmtree(aside)
        return
    storage.remove(storage.join(url, EXPORT_MARKER_NAME))  # from here no reader takes url for complete
    new, old = relative_files(staging), relative_files(url)
    for rel in sorted(set(new) - {EXPORT_MARKER_NAME}):
        copy_object(storage.join(staging, rel), storage.join(url, rel))
    for stale in sorted(set(old) - set(new)):
        storage.remove(storage.join(url, stale))
    copy_object(storage.join(staging, EXPORT_MARKER_NAME), storage.join(url, EXPORT_MARKER_NAME))
    storage.remove(staging)


def copy_object(source: str, target: str) -> None:
    """A server-side copy of one object within an object store."""
    fs, source_path = storage.filesystem(source)
    storage.retrying(lambda: fs.copy(source_path, storage.filesystem(target)[1]), f"copy to {target}")


def relative_files(url: str) -> list[str]:
    """Every file under the directory ``url``, as paths relative to it ([] when there is none)."""
    def run():
        fs, path = storage.filesystem(url)
        root = path.rstrip("/")
        if not fs.exists(root):
            return []
        return [f[len(root):].lstrip("/") for f in fs.find(root)]
    return storage.retrying(run, f"list {url}")


# ---- an object store's export, written locally first ----------------------------------------------
LOCAL_STAGING_PREFIX = "dmd2-export-"
# a local staging with no lock file beside it (an older dmd2's) is taken for a killed export's
# only once it is this old: nothing says whether a live export still writes it
UNLOCKED_STAGING_STALE_S = 6 * 3600.0


class LocalStaging:
    """A fresh directory under ``$TMPDIR`` (``dmd2-export-*``) where an object store's export is
    streamed before it is uploaded: the student's transformers, up to two of them. The export
    holds an exclusive ``flock`` on ``{directory}.lock`` while the directory lives; the kernel
    drops it when the process dies, however it dies, so the lock, unlike a pid or a hostname,
    cannot be taken for a live export's by another process or container. Creating one first sweeps
    the stale ones (``sweep_local_staging``)."""

    def __init__(self):
        sweep_local_staging()
        self.lock_fd, lock = tempfile.mkstemp(prefix=LOCAL_STAGING_PREFIX, suffix=".lock")
        fcntl.flock(self.lock_fd, fcntl.LOCK_EX)
        self.lock = Path(lock)
        self.path = self.lock.with_suffix("")
        self.path.mkdir()

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.lock.unlink()
        with contextlib.suppress(OSError):
            os.close(self.lock_fd)


def sweep_local_staging(root: str | None = None) -> list[str]:
    """Delete the local stagings under ``root`` (``$TMPDIR``) that no live export holds: their
    lock is free (the export that made them was killed), or, with no lock, they are older than
    ``UNLOCKED_STAGING_STALE_S``. Returns the paths deleted, each said in a warning."""
    root_dir = Path(root or tempfile.gettempdir())
    swept = []
    for entry in sorted(root_dir.glob(f"{LOCAL_STAGING_PREFIX}*")):
        lock = entry if entry.suffix == ".lock" else entry.with_name(entry.name + ".lock")
        if entry.suffix == ".lock" and entry.with_suffix("").exists():
            continue  # judged with its directory
        try:
            if lock.exists():
                if not _lock_is_free(lock):
                    continue
            elif time.time() - entry.stat().st_mtime < UNLOCKED_STAGING_STALE_S:
                continue
        except OSError:  # gone meanwhile: its export finished
            continue
        directory = entry.with_suffix("") if entry.suffix == ".lock" else entry
        if directory.is_dir():
            size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
            shutil.rmtree(directory, ignore_errors=True)
            log.warning(f"export: removed {directory}, the local staging of a killed export ({size} bytes)")
            swept.append(str(directory))
        with contextlib.suppress(OSError):
            lock.unlink()
    return swept


def _lock_is_free(lock: Path) -> bool:
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # releases the lock taken here, if any


def workflow_entry(family, workflow: str) -> dict:
    """export.json's ``workflow`` of a student whose modular pipeline serves several (MiniMax-H3):
    the name ``ModularPipeline.from_pretrained(export, workflow=...)`` takes, the one the student
    was distilled on (an fl2va student is served its keyframes: ``image`` / ``last_image``, or
    their ``condition_latents``); nothing for a family with one pipeline."""
    if not family.modular_pipeline:
        return {}
    return {"workflow": workflow}
