"""Byzantine robustness on Fashion-MNIST: the table attack × defence, measured with fedkit.

    python benchmarks/robustness.py --root data/fmnist [--quick] [--parallel 2]

Each cell is one ``fedkit run`` of ``niid-fmnist-fedavg`` (NIID-Bench's set-up: 10
clients, all of them every round, the paper's CNN, SGD lr 0.01 with momentum 0.9, batch
64) with an attack on 20% of the clients (2 of 10, drawn from the cell's seed) and a
defence, on an IID or a Dirichlet(0.5) partition (NIID-Bench's capped draw, as
``benchmarks/niid_bench.py`` draws it). ``none`` is the row without an attack and the
column without a defence. A finished cell appends ``{"attack", "defence", "partition",
"seed", "accuracy", "backdoor_success", "detection_precision", "detection_recall", ...}``
(final global test accuracy and backdoor success in %, detection averaged over the rounds
that scored it) to ``benchmarks/results/robustness_fmnist.jsonl``; cells already there are
skipped and a killed cell resumes from its run directory in ``--out``. ``--quick`` runs
12 cells (or the ``--attacks``/``--defences``/``--partitions`` given) for 5 rounds of 2
local epochs on a sixth of the images, into a results file of its own.
``--paper NAME`` runs only the cells of a published claim (``PAPERS``), shortened to fit a
CPU, into a results file and run directory of its own, and prints whether our numbers agree
with the claim's direction and rough size.
At the end (and with ``--table`` alone) it prints the table as Markdown.

The published point (``PUBLISHED``) is the no-attack, no-defence cell: FedAvg on NIID-Bench's
Fashion-MNIST set-up after the full 50 rounds of 10 local epochs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from niid_bench import PARTITIONS as NIID_PARTITIONS
from niid_bench import diverged, final_accuracy, read_rows, run_cells

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "robustness_fmnist.jsonl"
RECIPE = "niid-fmnist-fedavg"
FRACTION = 0.2
NUM_CLIENTS = 10

ATTACKS: dict[str, dict | None] = {
    "none": None,
    "label_flip": {},
    "sign_flip": {},
    "gaussian_noise": {},
    "alie": {},
    "ipm": {},
    "min_max": {},
    "min_sum": {},
    "backdoor": {"target": 0},
}
"""Each attack's options besides ``fraction`` and ``seed`` (``None``: no attack)."""
DEFENCES: dict[str, dict | None] = {
    "none": None,
    "median": {},
    "trimmed_mean": {"beta": 0.2},
    "krum": {"f": 2, "m": NUM_CLIENTS - 2},
    "bulyan": {"f": 1},
    "rfa": {},
    "bucketing": {"s": 2},
    "fltrust": {},
    "flame": {},
}
"""Each defence's options (``None``: FedAvg's weighted mean). Krum is Multi-Krum with
m = n − f. Bulyan assumes f = 1: its bound n ≥ 4f + 3 rules out f = 2 with 10 clients, so
it is run below the attack's real strength, as the README's table says."""
FLTRUST_ROOT = 100
"""FLTrust's root data set, taken from the training images as the server's split: 100
images, the paper's default size (Cao et al., NDSS 2021)."""
TRAIN_IMAGES = 60000
"""Fashion-MNIST's training images, before a preset's ``data.max_train`` cuts them."""
PARTITIONS = {name: NIID_PARTITIONS[name] for name in ("iid", "dirichlet-0.5")}
QUICK = {
    "attacks": ("none", "sign_flip", "alie", "backdoor"),
    "defences": ("none", "median", "krum"),
    "partitions": ("iid",),
    "sets": ["federation.rounds=5", "federation.local_epochs=2", "data.max_train=10000"],
}
"""``--quick``: 12 cells of 5 rounds of two local epochs on 10,000 training images (explicit
``--attacks``, ``--defences`` and ``--partitions`` replace its lists)."""
PUBLISHED = {
    "source": "NIID-Bench (Li et al., ICDE 2022), Table III, FMNIST, FedAvg; Flower's "
    "baselines/niid_bench README, seed 42",
    "iid": (89.3, 89.0),
    "dirichlet-0.5": (86.1, 88.4),
    "tolerance": 2.0,
}
"""The published point: the (none, none) cell after the recipe's 50 rounds of 10 local
epochs, as (paper, Flower) accuracy in %, to be matched within ``tolerance`` points of
either. The paper's figures are as ``niid_bench.py`` entered them (not checked against the
paper offline); Flower's were checked against its README."""
PAPERS: dict[str, dict] = {
    "shejwalkar2021": {
        "source": "Shejwalkar and Houmansadr, 'Manipulating the Byzantine: Optimizing Model "
        "Poisoning Attacks and Defenses for Federated Learning', NDSS 2021, abstract",
        "claim": "the AGR-agnostic attacks (min-max, min-sum) take 1.5x to 60x more accuracy "
        "from a Byzantine-robust aggregator than earlier attacks such as ALIE (LIE)",
        "attacks": ("none", "alie", "min_max", "min_sum"),
        "defences": ("krum", "trimmed_mean", "median"),
        "partitions": ("iid",),
        "seeds": (1, 2, 3),
        "sets": ["federation.rounds=20", "federation.local_epochs=1", "data.max_train=10000"],
        "baseline": "alie",
        "stronger": ("min_max", "min_sum"),
        "ratio": 1.5,
    },
}
"""Published claims ``--paper NAME`` checks, each with the cells that test it (20% of the
clients attack, as in the table) and the shorter run that fits a CPU. A claim holds here
when, for a defence, the larger accuracy loss of the ``stronger`` attacks is at least
``ratio`` times the ``baseline`` attack's loss (a loss against the same defence's no-attack
cell, averaged over the seeds) and at least ``NOISE`` points."""
NOISE = 2.0
"""Accuracy losses smaller than this many points are read as no loss: seed-to-seed spread of
the short runs is of that order."""
FAILS_BY = 10.0
"""A defended cell is marked failed (✗) when its accuracy is more than this many points
below the same partition's no-attack cell of the same defence, or its backdoor success is
above 50%."""


