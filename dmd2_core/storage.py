"""fsspec storage: every path is a URL (plain path, file://, s3://). One place for I/O helpers.

S3 endpoints and credentials come from the usual AWS environment, which Ray workers and other
child processes inherit from the driver: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_DEFAULT_REGION and AWS_ENDPOINT_URL (or the S3-only AWS_ENDPOINT_URL_S3) for a non-AWS store
such as MinIO or moto. Verified with s3fs/fsspec 2026.9.0 (aiobotocore 3.10, botocore 1.43):
botocore's config chain reads AWS_ENDPOINT_URL when s3fs creates its client, so the variable
works even when set after s3fs was imported, and boto3 honours it too. (fsspec's own
FSSPEC_S3_ENDPOINT_URL also works, but fsspec reads FSSPEC_* variables only once, when it is
imported, so it is the weaker choice.) fsspec caches S3FileSystem instances per constructor
arguments: change the endpoint variables before the first s3:// access of a process, not after.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Iterator

import fsspec


def filesystem(url: str):
    fs, path = fsspec.core.url_to_fs(str(url))
    fs.invalidate_cache()
    return fs, path


def is_local(url: str) -> bool:
    fs, _ = fsspec.core.url_to_fs(str(url))
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def join(url: str, *parts: str) -> str:
    return "/".join([str(url).rstrip("/"), *[p.strip("/") for p in parts]])


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    return fs.exists(path)


def nearest_sibling(url: str) -> str:
    """'; did you mean ...?' naming the closest existing entry beside a missing ``url``, or ''."""
    import difflib

    parent, _, name = str(url).rstrip("/").rpartition("/")
    if not parent:
        parent, name = ".", name
    try:
        fs, path = filesystem(parent)
        siblings = [p.rstrip("/").rpartition("/")[2] for p in fs.ls(path, detail=False)]
    except Exception:  # noqa: BLE001 - no listing, no suggestion
        return ""
    match = difflib.get_close_matches(name, siblings, n=1, cutoff=0.6)
    return f"; did you mean '{parent}/{match[0]}'?" if match else ""


def read_bytes(url: str) -> bytes:
    fs, path = filesystem(url)
    with fs.open(path, "rb") as f:
        return f.read()


def read_text(url: str) -> str:
    return read_bytes(url).decode()


def write_bytes(url: str, data: bytes) -> None:
    """Write a file so readers see the old content or the new one, never a torn one: local files
    go through a temp name and an atomic rename; object stores put whole objects."""
    fs, path = filesystem(url)
    if is_local(url):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
    else:
        fs.pipe_file(path, data)


def write_text(url: str, text: str) -> None:
    write_bytes(url, text.encode())


def upload_dir(local_dir: str | Path, url: str) -> None:
    fs, path = filesystem(url)
    local_dir = Path(local_dir)
    if is_local(url):
        shutil.copytree(local_dir, path, dirs_exist_ok=True)
        return
    for file in sorted(local_dir.rglob("*")):
        if file.is_file():
            fs.put_file(str(file), f"{path.rstrip('/')}/{file.relative_to(local_dir).as_posix()}")


def download_dir(url: str, local_dir: str | Path) -> None:
    fs, path = filesystem(url)
    root = path.rstrip("/")
    for remote in fs.find(root):
        rel = remote[len(root):].lstrip("/")
        target = Path(local_dir) / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(remote, str(target))


@contextlib.contextmanager
def local_copy(url: str) -> Iterator[Path]:
    """A local directory holding the contents of ``url`` (itself when it is already local):
    diffusers cannot from_pretrained an s3:// URL."""
    if is_local(url):
        _, path = filesystem(url)
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="dmd2-stage-") as tmp:
        download_dir(url, tmp)
        yield Path(tmp)


@contextlib.contextmanager
def staged_dir(url: str) -> Iterator[Path]:
    """A local directory to write into; its contents land at ``url`` when the block exits cleanly."""
    with tempfile.TemporaryDirectory(prefix="dmd2-stage-") as tmp:
        yield Path(tmp)
        upload_dir(tmp, url)


def remove(url: str) -> None:
    fs, path = filesystem(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)
