"""MLflow: metrics with their step, the configuration as parameters (once: MLflow's parameters
cannot change), PNG media as MLflow images (a step slider in the UI) and every medium as an
artifact under ``eval/iter_{step}/``. The default store is local, in the save: SQLite
(``{save}/mlflow.db``; MLflow 3 refuses new file stores) with artifacts in ``{save}/mlflow-artifacts``.
A resumed run reopens its MLflow run by id, in the store whose absolute URI ``trackers.json`` keeps
(a rerun from another directory finds it); a run that is gone (deleted, or a store that does not
have it) is replaced by a new one, with a warning, which is given the run's rows again."""

from __future__ import annotations

import io
import logging
import tempfile
import time
from pathlib import Path
from typing import Optional

from dmd2_core import storage
from dmd2_core.args import Args
from dmd2_core.trackers.base import Medium, Sink

log = logging.getLogger("dmd2")

BATCH = 100  # MLflow's limit of parameters per log_batch call
PARAM_CHARS = 6000  # and of one parameter's value


def absolute_uri(uri: str) -> str:
    """A tracking URI that names the same store from any working directory: a relative SQLite
    path or local directory made absolute (MLflow's own default is ``sqlite:///mlflow.db``, in
    the working directory); a server's URI as it is."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return f"sqlite:///{Path(uri[len('sqlite:///'):]).resolve()}"
    if "://" not in uri and ":" not in uri.partition("/")[0]:  # a bare path (a file store)
        return Path(uri).resolve().as_uri()
    return uri


def store_of(args: Args) -> tuple[str, Optional[str]]:
    """(tracking URI, artifact location of a new experiment): the flag, or a local store in a
    local save, else MLflow's own default (MLFLOW_TRACKING_URI, else ``sqlite:///mlflow.db`` in the
    working directory); a relative one made absolute, so that ``trackers.json`` names the store
    and not the directory a run was started from."""
    if args.mlflow_tracking_uri:
        return absolute_uri(args.mlflow_tracking_uri), None
    if not storage.is_local(args.save):
        import mlflow

        return absolute_uri(mlflow.get_tracking_uri()), None
    save = Path(storage.filesystem(args.save)[1]).resolve()
    save.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{save / 'mlflow.db'}", (save / "mlflow-artifacts").as_uri()


class MlflowSink(Sink):
    name = "mlflow"

    def __init__(self, args: Args, run_name: str, state: Optional[dict], written: int):
        from mlflow.tracking import MlflowClient

        super().__init__(args, run_name, state, written)
        uri, artifacts = store_of(args)
        uri = self.state.get("tracking_uri") or uri  # an older save kept null: MLflow's default, unresolved
        self.client = MlflowClient(uri)
        self.run_id = self.state.get("run_id")
        if self.run_id and self._gone():
            log.warning(f"mlflow: run {self.run_id} is not in {uri} any more; a new run replaces it "
                        f"and is given the metrics log's rows")
            self.run_id, self.new_run, self.held = None, True, -1
        if self.run_id:
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            name = args.mlflow_experiment or args.run_name
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(name, artifact_location=artifacts))
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        self.state.update(tracking_uri=uri, run_id=self.run_id)

    def _gone(self) -> bool:
        """Whether the stored run is missing from the store (or deleted); an unreachable store
        raises (the sink fails to open, and the next run tries again)."""
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(self.run_id)
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return True
            raise
        return run.info.lifecycle_stage == "deleted"

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
