"""Serve the dmd2 deployments from this process (no work pool needed):

    python -m deployments.serve [--only tiny] [--limit N] [--local-server] [--alert-webhook URL]
    python -m deployments.serve --automations-only [--alert-webhook URL]   # deployments run by a worker

Run it from the repository root against a Prefect server (PREFECT_API_URL); flow runs execute
here, in subprocesses, so recipe paths such as runs/teacher resolve against the current directory.

The deployments are the ones ``deployments/prefect.yaml`` declares for ``prefect deploy``, read
from that file (names, descriptions, tags, parameters, schedules, limits, the work pool's
environment), so the two cannot differ; a key there that serve cannot honour stops it with an error.

- ``minimax-h3``: recipe minimax-h3, nightly at 02:00 UTC (cron ``0 2 * * *``, timezone UTC), one
  run at a time. hf_checkpoint, prompts and save (which the recipe leaves to the deployment) come
  from DMD2_MINIMAX_H3_HF_CHECKPOINT, DMD2_MINIMAX_H3_PROMPTS and DMD2_MINIMAX_H3_SAVE (the
  ``{{ $VAR }}`` parameters of prefect.yaml); when one is missing from both, the deployment is
  served with its schedule paused, a description saying what to set, and serve prints one line
  naming the missing keys. Skipped with a warning when the recipe file does not exist. Each night
  is a leg of one distillation: ``time_budget_s`` (prefect.yaml: 36000, the 02:00-12:00 UTC window)
  stops it in time to checkpoint, evaluate and export, and the next night resumes the same save.
- ``tiny``: recipe tiny (the digits demo), on demand: ``prefect deployment run dmd2/tiny``.

Server automations made with them: a run that stops sending heartbeats is Crashed, a Crashed one
is rerun (``ensure_automations``), and with ``--alert-webhook`` (or DMD2_ALERT_WEBHOOK_URL) a
Slack-compatible message goes to that webhook (flows/alerts.py) when a run fails or crashes, when a
completed night regresses against the nights before it, and when a scheduled deployment has no
completed night within its window: the longest gap of its cron schedule plus STALE_SLACK (26 h for
``0 2 * * *``; only deployments whose schedule is active on the server, so a paused minimax-h3 is
not expected to have nights).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import yaml

from flows.environment import configure_environment, local_prefect_server

if __name__ == "__main__":  # Prefect and Ray read these settings when they are imported
    configure_environment()

from flows.alerts import (WEBHOOK_ENV, ensure_failure_alert, ensure_regression_alert,  # noqa: E402
                          ensure_stale_alert, stale_window)
from flows.dmd2 import dmd2  # noqa: E402

from dmd2_core.args import read_recipe, resolve_recipe  # noqa: E402
from dmd2_core.errors import ArgsError

PREFECT_YAML = Path(__file__).resolve().with_name("prefect.yaml")
REQUIRED = ("hf_checkpoint", "prompts", "save")
# what serve reads of a deployment in prefect.yaml; any other key (version, paused, triggers, ...)
# is an error rather than a difference between the served and the deployed deployments
DEPLOYMENT_KEYS = {"name", "description", "entrypoint", "tags", "parameters", "schedules", "concurrency_limit",
                   "work_pool"}
SCHEDULE_KEYS = {"cron", "timezone", "active"}  # active: serve decides it from the inputs (below)
WORK_POOL_KEYS = {"name", "work_queue_name", "job_variables"}
_TEMPLATE = re.compile(r"^\{\{\s*\$([A-Za-z_][A-Za-z0-9_]*)\s*\}\}$")


def env_template(value: Any) -> Optional[str]:
    """The variable of a ``{{ $VAR }}`` parameter of prefect.yaml (``prefect deploy`` fills it from
    the environment, and so does serve); None for any other value."""
    match = _TEMPLATE.match(value.strip()) if isinstance(value, str) else None
    return match.group(1) if match else None


def _read_yaml(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        doc = yaml.safe_load(f)
    return doc.get("deployments") or []


def deployment_specs(path: Optional[Path] = None) -> list[dict[str, Any]]:
    """What each deployment of prefect.yaml is, as serve serves it: name, recipe, parameters (the
    ``{{ $VAR }}`` ones as {key: VAR} in ``templates``), cron and timezone, concurrency limit,
    description, tags and the work pool's environment. ValueError for a key serve cannot honour."""
    path = Path(path) if path is not None else PREFECT_YAML
    specs = []
    for entry in _read_yaml(path):
        name = entry.get("name")
        where = f"{path}: deployment {name!r}"
        unknown = set(entry) - DEPLOYMENT_KEYS
        if unknown:
            raise ValueError(f"{where}: {', '.join(sorted(unknown))} not served by deployments/serve.py")
        flow_module, _, flow_name = str(entry.get("entrypoint", "")).partition(":")
        if (flow_module.removesuffix(".py").replace("/", "."), flow_name) != (dmd2.fn.__module__, dmd2.fn.__name__):
            raise ValueError(f"{where}: entrypoint {entry.get('entrypoint')!r} is not the flow serve serves "
                             f"({dmd2.fn.__module__}:{dmd2.fn.__name__})")
        schedules = entry.get("schedules") or []
        if len(schedules) > 1 or any(set(s) - SCHEDULE_KEYS for s in schedules):
            raise ValueError(f"{where}: serve serves at most one schedule of keys {sorted(SCHEDULE_KEYS)}")
        pool = entry.get("work_pool") or {}
        if set(pool) - WORK_POOL_KEYS or set(pool.get("job_variables") or {}) - {"env"}:
            raise ValueError(f"{where}: work_pool keys other than {sorted(WORK_POOL_KEYS)} and job_variables.env")
        parameters = dict(entry.get("parameters") or {})
        if "recipe" not in parameters:
            raise ValueError(f"{where}: no recipe parameter")
        templates = {k: env_template(v) for k, v in parameters.items() if env_template(v)}
        schedule = schedules[0] if schedules else {}
        specs.append(dict(
            name=name, recipe=parameters["recipe"],
            parameters={k: v for k, v in parameters.items() if k not in templates}, templates=templates,
            cron=schedule.get("cron"), timezone=schedule.get("timezone"),
            concurrency_limit=entry.get("concurrency_limit"), description=entry.get("description", ""),
            tags=list(entry.get("tags") or []),
            env={k: str(v) for k, v in ((pool.get("job_variables") or {}).get("env") or {}).items()},
        ))
    return specs


