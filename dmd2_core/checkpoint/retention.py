"""Retention of a run's trainer checkpoints: which are deleted, and when (its exports': export/retention.py)."""

from __future__ import annotations

from typing import Iterable

from dmd2_core import storage
from dmd2_core.save_layout import complete_url, trainer_dir
from dmd2_core.checkpoint.latest import read_latest



# ---- trainer checkpoints -------------------------------------------------------------------------

def saved_iterations(save_url: str, role: str) -> dict[int, bool]:
    """Iteration -> complete (has its marker) of every checkpoint directory of ``role``."""
    root = storage.join(save_url, "trainers", role)
    if not storage.exists(root):
        return {}
    fs, path = storage.filesystem(root)
    out = {}
    for entry in storage.retrying(lambda: fs.ls(path, detail=False), f"list {root}"):
        name = str(entry).rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("iter_") and name[5:].isdigit():
            out[int(name[5:])] = storage.exists(complete_url(save_url, role, int(name[5:])))
    return out


def prune(save_url: str, roles: Iterable[str], keep_last_n: int) -> list[str]:
    """Delete the checkpoints of ``roles`` older than the ``keep_last_n`` newest complete ones up
    to the tracked one (0: keep all). Run it after the latest pointer moved: it never deletes the tracked
    checkpoint or anything newer (a save in flight), and deletes an older one only once a newer
    one is tracked. Older incomplete directories (saves that failed midway) go too. Returns the
    deleted directories."""
    if keep_last_n <= 0:
        return []
    tracked = read_latest(save_url)
    if tracked is None:
        return []
    deleted = []
    for role in roles:
        found = saved_iterations(save_url, role)
        complete = sorted((i for i, ok in found.items() if ok and i <= tracked), reverse=True)
        keep = set(complete[:keep_last_n]) | {tracked}
        for i in sorted(found):
            if i < tracked and i not in keep:
                d = trainer_dir(save_url, role, i)
                storage.remove(complete_url(save_url, role, i))  # no reader takes it for complete meanwhile
                storage.remove(d)
                deleted.append(d)
    return deleted
