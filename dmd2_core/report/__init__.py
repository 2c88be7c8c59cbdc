"""What a person reads about a run and its nights. No Prefect here: the flow turns these into
artifacts (flows/artifacts.py, flows/nights.py). Reporting imports evaluation (the run's
evaluator names the figures, the criterion, the columns and panels), never the reverse.

- ``metrics_log``: the metrics log ({save}/metrics.jsonl, strict JSON), in segments while a run goes on;
- ``table``: the short metrics table and how a figure is written in a cell;
- ``plot``: the metrics plot, a panel per kind of figure;
- ``summary``: the run summary's markdown and the run's best eval by its criterion;
- ``nights_view``: the nights view of a deployment, a row per night.
"""

from dmd2_core.report.metrics_log import MetricsLog, json_line, read_metrics
from dmd2_core.report.plot import PLOT_POINTS, plot_panels, plot_png, thin
from dmd2_core.report.summary import best_eval, campaign_best, config_rows, criterion, drift_table, summary_markdown
from dmd2_core.report.table import GAN_KEYS, TABLE_ROWS, cell, metrics_table, round_sig, table_columns

__all__ = [
    "GAN_KEYS", "MetricsLog", "PLOT_POINTS", "TABLE_ROWS", "best_eval", "campaign_best", "cell", "config_rows", "criterion",
    "drift_table", "json_line", "metrics_table", "plot_panels", "plot_png", "read_metrics", "round_sig",
    "summary_markdown", "table_columns", "thin",
]
