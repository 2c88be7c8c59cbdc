"""Retention of a run's exports: which are kept, and a swap a kill interrupted finished before
any is judged."""

from __future__ import annotations

import re
from typing import Any, Iterable

from dmd2_core import storage
from dmd2_core.export.files import finish_swap
from dmd2_core.save_layout import EXPORT_MARKER_NAME, EXPORT_STAGING_SEP, EXPORT_SWAP_SUFFIX, exports_root

_ITER_RE = re.compile(r"^iter_(\d{7,})$")
_STAGING_RE = re.compile(r"^iter_(\d{7,})" + re.escape(EXPORT_STAGING_SEP))


def list_exports(root: str, staging: bool = False) -> list[dict[str, Any]]:
    """The export directories named iter_XXXXXXX under ``root``, oldest first:
    [{"iteration", "url", "complete" (has export.json)}]; ``staging``: instead the directories
    exports are written in before they are swapped in (``iter_XXXXXXX.staging-*``, never complete)."""
    if not storage.exists(root):
        return []
    pattern = _STAGING_RE if staging else _ITER_RE

    def ls():
        fs, path = storage.filesystem(root)
        return fs.ls(path, detail=True)

    found = []
    for entry in storage.retrying(ls, f"list {root}"):
        if entry.get("type") != "directory":
            continue
        name = entry["name"].rstrip("/").rpartition("/")[2]
        match = pattern.match(name)
        if match:
            url = storage.join(root, name)
            found.append({"iteration": int(match.group(1)), "url": url,
                          "complete": not staging and storage.exists(storage.join(url, EXPORT_MARKER_NAME))})
    return sorted(found, key=lambda e: e["iteration"])


def finish_swaps(root: str) -> list[str]:
    """Finish every swap into an export under ``root`` that a kill interrupted (its
    ``iter_XXXXXXX.swap.json`` remains; ``export.files.finish_swap``). Returns their URLs."""
    names = storage.list_names(root)
    urls = [storage.join(root, n[:-len(EXPORT_SWAP_SUFFIX)]) for n in names if n.endswith(EXPORT_SWAP_SUFFIX)]
    for url in urls:
        finish_swap(url)
    return urls


def latest_exports(save_url: str) -> list[str]:
    """The complete exports of a run (``{save}/exports/iter_XXXXXXX``), newest first."""
    return [e["url"] for e in reversed(list_exports(exports_root(save_url))) if e["complete"]]


def prune_exports(exports_root: str, keep: int, protect: Iterable[str] = ()) -> list[str]:
    """Delete all but the newest ``keep`` complete exports under ``exports_root`` (keep=0: keep
    them all), never one named in ``protect`` (URLs or iter_XXXXXXX names). Incomplete ones
    (no export.json: a write interrupted midway) and staging directories (an export killed
    before it was swapped in) older than the newest complete one are removed whatever ``keep``
    is; newer ones may be a write under way and are left alone. A swap a kill interrupted is
    finished first, so the staging it completes from is never taken for a killed export's.
    Each goes marker first, so a half-deleted export never looks complete. Returns the URLs
    removed."""
    if keep < 0:
        raise ValueError(f"keep must be >= 0, got {keep}")
    protected = {str(p).rstrip("/") for p in protect}
    protected |= {p.rpartition("/")[2] for p in protected}
    finish_swaps(exports_root)
    entries = list_exports(exports_root)
    complete = [e for e in entries if e["complete"]]
    newest = complete[-1]["iteration"] if complete else None
    doomed = []
    if keep:
        doomed += complete[:-keep] if len(complete) > keep else []
    if newest is not None:
        doomed += [e for e in entries + list_exports(exports_root, staging=True)
                   if not e["complete"] and e["iteration"] < newest]
    removed = []
    for entry in sorted(doomed, key=lambda e: e["iteration"]):
        url = entry["url"]
        if url.rstrip("/") in protected or url.rpartition("/")[2] in protected:
            continue
        storage.remove(storage.join(url, EXPORT_MARKER_NAME))
        storage.remove(url)
        removed.append(url)
    return removed
