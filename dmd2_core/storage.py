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

Outages: every helper here retries transient errors (connection refused/reset, timeouts, 5xx,
throttling) with exponential backoff for up to ``DMD2_STORAGE_RETRY_S`` seconds (default 300;
read when this module is imported, so Ray workers take the driver's value), then raises
``StorageUnavailableError`` -- a RuntimeError, never a ValueError, so it is never mistaken for bad
input. Permanent errors (access denied, no such bucket or key) are raised at once.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional, TypeVar

import fsspec
from dmd2_core.errors import InputChangedError, SafetensorsHeaderError, StorageUnavailableError, one_line

log = logging.getLogger("dmd2")
T = TypeVar("T")

RETRY_S = float(os.environ.get("DMD2_STORAGE_RETRY_S", "300"))
RETRY_FIRST_DELAY_S = 0.5
RETRY_MAX_DELAY_S = 10.0


_TRANSIENT_ERRNOS = {errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT,
                     errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.EPIPE, errno.EAGAIN}
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "TooManyRequests",
                    "RequestLimitExceeded", "RequestTimeout", "InternalError", "ServiceUnavailable",
                    "503", "500", "502", "504"}
_TRANSIENT_NAMES = {"EndpointConnectionError", "ConnectionClosedError", "ConnectTimeoutError",
                    "ReadTimeoutError", "HTTPClientError", "ClientConnectionError", "ClientConnectorError",
                    "ServerDisconnectedError", "ClientOSError", "ClientPayloadError", "IncompleteRead",
                    "ProtocolError", "FSTimeoutError", "ResponseParserError", "ConnectionError"}


def is_transient(exc: BaseException) -> bool:
    """True for errors an outage causes and a later attempt may not: connection refused/reset,
    timeouts, HTTP 5xx and throttling (looked up through the exception's causes, since s3fs
    translates botocore's errors into OSErrors)."""
    seen = 0
    while exc is not None and seen < 8:
        seen += 1
        if isinstance(exc, StorageUnavailableError):
            return False  # already retried
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return True
        if any(c.__name__ in _TRANSIENT_NAMES for c in type(exc).__mro__):
            return True
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            err = response.get("Error") or {}
            status = int((response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0)
            if str(err.get("Code", "")) in _TRANSIENT_CODES or status >= 500 or status == 429:
                return True
            return False  # a definite answer from the store (403, 404, ...)
        if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def retrying(fn: Callable[[], T], what: str, budget_s: float | None = None) -> T:
    """``fn()``, retried with exponential backoff while it fails with transient errors."""
    budget = RETRY_S if budget_s is None else budget_s
    deadline = time.monotonic() + budget
    delay = RETRY_FIRST_DELAY_S
    attempt = 0
    while True:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - classified below
            if not is_transient(exc):
                raise
            attempt += 1
            if time.monotonic() + delay > deadline:
                raise StorageUnavailableError(
                    f"{what}: storage unavailable for {budget:.0f} s ({one_line(exc)})") from exc
            log.warning(f"storage: {what}: {one_line(exc)}; retry {attempt} in {delay:.1f} s")
            time.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_DELAY_S)


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
    def run():
        fs, path = filesystem(url)
        return fs.exists(path)
    return retrying(run, f"exists {url}")


def list_names(url: str) -> list[str]:
    """Names of the entries directly under ``url``, sorted ([] when there is no such directory)."""
    def run():
        fs, path = filesystem(url)
        if not fs.exists(path):
            return []
        return sorted(p.rstrip("/").rpartition("/")[2] for p in fs.ls(path, detail=False))
    try:
        return retrying(run, f"list {url}")
    except FileNotFoundError:
        return []


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
    def run():
        fs, path = filesystem(url)
        with fs.open(path, "rb") as f:
            return f.read()
    return retrying(run, f"read {url}")


MAX_SAFETENSORS_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header
# bits per element of every dtype a safetensors header may name
SAFETENSORS_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16,
    "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}