def plugins_value(attack: str, defence: str, seed: int) -> str:
    """The ``plugins=`` value of a cell: fedavg, then the attack, then the defence."""
    items = ["fedavg"]
    if ATTACKS[attack] is not None:
        options = {"fraction": FRACTION, "seed": seed, **ATTACKS[attack]}
        items.append(json.dumps({attack: options}))
    if DEFENCES[defence] is not None:
        items.append(json.dumps({defence: DEFENCES[defence]}) if DEFENCES[defence] else defence)
    return "plugins=[" + ", ".join(items) + "]"


def root_fraction(sets: list[str]) -> float:
    """The ``data.server_fraction`` that gives FLTrust ``FLTRUST_ROOT`` images: a fraction of
    the training images the cell keeps (``data.max_train`` when a preset cuts them), since
    the server's split is drawn after that cut."""
    train = TRAIN_IMAGES
    for item in sets:
        key, _, value = item.partition("=")
        if key.strip() == "data.max_train":
            train = min(train, int(value))
    return FLTRUST_ROOT / train


def cell_out(attack: str, defence: str, partition: str, seed: int, args: argparse.Namespace):
    """A cell's run directory."""
    return args.out / f"{attack}-{defence}-{partition}-s{seed}"


def cell_command(
    attack: str, defence: str, partition: str, seed: int, args: argparse.Namespace
) -> list[str]:
    """The ``fedkit run`` of a cell, or its ``--resume`` when the run directory exists."""
    fedkit = str(Path(sys.executable).with_name("fedkit"))
    out = cell_out(attack, defence, partition, seed, args)
    if (out / "recipe.yaml").exists():
        return [fedkit, "run", "--resume", str(out), "--quiet", "--no-report"]
    sets = [f"data.root={args.root}", "data.download=false", f"seed={seed}"]
    sets += [p.replace("SEED", str(seed)) for p in PARTITIONS[partition]]
    sets.append(plugins_value(attack, defence, seed))
    if defence == "fltrust":
        sets.append(f"data.server_fraction={root_fraction(args.sets):.8f}")
    sets += args.sets
    cmd = [fedkit, "run", RECIPE, "--out", str(out), "--quiet", "--no-report"]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def measured(out: Path) -> dict:
    """Backdoor success (last measured, %) and the mean detection scores of a run."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    found: dict = {}
    backdoor = [r["backdoor_success"] for r in rows if "backdoor_success" in r]
    if backdoor:
        found["backdoor_success"] = round(100 * backdoor[-1], 2)
    for key in ("detection_precision", "detection_recall"):
        values = [r[key] for r in rows if key in r]
        if values:
            found[key] = round(statistics.fmean(values), 3)
    return found


def cell_row(cell: tuple, args: argparse.Namespace) -> dict:
    """The results row of a finished cell."""
    attack, defence, partition, seed = cell
    out = cell_out(*cell, args)
    accuracy, seconds = final_accuracy(out)
    row = {"attack": attack, "defence": defence, "partition": partition, "seed": seed}
    row |= {"accuracy": accuracy, **measured(out), "sets": args.sets}
    return {**row, "seconds": seconds}


def stopped_row(cell: tuple, args: argparse.Namespace) -> dict | None:
    """The row of a cell whose every client diverged (the last accuracy measured before),
    or ``None`` for another stop, which a rerun resumes."""
    attack, defence, partition, seed = cell
    out = cell_out(*cell, args)
    found = diverged(out)
    if found is None:
        return None
    row = {"attack": attack, "defence": defence, "partition": partition, "seed": seed}
    return {**row, **found, **measured(out), "sets": args.sets}


def failed(row: dict, clean: dict | None) -> bool:
    """Whether a defended cell counts as a defence failing (see ``FAILS_BY``)."""
    if row.get("backdoor_success", 0.0) > 50:
        return True
    return clean is not None and row["accuracy"] < clean["accuracy"] - FAILS_BY


def table(rows: list[dict]) -> str:
    """Per partition, attacks down and defences across: final accuracy (%, the mean over the
    seeds), then the backdoor's success after a slash; ✗ marks a failed defence (in any seed,
    against that seed's no-attack cell), ‡ a diverged run."""
    defences = [d for d in DEFENCES if any(r["defence"] == d for r in rows)]
    attacks = [a for a in ATTACKS if any(r["attack"] == a for r in rows)]
    lines = []
    for partition in PARTITIONS:
        here = [r for r in rows if r["partition"] == partition]
        if not here:
            continue
        lines += [f"**{partition}**", ""]
        lines += ["| attack | " + " | ".join(defences) + " |", "|---" * (len(defences) + 1) + "|"]
        for attack in attacks:
            cells = []
            for defence in defences:
                found = [r for r in here if (r["attack"], r["defence"]) == (attack, defence)]
                clean = {
                    r["seed"]: r for r in here if (r["attack"], r["defence"]) == ("none", defence)
                }
                if not found:
                    cells.append("–")
                    continue
                text = f"{statistics.fmean(r['accuracy'] for r in found):.1f}"
                if any("backdoor_success" in r for r in found):
                    bd = statistics.fmean(r.get("backdoor_success", 0.0) for r in found)
                    text += f" / {bd:.0f}"
                if any("diverged" in r for r in found):
                    text += "‡"
                if attack != "none" and any(failed(r, clean.get(r["seed"])) for r in found):
                    text += " ✗"
                cells.append(text)
            lines.append(f"| {attack} | " + " | ".join(cells) + " |")
        lines.append("")
    notes = [
        "accuracy %, then backdoor success % after a slash (backdoor row);",
        f"✗ the defence failed: more than {FAILS_BY:.0f} points below its no-attack cell, "
        "or backdoor success above 50%; ‡ every client diverged (last accuracy measured).",
    ]
    return "\n".join([*lines, *notes])


