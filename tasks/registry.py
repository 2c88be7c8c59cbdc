"""The live DistillRun objects of this process, keyed by run id (the flow run's id).

Tasks take the run id and small values only; the driver object (groups, placement group, handoff
ObjectRefs) never passes through Prefect's parameters or results.
"""

from __future__ import annotations

import threading
from typing import Any

_RUNS: dict[str, Any] = {}
_LOCK = threading.Lock()


def register(run_id: str, run: Any) -> str:
    with _LOCK:
        if run_id in _RUNS and _RUNS[run_id] is not run:
            raise RuntimeError(f"run id {run_id!r} is already registered")
        _RUNS[run_id] = run
    return run_id


def get_run(run_id: str) -> Any:
    with _LOCK:
        run = _RUNS.get(run_id)
    if run is None:
        raise KeyError(f"no live run {run_id!r} in this process (known: {sorted(_RUNS) or 'none'})")
    return run


def unregister(run_id: str) -> Any:
    with _LOCK:
        return _RUNS.pop(run_id, None)


def shutdown_run(run_id: str) -> bool:
    """Kill the run's actors and placement group and forget it; False when it was not live."""
    run = unregister(run_id)
    if run is None:
        return False
    run.shutdown()
    return True
