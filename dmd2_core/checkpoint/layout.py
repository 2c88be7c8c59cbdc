"""Where a run's checkpoints, tracker and exports live under its ``save`` URL, and the names of
the files in them (the layout is drawn in the package docstring)."""

from __future__ import annotations

from dmd2_core import storage

FORMAT = 3  # sharded (DCP); the only format this dmd2 reads
TRACKER_NAME = "latest_checkpointed_iteration.txt"
COMPLETE_NAME = "complete.json"
STATE_NAME = "trainer_state.pt"
DCP_DIR = "dcp"
EXPORT_MARKER_NAME = "export.json"
STATE_FILES = (STATE_NAME, f"{DCP_DIR}/.metadata")  # small: hashed on the driver before any actor starts


def trainer_dir(save_url: str, role: str, iteration: int) -> str:
    return storage.join(save_url, "trainers", role, f"iter_{int(iteration):07d}")


def tracker_url(save_url: str) -> str:
    return storage.join(save_url, TRACKER_NAME)


def complete_url(save_url: str, role: str, iteration: int) -> str:
    return storage.join(trainer_dir(save_url, role, iteration), COMPLETE_NAME)


def exports_root(save_url: str) -> str:
    return storage.join(save_url, "exports")


def export_url(save_url: str, iteration: int) -> str:
    return storage.join(exports_root(save_url), f"iter_{int(iteration):07d}")
