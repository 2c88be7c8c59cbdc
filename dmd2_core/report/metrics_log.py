"""The metrics log of a run: one strict-JSON line per iteration ({save}/metrics.jsonl, kept in
segments while the run goes on).

Strict JSON: every line of the metrics log parses with any JSON reader. A non-finite float
(NaN, +-inf) is written as ``null`` and its key is listed in the row's ``nonfinite`` field, so a
reader can tell a missing value from a diverged one.
"""

from __future__ import annotations

import json
import math
from typing import Any

from dmd2_core import storage
from dmd2_core.save_layout import METRICS_SEGMENTS_DIR, metrics_segment_url, metrics_url

SEGMENT_ITERATIONS = 100  # lines per segment file: the open one is rewritten, its size is bounded

# ---- strict JSON ------------------------------------------------------------------------------

def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def json_line(row: dict) -> str:
    """One strict-JSON line: non-finite floats become null and are named in ``nonfinite``."""
    bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
    out = _finite({k: v for k, v in row.items() if k != "nonfinite"})
    if bad:
        out["nonfinite"] = bad
    return json.dumps(out, default=str, allow_nan=False) + "\n"


# ---- the metrics log --------------------------------------------------------------------------

class MetricsLog:
    """One strict-JSON line per iteration, kept in segment files of SEGMENT_ITERATIONS iterations
    (``{save}/metrics/iter_XXXXXXX.jsonl``, named by their first iteration). Object stores cannot
    append, so only the open segment is rewritten after an iteration: a write costs the same at
    iteration 4000 as at iteration 10. ``{save}/metrics.jsonl`` (every line, in order) is written
    once when the run ends (``finish``). On resume, lines after the checkpoint are dropped: those
    iterations are replayed. ``last_found``: the last iteration the log held before (-1: none),
    what an earlier attempt got to (the trackers' replay rule, trackers/sinks.py)."""

    def __init__(self, save_url: str, resume_after: int, segment: int = SEGMENT_ITERATIONS):
        self.save_url = save_url
        self.url = metrics_url(save_url)
        self.segment = int(segment)
        self.rows: dict[int, dict] = {}
        self._dirty: set[int] = set()
        found = read_metrics(save_url)
        self.last_found = max((int(row.get("iteration", -1)) for row in found), default=-1)
        if resume_after > 0:
            for row in found:
                if int(row.get("iteration", -1)) <= resume_after:
                    self.rows[int(row["iteration"])] = row
            self._drop_segments_after(resume_after)
        else:
            self._drop_segments_after(-1)

    def segment_url(self, iteration: int) -> str:
        first = (int(iteration) // self.segment) * self.segment
        return metrics_segment_url(self.save_url, first)

    def _drop_segments_after(self, iteration: int) -> None:
        for url in _segment_urls(self.save_url):
            first = int(url.rstrip("/").rpartition("iter_")[2].split(".")[0])
            if first > iteration:
                storage.remove(url)
        if iteration >= 0:
            self._dirty.add(int(iteration))

    def update(self, iteration: int, values: dict) -> dict:
        row = self.rows.setdefault(int(iteration), {"iteration": int(iteration)})
        row.update({k: v for k, v in values.items() if k != "skipped"})
        self._dirty.add(int(iteration))
        return row

    def write(self) -> None:
        """Rewrite the segments touched since the last write (normally the open one)."""
        for seg in sorted({self.segment_url(i) for i in self._dirty}):
            first = int(seg.rpartition("iter_")[2].split(".")[0])
            lines = [json_line(self.rows[i]) for i in sorted(self.rows) if first <= i < first + self.segment]
            storage.write_text(seg, "".join(lines))
        self._dirty.clear()

    def finish(self) -> None:
        """Write the open segment and the whole log as one file, ``{save}/metrics.jsonl``."""
        self.write()
        storage.write_text(self.url, "".join(json_line(self.rows[i]) for i in sorted(self.rows)))

    def table(self) -> list[dict]:
        return [self.rows[i] for i in sorted(self.rows)]


def _segment_urls(save_url: str) -> list[str]:
    root = storage.join(save_url, METRICS_SEGMENTS_DIR)
    return [storage.join(root, name) for name in storage.list_names(root) if name.startswith("iter_")]


def read_metrics(save_url: str) -> list[dict]:
    """Every row of a run's metrics log, in iteration order: the segments when there are any (a
    run in progress or one that crashed), else ``metrics.jsonl``."""
    rows: dict[int, dict] = {}
    urls = _segment_urls(save_url) or [u for u in [metrics_url(save_url)] if storage.exists(u)]
    for url in urls:
        for line in storage.read_text(url).splitlines():
            if line.strip():
                row = json.loads(line)
                rows[int(row.get("iteration", -1))] = row
    return [rows[i] for i in sorted(rows)]
