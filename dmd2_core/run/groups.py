"""Trainer groups on Ray: N ranks of the one Trainer class on one placement group, a bundle per
device, rank r of every colocated group on bundle r with a fractional share."""

from __future__ import annotations

import os
import signal
import uuid
from typing import Any, Optional, Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dmd2_core import parallel
from dmd2_core.args import Args
from dmd2_core.train.trainer import Trainer

RemoteTrainer = ray.remote(Trainer)

# glibc returns every large freed block to the OS and faults it in again on the next allocation:
# ~45k page faults and ~5% of a digits iteration on CPU. A CPU trainer's tensors live in host
# memory, so keep what it frees for reuse, as CUDA's caching allocator does on a GPU (read by glibc
# at process start; a threshold set this way is not capped as one set by mallopt is).
CPU_ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 40), "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def worker_env(args: Args) -> dict[str, str]:
    """Environment of a trainer rank's process."""
    return dict(CPU_ALLOCATOR_ENV) if args.device == "cpu" else {}


def init_ray(args: Args, num_groups: int = 1) -> None:
    """Join the cluster at ``ray_address`` or start a local Ray that has ``num_devices`` of the
    device resource. Prefect's SIGTERM handler survives (ray.init replaces it)."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    handler = signal.getsignal(signal.SIGTERM)
    if args.ray_address:
        ray.init(address=args.ray_address, namespace=args.run_name, log_to_driver=True)
    else:
        resources = {} if args.resource_name == "GPU" else {args.resource_name: float(args.num_devices * (1 if args.colocate else num_groups))}
        # "local": a new Ray of its own, even where RAY_ADDRESS or a `ray start` cluster on this
        # machine would otherwise be joined (ray.init's default)
        for attempt in (1, 2):
            try:
                ray.init(address="local", namespace=args.run_name, resources=resources, include_dashboard=False,
                         log_to_driver=True)
                break
            except Exception as exc:  # noqa: BLE001 - Ray gives its raylet a fixed 30 s to register
                if attempt == 2 or "timed out during startup" not in str(exc):
                    raise
                ray.shutdown()  # a loaded machine: stop what started and start once more
    if handler is not None:
        signal.signal(signal.SIGTERM, handler)


def create_placement_group(args: Args, num_groups: int, timeout_s: Optional[float] = None):
    """One bundle per device; without colocation every group gets bundles of its own."""
    bundle: dict[str, float] = {args.resource_name: 1.0}
    count = args.num_devices * (1 if args.colocate else num_groups)
    pg = placement_group([dict(bundle) for _ in range(count)], strategy="PACK")
    if not pg.wait(timeout_seconds=timeout_s or args.ray_timeout_s):
        remove_placement_group(pg)
        raise TimeoutError(
            f"placement group of {count} x {bundle} not ready: the cluster lacks '{args.resource_name}'"
        )
    return pg


def bundle_indices_by_node(pg, offset: int, count: int) -> list[int]:
    """The bundle of each rank among ``count`` bundles from ``offset``: ordered by (node, device),
    so that a shard group (consecutive ranks) stays inside one node whenever it can."""
    from ray.util import placement_group_table

    nodes = placement_group_table(pg)["bundles_to_node_id"]
    return [offset + i for i in parallel.bundles_in_node_order([nodes[offset + b] for b in range(count)])]


class TrainerGroup:
    """The ranks of one trainer; calls fan out to every rank and come back as per-rank lists."""

    def __init__(self, args: Args, role: str, pg, share: float, bundle_offset: int = 0):
        self.args, self.role = args, role
        self.timeout = args.ray_timeout_s
        n = args.num_devices
        self.instance = uuid.uuid4().hex[:8]
        self.bundle_indices = bundle_indices_by_node(pg, bundle_offset, n)
        resources = {"num_gpus": share} if args.resource_name == "GPU" else {"resources": {args.resource_name: share}}
        env = worker_env(args)
        self.ranks = [
            RemoteTrainer.options(
                # unique per group instance: a rebuilt group must not wait for its killed
                # predecessor's names to be released
                name=f"{args.run_name}-{role}-{rank}-{self.instance}",
                num_cpus=0,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=self.bundle_indices[rank]),
                **({"runtime_env": {"env_vars": env}} if env else {}),
                **resources,
            ).remote(args, role, rank, n)
            for rank in range(n)
        ]

    def connect(self) -> "TrainerGroup":
        """Wait for the ranks to join one torch.distributed group and read their shards."""
        self.get(self.begin_connect())
        return self

    def begin_connect(self) -> list:
        """Start joining the ranks in one torch.distributed group (each then reads its shards);
        returns the calls to wait on, so that several groups read their models at the same time."""
        addr, port = self.get(self.ranks[0].address.remote())
        return [r.init_process_group.remote(addr, port) for r in self.ranks]

    def get(self, refs):
        return ray.get(refs, timeout=self.timeout)

    def call(self, method: str, *args, **kwargs) -> list[Any]:
        return self.get(self.call_async(method, *args, **kwargs))

    def call_async(self, method: str, *args, **kwargs) -> list:
        return [getattr(r, method).remote(*args, **kwargs) for r in self.ranks]

    def call_per_rank(self, method: str, per_rank: Sequence[tuple], num_returns: int = 1) -> list:
        """Rank r gets the r-th argument tuple; ObjectRefs among them resolve on that rank."""
        if len(per_rank) != len(self.ranks):
            raise ValueError(f"{self.role}: {len(per_rank)} payloads for {len(self.ranks)} ranks")
        return [getattr(r, method).options(num_returns=num_returns).remote(*a) for r, a in zip(self.ranks, per_rank)]

    def train_async(self, iteration: int, pairs: Sequence, external_data: Sequence | Any = None) -> list:
        """Start ``train`` on every rank: ``pairs`` one payload (or ObjectRef) per rank,
        ``external_data`` one per rank or one shared by all. Returns [(outputs_ref, metrics_ref)]."""
        if not isinstance(external_data, (list, tuple)):
            external_data = [external_data] * len(self.ranks)
        if len(external_data) != len(self.ranks):
            raise ValueError(f"{self.role}: {len(external_data)} external-data payloads for {len(self.ranks)} ranks")
        return self.call_per_rank("train", [(iteration, p, e) for p, e in zip(pairs, external_data)], num_returns=2)

    def kill(self) -> None:
        for r in self.ranks:
            try:
                ray.kill(r, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead is fine
                pass
        self.ranks = []


def shutdown_placement_group(pg) -> None:
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001
            pass
