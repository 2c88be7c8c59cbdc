"""The trackers' flags, a part of the run's arguments (``dmd2_core.args.Args`` builds on
``TrackerFlags``): which trackers a run writes to and where each one's run lives."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, Field


def flag(default, help: str):
    return Field(default, description=help, json_schema_extra={"group": "trackers"})


class TrackerFlags(BaseModel):
    trackers: list[str] = flag(
        [], "Experiment trackers the run also writes to: any of tensorboard, mlflow, wandb (each needs its extra: "
        "pip install 'dmd2[NAME]'). A rerun continues the same tracker runs (their ids are in {save}/trackers.json).")
    tracker_run_name: Optional[str] = flag(None, "The tracker runs' name; default the flow run's name.")
    tensorboard_dir: Optional[str] = flag(
        None, "TensorBoard log directory of the run; default {save}/tensorboard/{run_name} (./tensorboard/{run_name} "
        "when the save is not a local path): tensorboard --logdir on its parent lists it by name.")
    mlflow_tracking_uri: Optional[str] = flag(
        None, "MLflow tracking URI; default a local store in the save (sqlite:///{save}/mlflow.db, artifacts in "
        "{save}/mlflow-artifacts), or MLflow's own default when the save is not a local path (MLFLOW_TRACKING_URI, "
        "else sqlite:///mlflow.db in the working directory); kept as an absolute URI, so a rerun from anywhere "
        "finds it.")
    mlflow_experiment: Optional[str] = flag(None, "MLflow experiment name; default run_name.")
    wandb_mode: Literal["offline", "online"] = flag(
        "offline", "W&B mode: offline writes run files only (`wandb sync` uploads them later); online logs in.")
    wandb_project: Optional[str] = flag(None, "W&B project; default run_name.")
    wandb_dir: Optional[str] = flag(
        None, "Local directory of W&B's run files ({dir}/wandb/); default the save, or the working directory when "
        "the save is not a local path.")