def read_safetensors_header(url: str) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the size of the data after it, read with
    bounded memory (one small read, also on S3): an 8-byte length, then a header within the file.
    Raises SafetensorsHeaderError when the file holds no such header."""
    entries, data_size, _ = safetensors_layout(url)
    return entries, data_size


def safetensors_layout(url: str) -> tuple[dict, int, int]:
    """``read_safetensors_header``'s header and data size, and the file offset where the data
    starts (a tensor's ``data_offsets`` count from there)."""
    entries, data_size, data_start, _ = pinned_safetensors_layout(url)
    return entries, data_size, data_start


HEADER_PROBE_BYTES = 64 << 10  # the first read of a header: most headers fit, so one request reads them


def pinned_safetensors_layout(url: str) -> tuple[dict, int, int, "FileVersion"]:
    """``safetensors_layout``, and the version of the file its header was read from: a reader
    that reads tensors at the header's offsets later passes it to ``read_ranges`` (``pins``), so a
    file replaced meanwhile is named instead of read as misaligned rows."""
    version = file_version(url)
    size, pins = version.size, {url: version}
    if size < 8:
        raise SafetensorsHeaderError(f"{size} bytes, shorter than a header")
    head = bytes(_read_ranges([(url, 0, min(size, HEADER_PROBE_BYTES))], pins)[0])
    n = int.from_bytes(head[:8], "little")
    if n <= 0 or n > min(MAX_SAFETENSORS_HEADER_BYTES, size - 8):
        raise SafetensorsHeaderError(f"header length {n} does not fit a {size}-byte file")
    header = head[8:8 + n]
    if len(header) < n:
        header += bytes(_read_ranges([(url, len(head), 8 + n)], pins)[0])
    try:
        entries = json.loads(header)
        if not isinstance(entries, dict):
            raise ValueError("header is not a JSON object")
    except ValueError as exc:
        raise SafetensorsHeaderError(f"unreadable header: {one_line(exc)}") from None
    data_size = size - 8 - len(header)
    for key, info in entries.items():
        if key == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise SafetensorsHeaderError(f"tensor '{key}' has no valid data_offsets")
        if offsets[1] > data_size:
            raise SafetensorsHeaderError(f"truncated: tensor '{key}' ends at byte {offsets[1]} of the data, the file "
                                         f"holds {data_size} (cut off while it was written or downloaded)")
        _check_span(key, info, offsets)
    return entries, data_size, 8 + len(header), version


def _check_span(key: str, info: dict, offsets: list[int]) -> None:
    """A tensor's shape x dtype is exactly its byte span: a larger one would read the next
    tensor's bytes, a smaller one leaves bytes nobody reads."""
    shape, dtype = info.get("shape"), info.get("dtype")
    if not (isinstance(shape, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)):
        raise SafetensorsHeaderError(f"tensor '{key}' has no valid shape ({shape!r})")
    if dtype not in SAFETENSORS_DTYPE_BITS:
        raise SafetensorsHeaderError(f"tensor '{key}' has an unknown dtype {dtype!r}")
    bits = SAFETENSORS_DTYPE_BITS[dtype]
    for n in shape:
        bits *= n
    span = offsets[1] - offsets[0]
    if bits != span * 8:
        raise SafetensorsHeaderError(f"tensor '{key}' ({dtype} {shape}) needs {bits / 8:g} bytes, its data_offsets "
                                     f"span {span}")


@dataclass(frozen=True)
class FileVersion:
    """One version of a file, as a reader opened it: its size and a tag that replacing the file
    changes (an object's ETag; a local file's device, inode and mtime_ns, which a rename over it
    or a write into it change)."""
    size: int
    tag: str


def file_version(url: str) -> FileVersion:
    """The version of the file at ``url`` now (one stat; a HEAD request on an object store)."""
    path = filesystem(url)[1]
    if is_local(url):
        return _local_version(os.stat(path))
    info = retrying(lambda: filesystem(url)[0].info(path), f"stat {url}")
    tag = next((str(info[k]) for k in ("ETag", "etag", "generation", "mtime", "LastModified", "created")
                if info.get(k)), "")
    return FileVersion(int(info.get("size") or 0), tag)


def _local_version(stat: os.stat_result) -> FileVersion:
    return FileVersion(stat.st_size, f"{stat.st_dev}:{stat.st_ino}:{stat.st_mtime_ns}")


def content_stamp(url: str, version: FileVersion) -> str:
    """What of ``version``'s tag a copy of the content keeps: an object's tag as it is; of a local
    file its mtime_ns alone (a copy that keeps it, cp -p or rsync -a, has another device and inode)."""
    return version.tag.rsplit(":", 1)[-1] if is_local(url) else version.tag


def _changed(url: str, why: str) -> InputChangedError:
    return InputChangedError(f"{url}: changed in storage since this run opened it ({why}); stopping rather than "
                             "reading rows at the old offsets: rerun to resume from the latest checkpoint with the "
                             "file as it is now")


def _version_change(pinned: FileVersion, now: FileVersion) -> Optional[str]:
    """How ``now`` differs from ``pinned`` (None when it does not)."""
    if now.size != pinned.size:
        return f"{pinned.size} bytes then, {now.size} now"
    if now.tag != pinned.tag:
        return f"version {pinned.tag} then, {now.tag} now"
    return None


def read_ranges(ranges: list[tuple[str, int, int]],
                pins: Optional[Mapping[str, FileVersion]] = None) -> list[bytes | bytearray]:
    """The bytes ``[start, end)`` of each ``(url, start, end)`` (all on one filesystem): ranged
    reads only (seeks in a local file; on an object store concurrent Range requests), so a reader
    fetches only the bytes it needs; retried together. A URL in ``pins`` is read only at that
    version (``pinned_safetensors_layout``): checked on every read (a local file's fstat around
    it; on S3 each request's If-Match, and the ETag and size it answers with), raising
    InputChangedError naming the URL when the file changed."""
    return _read_ranges(ranges, pins or {})


def _read_ranges(ranges: list[tuple[str, int, int]], pins: Mapping[str, FileVersion]) -> list[bytes | bytearray]:
    if not ranges:
        return []
    first = ranges[0][0]

    def run():
        fs = filesystem(first)[0]
        paths = [filesystem(url)[1] for url, _, _ in ranges]
        if is_local(first):
            out = [_local_range(path, url, start, end, pins.get(url)) for path, (url, start, end) in zip(paths, ranges)]
        elif hasattr(fs, "_call_s3"):
            from fsspec.asyn import sync

            out = sync(fs.loop, _s3_ranges, fs, paths, ranges, pins)
        else:
            out = fs.cat_ranges(paths, [r[1] for r in ranges], [r[2] for r in ranges], on_error="raise")
            for url in {url for url, _, _ in ranges if url in pins}:  # no conditional reads here: stat after
                why = _version_change(pins[url], file_version(url))
                if why:
                    raise _changed(url, why)
        for buf, (url, start, end) in zip(out, ranges):
            if len(buf) != end - start:
                raise EOFError(f"{url}: {len(buf)} bytes at offset {start}, expected {end - start} (file cut off?)")
        return out
    return retrying(run, f"read {len(ranges)} ranges of {first}")


def _local_range(path: str, url: str, start: int, end: int, pin: Optional[FileVersion]) -> bytearray:
    """The bytes ``[start, end)`` of a local file; with ``pin``, the open file is that version
    before and after the read (a write into it during the read moves its mtime)."""
    buf = bytearray(end - start)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        if pin is None:
            raise
        raise _changed(url, "no longer there") from None
    with f:
        if pin is not None:
            _check_open_file(f, url, pin)
        f.seek(start)
        got = f.readinto(buf)
        if pin is not None:
            _check_open_file(f, url, pin)
    return buf if got == len(buf) else buf[:got]


def _check_open_file(f, url: str, pin: FileVersion) -> None:
    why = _version_change(pin, _local_version(os.fstat(f.fileno())))
    if why:
        raise _changed(url, why)


async def _s3_ranges(fs, paths: list[str], ranges: list[tuple[str, int, int]],
                     pins: Mapping[str, FileVersion]) -> list[bytes]:
    """One concurrent ranged GetObject per range; a pinned URL's carry ``IfMatch`` (the store
    refuses a replaced object: 412, no extra request) and their answer's ETag and total size are
    checked too, for a store that ignores the condition."""
    import asyncio

    from fsspec.config import conf

    # at most as many requests in flight as fsspec's cat_ranges would have (its batch for calls that open no file)
    in_flight = asyncio.Semaphore(fs.batch_size or conf.get("nofiles_gather_batch_size", 1280))

    async def get(path: str, url: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        bucket, key, version_id = fs.split_path(path)
        pin = pins.get(url)
        condition = {**({"VersionId": version_id} if version_id else {}),
                     **({"IfMatch": pin.tag} if pin is not None and pin.tag else {})}
        try:
            out = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", **condition)
        except FileNotFoundError:
            if pin is None:
                raise
            why = "no longer there"
        except OSError as exc:
            if pin is None or not precondition_failed(exc):
                raise
            why = f"its ETag is no longer {pin.tag}"
        else:
            try:
                data = await out["Body"].read()
            finally:
                out["Body"].close()
            if pin is None:
                return data
            total = str(out.get("ContentRange") or "").rpartition("/")[2]
            now = FileVersion(int(total) if total.isdigit() else pin.size, out.get("ETag") or pin.tag)
            why = _version_change(pin, now)
            if why is None:
                return data
        raise _changed(url, why)

    async def bounded(path: str, url: str, start: int, end: int) -> bytes:
        async with in_flight:
            return await get(path, url, start, end)

    return list(await asyncio.gather(*(bounded(path, url, start, end)
                                       for path, (url, start, end) in zip(paths, ranges))))


def precondition_failed(exc: BaseException) -> bool:
    """An S3 412 (a condition such as If-Match or If-None-Match not met) anywhere in the chain of
    ``exc``: s3fs translates botocore's error into an OSError with it as the cause."""
    seen = 0
    while exc is not None and seen < 8:  # bounded: a chain can loop through __context__
        seen += 1
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            code = str((response.get("Error") or {}).get("Code", ""))
            status = int((response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0)
            if code == "PreconditionFailed" or status == 412:
                return True
        exc = exc.__cause__ or exc.__context__
    return False


def sha256(url: str, chunk: int = 8 << 20) -> str:
    """sha256 of the file at ``url``, streamed (bounded memory)."""
    def run():
        fs, path = filesystem(url)
        h = hashlib.sha256()
        with fs.open(path, "rb") as f:
            while block := f.read(chunk):
                h.update(block)
        return h.hexdigest()
    return retrying(run, f"read {url}")


def read_text(url: str) -> str:
    return read_bytes(url).decode()


def write_bytes(url: str, data: bytes, content_type: Optional[str] = None, budget_s: Optional[float] = None) -> None:
    """Write a file so readers see the old content or the new one, never a torn one: local files
    go through a temp name and an atomic rename; object stores put whole objects (with
    ``content_type`` when given, so a browser shows media instead of downloading octet-stream)."""
    if not is_local(url):
        def put():
            fs, path = filesystem(url)
            fs.pipe_file(path, data, **({"ContentType": content_type} if content_type else {}))
        retrying(put, f"write {url}", budget_s)  # budget_s: retries end with it (default RETRY_S)
        return
    fs, path = filesystem(url)
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


def write_text(url: str, text: str, budget_s: Optional[float] = None) -> None:
    write_bytes(url, text.encode(), budget_s=budget_s)


def upload_dir(local_dir: str | Path, url: str) -> None:
    fs, path = filesystem(url)
    local_dir = Path(local_dir)
    if is_local(url):
        shutil.copytree(local_dir, path, dirs_exist_ok=True)
        return
    for file in sorted(local_dir.rglob("*")):
        if file.is_file():
            target = f"{path.rstrip('/')}/{file.relative_to(local_dir).as_posix()}"
            retrying(lambda: filesystem(url)[0].put_file(str(file), target), f"upload {url}")


def download_dir(url: str, local_dir: str | Path) -> None:
    fs, path = filesystem(url)
    root = path.rstrip("/")
    for remote in retrying(lambda: filesystem(url)[0].find(root), f"list {url}"):
        rel = remote[len(root):].lstrip("/")
        target = Path(local_dir) / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        retrying(lambda: filesystem(url)[0].get_file(remote, str(target)), f"download {url}")


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


def signed_url(url: str, expires: int) -> str:
    """The store's presigned http(s) URL of ``url``, valid ``expires`` seconds (raises where the
    store cannot sign)."""
    fs, path = filesystem(url)
    return fs.url(path, expires=int(expires))


def s3_call(url: str, method: str, what: str | None = None, budget_s: float | None = None, **kw) -> dict:
    """One S3 API call (``put_object``, ``delete_object``, ...) on the object at the s3:// ``url``,
    retried (for ``budget_s``, default the storage budget): for what the file API cannot express,
    such as conditional writes."""
    bucket, _, key = filesystem(url)[1].partition("/")
    return retrying(lambda: filesystem(url)[0].call_s3(method, Bucket=bucket, Key=key, **kw), what or f"{method} {url}",
                    budget_s)


def s3_get_object(url: str, what: str | None = None, budget_s: float | None = None) -> tuple[bytes, str | None]:
    """The body and ETag of the object at the s3:// ``url`` from one GetObject (so the two always
    match), retried. Raises FileNotFoundError when there is no such object."""
    from fsspec.asyn import sync

    bucket, _, key = filesystem(url)[1].partition("/")

    async def get(fs):
        out = await fs._call_s3("get_object", Bucket=bucket, Key=key)
        data = await out["Body"].read()
        out["Body"].close()
        return data, out.get("ETag")

    def run():
        fs = filesystem(url)[0]
        return sync(fs.loop, get, fs)
    return retrying(run, what or f"read {url}", budget_s)


def remove(url: str) -> None:
    def run():
        fs, path = filesystem(url)
        if fs.exists(path):
            fs.rm(path, recursive=True)
    retrying(run, f"remove {url}")
