"""MLflow: metrics with their step, the configuration as parameters (once: MLflow's parameters
cannot change), PNG media as MLflow images (a step slider in the UI) and every medium as an
artifact under ``eval/iter_{step}/``. The default store is local, in the save: SQLite
(``{save}/mlflow.db``; MLflow 3 refuses new file stores) with artifacts in ``{save}/mlflow-artifacts``.
A resumed run reopens its MLflow run by id."""

from __future__ import annotations

import io
import tempfile
import time
from pathlib import Path
from typing import Optional

from dmd2_core import storage
from dmd2_core.args import Args
from dmd2_core.trackers.base import Medium, Sink

BATCH = 100  # MLflow's limit of parameters per log_batch call
PARAM_CHARS = 6000  # and of one parameter's value


def store_of(args: Args) -> tuple[Optional[str], Optional[str]]:
    """(tracking URI, artifact location of a new experiment): the flag, or a local store in a
    local save; None: MLflow's own default (MLFLOW_TRACKING_URI)."""
    if args.mlflow_tracking_uri:
        return args.mlflow_tracking_uri, None
    if not storage.is_local(args.save):
        return None, None
    save = Path(storage.filesystem(args.save)[1]).resolve()
    save.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{save / 'mlflow.db'}", (save / "mlflow-artifacts").as_uri()


class MlflowSink(Sink):
    name = "mlflow"

    def __init__(self, args: Args, run_name: str, state: Optional[dict], written: int):
        from mlflow.tracking import MlflowClient

        super().__init__(args, run_name, state, written)
        uri, artifacts = store_of(args)
        uri = self.state.get("tracking_uri", uri)
        self.client = MlflowClient(uri)
        if self.state.get("run_id"):
            self.run_id = self.state["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            name = args.mlflow_experiment or args.run_name
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(name, artifact_location=artifacts))
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        self.state.update(tracking_uri=uri, run_id=self.run_id)

    def log_config(self, config: dict) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)[:PARAM_CHARS]) for k, v in sorted(config.items())]
        for at in range(0, len(params), BATCH):
            self.client.log_batch(self.run_id, params=params[at:at + BATCH])

    def write(self, step: int, scalars: dict[str, float], media: list[Medium]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])
        if not media:
            return
        from PIL import Image

        with tempfile.TemporaryDirectory(prefix="dmd2-mlflow-") as tmp:
            for m in media:
                if m.ext == "png":
                    with Image.open(io.BytesIO(m.data)) as img:
                        self.client.log_image(self.run_id, img.convert("RGB"), key=f"eval/{m.name}", step=step)
                path = Path(tmp) / f"{m.name}.{m.ext}"
                path.write_bytes(m.data)
                self.client.log_artifact(self.run_id, str(path), artifact_path=f"eval/iter_{step:07d}")

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
