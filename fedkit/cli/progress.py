"""What a person sees during a run: rich progress bars, a line per round, a summary; or,
for log collectors, one JSON object per line."""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

CHECKPOINTED = "run directory "
"""The start of the line a deployed ServerApp prints once its run directory holds a
checkpoint (a new run written, or a run about to be resumed): ``fedkit deploy run`` then
knows that running it again resumes, and takes only the ``--set`` keys a resume accepts."""

SHOWN = (
    "train_loss",
    "test_accuracy",
    "personalized_accuracy",
    "knn_accuracy",
    "linear_accuracy",
    "ari",
)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GB"


def round_line(metrics: dict[str, Any], rounds: int) -> str:
    parts = [f"round {metrics['round']:>3}/{rounds}"]
    for key in SHOWN:
        value = metrics.get(key)
        if isinstance(value, float):
            parts.append(f"{key} {value:.4f}")
    sent = metrics.get("bytes", {})
    if sent:  # every category the ledger books in each direction (tensors and values)
        up, down, scored = (
            sum(v for k, v in sent.items() if k.startswith(f"{d}_")) for d in ("up", "down", "eval")
        )
        parts.append(f"up {human_bytes(up)}")
        parts.append(f"down {human_bytes(down)}")
        if scored:
            parts.append(f"eval {human_bytes(scored)}")
    return "  ".join(parts)


class RichReporter:
    """Progress bars for rounds and clients, and one printed line per finished round."""

    def __init__(self, console: Console, rounds: int, done: int = 0) -> None:
        self.console, self.rounds = console, rounds
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        )
        self.round_task = self.progress.add_task("rounds", total=rounds, completed=done)
        self.client_task = self.progress.add_task("clients", total=1)

    def __enter__(self) -> RichReporter:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def round_started(self, round: int, clients: list[int]) -> None:
        self.progress.reset(
            self.client_task, total=len(clients), description=f"round {round} clients"
        )

    def client_done(self, round: int, client: int) -> None:
        self.progress.advance(self.client_task)

    def round_done(self, round: int, metrics: dict[str, Any]) -> None:
        self.progress.advance(self.round_task)
        self.progress.console.print(round_line(metrics, self.rounds))


class JsonlReporter:
    """``--log-format jsonl``: one JSON object per line on stdout, for log collectors
    and schedulers: ``{"event": "round", ...the metrics row}`` as each round ends
    (per-client values stay in ``clients.jsonl``); the CLI adds ``start`` and ``end``."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream

    def emit(self, event: str, **values: Any) -> None:
        stream = self.stream or sys.stdout
        stream.write(json.dumps({"event": event, **values}, sort_keys=True, default=str) + "\n")
        stream.flush()

    def round_started(self, round: int, clients: list[int]) -> None: ...
    def client_done(self, round: int, client: int) -> None: ...

    def round_done(self, round: int, metrics: dict[str, Any]) -> None:
        self.emit("round", **{k: v for k, v in metrics.items() if k != "per_client"})


class LineReporter:
    """One plain line per finished round (``round_line``), flushed at once: what a
    deployed ServerApp prints, since Flower streams its stdout line by line to
    ``fedkit deploy run`` and ``flwr log`` and a progress bar would be noise there."""

    def __init__(self, rounds: int, stream: TextIO | None = None) -> None:
        self.rounds, self.stream = rounds, stream

    def round_started(self, round: int, clients: list[int]) -> None: ...
    def client_done(self, round: int, client: int) -> None: ...

    def round_done(self, round: int, metrics: dict[str, Any]) -> None:
        stream = self.stream or sys.stdout
        stream.write(round_line(metrics, self.rounds) + "\n")
        stream.flush()


def summary_table(summary: dict[str, Any], out: str) -> Table:
    table = Table(title=f"run summary — {out}", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    final = summary.get("final", {})
    table.add_row("rounds", str(summary["rounds"]))
    table.add_row("plugins", ", ".join(summary["plugins"]))
    for key, value in final.items():
        if isinstance(value, float):
            table.add_row(
                key, f"{value:.4f}" if value == 0 or abs(value) >= 1e-3 else f"{value:.3g}"
            )
    for key, value in summary["bytes"].items():
        table.add_row(f"bytes {key}", human_bytes(value))
    return table
