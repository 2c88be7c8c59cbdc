"""Experiment trackers (metric sinks): TensorBoard, MLflow and W&B, zero or more per run (the
``trackers`` flag). Each gets the run's configuration once, every iteration's metrics (every
numeric key of its metrics row) and the eval media (by name). ``sinks.Trackers`` fans out to them
and keeps the replay rule: docs/design.md#experiment-trackers. No Prefect here."""