def missing_inputs(spec: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(parameters, missing): the deployment's parameters (its own, the ``{{ $VAR }}`` ones from the
    environment where set) and the REQUIRED keys set neither by them nor by the recipe."""
    recipe = read_recipe(spec["recipe"])
    parameters: dict[str, Any] = dict(spec["parameters"])
    parameters.update({k: os.environ[var] for k, var in spec["templates"].items() if os.environ.get(var)})
    return parameters, [k for k in REQUIRED if k not in parameters and not recipe.get(k)]


def build_deployments(only: Optional[list[str]] = None, warn=print) -> list:
    """The deployments to serve. One whose required inputs are missing is still served (it can be
    run by hand with them) but its schedule is paused, its description says what to set, the run
    form marks the missing keys as required, and ``warn`` gets one line naming them: no scheduled
    run is ever created that is certain to fail."""
    from prefect.schedules import Cron

    deployments = []
    for spec in deployment_specs():
        if only and spec["name"] not in only:
            continue
        try:
            resolve_recipe(spec["recipe"])
            parameters, missing = missing_inputs(spec)
        except ArgsError as exc:
            warn(f"warning: skipping deployment '{spec['name']}': {exc}")
            continue
        description = spec["description"]
        if missing:
            names = ", ".join(missing)
            envs = ", ".join(spec["templates"][k] for k in missing if k in spec["templates"])
            if spec["cron"] and all(k in spec["templates"] for k in missing):
                warn(f"warning: deployment '{spec['name']}': schedule paused, missing {names} "
                     f"(set {envs} and restart serve)")
                description += (f" **Schedule paused**: {names} missing. Set {envs} and restart "
                                f"`python -m deployments.serve`, or run it by hand with these parameters.")
            elif spec["cron"]:
                warn(f"warning: deployment '{spec['name']}': schedule paused, missing {names} "
                     f"(pass them as parameters)")
                description += f" **Schedule paused**: {names} missing. Set them as parameters."
            else:
                warn(f"warning: deployment '{spec['name']}': missing {names} (pass them as parameters)")
                description += f" Set {names} as parameters."
        schedules = ([Cron(spec["cron"], timezone=spec["timezone"], active=not missing)] if spec["cron"] else None)
        deployment = dmd2.to_deployment(
            name=spec["name"],
            schedules=schedules,
            concurrency_limit=spec["concurrency_limit"],
            parameters=parameters,
            description=description,
            tags=spec["tags"],
            entrypoint_type=_module_path(),
        )
        schema = deployment._parameter_openapi_schema
        for key in missing:  # the run form reads them as required (no '(Optional)')
            if key not in schema.required:
                schema.required.append(key)
        deployments.append(deployment)
    return deployments


HEARTBEAT_S = 30  # PREFECT_FLOWS_HEARTBEAT_FREQUENCY when the work pool's environment sets none
RERUN_AUTOMATION = "dmd2: rerun crashed runs"
ZOMBIE_AUTOMATION = "dmd2: crash runs without heartbeat"


def ensure_automations(deployment_ids: list, heartbeat_s: int = HEARTBEAT_S) -> list:
    """Two server automations (replaced if they exist), so a run whose process dies comes back:

    - a run of these deployments that emitted a heartbeat and then nothing (no heartbeat, no final
      state) for 3 heartbeats is set Crashed (its node died; a kill -9 of the flow-run process alone
      is reported Crashed at once by the serve process that started it);
    - a Crashed run of these deployments is set Scheduled again: a serve process picks it up, and
      it resumes from the checkpoint tracker. The flow itself bounds the reruns (``max_crash_reruns``):
      beyond them it fails (Failed is not Crashed, so the loop ends there).

    Returns the automations' ids."""
    from datetime import timedelta

    from prefect.automations import Automation, ChangeFlowRunState, EventTrigger, Posture
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType

    related = {"prefect.resource.role": "deployment",
               "prefect.resource.id": [f"prefect.deployment.{d}" for d in deployment_ids]}
    wanted = [
        Automation(
            name=ZOMBIE_AUTOMATION,
            description="A dmd2 deployment run that stops sending heartbeats is Crashed.",
            trigger=EventTrigger(
                after={"prefect.flow-run.heartbeat"},
                expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                        "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"},
                match={"prefect.resource.id": "prefect.flow-run.*"}, match_related=related,
                for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
                within=timedelta(seconds=3 * heartbeat_s)),
            actions=[ChangeFlowRunState(state=StateType.CRASHED, message=f"no heartbeat for {3 * heartbeat_s} s")],
        ),
        Automation(
            name=RERUN_AUTOMATION,
            description="A Crashed dmd2 deployment run is scheduled again; it resumes from its checkpoint.",
            trigger=EventTrigger(
                expect={"prefect.flow-run.Crashed"}, match={"prefect.resource.id": "prefect.flow-run.*"},
                match_related=related, posture=Posture.Reactive, threshold=1, within=timedelta(0)),
            actions=[ChangeFlowRunState(state=StateType.SCHEDULED, name="AwaitingRerun",
                                        message="rerun after a crash (dmd2 serve automation)")],
        ),
    ]
    with get_client(sync_client=True) as client:
        for automation in wanted:
            for old in client.read_automations_by_name(automation.name):
                client.delete_automation(old.id)
    return [automation.create().id for automation in wanted]


