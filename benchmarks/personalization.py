"""Personalised FL on Fashion-MNIST: FedAvg's global model, FedAvg with local
fine-tuning, FedBN, Ditto, FedRep, FedBABU and IFCA, side by side.

    python benchmarks/personalization.py --root data/fmnist [--seeds 0 1 2] [--parallel 2]

Every method runs the ``pfl-fmnist`` recipe (12,000 images, 10 clients, 20 rounds of 2
local epochs, the NIID-Bench CNN with BatchNorm) with its plugins swapped in, on
Dirichlet(0.5) and on 2 labels per client. The score is personalised accuracy: each
client's model (the global one for FedAvg, its fine-tuned copy, its own BN layers, v_k,
its head, its cluster's model) on the client's own 200 test images (drawn with its class
mix), averaged over the 10 clients, after the last round. Finished cells append
``{"method", "partition", "seed", "personalized_accuracy", "test_accuracy", "seconds"}``
to ``benchmarks/results/personalization_fmnist.jsonl`` and are skipped next time; a
killed cell resumes. The table gives mean ± std over seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from niid_bench import read_rows, run_cells

RESULTS = Path(__file__).resolve().parent / "results" / "personalization_fmnist.jsonl"
METHODS = {
    "fedavg": "[fedavg]",
    "fedavg-ft": "[fedavg, {finetune: {epochs: 5}}]",
    "fedbn": "[fedavg, fedbn]",
    "ditto": "[fedavg, {ditto: {lam: 0.1}}]",
    "fedrep": "[{fedrep: {head_epochs: 10}}]",
    "fedbabu": "[{fedbabu: {finetune_epochs: 5}}]",
    "ifca": "[{ifca: {num_clusters: 3}}]",
}
PARTITIONS = {
    "dirichlet-0.5": "{name: dirichlet, alpha: 0.5, min_size: 10, cap: true}",
    "labels-2": "{name: labels_per_client, k: 2}",
}


def command(method: str, partition: str, seed: int, args: argparse.Namespace) -> list[str]:
    fedkit = str(Path(sys.executable).with_name("fedkit"))
    out = args.out / f"{method}-{partition}-s{seed}"
    if (out / "recipe.yaml").exists():
        return [fedkit, "run", "--resume", str(out), "--quiet", "--no-report"]
    sets = [
        f"data.root={args.root}",
        f"seed={seed}",
        f"plugins={METHODS[method]}",
        f"data.partition={PARTITIONS[partition]}",
    ]
    cmd = [fedkit, "run", "pfl-fmnist", "--out", str(out), "--quiet", "--no-report"]
    return cmd + [x for s in sets for x in ("--set", s)]


def finished(out: Path) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    final = summary["final"]
    return {
        "personalized_accuracy": round(100 * final["personalized_accuracy"], 2),
        "test_accuracy": round(100 * final["test_accuracy"], 2)
        if "test_accuracy" in final
        else None,
        "seconds": summary.get("seconds", 0.0),
    }


def personal_row(cell: tuple[str, str, int], args: argparse.Namespace) -> dict:
    method, partition, seed = cell
    row = {"method": method, "partition": partition, "seed": seed}
    return {**row, **finished(args.out / f"{method}-{partition}-s{seed}")}


def table(rows: list[dict]) -> str:
    lines = ["| method | " + " | ".join(PARTITIONS) + " | s / run |", "|---|---|---|---|"]
    for method in METHODS:
        cells, seconds = [], []
        for partition in PARTITIONS:
            found = [r for r in rows if (r["method"], r["partition"]) == (method, partition)]
            values = [r["personalized_accuracy"] for r in found]
            seconds += [r["seconds"] for r in found]
            if not values:
                cells.append("–")
                continue
            spread = f" ± {statistics.stdev(values):.1f}" if len(values) > 1 else ""
            cells.append(f"{statistics.fmean(values):.1f}{spread} (n={len(values)})")
        cost = f"{statistics.fmean(seconds):.0f}" if seconds else "–"
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {cost} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("data/fmnist"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--partitions", nargs="+", default=list(PARTITIONS), choices=PARTITIONS)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/personalization"))
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--table", action="store_true", help="only print the table")
    args = parser.parse_args()
    if not args.table:
        done = {(r["method"], r["partition"], r["seed"]) for r in read_rows(args.results)}
        cells = [(m, p, s) for s in args.seeds for p in args.partitions for m in args.methods]
        todo = [c for c in cells if c not in done]
        print(f"{len(todo)} cells to run ({len(cells) - len(todo)} already in {args.results})")
        run_cells(todo, args, command, lambda cell: personal_row(cell, args))
    print(table(read_rows(args.results)))


if __name__ == "__main__":
    main()
