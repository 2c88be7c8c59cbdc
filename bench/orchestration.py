"""What does a long run cost Prefect? The dmd2 flow drives N iterations of a near-zero-cost stand-in
(every phase returns at once; evals return a blank grid; checkpoints write only the tracker) on the
minimax-h3 recipe's intervals, against a real `prefect server start`. Prints one JSON line:

  {"iterations", "iterations_per_window", "overhead_per_iteration_ms" (median, end to end),
   "overhead_mean_ms" (all of them, window starts included), "slowest_iteration_s" (a window start
   waits for the server to write the previous window's task runs: a zero-cost loop outruns a
   server on a busy machine), "server_catch_up_s" (after the run, until every task run is in the
   graphs), "driver_cpu_ms_per_iteration" and "server_cpu_ms_per_iteration" (CPU time, which a busy
   machine does not inflate the way it inflates wall time), "largest_graph_nodes" (the biggest
   flow-run graph the UI would load), "parent_graph_nodes", "graphs", "db_growth_mb_per_1000",
   "log_lines_per_iteration", "metrics_write_kb_first_last" / "metrics_write_ms_first_last" (what the
   metrics log writes after iteration 10 and after the 10th iteration of the last segment),
   "extrapolated_4000": {...}}

    python bench/orchestration.py [--iterations 1000] [--window 100] [--api-url URL]

Without --api-url it starts its own server (a temporary PREFECT_HOME, a free port) and stops it at
the end; the database growth is then measured on that server's SQLite file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from flows.environment import LOCAL_SERVER_ENV, configure_environment, free_port, local_prefect_server  # noqa: E402


def _get(url: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


@contextlib.contextmanager
def prefect_server(home: Path):
    """`prefect server start` on a free loopback port with its own PREFECT_HOME; yields the API URL."""
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_API_URL=api, PREFECT_UI_API_URL=api, PREFECT_SERVER_UI_ENABLED="false",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", **LOCAL_SERVER_ENV)  # the settings bench/README.md measured
    with local_prefect_server(port, env=env, log=home / "server.log") as (api, proc):
        yield api, proc.pid


class StandIn:
    """A DistillRun with the same interface whose work costs nothing."""

    def __init__(self, args, owner=None):
        from dmd2_core.train.trainer_config import compute_trainer_args, compute_trainer_configs

        self.trainer_args = {c.role: compute_trainer_args(args, c) for c in compute_trainer_configs(args)}
        self.args = self.trainer_args["actor"]
        self.resumed_with: list[str] = []  # a fresh start: no optimizer setting changed
        self.startup_s: dict[str, float] = {}

    def start(self) -> int:
        return 0

    def rollout(self, i):
        return {"stop_step": float(i % 4), "rollout_s": 0.0}

    def critic_train_and_score(self, i):
        return {"critic_loss": 1.0 / (1 + i), "critic_grad_norm": 1.0, "dmd2_grad_norm": 0.5}

    def sleep_critic(self, i):
        return {"critic_sleep_s": 0.0}

    def student_train(self, i):
        return {"dmd2_loss": 0.1 / (1 + i), "actor_grad_norm": 0.2}

    def sleep_actor(self, i):
        return {"actor_sleep_s": 0.0}

    def checkpoint(self, i, wait=False, export=None):
        from dmd2_core import checkpoint

        checkpoint.write_latest(self.args.save, i)
        trainers = {r: f"{self.args.save}/trainers/{r}/iter_{i:07d}" for r in self.trainer_args}
        return {"checkpoint": {"iteration": i, "trainers": trainers}, "checkpoint_iteration": i,
                "checkpoint_blocked_s": 0.0, "checkpoint_save_s": 0.0}

    def shutdown(self):
        pass


def stand_in_eval(run, iteration):
    import torch

    from dmd2_core.media.images import image_grid, png_bytes
    from dmd2_core.media.eval_files import publish
    from dmd2_core.save_layout import media_stem

    data = png_bytes(image_grid(torch.zeros(8, 3, 32, 32), nrow=4))
    return {"iteration": int(iteration), "metrics": {"eval_media_s": 0.0},
            "media": [publish(f"{media_stem(run.args.save, iteration)}.png", data, f"iteration {iteration}", 512 * 1024)]}


def _graph_nodes(api: str, flow_run_id: str) -> int:
    return len(_get(f"{api}/flow_runs/{flow_run_id}/graph-v2")["nodes"])


def _count_logs(api: str, flow_run_ids: list[str]) -> int:
    total, offset = 0, 0
    while True:
        page = _get(f"{api}/logs/filter", {"logs": {"flow_run_id": {"any_": flow_run_ids}}, "limit": 200, "offset": offset})
        total += len(page)
        offset += 200
        if len(page) < 200:
            return total


def _db_bytes(home: Path | None) -> int | None:
    """The server's SQLite database size, its write-ahead log folded in first."""
    if home is None:
        return None
    import sqlite3

    with contextlib.closing(sqlite3.connect(home / "prefect.db", timeout=60)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return sum(p.stat().st_size for p in home.glob("prefect.db*"))


def _cpu_s(pid: int | None) -> float | None:
    if pid is None:
        return None
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def measure(api: str, home: Path | None, iterations: int, window: int, server_pid: int | None = None) -> dict:
    os.environ["PREFECT_API_URL"] = api
    import flows.dmd2 as flow_module
    import tasks.eval as eval_module

    flow_module.DistillRun = StandIn
    eval_module.run_eval = stand_in_eval
    # what the metrics log writes per iteration, early and late in the run
    from dmd2_core import storage

    writes: list[tuple[str, int, int, float]] = []  # (segment, lines, bytes, seconds)
    original_write = storage.write_text

    def write_text(url, text, **kw):
        t = time.perf_counter()
        original_write(url, text, **kw)
        if "/metrics/" in str(url):
            writes.append((str(url), text.count("\n"), len(text), time.perf_counter() - t))
    storage.write_text = write_text
    save = tempfile.mkdtemp(prefix="dmd2-orchestration-")
    db_before = _db_bytes(home)
    server_cpu = _cpu_s(server_pid)
    driver_cpu = time.process_time()
    start = time.perf_counter()
    state = flow_module.dmd2(recipe="minimax-h3", overrides={
        "hf_checkpoint": "stand-in", "prompts": "digits", "save": save, "device": "cpu", "num_devices": 1, "cp_size": 1, "lora_rank": 0,
        "num_iterations": iterations, "iterations_per_window": window, "run_name": "orchestration-bench"},
        return_state=True)
    wall = time.perf_counter() - start
    driver_cpu = time.process_time() - driver_cpu  # CPU time is what a busy machine cannot inflate
    if not state.is_completed():
        raise RuntimeError(f"bench flow run ended {state.type}: {state.message}")
    parent = str(state.state_details.flow_run_id)
    from dmd2_core.report import read_metrics

    rows = [r for r in read_metrics(save) if r.get("iteration", 0) >= 1]
    ends = [r["wall_time"] for r in rows]
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    subflows = _get(f"{api}/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [parent]}}, "limit": 200})
    # the server records task runs from events, asynchronously: wait until the graphs stop growing
    expected_windows = len(flow_module.windows(0, iterations, window))
    counts: dict[str, int] = {}
    caught_up = time.perf_counter()
    for _ in range(600):
        counts = {f["name"]: _graph_nodes(api, f["id"]) for f in subflows}
        counts["parent"] = _graph_nodes(api, parent)
        if counts["parent"] >= expected_windows and sum(counts.values()) >= 5 * iterations:
            time.sleep(2)
            again = {f["name"]: _graph_nodes(api, f["id"]) for f in subflows}
            if all(again[k] == counts[k] for k in again):
                break
        time.sleep(1)
    caught_up = time.perf_counter() - caught_up
    server_cpu = None if server_cpu is None else _cpu_s(server_pid) - server_cpu  # until every task run is written
    first = next(w for w in writes if w[0].endswith("iter_0000000.jsonl") and w[1] == 11)  # iterations 0..10
    later = [w for w in writes if not w[0].endswith("iter_0000000.jsonl") and w[1] == 10]
    at10 = [first, later[-1] if later else writes[-1]]
    logs = _count_logs(api, [parent] + [f["id"] for f in subflows])
    db_after = _db_bytes(home)
    largest = max(counts.values())
    per_iter = statistics.median(gaps)
    growth = None if db_before is None else (db_after - db_before) / iterations * 1000 / 1e6
    return {
        "iterations": iterations,
        "iterations_per_window": window,
        "overhead_per_iteration_ms": round(per_iter * 1000, 2),
        "overhead_mean_ms": round((ends[-1] - ends[0]) / max(1, len(gaps)) * 1000, 2),
        "slowest_iteration_s": round(max(gaps), 2),
        "driver_cpu_ms_per_iteration": round(driver_cpu / iterations * 1000, 2),
        "server_cpu_ms_per_iteration": None if server_cpu is None else round(server_cpu / iterations * 1000, 2),
        "flow_wall_s": round(wall, 1),
        "server_catch_up_s": round(caught_up, 1),
        "largest_graph_nodes": largest,
        "parent_graph_nodes": counts["parent"],
        "graphs": len(counts),
        "task_runs": sum(v for k, v in counts.items() if k != "parent"),
        "log_lines_per_iteration": round(logs / iterations, 3),
        # one write, when the open segment holds its 10th iteration: the first segment vs the last
        "metrics_write_kb_first_last": [round(at10[0][2] / 1024, 2), round(at10[-1][2] / 1024, 2)],
        "metrics_write_ms_first_last": [round(at10[0][3] * 1000, 2), round(at10[-1][3] * 1000, 2)],
        "metrics_write_kb_max": round(max(w[2] for w in writes) / 1024, 2),
        "db_growth_mb_per_1000": None if growth is None else round(growth, 2),
        "extrapolated_4000": {
            "overhead_s": round(4000 * (ends[-1] - ends[0]) / max(1, len(gaps)), 0),
            "largest_graph_nodes": max(largest, len(flow_module.windows(0, 4000, window))),
            "db_growth_mb": None if growth is None else round(growth * 4, 1),
            "log_lines": round(logs / iterations * 4000),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--window", type=int, default=100)
    parser.add_argument("--api-url", help="an existing server's API URL (no database growth figure then)")
    ns = parser.parse_args()
    configure_environment()
    if ns.api_url:
        print(json.dumps(measure(ns.api_url, None, ns.iterations, ns.window)))
        return
    home = Path(tempfile.mkdtemp(prefix="dmd2-prefect-home-"))
    with prefect_server(home) as (api, server_pid):
        os.environ["PREFECT_HOME"] = str(home)
        result = measure(api, home, ns.iterations, ns.window, server_pid)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
