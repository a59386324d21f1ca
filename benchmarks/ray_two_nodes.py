"""A Ray run across two nodes, against the sequential executor.

    python benchmarks/ray_two_nodes.py [--rounds 3]

Starts a Ray cluster of two raylets on this machine (``ray.cluster_utils.Cluster``: a
head node and a second node, one CPU each, as ``ray start --head`` and ``ray start
--address`` would on two machines), joins it with ``engine.address``, and runs a small
FedAvg + FedBN recipe (10 clients, 4 per round, the disk store) with two worker actors,
one on each node. The client store is an actor on the driver's node (the head), so the
second node never touches the run directory: no shared file system is assumed. Prints
where each worker actor ran and whether metrics, ledger and the final pool equal a
sequential run's.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from fedkit.config.schema import validate
from fedkit.core import runs
from fedkit.rundir import checkpoint, logs
from fedkit.testing import tiny_recipe


def main() -> None:
    import ray
    from ray.cluster_utils import Cluster

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    raw = tiny_recipe(
        plugins=["fedavg", "fedbn"],
        data={"num_clients": 10, "max_train": 400},
        federation={"rounds": args.rounds, "clients_per_round": 4},
    )
    tmp = Path(tempfile.mkdtemp(prefix="fedkit-ray-two-"))
    began = time.perf_counter()
    runs.execute(runs.start(validate(raw), tmp / "seq"), tmp / "seq")
    seq_seconds = time.perf_counter() - began
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        print(f"cluster: {len(nodes)} nodes, {ray.cluster_resources().get('CPU')} CPUs")
        raw["engine"] = {
            "executor": "ray",
            "workers": 2,
            "store": "disk",
            "address": cluster.address,
        }
        run = runs.start(validate(raw), tmp / "ray")
        actors = run.executor.actors
        where = ray.get([a.node.remote() for a in actors])
        print("worker actors on nodes:", sorted(where), "- distinct:", len(set(where)))
        began = time.perf_counter()
        runs.execute(run, tmp / "ray")
        ray_seconds = time.perf_counter() - began
    finally:
        ray.shutdown()
        cluster.shutdown()
    same = {
        "metrics": logs.read_metrics(tmp / "ray") == logs.read_metrics(tmp / "seq"),
        "ledger": logs.read_ledger(tmp / "ray") == logs.read_ledger(tmp / "seq"),
        "clients": logs.read_clients(tmp / "ray") == logs.read_clients(tmp / "seq"),
    }
    a, b = (checkpoint.read(tmp / o).pool for o in ("seq", "ray"))
    same["pool"] = a.keys() == b.keys() and all(
        torch.equal(a[k][t], b[k][t]) for k in a for t in a[k]
    )
    print("identical to sequential:", same)
    print(
        f"seconds: sequential {seq_seconds:.1f}, "
        f"two-node Ray {ray_seconds:.1f} (rounds, after start)"
    )


if __name__ == "__main__":
    main()
