"""What every tracker sink shares: the media it is given and the interface it implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from dmd2_core.args import Args


@dataclass(frozen=True)
class Medium:
    """One eval medium: ``kind`` image (PNG), video (GIF or MP4) or audio (WAV); ``name`` says
    which sample it shows (``samples``, ``p3``, ``p3_frames``, ``p3_sound``...), the same at
    every eval."""
    name: str
    kind: str
    data: bytes
    ext: str
    caption: str = ""
    sample_rate: int = 0
    channels: int = 0
    frames: int = 0


def scalars_of(row: dict) -> dict[str, float]:
    """Every numeric value of a metrics row but its iteration (the step), as floats; a diverged
    value (NaN, inf) stays what it is."""
    return {k: float(v) for k, v in row.items()
            if k != "iteration" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class Sink:
    """One tracker run. ``state`` is what resumes it (its run id, its directory), kept in
    ``{save}/trackers.json``: a sink built from a stored state continues that tracker run."""
    name = ""
    config_every_open = False  # True: the configuration is state the tracker keeps (set again at a rerun), not a record

    def __init__(self, args: Args, run_name: str, state: Optional[dict], written: int):
        self.state: dict[str, Any] = dict(state or {})
        self.held: Optional[int] = None  # the last step the tracker holds, when it can tell and may hold less than it was given
        self.new_run = False  # True: the stored run was gone and a new one replaces it (it gets the configuration)

    def log_config(self, config: dict) -> None:
        raise NotImplementedError

    def write(self, step: int, scalars: dict[str, float], media: list[Medium]) -> None:
        raise NotImplementedError

    def close(self, failed: bool = False) -> None:
        raise NotImplementedError