STALE_SLACK = timedelta(hours=2)  # a night may end this much later than the one before it


def scheduled(deployment_ids: list) -> tuple[list, list[tuple[str, Optional[str]]]]:
    """(ids, [(cron, timezone)]): the deployments among these whose cron schedule is active on the
    server (the deployment not paused), and those schedules."""
    from prefect.client.orchestration import get_client

    ids, crons = [], []
    with get_client(sync_client=True) as client:
        for d in deployment_ids:
            deployment = client.read_deployment(d)
            active = [s.schedule for s in deployment.schedules or [] if s.active and getattr(s.schedule, "cron", None)]
            if active and not deployment.paused:
                ids.append(d)
                crons += [(s.cron, s.timezone) for s in active]
    return ids, crons


def ensure_alerts(deployment_ids: list, webhook_url: Optional[str]) -> Optional[str]:
    """The three messages to a person (flows/alerts.py): a failed or crashed run, a regressed
    night, a scheduled deployment without a completed night (its window from its schedule). Without
    a URL none (older ones removed). Returns the failure automation's id."""
    failure = ensure_failure_alert(deployment_ids, webhook_url)
    ensure_regression_alert(deployment_ids, webhook_url)
    ids, crons = scheduled(deployment_ids) if webhook_url else ([], [])
    ensure_stale_alert(ids, webhook_url, stale_window(crons, STALE_SLACK))
    return failure


