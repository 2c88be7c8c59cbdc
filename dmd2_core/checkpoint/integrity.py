"""What makes a checkpoint trustworthy: the sha256 of every file, computed as it is written;
the ``complete.json`` marker that lists every file with its size and hash; the checks of the
listing, sizes and hashes against it; and the refusal to save non-finite state."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json

import torch

from dmd2_core import parallel, storage
from dmd2_core.save_layout import COMPLETE_NAME, FORMAT
from dmd2_core.finite import first_nonfinite
from dmd2_core.errors import CheckpointError, NonFiniteError, StorageUnavailableError, one_line


# ---- hashing while writing -----------------------------------------------------------------------

class _HashingStream(io.RawIOBase):
    """A write-only stream that forwards to ``inner`` and hashes what passes through."""

    def __init__(self, inner, digest):
        super().__init__()
        self.inner, self.digest = inner, digest

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        written = self.inner.write(view)
        return len(view) if written is None else written

    def tell(self) -> int:
        return self.inner.tell()

    def flush(self) -> None:
        self.inner.flush()

    def fileno(self) -> int:
        return self.inner.fileno()


def hashing_writer(url: str, digests: dict[str, str]):
    """DCP's fsspec writer, recording the sha256 of every file it writes (by file name)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecWriter

    class HashingFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path, mode):
            with super().create_stream(path, mode) as stream:
                if "w" not in mode:
                    yield stream
                    return
                digest = hashlib.sha256()
                yield _HashingStream(stream, digest)
                name = str(path).rstrip("/").rsplit("/", 1)[-1]
                if not name.endswith(".tmp"):  # .metadata goes through a temp name: hashed once renamed
                    digests[name] = digest.hexdigest()

    writer = FsspecWriter(url, sync_files=storage.is_local(url))
    fs = HashingFileSystem()
    writer.path = fs.init_path(url)
    writer.fs = fs
    return writer


# ---- the marker and the checks against it --------------------------------------------------------

def listing(url: str) -> dict[str, int]:
    """Relative path -> size of every file under ``url``."""
    fs, root = storage.filesystem(url)
    root = root.rstrip("/")
    out = {}
    found = storage.retrying(lambda: storage.filesystem(url)[0].find(root, detail=True), f"list {url}")
    for path, info in found.items():
        if info.get("type", "file") != "directory":
            out[path[len(root):].lstrip("/")] = int(info["size"])
    return out


def read_marker(d: str) -> dict:
    """The parsed complete.json of a trainer dir; CheckpointError when missing or unreadable."""
    marker_url = storage.join(d, COMPLETE_NAME)
    try:
        if not storage.exists(marker_url):
            if not storage.exists(d):
                raise CheckpointError(f"{d}: checkpoint directory does not exist")
            raise CheckpointError(
                f"{d}: incomplete checkpoint (no {COMPLETE_NAME}; its save was interrupted)"
            )
        marker = json.loads(storage.read_text(marker_url))
        if not isinstance(marker, dict) or not isinstance(marker.get("files"), dict):
            raise ValueError("not a checkpoint marker")
        return marker
    except (CheckpointError, StorageUnavailableError):
        raise
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"{marker_url}: unreadable checkpoint marker ({one_line(exc)})") from None


def read_current_marker(d: str) -> dict:
    """``read_marker``, refusing a checkpoint in any format but this dmd2's."""
    marker = read_marker(d)
    found = int(marker.get("format", 1))
    if found > FORMAT:
        raise CheckpointError(f"{d}: checkpoint format {found} is newer than this dmd2 reads "
                                  f"({FORMAT}); resume it with the version that wrote it")
    if found < FORMAT:
        raise CheckpointError(f"{d}: checkpoint format {found} is older than this dmd2 reads "
                                  f"({FORMAT}); formats before {FORMAT} are no longer read")
    return marker


def check_files(d: str, marker: dict, hashes: bool | tuple[str, ...] = True) -> None:
    """Every file the marker lists is there with its recorded size and (``hashes``) sha256:
    ``True`` every file, a tuple only those files (the small ones the driver reads cheaply)."""
    try:
        present = listing(d)
    except StorageUnavailableError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"{d}: cannot list checkpoint ({one_line(exc)})") from None
    for rel, size in marker["files"].items():
        url = storage.join(d, rel)
        if rel not in present:
            raise CheckpointError(f"{url}: missing from checkpoint")
        if present[rel] != int(size):
            raise CheckpointError(f"{url}: corrupt ({present[rel]} bytes, {size} recorded at save)")
    if not hashes:
        return
    for rel, digest in (marker.get("sha256") or {}).items():
        if hashes is not True and rel not in hashes:
            continue
        url = storage.join(d, rel)
        try:
            actual = storage.sha256(url)
        except StorageUnavailableError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"{url}: cannot read ({one_line(exc)})") from None
        if actual != digest:
            raise CheckpointError(f"{url}: corrupt (sha256 differs from the one recorded at save)")


# ---- finite state --------------------------------------------------------------------------------

def nested_tensors(obj, prefix: str):
    """(dotted key, tensor) of every tensor in nested dicts and lists."""
    if torch.is_tensor(obj):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from nested_tensors(v, f"{prefix}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from nested_tensors(v, f"{prefix}.{i}")


def check_finite(role, iteration, state: dict[str, torch.Tensor], process_group) -> None:
    """No checkpoint with a non-finite weight, EMA weight or optimizer moment is written. Each
    rank checks its own shards and every rank learns the verdict, so all of them refuse."""
    import torch.distributed as dist

    bad = first_nonfinite((k, parallel.local(v)) for k, v in state.items())
    if process_group is not None:
        verdicts: list = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(verdicts, bad, group=process_group)
        bad = next((v for v in verdicts if v is not None), None)
    if bad is not None:
        raise NonFiniteError(f"{role}: not saving iteration {iteration}: '{bad[0]}' holds {bad[1]} non-finite values")
