"""A dmd2 flow run across its attempts (a crash rerun is the same flow run, run_count + 1) and what
the server's automations read of it.

- ``close_stale_windows``: on a rerun, the windows (subflow runs) the crashed attempt left Running
  are set Crashed, with their tracking task runs. Prefect otherwise reattaches the rerun's n-th
  window to the crashed attempt's n-th non-final one (same dynamic key): that window would be
  renamed to a range it did not run and hold both attempts' tasks. Closed, each keeps its name and
  contents, and the rerun's windows are new runs.
- ``set_progress_labels``: the flow run's labels ``dmd2_iteration`` (and ``dmd2_error``, the last
  line of the error that ends it), which the failure notification (flows/alerts.py) names.
"""

from __future__ import annotations

import logging
from typing import Optional

log = logging.getLogger("dmd2")


def close_stale_windows(parent_flow_run_id: str, reason: str) -> list[str]:
    """Set Crashed the non-final subflow runs of this flow run and their tracking task runs;
    returns the names of the windows closed."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.states import Crashed

    closed = []
    with get_client(sync_client=True) as client:
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_flow_run_id])))
        for child in children:
            if child.state is None or child.state.is_final():
                continue
            client.set_flow_run_state(child.id, Crashed(message=reason), force=True)
            if child.parent_task_run_id:
                client.set_task_run_state(child.parent_task_run_id, Crashed(message=reason), force=True)
            closed.append(child.name)
    return closed


def set_progress_labels(flow_run_id: Optional[str], iteration: Optional[int], error: Optional[str] = None) -> None:
    """Best effort (a run outside a server, or a server that is briefly away, still trains)."""
    if not flow_run_id:
        return
    from prefect.client.orchestration import get_client

    labels: dict = {} if iteration is None else {"dmd2_iteration": int(iteration)}
    if error is not None:
        labels["dmd2_error"] = last_line(error)
    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run_labels(flow_run_id, labels)
    except Exception as exc:  # noqa: BLE001 - labels are for people; training goes on
        log.warning(f"could not label flow run {flow_run_id}: {exc}")


def last_line(text: str, limit: int = 300) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return (lines[-1] if lines else "")[:limit]