def published(rows: list[dict]) -> str:
    """The (none, none) cells of full-length runs against the published point."""
    lines = [f"published point: {PUBLISHED['source']}"]
    for partition in PARTITIONS:
        paper, flower = PUBLISHED[partition]
        found = [
            r["accuracy"]
            for r in rows
            if (r["attack"], r["defence"], r["partition"]) == ("none", "none", partition)
            and not r.get("sets")
        ]
        if not found:
            lines.append(f"  {partition}: paper {paper}, Flower {flower}; no full-length run")
            continue
        ours = statistics.fmean(found)
        gap = min(abs(ours - paper), abs(ours - flower))
        verdict = "within" if gap <= PUBLISHED["tolerance"] else "OUTSIDE"
        lines.append(
            f"  {partition}: fedkit {ours:.1f} (n {len(found)}), paper {paper}, Flower {flower}: "
            f"{verdict} ±{PUBLISHED['tolerance']} points"
        )
    return "\n".join(lines)


def loss(rows: list[dict], attack: str, defence: str) -> tuple[float, int] | None:
    """Mean accuracy (points) an attack takes from a defence's no-attack cell, over the seeds
    both were run with, and how many seeds; ``None`` when no seed has both."""

    def by_seed(a: str) -> dict:
        here = [r for r in rows if (r["attack"], r["defence"]) == (a, defence)]
        return {r["seed"]: r["accuracy"] for r in here}

    clean, attacked = by_seed("none"), by_seed(attack)
    seeds = sorted(set(clean) & set(attacked))
    if not seeds:
        return None
    return statistics.fmean(clean[s] - attacked[s] for s in seeds), len(seeds)


