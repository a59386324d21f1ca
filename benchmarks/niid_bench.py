"""NIID-Bench's Fashion-MNIST table (Li et al., ICDE 2022), measured with fedkit.

    python benchmarks/niid_bench.py --root data/fmnist [--seeds 42] [--parallel 2]

Runs ``niid-fmnist-<method>`` (FedAvg, SCAFFOLD, FedProx μ 0.01, FedNova: 10 clients, all
of them every round, 50 rounds of 10 local epochs, batch 64, SGD lr 0.01 with momentum
0.9, the paper's CNN) on five partitions: ``iid``, ``dirichlet-0.5`` (NIID-Bench's capped
Dirichlet, at least 10 images a client) and ``labels-1``, ``labels-2``, ``labels-3``
(#C = k labels per client). Each cell is one ``fedkit run`` in ``--out``; a killed cell
resumes from its checkpoint the next time. A finished cell appends
``{"method", "partition", "seed", "accuracy"}`` (final global test accuracy, %) to
``benchmarks/results/niid_bench_fmnist.jsonl``; cells already there are skipped. A cell
rerun on a newer set-up (``--redo-outdated``) replaces its older rows there, which move to
``niid_bench_fmnist_superseded.jsonl``, so the results file holds one row a cell. At the
end (and with ``--table`` alone) it prints the measured table beside Flower's baseline
(adap/flower, baselines/niid_bench, seed 42) and the paper's Table III.

A cell takes about 30 minutes on 2 cores of this machine (36 s a round); with
``--parallel 2`` two cells run at once. Every cell runs at its recipe's thread count
(``engine.num_cpus``, which fedkit already gives each client's work; the server's
evaluation and aggregation get the same), whatever ``--parallel`` is, and its row records
it (``threads``), so a row is reproduced at any ``--parallel``.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from fedkit.rundir import atomic

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "niid_bench_fmnist.jsonl"
METHODS = ("fedavg", "scaffold", "fedprox", "fednova")
NAMES = {"fedavg": "FedAvg", "scaffold": "SCAFFOLD", "fedprox": "FedProx", "fednova": "FedNova"}
PARTITIONS = {
    "iid": ["data.partition={name: iid}"],
    "dirichlet-0.5": [
        "data.partition={name: dirichlet, alpha: 0.5, min_size: 10, cap: true, draw_seed: SEED}"
    ],
    "labels-1": ["data.partition={name: labels_per_client, k: 1, draw_seed: SEED}"],
    "labels-2": ["data.partition={name: labels_per_client, k: 2, draw_seed: SEED}"],
    "labels-3": ["data.partition={name: labels_per_client, k: 3, draw_seed: SEED}"],
}
"""A partition's ``--set`` values; ``SEED`` stands for the cell's seed. The Dirichlet and
label skews draw as Flower's baseline does for that seed (``draw_seed``), so a seed-42
cell holds the partition of Flower's seed-42 table."""
FLOWER = {  # adap/flower baselines/niid_bench/README.md, Fashion-MNIST, seed 42
    "iid": (89.0, 89.5, 89.5, 89.3),
    "dirichlet-0.5": (88.4, 88.4, 88.6, 88.1),
    "labels-1": (10.0, 10.0, 38.0, 11.1),
    "labels-2": (81.0, 10.0, 78.8, 70.5),
    "labels-3": (83.2, 84.2, 82.5, 83.2),
}
FLOWER_ORDER = ("fedavg", "scaffold", "fedprox", "fednova")
# NIID-Bench, Table III, FMNIST rows (mean over 3 runs), FedAvg/FedProx/SCAFFOLD/FedNova;
# not yet checked against the paper itself (see PAPER_NOTE); FLOWER was checked
PAPER = {
    "iid": (89.3, 89.1, 89.8, 89.3),
    "dirichlet-0.5": (86.1, 86.6, 86.8, 86.4),
    "labels-1": (11.2, 28.9, 12.8, 14.8),
    "labels-2": (77.3, 74.9, 42.8, 78.9),
    "labels-3": (80.7, 82.5, 77.7, 80.4),
}
PAPER_ORDER = ("fedavg", "fedprox", "scaffold", "fednova")
DIVERGED_NOTE = (
    "‡ diverged: every client's training loss became non-finite and the run stopped; "
    "the figure is the last global test accuracy measured before that round"
)
OWN_DRAWS = ("dirichlet-0.5", "labels-2", "labels-3")
"""Partitions drawn with ``draw_seed``, whose rows from before it existed hold a partition
of fedkit's own draw (with one label, client i holds class i whichever generator draws)."""
OWN_DRAWS_NOTE = (
    "§ run before `draw_seed` existed: the partition was drawn from fedkit's own "
    "generator, not as Flower's baseline draws it for the seed"
)
STANDARDIZED_NOTE = (
    "¶ inputs standardised with the train split's mean and std (fedkit's only behaviour "
    "before `data.standardize`), not NIID-Bench's 0..1 inputs"
)
PAPER_NOTE = (
    "† the paper's Table III as entered here, not yet checked against the paper "
    "(it could not be opened offline); Flower's column matches its README"
)


