"""deployments/serve.py serves what deployments/prefect.yaml declares for `prefect deploy`: it reads
the file, so every field the file gives a deployment must reach the served one, and a field serve
cannot honour must stop it rather than be dropped."""

from __future__ import annotations

import pytest
import yaml

from deployments import serve


def _declared() -> list[dict]:
    with open(serve.PREFECT_YAML) as f:
        return yaml.safe_load(f)["deployments"]


def test_served_deployments_are_the_declared_ones(monkeypatch):
    declared = _declared()
    values = {}
    for entry in declared:  # every {{ $VAR }} parameter set, so nothing is missing or paused
        for key, value in entry.get("parameters", {}).items():
            var = serve.env_template(value)
            if var:
                values[var] = f"s3://bucket/{entry['name']}/{key}"
                monkeypatch.setenv(var, values[var])
    assert values, "prefect.yaml has no {{ $VAR }} parameter: the minimax-h3 inputs come from the environment"
    lines: list[str] = []
    served = serve.build_deployments(warn=lines.append)
    assert lines == []
    assert [d.name for d in served] == [e["name"] for e in declared]
    for entry, dep in zip(declared, served):
        assert set(entry) <= serve.DEPLOYMENT_KEYS, entry["name"]
        assert dep.description == entry["description"]
        assert dep.tags == entry["tags"]
        assert dep.concurrency_limit == entry.get("concurrency_limit")
        want = {k: values.get(serve.env_template(v), v) for k, v in entry["parameters"].items()}
        assert dep.parameters == want
        schedules = entry.get("schedules", [])
        assert [(s.schedule.cron, s.schedule.timezone, s.active) for s in dep.schedules] == \
               [(s["cron"], s["timezone"], True) for s in schedules]
        module, _, flow = entry["entrypoint"].partition(":")
        assert dep.entrypoint == module.removesuffix(".py").replace("/", ".") + "." + flow
        env = entry["work_pool"]["job_variables"]["env"]
        assert {k: str(v) for k, v in env.items()} == serve.deployment_specs()[served.index(dep)]["env"]
        assert env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == str(serve.HEARTBEAT_S)


@pytest.mark.parametrize("change", [
    lambda d: d.update(version="2"),
    lambda d: d.update(paused=True),
    lambda d: d.update(entrypoint="flows/teacher.py:teacher"),
    lambda d: d.update(schedules=[{"cron": "0 2 * * *"}, {"cron": "0 3 * * *"}]),
    lambda d: d.update(schedules=[{"interval": 3600}]),
    lambda d: d["work_pool"].update(job_variables={"image": "x"}),
    lambda d: d["parameters"].pop("recipe"),
])
def test_a_field_serve_cannot_honour_is_an_error(tmp_path, change):
    with open(serve.PREFECT_YAML) as f:
        doc = yaml.safe_load(f)
    assert len(serve.deployment_specs()) == len(doc["deployments"])
    change(doc["deployments"][0])
    path = tmp_path / "prefect.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ValueError, match="minimax-h3"):
        serve.deployment_specs(path)


def test_package_data_lists_every_file_the_packages_read():
    """An installed (non-editable) package carries only the .py files and what
    [tool.setuptools.package-data] lists: every other file in the packages (recipes, prefect.yaml,
    the model configs, the activation calibration) must match one of its patterns."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")
    root = Path(serve.PREFECT_YAML).parents[1]
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = {path.resolve() for package, patterns in pyproject["package-data"].items() for pattern in patterns
              for path in (root / package.replace(".", "/")).glob(pattern) if path.is_file()}
    packages = {p.split("*")[0] for p in pyproject["packages"]["find"]["include"]}
    files = {path.resolve() for package in packages for path in (root / package).rglob("*")
             if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts}
    assert {str(p.relative_to(root)) for p in files - listed} == set()
    assert root / "dmd2_core" / "memory" / "activation_calibration.json" in listed
    assert {p.name for p in (root / "deployments" / "recipes").glob("*.yaml")} <= {p.name for p in listed}