def paper_check(rows: list[dict], name: str) -> str:
    """Per defence, the accuracy each attack takes, and whether the paper's claim holds."""
    paper = PAPERS[name]
    lines = [f"published claim: {paper['source']}: {paper['claim']}"]
    for defence in paper["defences"]:
        base = loss(rows, paper["baseline"], defence)
        strong = {a: loss(rows, a, defence) for a in paper["stronger"]}
        found = {a: x for a, x in strong.items() if x is not None}
        if base is None or not found:
            lines.append(f"  {defence}: not all cells run yet")
            continue
        said = ", ".join(f"{a} {x[0]:+.1f}" for a, x in [(paper["baseline"], base), *found.items()])
        top = max(x[0] for x in found.values())
        need = max(paper["ratio"] * max(base[0], 0.0), NOISE)
        verdict = "agrees" if top >= need else "does NOT agree"
        lines.append(
            f"  {defence} (accuracy lost, points, n {base[1]}): {said}; strongest / "
            f"{paper['baseline']} must be >= {paper['ratio']}x and >= {NOISE} points: {verdict}"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the cells, the extra settings and the results file filled in."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("data/fmnist"))
    parser.add_argument("--seeds", type=int, nargs="+", default=None)
    parser.add_argument("--attacks", nargs="+", choices=ATTACKS, default=None)
    parser.add_argument("--defences", nargs="+", choices=DEFENCES, default=None)
    parser.add_argument("--partitions", nargs="+", choices=PARTITIONS, default=None)
    parser.add_argument("--quick", action="store_true", help="12 short cells (own results file)")
    parser.add_argument(
        "--paper", choices=PAPERS, default=None, help="only a published claim's cells (own file)"
    )
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/robustness"))
    parser.add_argument("--results", type=Path, default=None)
    parser.add_argument("--table", action="store_true", help="only print the table")
    args = parser.parse_args(argv)
    if args.parallel < 1:
        parser.error("--parallel must be at least 1")
    if args.quick and args.paper:
        parser.error("--quick and --paper are two presets: choose one")
    preset = QUICK if args.quick else PAPERS[args.paper] if args.paper else {}
    suffix = "-quick" if args.quick else f"-{args.paper}" if args.paper else ""
    args.attacks = args.attacks or list(preset.get("attacks", ATTACKS))
    args.defences = args.defences or list(preset.get("defences", DEFENCES))
    args.partitions = args.partitions or list(preset.get("partitions", PARTITIONS))
    args.seeds = args.seeds or list(preset.get("seeds", [42]))
    args.sets = list(preset.get("sets", []))
    if suffix:
        args.out = args.out.with_name(args.out.name + suffix)
    if args.results is None:
        args.results = RESULTS.with_name(RESULTS.stem + suffix + ".jsonl")
    return args


def todo(args: argparse.Namespace) -> list[tuple]:
    """The cells asked for that the results file does not hold yet."""
    done = {(r["attack"], r["defence"], r["partition"], r["seed"]) for r in read_rows(args.results)}
    cells = [
        (a, d, p, s)
        for s in args.seeds
        for p in args.partitions
        for a in args.attacks
        for d in args.defences
    ]
    return [c for c in cells if c not in done]


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if not args.table:
        cells = todo(args)
        print(f"{len(cells)} cells to run into {args.results}", flush=True)
        run_cells(
            cells,
            args,
            cell_command,
            lambda cell: cell_row(cell, args),
            lambda cell: stopped_row(cell, args),
            threads=lambda cell: 1,
        )
    rows = read_rows(args.results)
    print(table(rows))
    print(paper_check(rows, args.paper) if args.paper else published(rows))


if __name__ == "__main__":
    main()
