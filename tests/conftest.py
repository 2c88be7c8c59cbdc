"""Shared fixtures and hooks: process environment for tests, and an S3 store (moto) on loopback.
Plain helpers the tests share (no fixtures): tests/helpers.py.

The S3 endpoint is published through AWS_ENDPOINT_URL (see dmd2_core/storage.py), so s3fs in this
process, boto3, and any child process (Ray workers, Prefect subprocesses) all reach the moto server
without further configuration.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import threading
import uuid
from pathlib import Path

import pytest
import torch

from flows.environment import ENVIRONMENT_DEFAULTS, local_prefect_server
from tests.helpers import SHORT_TEACHER_STEPS, free_port, session_shared

# Tests marked `multi_rank` start groups of 2+ ranks. Ranks wait on each other in every gloo
# collective, so two such groups sharing two cores stall each other (a 2-rank test took 12x longer
# beside two busy processes). Under `--dist loadscope` (make test) the marked tests are one scope
# and run one after another on one worker; the other tests of a file are a scope of their own, as
# with loadfile. The tests marked `server` (tests/test_alerts.py, tests/test_served.py) are one
# scope too: the real Prefect server is a session fixture, so on one worker it starts once, where
# the two files on two workers started one each. The controller never imports the tests, so it
# reads the markers from each file's source. (xdist's own loadgroup cannot do this under pytest 9:
# its suffix on the node id is ignored.) A test with both marks is multi-rank.
MARKED_SCOPES = {"multi_rank": "multi-rank", "server": "prefect-server"}


def marked_tests(path: Path) -> dict[str, str]:
    """The test functions of ``path`` decorated with a mark of MARKED_SCOPES: name -> scope."""
    import ast

    def marks(node) -> list[str]:
        names = []
        for decorator in node.decorator_list:
            target = decorator.func if isinstance(decorator, ast.Call) else decorator
            if isinstance(target, ast.Attribute) and target.attr in MARKED_SCOPES:
                names.append(target.attr)
        return names

    tree = ast.parse(path.read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (names := marks(node)):
            found[node.name] = MARKED_SCOPES["multi_rank" if "multi_rank" in names else names[0]]
    return found


# The longest scopes go first, so that no long one is left for the end (seconds of work each,
# medians of the `--durations` reports of five whole-suite runs on the 2-core machine,
# 2026-12-06: multi-rank ~580, the served scope ~500, faults ~235, dmd2 ~115, flow ~90, wan video
# ~85, the night budget ~65, broken checkpoints ~65, trackers ~60, the checkpoint-at-scale file's
# one unmarked test ~35; most others are under 30). Scopes not named here follow in xdist's order,
# by number of tests, in which the night budget's 5 tests came 37th of 47 scopes and the
# checkpoint-at-scale file's one test 44th. A name that matches no scope is ignored by the
# scheduler, so tests/test_scopes.py checks every one against the suite.
LONGEST_FIRST = ("multi-rank", "prefect-server", "tests/test_faults.py", "tests/test_dmd2.py", "tests/test_flow.py",
                 "tests/test_wan_video.py", "tests/test_night_budget.py", "tests/checkpoint/test_broken_checkpoints.py",
                 "tests/test_trackers.py", "tests/checkpoint/test_checkpoints_at_scale.py")


class MarkedScopesScheduling:
    """Registered only where xdist is (``-p no:xdist`` must still run the suite)."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config, log):
        if config.getvalue("dist") != "loadscope":
            return None
        from functools import lru_cache

        from xdist.scheduler import LoadScopeScheduling

        marked_in = lru_cache(maxsize=None)(lambda path: marked_tests(Path(config.rootpath) / path))

        class MarkedTestsTogether(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                path, _, rest = nodeid.partition("::")
                name = rest.split("[", 1)[0].split("::")[-1]
                return marked_in(path).get(name, path)

            def _assign_work_unit(self, node) -> None:
                first = next((scope for scope in LONGEST_FIRST if scope in self.workqueue), None)
                if first is not None:
                    self.workqueue.move_to_end(first, last=False)
                super()._assign_work_unit(node)

        return MarkedTestsTogether(config, log)


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(MarkedScopesScheduling(), "dmd2-marked-scopes-scheduling")


def _set_env(monkeypatch_env: dict, values: dict) -> None:
    for key, value in values.items():
        monkeypatch_env.setdefault(key, os.environ.get(key))
        os.environ[key] = value


def _restore_env(saved: dict) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session", autouse=True)
def _test_environment(tmp_path_factory):
    """Quiet, local, single-threaded settings every test and child process inherits."""
    from filelock import FileLock

    saved: dict = {}
    cache = session_shared(tmp_path_factory) / "dmd2-cache"  # the digits classifier, trained once per session
    _set_env(saved, {**ENVIRONMENT_DEFAULTS, "DMD2_CACHE_DIR": str(cache)})
    torch.set_num_threads(1)
    with FileLock(str(cache) + ".lock"):
        from dmd2_core.toys.digits_metrics import digits_classifier

        digits_classifier()
    yield
    _restore_env(saved)


_MOTO: dict = {}  # the live moto server of the session (replaced when an outage restarts it)


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on 127.0.0.1 (free port) for the whole session; yields its endpoint URL.
    AWS_* variables point every S3 client at it until the session ends."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    _MOTO["server"] = server
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved: dict = {}
    _set_env(saved, {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    })
    for key in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL_S3"):
        saved.setdefault(key, os.environ.pop(key, None))
    try:
        yield endpoint
    finally:
        _MOTO["server"].stop()
        _restore_env(saved)


@pytest.fixture
def s3_outage(s3_server):
    """``outage(seconds)``: stop the session's moto server now (connections are refused) and start
    it again on the same port after ``seconds`` or when the returned thread's ``end()`` is called,
    in a background thread; returns the thread. The buckets and objects survive (moto keeps them
    in this process)."""
    import threading

    from moto.server import ThreadedMotoServer

    threads = []

    def outage(seconds: float) -> threading.Thread:
        for earlier in threads:  # the previous restart must have replaced the server first
            earlier.join()
        host, port = _MOTO["server"].get_host_and_port()
        _MOTO["server"].stop()

        ended = threading.Event()

        def restart():
            ended.wait(seconds)
            server = ThreadedMotoServer(ip_address=host, port=port, verbose=False)
            server.start()
            _MOTO["server"] = server

        thread = threading.Thread(target=restart, daemon=True)
        thread.end = ended.set
        thread.start()
        threads.append(thread)
        return thread

    yield outage
    for thread in threads:
        thread.join(timeout=120)


@pytest.fixture
def s3_bucket(s3_server) -> str:
    """A fresh, empty bucket on the moto server, as 's3://name'."""
    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket=name)
    return f"s3://{name}"


