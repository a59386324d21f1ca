"""The run directory: resolved recipe, metrics, ledger, partition, checkpoints, summary.

Every file is written atomically. ``metrics.jsonl`` is written just before each
checkpoint; on resume, rows past the newest checkpoint are dropped and recomputed, so
``fedkit run --resume DIR`` continues exactly where the last checkpoint left off.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from fedkit import checkpoint
from fedkit.atomic import write_json, write_jsonl, write_text
from fedkit.data.summary import partition_table, save_partition
from fedkit.engine import Reporter, Run, SilentReporter, prepare, run_round
from fedkit.errors import FedkitError
from fedkit.recipe import Recipe, dump_recipe, load_recipe

RECIPE = "recipe.yaml"
METRICS = "metrics.jsonl"


def default_out(recipe_name: str) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{recipe_name}-{stamp}"


def read_metrics(out: Path) -> list[dict[str, Any]]:
    path = out / METRICS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def start(recipe: Recipe, out: Path) -> Run:
    """Prepare a fresh run, lay out its directory and write the round-0 checkpoint
    (refuses to overwrite a run)."""
    if (out / RECIPE).exists():
        raise FedkitError(f"{out} already holds a run; use --resume {out} or another --out")
    out.mkdir(parents=True, exist_ok=True)
    run = prepare(recipe)
    write_text(out / RECIPE, dump_recipe(recipe))
    save_partition(partition_table(run.server.data), out / "partition.json")
    checkpoint.save(run, out, 0)
    return run


def resume(out: Path) -> tuple[Run, int]:
    """Rebuild a run from its directory and restore its newest checkpoint."""
    if not (out / RECIPE).is_file():
        raise FedkitError(f"{out}: no {RECIPE} here; expected a run directory to resume")
    snapshot = checkpoint.read(out)
    run = prepare(load_recipe(out / RECIPE), snapshot=snapshot)
    done = snapshot.round if snapshot is not None else 0
    run.history = [row for row in read_metrics(out) if row["round"] <= done]
    return run, done


def execute(run: Run, out: Path, done: int = 0, reporter: Reporter = SilentReporter()) -> dict:
    """Run rounds ``done+1 .. R``, checkpointing as configured; returns the summary."""
    rounds, every = run.recipe.federation.rounds, run.recipe.engine.checkpoint_every
    began = time.perf_counter()
    for r in range(done + 1, rounds + 1):
        run.history.append(run_round(run, r, reporter))
        if r % every == 0 or r == rounds:
            write_jsonl(out / METRICS, run.history)
            checkpoint.save(run, out, r)
            write_json(out / "ledger.json", run.server.ledger.to_rows())
    summary = {
        "rounds": rounds,
        "final": run.history[-1] if run.history else {},
        "bytes": run.server.ledger.totals(),
        "plugins": run.plugins.names,
        "seconds_this_session": round(time.perf_counter() - began, 2),
    }
    write_json(out / "summary.json", summary)
    return summary
