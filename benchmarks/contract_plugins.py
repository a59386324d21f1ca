"""The plugins of contract v2 side by side on label-skewed digits: FedAvg, FedProx,
SCAFFOLD, FedBN, FedAvgM, FedAdam (10 clients, 2 classes each), and client-level
DP-FedAvg (with BatchNorm kept local by FedBN) at four noise levels next to the same
without DP, on 50 IID clients, 10 per round.

Every configuration is a shipped recipe (plus ``--set``-style changes), run in-process
with the same seeds, so the rows differ only in the plugins. Reports final global test
accuracy, final personalised accuracy, the first round reaching 80% / 90% personalised accuracy,
MB moved per round and wall seconds; DP rows add ε at δ = 1e-5. Rounds to a level are
counted on personalised accuracy (each client's own model on its local test set), the
one measure every row has: FedBN's global model has no trained normalisation layers.

    OMP_NUM_THREADS=1 python benchmarks/contract_plugins.py --seeds 0 \\
        --out benchmarks/results/contract_plugins.jsonl

``--table`` prints the markdown table of a results file.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedkit.config.schema import apply_overrides, load_raw, validate
from fedkit.config.shipped import shipped
from fedkit.core.engine import prepare, rounds

CONFIGS: dict[str, tuple[str, list[str]]] = {
    "FedAvg": ("fedavg-digits-skew", []),
    "FedProx μ=0.01": ("fedprox-digits", []),
    "FedProx μ=0.1": ("fedprox-digits", ["plugins.1.fedprox.mu=0.1"]),
    "SCAFFOLD": ("scaffold-digits", []),
    "FedBN": ("fedbn-digits", []),
    "FedAvgM β=0.5": (
        "fedavg-digits-skew",
        ["plugins=[fedavg, {fedopt: {optimizer: avgm, beta1: 0.5, lr: 1.0}}]"],
    ),
    "FedAdam η=0.01": ("fedadam-digits", []),
    "FedAvg + FedBN, 50 clients": ("dp-digits", ["plugins=[fedavg, fedbn]"]),
    "DP clip only (σ=0)": ("dp-digits", ["plugins.2.dp.noise_multiplier=0.0"]),
    "DP σ=0.03": ("dp-digits", []),
    "DP σ=0.3": ("dp-digits", ["plugins.2.dp.noise_multiplier=0.3"]),
    "DP σ=1": ("dp-digits", ["plugins.2.dp.noise_multiplier=1.0"]),
}


def first_round(rows: list[dict[str, Any]], level: float) -> int | None:
    """The first round whose personalised accuracy reaches ``level``."""
    return next((r["round"] for r in rows if r["personalized_accuracy"] >= level), None)


def run_config(name: str, seed: int) -> dict[str, Any]:
    recipe_name, changes = CONFIGS[name]
    raw = load_raw(shipped()[recipe_name])
    apply_overrides(raw, [*changes, f"seed={seed}", "device=cpu"])
    recipe = validate(raw)
    began = time.perf_counter()
    run = prepare(recipe)
    rows = list(rounds(run))
    last = rows[-1]
    result = {
        "config": name,
        "recipe": recipe_name,
        "changes": changes,
        "seed": seed,
        "test_accuracy": last["test_accuracy"],
        "personalized_accuracy": last["personalized_accuracy"],
        "round_80": first_round(rows, 0.8),
        "round_90": first_round(rows, 0.9),
        "mb_per_round": float(np.mean([r["bytes"]["total"] for r in rows])) / 2**20,
        "curve": [round(r["test_accuracy"], 4) for r in rows],
        "personal_curve": [round(r["personalized_accuracy"], 4) for r in rows],
        "seconds": round(time.perf_counter() - began, 1),
    }
    if "dp_epsilon" in last:
        result["dp_epsilon"] = last["dp_epsilon"]
    return result


def cell(rows: list[dict[str, Any]], key: str) -> str:
    """A percentage: the value, or mean ± half-range over seeds."""
    values = np.array([100.0 * r[key] for r in rows])
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{values.mean():.1f} ± {(values.max() - values.min()) / 2:.1f}"


def reached(rows: list[dict[str, Any]], key: str) -> str:
    return ", ".join("—" if r[key] is None else str(r[key]) for r in rows)


def table(path: Path) -> str:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    lines = [
        "| configuration | seeds | test acc. % | personalised % | rounds to 80% | rounds to 90% "
        "| MB/round | ε | s/run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in CONFIGS:
        mine = [r for r in rows if r["config"] == name]
        if not mine:
            continue

        eps = ", ".join(f"{r['dp_epsilon']:.3g}" for r in mine) if "dp_epsilon" in mine[0] else ""
        lines.append(
            f"| {name} | {len(mine)} | {cell(mine, 'test_accuracy')} | "
            f"{cell(mine, 'personalized_accuracy')} | {reached(mine, 'round_80')} | "
            f"{reached(mine, 'round_90')} | "
            f"{mine[0]['mb_per_round']:.1f} | {eps} | {np.mean([r['seconds'] for r in mine]):.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/contract_plugins.jsonl")
    )
    parser.add_argument("--table", action="store_true", help="print the table of --out and exit")
    args = parser.parse_args()
    if args.table:
        print(table(args.out))
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        for name in args.configs:
            result = run_config(name, seed)
            with args.out.open("a") as f:
                f.write(json.dumps(result) + "\n")
            print(json.dumps({k: v for k, v in result.items() if k != "curve"}), flush=True)
    print(table(args.out))


if __name__ == "__main__":
    main()