def read_rows(path: Path) -> list[dict]:
    """The rows of the results file (a line cut short by a kill is skipped)."""
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold ``path``'s sidecar lock, so that an append and a rewrite of the results file
    (two scripts may share it) never interleave."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _append(path: Path, rows: list[dict]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, "".join(json.dumps(row) + "\n" for row in rows).encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def append_row(path: Path, row: dict) -> None:
    """One whole line, written and flushed to disk in one call."""
    with locked(path):
        _append(path, [row])


def superseded_path(path: Path) -> Path:
    """Where rows that a newer set-up's rerun replaced are kept."""
    return path.with_name(f"{path.stem}_superseded{path.suffix}")


def supersede(path: Path) -> list[dict]:
    """Move each cell's rows of an older set-up out of the results file, once the cell has a
    row of a newer one, and return them. They are appended to :func:`superseded_path`
    before the results file is replaced (atomically), so a kill in between repeats a row
    there and loses none."""
    with locked(path):
        rows = read_rows(path)
        keep = newest(rows, lambda r: (r["method"], r["partition"], r["seed"]))
        moved = [r for r in rows if r not in keep]
        if moved:
            _append(superseded_path(path), moved)
            atomic.write_chunks(path, (json.dumps(row) + "\n" for row in keep))
        return moved


def cell_out(method: str, partition: str, seed: int, args: argparse.Namespace) -> Path:
    """A cell's run directory: the first of ``…``, ``…-unit`` and ``…-draw`` that is new or
    holds a run of today's set-up. A cell first run on standardised inputs (before the
    recipes set ``data.standardize: false``), or on fedkit's own draw of a partition that
    now sets ``draw_seed``, is rerun beside that run, so the old run stays as measured and
    a rerun never resumes it."""
    wanted = {"standardize": False}
    if any("draw_seed" in s for s in PARTITIONS[partition]):
        wanted["draw_seed"] = seed
    base = args.out / f"{method}-{partition}-s{seed}"
    for out in (base, base.with_name(base.name + "-unit"), base.with_name(base.name + "-draw")):
        if not (out / "recipe.yaml").exists() or provenance(out) == wanted:
            return out
    raise SystemExit(f"{base}: every run directory holds an older set-up; move one away")


def recipe_threads(method: str) -> int:
    """torch's threads for a cell of ``method``: its recipe's ``engine.num_cpus``."""
    from fedkit.config.schema import load_recipe
    from fedkit.config.shipped import resolve

    return max(1, int(load_recipe(resolve(f"niid-fmnist-{method}")).engine.num_cpus))


def cell_command(method: str, partition: str, seed: int, args: argparse.Namespace) -> list[str]:
    fedkit = str(Path(sys.executable).with_name("fedkit"))
    out = cell_out(method, partition, seed, args)
    if (out / "recipe.yaml").exists():
        return [fedkit, "run", "--resume", str(out), "--quiet", "--no-report"]
    partition_sets = [p.replace("SEED", str(seed)) for p in PARTITIONS[partition]]
    sets = [f"data.root={args.root}", f"seed={seed}", *partition_sets]
    if args.rounds:
        sets.append(f"federation.rounds={args.rounds}")
    cmd = [fedkit, "run", f"niid-fmnist-{method}", "--out", str(out), "--quiet", "--no-report"]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def final_accuracy(out: Path) -> tuple[float, float]:
    """The last round's global test accuracy (%) and the run's wall time."""
    summary = json.loads((out / "summary.json").read_text())
    return round(100 * summary["final"]["test_accuracy"], 2), summary.get("seconds", 0.0)


