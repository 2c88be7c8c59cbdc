"""Prefect artifacts of a run: metrics table, progress, eval media, checkpoint links.

Keys hold only [a-z0-9-]: ``artifact_keys(slug)`` derives them from one slug (the deployment's
name under a deployment, else the recipe's), e.g. dmd2-tiny-metrics. Creating an artifact again
under the same key adds a version; the UI shows the latest.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Optional

from prefect.artifacts import (
    create_image_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

MAX_TABLE_ROWS = 1000


def slugify(name: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", str(name).lower()).strip("-")
    return slug or "run"


def artifact_keys(slug: str) -> dict[str, str]:
    base = f"dmd2-{slugify(slug)}"
    return {kind: f"{base}-{kind}" for kind in ("metrics", "progress", "media", "checkpoint")}


def _cell(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return None if not math.isfinite(value) else float(f"{value:.6g}")
    return str(value)


def table_rows(rows: Iterable[dict], max_rows: int = MAX_TABLE_ROWS) -> list[dict]:
    """Rows with the same columns (union, in first-seen order; missing cells None), rounded."""
    rows = list(rows)[-max_rows:]
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns and not isinstance(row[k], dict)]
    return [{c: _cell(row.get(c)) for c in columns} for row in rows]


def publish_metrics(key: str, rows: list[dict], metrics_url: Optional[str] = None) -> None:
    if not rows:
        return
    note = f" Full log: `{metrics_url}`." if metrics_url else ""
    shown = "" if len(rows) <= MAX_TABLE_ROWS else f" (last {MAX_TABLE_ROWS} of {len(rows)} rows)"
    create_table_artifact(table=table_rows(rows), key=key,
                          description=f"DMD2 metrics, one row per iteration{shown}.{note}")


class Progress:
    """A progress artifact created once and updated in place."""

    def __init__(self, key: str, total: int, done: int = 0):
        self.total = max(1, int(total))
        self.id = create_progress_artifact(progress=self._percent(done), key=key,
                                           description=f"DMD2 iterations done of {total}")

    def _percent(self, done: int) -> float:
        return round(100.0 * min(max(done, 0), self.total) / self.total, 2)

    def update(self, done: int) -> None:
        update_progress_artifact(self.id, self._percent(done))


def _metrics_line(metrics: dict) -> str:
    shown = {k: v for k, v in metrics.items() if k in ("fd", "acc", "diversity")}
    return ", ".join(f"{k} {v:.4g}" for k, v in shown.items())


def publish_media(key: str, result: dict) -> None:
    """An image artifact when the one medium has a browser URL (presigned on S3); else markdown
    embedding small media as data: URIs (or browser links) and listing the storage paths."""
    iteration, media = result["iteration"], result["media"]
    quality = _metrics_line(result.get("metrics", {}))
    title = f"Eval media, iteration {iteration}" + (f" ({quality})" if quality else "")
    if len(media) == 1 and media[0].get("browser_url"):
        item = media[0]
        create_image_artifact(image_url=item["browser_url"], key=key,
                              description=f"{title}. {item['caption']}. Stored at `{item['url']}`.")
        return
    lines = [f"## {title}", ""]
    for item in media:
        src = item.get("browser_url") or item.get("data_uri")
        lines.append(f"**{item['caption']}**")
        lines.append("")
        if src:
            lines.append(f"![{item['caption']}]({src})")
        else:
            lines.append(f"_({item['bytes']} bytes: too large to embed)_")
        lines.append("")
        lines.append(f"stored at `{item['url']}`")
        lines.append("")
    create_markdown_artifact(markdown="\n".join(lines), key=key, description=title)


def publish_checkpoint(key: str, iteration: int, ckpt: dict, tracker_url: str) -> None:
    lines = [f"## Checkpoint, iteration {iteration}", "", "| trainer | storage URL |", "|---|---|"]
    for role, url in sorted((ckpt.get("checkpoint") or {}).items()):
        lines.append(f"| {role} | `{url}` |")
    lines += ["", f"Tracker `{tracker_url}` names iteration {iteration}: a run with the same `save` "
              f"(or `load`) resumes after it."]
    create_markdown_artifact(markdown="\n".join(lines), key=key,
                             description=f"DMD2 checkpoint at iteration {iteration}")
