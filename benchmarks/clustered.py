"""Clustered FL benchmark: CP-CFL (SimCLR, BYOL, SimSiam) vs IFCA vs IFCA (FedAvg) vs FedAvg
on the CP-CFL clustering set-up, CPU scale (the ``-small`` recipes).

    python benchmarks/clustered.py run --out runs/bench-clustered [--set KEY=VALUE ...]
    python benchmarks/clustered.py table runs/bench-clustered

``run`` executes the recipes one after another with ``fedkit run`` (FedAvg first: its
encoder warm-starts IFCA (FedAvg)); ``table`` prints Markdown tables of the final
personalized accuracy, F1, AUROC, ARI, bytes and wall time, and the ARI and accuracy by round.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from sklearn.metrics import adjusted_rand_score

METHODS = {
    "FedAvg": "fedavg-clusters-small",
    "IFCA (FedAvg)": "ifca-fedavg-small",
    "IFCA": "ifca-small",
    "CP-CFL (SimCLR)": "cpcfl-simclr-small",
    "CP-CFL (BYOL)": "cpcfl-byol-small",
    "CP-CFL (SimSiam)": "cpcfl-simsiam-small",
}


def run_all(out: Path, overrides: list[str]) -> None:
    """Run every method's recipe into ``out/<recipe>``, skipping finished ones."""
    out.mkdir(parents=True, exist_ok=True)
    fedkit = str(Path(sys.executable).with_name("fedkit"))
    for recipe in METHODS.values():
        target = out / recipe
        if (target / "summary.json").exists():
            continue
        cmd = [fedkit, "run", recipe, "--out", str(target)]
        if recipe.startswith("ifca-fedavg"):
            cmd += ["--set", f"plugins.0.ifca.encoder={out / 'fedavg-clusters-small'}"]
        for item in overrides:
            cmd += ["--set", item]
        began = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        (target / "wall.json").write_text(json.dumps({"seconds": time.perf_counter() - began}))


def _rows(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def formula_bytes(folder: Path, rounds: int) -> int | None:
    """CP-CFL's cost model for a finished run: T·K·(N+1)·S, or 2·T·K·S for one model
    (T rounds, K clients per round, N models of S bytes each)."""
    import yaml
    from safetensors.torch import load_file

    pointer = folder / "checkpoints" / "latest.json"
    if not pointer.exists():
        return None
    pool = load_file(
        folder / "checkpoints" / json.loads(pointer.read_text())["folder"] / "pool.safetensors"
    )
    n = len({k.split("/", 1)[0] for k in pool})
    size = sum(v.numel() * v.element_size() for k, v in pool.items() if k.startswith("0/"))
    fed = yaml.safe_load((folder / "recipe.yaml").read_text())["federation"]
    transfers = n + 1 if n > 1 else 2
    return rounds * fed["clients_per_round"] * transfers * size


def _partition(folder: Path) -> list[dict]:
    return json.loads((folder / "partition.json").read_text())


def _fmt(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def table(out: Path) -> str:
    """Markdown tables of the finished runs under ``out``."""
    lines = [
        "| method | pers. accuracy | F1 | AUROC | ARI | clusters | MB | = formula | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by_round: dict[str, list[dict]] = {}
    for name, recipe in METHODS.items():
        rows = _rows(out / recipe)
        if not rows:
            continue
        by_round[name] = rows
        last = rows[-1]
        wall = out / recipe / "wall.json"
        seconds = json.loads(wall.read_text())["seconds"] if wall.exists() else None
        total = sum(r["bytes"]["total"] for r in rows)
        expected = formula_bytes(out / recipe, len(rows))
        exact = "—" if expected is None else ("yes" if expected == total else f"no ({expected})")
        lines.append(
            f"| {name} | {_fmt(last.get('personalized_accuracy'))} "
            f"| {_fmt(last.get('personalized_f1'))} | {_fmt(last.get('personalized_auroc'))} "
            f"| {_fmt(last.get('ari'))} | {last.get('clusters_used', '—')} "
            f"| {total / 1e6:.1f} | {exact} | {_fmt(seconds, 0)} |"
        )
    if not by_round:
        return "no finished runs under " + str(out)
    for name, rows in by_round.items():
        groups = {p["client"]: p["group"] for p in _partition(out / METHODS[name])}
        for row in rows:
            found = [row["clusters"][str(c)] for c in row["clients"]]
            row["ari_round"] = adjusted_rand_score([groups[c] for c in row["clients"]], found)
    rounds = [r["round"] for r in next(iter(by_round.values()))]
    for metric, title in (
        ("ari", "ARI (every client's latest identity)"),
        ("ari_round", "ARI (the round's sampled clients)"),
        ("personalized_accuracy", "personalized accuracy"),
    ):
        lines += ["", f"{title} by round:", ""]
        lines.append("| method | " + " | ".join(str(r) for r in rounds) + " |")
        lines.append("|---|" + "---|" * len(rounds))
        for name, rows in by_round.items():
            cells = " | ".join(_fmt(r.get(metric), 2) for r in rows)
            lines.append(f"| {name} | {cells} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("--out", type=Path, default=Path("runs/bench-clustered"))
    run.add_argument("--set", action="append", default=[], dest="overrides")
    show = sub.add_parser("table")
    show.add_argument("out", type=Path)
    args = parser.parse_args()
    if args.command == "run":
        run_all(args.out, args.overrides)
    print(table(args.out))


if __name__ == "__main__":
    main()