def diverged(out: Path) -> dict | None:
    """How a run that stopped because every client's training became non-finite ended:
    the round it diverged in, and the last global test accuracy measured before it
    (what NIID-Bench and Flower report for such a run is a model at chance). ``None``
    for any other stop, which a rerun resumes."""
    try:
        stop = json.loads((out / "stops.jsonl").read_text().splitlines()[-1])
    except (OSError, IndexError, ValueError):
        return None
    failures = stop.get("failures") or []
    if not failures or any(f.get("kind") != "non-finite" for f in failures):
        return None
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in rows if "test_accuracy" in r]
    if not scored:
        return None
    last = scored[-1]
    return {
        "accuracy": round(100 * last["test_accuracy"], 2),
        "diverged": stop["round"],
        "accuracy_round": last["round"],
    }


def run_cells(
    cells: list[tuple[str, str, int]],
    args: argparse.Namespace,
    command: Callable[..., list[str]],
    row_of: Callable[[tuple[str, str, int]], dict],
    stopped: Callable[[tuple[str, str, int]], dict | None] = lambda cell: None,
    appended: Callable[[], object] = lambda: None,
    threads: Callable[[tuple[str, str, int]], int] | None = None,
) -> None:
    """Run the cells, ``args.parallel`` at a time, each at ``threads(cell)`` threads (by
    default the machine's split between the cells that run at once), appending
    ``row_of(cell)`` for each finished one, and ``stopped(cell)`` for one that stopped for
    good (it diverged), then calling ``appended()``; any other failed cell is left to
    resume."""
    split = max(1, (os.cpu_count() or 2) // args.parallel)
    pending, running = list(cells), {}
    while pending or running:
        while pending and len(running) < args.parallel:
            cell = pending.pop(0)
            count = str(threads(cell) if threads is not None else split)
            env = {**os.environ, "OMP_NUM_THREADS": count, "MKL_NUM_THREADS": count}
            print(f"start {cell} at {count} threads", flush=True)
            running[cell] = subprocess.Popen(command(*cell, args), env=env)
        time.sleep(2)
        for cell, process in list(running.items()):
            if process.poll() is None:
                continue
            del running[cell]
            row = row_of(cell) if process.returncode == 0 else stopped(cell)
            if row is None:
                print(f"{cell}: fedkit run exited {process.returncode}; rerun to resume it")
                continue
            append_row(args.results, row)
            appended()
            print(f"done {cell}: {row}", flush=True)


def provenance(out: Path) -> dict:
    """What of a row's set-up changed while the table was measured, read from the run's own
    recipe: ``standardize`` (inputs standardised, or on NIID-Bench's 0..1 scale), and
    ``draw_seed`` when the label sets were drawn as Flower's baseline draws them."""
    data = yaml.safe_load((out / "recipe.yaml").read_text()).get("data") or {}
    found = {"standardize": bool(data.get("standardize", True))}
    seed = (data.get("partition") or {}).get("draw_seed")
    return found if seed is None else {**found, "draw_seed": seed}


def outdated(row: dict) -> bool:
    """A row measured on an older set-up: standardised inputs, or fedkit's own draw of a
    partition that Flower's code now draws."""
    return standardized(row) or (row["partition"] in OWN_DRAWS and "draw_seed" not in row)


def setup_rank(row: dict) -> tuple[bool, bool]:
    """How old a row's set-up is, lower being newer: NIID-Bench's 0..1 inputs first, then
    Flower's draw of the partition (the order the table prefers rows in)."""
    return standardized(row), outdated(row)


def newest(rows: list[dict], group: Callable[[dict], tuple]) -> list[dict]:
    """The rows of the newest set-up (lowest :func:`setup_rank`) within each group."""
    keyed = [(group(row), setup_rank(row), row) for row in rows]
    best: dict[tuple, tuple[bool, bool]] = {}
    for key, rank, _ in keyed:
        best[key] = min(best.get(key, rank), rank)
    return [row for key, rank, row in keyed if rank == best[key]]


def standardized(row: dict) -> bool:
    """A row whose run standardised its inputs (rows from before ``standardize`` was
    recorded all did: it was fedkit's only behaviour then)."""
    return row.get("standardize", True)


def niid_row(cell: tuple[str, str, int], args: argparse.Namespace) -> dict:
    method, partition, seed = cell
    out = cell_out(*cell, args)
    accuracy, seconds = final_accuracy(out)
    row = {"method": method, "partition": partition, "seed": seed, "accuracy": accuracy}
    row |= {**provenance(out), "rounds": args.rounds or 50, "threads": recipe_threads(method)}
    return {**row, "seconds": seconds}


def diverged_row(cell: tuple[str, str, int], args: argparse.Namespace) -> dict | None:
    """The row of a cell that diverged (``diverged``), or ``None``."""
    method, partition, seed = cell
    out = cell_out(*cell, args)
    found = diverged(out)
    if found is None:
        return None
    row = {"method": method, "partition": partition, "seed": seed, **found, **provenance(out)}
    return {**row, "rounds": args.rounds or 50, "threads": recipe_threads(method)}


def table(rows: list[dict]) -> str:
    """Measured mean (± std over seeds, n) beside Flower's and the paper's numbers."""
    lines = [
        "| partition | method | fedkit | n | Flower | paper† | fedkit − Flower |",
        "|---|---|---|---|---|---|---|",
    ]
    for partition in PARTITIONS:
        for method in METHODS:
            cell = [r for r in rows if (r["method"], r["partition"]) == (method, partition)]
            cell = newest(cell, lambda r: ())  # 0..1 inputs, then Flower's draw, where measured
            found = [r["accuracy"] for r in cell]
            mark = "‡" if any("diverged" in r for r in cell) else ""
            if partition in OWN_DRAWS and any("draw_seed" not in r for r in cell):
                mark += "§"
            if any(standardized(r) for r in cell):
                mark += "¶"
            flower = FLOWER[partition][FLOWER_ORDER.index(method)]
            paper = PAPER[partition][PAPER_ORDER.index(method)]
            if found:
                mean = statistics.fmean(found)
                spread = f" ± {statistics.stdev(found):.1f}" if len(found) > 1 else ""
                ours, gap = f"{mean:.1f}{spread}{mark}", f"{mean - flower:+.1f}"
            else:
                ours, gap = "–", ""
            lines.append(
                f"| {partition} | {NAMES[method]} | {ours} | {len(found)} | {flower:.1f} "
                f"| {paper:.1f} | {gap} |"
            )
    notes = [PAPER_NOTE, DIVERGED_NOTE, OWN_DRAWS_NOTE, STANDARDIZED_NOTE]
    return "\n".join([*lines, "", *notes])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("data/fmnist"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[42])
    parser.add_argument("--extra-seeds", type=int, nargs="*", default=[],
                        help="more seeds, for the dirichlet-0.5 row only")  # fmt: skip
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--partitions", nargs="+", default=list(PARTITIONS), choices=PARTITIONS)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=None, help="a shorter trial (own file)")
    parser.add_argument("--out", type=Path, default=Path("runs/niid-bench"))
    parser.add_argument("--results", type=Path, default=None)
    parser.add_argument("--table", action="store_true", help="only print the table")
    parser.add_argument("--redo-outdated", action="store_true",
                        help="rerun cells measured only on an older set-up (standardised "
                        "inputs, or fedkit's own draw of a partition)")  # fmt: skip
    args = parser.parse_args()
    if args.results is None:
        suffix = f"-r{args.rounds}" if args.rounds else ""
        args.results = RESULTS.with_name(f"niid_bench_fmnist{suffix}.jsonl")
    if args.rounds:
        args.out = args.out.with_name(f"{args.out.name}-r{args.rounds}")
    if not args.table:
        supersede(args.results)
        rows = read_rows(args.results)
        if args.redo_outdated:
            rows = [r for r in rows if not outdated(r)]
        done = {(r["method"], r["partition"], r["seed"]) for r in rows}
        cells = [(m, p, s) for s in args.seeds for p in args.partitions for m in args.methods]
        cells += [(m, "dirichlet-0.5", s) for s in args.extra_seeds for m in args.methods]
        todo = [c for c in dict.fromkeys(cells) if c not in done]
        print(f"{len(todo)} cells to run ({len(cells) - len(todo)} already in {args.results})")
        run_cells(
            todo,
            args,
            cell_command,
            lambda cell: niid_row(cell, args),
            lambda cell: diverged_row(cell, args),
            lambda: supersede(args.results),
            lambda cell: recipe_threads(cell[0]),
        )
    print(table(read_rows(args.results)))


if __name__ == "__main__":
    main()