def registered_ids(names: list[str], warn=print) -> list:
    """The ids of the dmd2 deployments of these names already on the server (``prefect deploy``)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    ids = []
    with get_client(sync_client=True) as client:
        for name in names:
            try:
                ids.append(client.read_deployment_by_name(f"dmd2/{name}").id)
            except ObjectNotFound:
                warn(f"warning: deployment 'dmd2/{name}' is not on the server: no automation for it")
    return ids


def _module_path():
    # flows.dmd2.dmd2 imports from wherever the package is importable, independent of the cwd.
    from prefect.types.entrypoint import EntrypointType

    return EntrypointType.MODULE_PATH


def configured_api_url() -> Optional[str]:
    from prefect.settings import PREFECT_API_URL

    return os.environ.get("PREFECT_API_URL") or PREFECT_API_URL.value()


@contextlib.contextmanager
def local_server(port: int = 4200, timeout_s: float = 120.0):
    """A `prefect server start` on loopback for as long as the block runs; PREFECT_API_URL (and
    the UI's) point at it meanwhile. The server is stopped with SIGTERM when the block exits."""
    api = f"http://127.0.0.1:{port}/api"
    os.environ.update(PREFECT_API_URL=api, PREFECT_UI_API_URL=api)
    with local_prefect_server(port, timeout_s=timeout_s):
        print(f"Prefect server: http://127.0.0.1:{port} (UI), PREFECT_API_URL={api}", file=sys.stderr)
        from prefect.settings import PREFECT_API_URL, PREFECT_UI_API_URL, temporary_settings

        # the environment reaches the flow-run subprocesses; this process read its settings at import
        with temporary_settings(updates={PREFECT_API_URL: api, PREFECT_UI_API_URL: api}):
            yield api


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.serve", description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="Serve only these deployments.")
    parser.add_argument("--limit", type=int, default=None, help="Most flow runs at once (default unlimited).")
    parser.add_argument("--local-server", type=int, nargs="?", const=4200, default=None, metavar="PORT",
                        help="When no PREFECT_API_URL is configured, start a Prefect server on 127.0.0.1:PORT "
                             "(default 4200) for as long as this process serves.")
    parser.add_argument("--alert-webhook", default=os.environ.get(WEBHOOK_ENV), metavar="URL",
                        help=f"Slack-compatible webhook a failed or crashed run posts to (default ${WEBHOOK_ENV}; "
                             "none: no failure messages).")
    parser.add_argument("--automations-only", action="store_true",
                        help="Create the automations for the dmd2 deployments already on the server (deployed with "
                             "`prefect deploy` and run by a worker) and exit, serving nothing.")
    ns = parser.parse_args(argv)
    if ns.automations_only:
        names = [s["name"] for s in deployment_specs() if not ns.only or s["name"] in ns.only]
        ids = registered_ids(names, warn=lambda m: print(m, file=sys.stderr))
        if not ids:
            print("error: no dmd2 deployment on the server", file=sys.stderr)
            return 2
        ensure_automations(ids)
        ensure_alerts(ids, ns.alert_webhook)
        print(f"automations for {len(ids)} deployment(s)" + ("" if ns.alert_webhook else
              f"; no failure messages (no --alert-webhook / {WEBHOOK_ENV})"), file=sys.stderr)
        return 0
    with contextlib.ExitStack() as stack:
        if not configured_api_url():
            if ns.local_server is not None:
                stack.enter_context(local_server(ns.local_server))
            else:
                print("note: PREFECT_API_URL is not set; start a server (prefect server start) and point "
                      "PREFECT_API_URL at it, or use --local-server", file=sys.stderr)
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            deployments = build_deployments(ns.only, warn=lambda m: print(m, file=sys.stderr))
        if not deployments:
            print("error: no deployment to serve", file=sys.stderr)
            return 2
        from prefect import serve

        for spec in deployment_specs():  # the flow-run processes get the work pool's environment, as a worker's do
            for key, value in spec["env"].items():
                os.environ.setdefault(key, value)
        os.environ.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", str(HEARTBEAT_S))
        ids = [d.apply() for d in deployments]  # registered first, so the automations can name them
        ensure_automations(ids, int(os.environ["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"]))
        if ensure_alerts(ids, ns.alert_webhook) is None:
            print(f"note: no --alert-webhook / {WEBHOOK_ENV}: a failed night shows only in the UI", file=sys.stderr)
        serve(*deployments, limit=ns.limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
