"""The quickstart under every runtime, side by side: sequential, Ray, Flower's simulation
and a Flower deployment on this machine (a SuperLink and one ``fedkit deploy node`` per
client, all on 127.0.0.1).

    python benchmarks/runtimes.py --rounds 4
    python benchmarks/runtimes.py --rounds 4 --clients 2 --no-database

``--clients N`` runs the quickstart with N clients, all of them every round, and N
deployment nodes (default 10, the recipe's own); ``--no-database`` leaves out the
deployment whose SuperLink keeps its state in SQLite.

Each run is a fresh process (``fedkit run ... --executor X`` or ``fedkit deploy run``);
this script watches the run's metrics.jsonl, which gains one line as each round ends
(checkpoint_every 1), and reports the time from launch to the end of round 1 (start-up
plus round 1) and the mean time of rounds 2..R. Every run uses one torch thread per client
(Ray and Flower: 2 actors of 1 CPU; the deployment: one node process per client, all
sharing this machine's cores). It prints a table and checks that every runtime wrote the
same metrics as the sequential one, and prints the ledger's bytes beside the bytes the
Flower runs put on the wire.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def watch(proc: subprocess.Popen, out: Path, rounds: int, began: float) -> list[float]:
    """Seconds from launch at which each round's row appeared."""
    ends: list[float] = []
    metrics = out / "metrics.jsonl"
    while len(ends) < rounds:
        lines = metrics.read_text().count("\n") if metrics.is_file() else 0
        while len(ends) < lines:
            ends.append(time.monotonic() - began)
        if proc.poll() is not None and len(ends) < rounds:
            lines = metrics.read_text().count("\n") if metrics.is_file() else 0
            if lines < rounds:
                raise RuntimeError(f"{out}: the run ended after {lines} rounds")
        time.sleep(0.05)
    proc.wait()
    return ends


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--only", default=None, help="run one runtime (debugging)")
    parser.add_argument("--clients", type=int, default=10, help="clients, and deployment nodes")
    parser.add_argument("--no-database", action="store_true", help="skip the SQLite deployment")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fedkit-runtimes-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLWR_TELEMETRY_ENABLED": "0"}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    sets = ["--set", f"federation.rounds={args.rounds}", *clients_sets(args.clients)]
    results = {}
    for name, extra in [
        ("sequential", []),
        ("ray", ["--executor", "ray", "--workers", "2"]),
        ("flower simulation", ["--executor", "flower", "--workers", "2"]),
    ]:
        if args.only and args.only != name:
            continue
        out = tmp / name.replace(" ", "-")
        began = time.monotonic()
        proc = subprocess.Popen(
            [str(BIN / "fedkit"), "run", "quickstart", "--out", str(out), "-q", *sets, *extra],
            env=env,
            stdout=subprocess.DEVNULL,
        )
        results[name] = (out, watch(proc, out, args.rounds, began))
        print(name, [round(t, 1) for t in results[name][1]], flush=True)
    for name, database in (
        ("flower deployment", False),
        ("flower deployment, SuperLink database", True),
    ):
        if (args.only and args.only != name) or (database and args.no_database):
            continue
        folder = tmp / name.replace(" ", "-").replace(",", "")
        results[name] = deployment(folder, args.rounds, args.clients, sets, env, database)
    if args.only:
        return
    base = results["sequential"]
    same = {n: read(o) == read(base[0]) for n, (o, _) in results.items()}
    sim = results["flower simulation"][1]
    sim_round = (sim[-1] - sim[0]) / (len(sim) - 1)
    print()
    head = "| runtime | launch → end of round 1 (s) | rounds 2..R, mean (s) | vs sequential |"
    print(head + " same metrics as sequential |")
    print("|---|---|---|---|---|")
    seq_round = (base[1][-1] - base[1][0]) / (len(base[1]) - 1)
    for name, (_, ends) in results.items():
        per = (ends[-1] - ends[0]) / (len(ends) - 1)
        print(f"| {name} | {ends[0]:.1f} | {per:.2f} | {per / seq_round:.2f}× | {same[name]} |")
    dep = results["flower deployment"][1]
    ratio = ((dep[-1] - dep[0]) / (len(dep) - 1)) / sim_round
    print(f"\ndeployment round / simulation round (rounds 2..R): {ratio:.2f}")
    for name in ("flower simulation", "flower deployment"):
        summary = json.loads((results[name][0] / "summary.json").read_text())
        ledger, wire = summary["bytes"], summary.get("wire_bytes", {})
        down = sum(ledger[f"down_{c}"] for c in ("model", "aux", "data"))
        up = sum(ledger[f"up_{c}"] for c in ("model", "aux", "data"))
        evaluation = sum(ledger.get(f"eval_{c}", 0) for c in ("model", "aux", "data"))
        print(
            f"{name}: ledger down {down:,} B, eval {evaluation:,} B, up {up:,} B; "
            f"on the wire down {wire.get('down', 0):,} B, up {wire.get('up', 0):,} B"
        )


def clients_sets(clients: int) -> list[str]:
    """``--set`` arguments giving the quickstart ``clients`` clients, all of them every
    round."""
    return [
        "--set",
        f"data.num_clients={clients}",
        "--set",
        f"federation.clients_per_round={clients}",
    ]


def deployment(
    tmp: Path, rounds: int, clients: int, sets: list[str], env: dict, database: bool
) -> tuple[Path, list[float]]:
    """A SuperLink and one ``fedkit deploy node`` process per client on 127.0.0.1, then
    ``fedkit deploy run`` with ``sets``; every process is stopped after. ``database``: the
    SuperLink keeps its state in an SQLite file (``--database``) instead of in memory."""
    tmp.mkdir(parents=True)
    port = free_port()
    procs = []
    began_federation = time.monotonic()
    superlink = [
        str(BIN / "flower-superlink"),
        "--insecure",
        "--isolation",
        "subprocess",
        "--disable-runtime-dependency-installation",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    if database:  # Flower's state in SQLite; without it, in memory
        superlink += ["--database", str(tmp / "superlink.db")]
    procs.append(
        subprocess.Popen(
            superlink,
            env={**env, "FEDKIT_SERVER_ROOT": str(tmp)},  # where the ServerApp writes runs
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    )
    for k in range(clients):
        node = [
            str(BIN / "fedkit"),
            "deploy",
            "node",
            "--superlink",
            f"127.0.0.1:{port}",
            "--partition",
            str(k),
            "--dir",
            str(tmp / f"node{k}"),
            "--insecure",
        ]
        procs.append(
            subprocess.Popen(
                node,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )
    try:
        deadline = time.monotonic() + 120
        while True:  # the SuperLink's port (ten node processes loading torch slow it down)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        out = tmp / "flower-deployment"
        began = time.monotonic()
        run = [
            str(BIN / "fedkit"),
            "deploy",
            "run",
            "quickstart",
            "--superlink",
            f"127.0.0.1:{port}",
            "--out",
            out.name,  # under the SuperLink's FEDKIT_SERVER_ROOT
            "--insecure",
            *sets,
        ]
        log = (tmp / "deploy-run.log").open("w")
        proc = subprocess.Popen(run, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            ends = watch(proc, out, rounds, began)
        except RuntimeError:
            print((tmp / "deploy-run.log").read_text()[-3000:])
            raise
        print(
            tmp.name,
            [round(t, 1) for t in ends],
            f"(SuperLink and nodes started {began - began_federation:.1f} s before)",
            flush=True,
        )
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            p.wait(timeout=30)
    return out, ends


def read(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


if __name__ == "__main__":
    main()