@pytest.fixture(scope="session")
def tiny_teacher(tmp_path_factory) -> str:
    """An untrained tiny SD3 digits model saved as a teacher checkpoint (seeded, so every test
    session builds the same weights)."""
    from dmd2_core.models import save_model_dir
    from dmd2_core.models.sd3 import SD3ImageFamily
    from dmd2_core.toys.digits import tiny_digits_config

    torch.manual_seed(0)
    model = SD3ImageFamily().build(tiny_digits_config())
    url = str(tmp_path_factory.mktemp("tiny-teacher") / "teacher")
    save_model_dir(model, url, shift=3.0)
    return url


@pytest.fixture(scope="session")
def ray_session(s3_server):
    """One local Ray for the whole session with 4 stand-in devices ('dmd2_device'), started after
    the S3 endpoint is in the environment so workers inherit it."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", namespace="dmd2-tests", resources={"dmd2_device": 4.0}, include_dashboard=False,
                 log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def prefect_harness(s3_server):
    """Prefect's test harness (a temporary database and server) for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def short_teacher(tmp_path_factory):
    """A digits teacher trained for a short while (~20 s), once per session whatever the number of
    workers: (url, training info without the model)."""
    import json

    from filelock import FileLock

    from dmd2_core.toys import digits_teacher

    shared = session_shared(tmp_path_factory)
    url, record = shared / "short-teacher", shared / "short-teacher.json"
    with FileLock(str(shared / "short-teacher.lock")):
        if not record.exists():
            info = digits_teacher.train_teacher(str(url), seed=0, num_steps=SHORT_TEACHER_STEPS, batch_size=64, log=None)
            record.write_text(json.dumps({k: v for k, v in info.items() if k != "model"}))
    return str(url), json.loads(record.read_text())


@pytest.fixture(scope="session")
def harness(prefect_harness, ray_session):
    """The session's Prefect test harness and Ray (started after the S3 endpoint is set, so the
    workers reach the moto server)."""
    return prefect_harness


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """One real `prefect server start` (free loopback port, own PREFECT_HOME, no UI) shared by the
    tests that need a real server. Yields (api_url, env for child processes)."""
    port = free_port()
    home = tmp_path_factory.mktemp("prefect-server")
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update({
        "PREFECT_HOME": str(home / "home"),
        "PREFECT_API_URL": api,
        "PREFECT_UI_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_UI_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        "PYTHONUNBUFFERED": "1",
    })
    with local_prefect_server(port, env=env, log=home / "server.log"):
        yield api, env


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path) -> str:
    """A storage root: a local directory, or a fresh bucket on the moto server."""
    if request.param == "local":
        return str(tmp_path / "store")
    return request.getfixturevalue("s3_bucket") + "/run"


@pytest.fixture(scope="module")
def receiver():
    """A local HTTP server that records the JSON bodies POSTed to it: (url, list of bodies); the
    webhook that failure, regression and no-night messages go to in the served tests."""
    got: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", got
    server.shutdown()
