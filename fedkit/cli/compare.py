"""``fedkit compare RUN_DIR...``: several runs side by side — a table of final and best
metrics, bytes and wall time, and the curves of every metric they share, as a rich table
and as one self-contained HTML page (``OUT/compare.html``, plots in ``OUT/``)."""

from __future__ import annotations

import html
import io
from pathlib import Path
from typing import Any

from rich.table import Table

from fedkit.cli.report import ACCURACY, RunData, figure, page, pyplot
from fedkit.errors import FedkitError
from fedkit.rundir.atomic import write_bytes, write_text

CURVES = (*ACCURACY, "train_loss", "ari")


def best(rounds: list[int], values: list[float], key: str) -> tuple[float, int] | None:
    """The best value of a curve and its round (lowest for losses, highest otherwise)."""
    if not values:
        return None
    pick = min if "loss" in key else max
    value = pick(values)
    return value, rounds[values.index(value)]


def summarise(data: RunData) -> dict[str, Any]:
    """One run's line of the comparison."""
    final = data.rows[-1] if data.rows else {}
    line: dict[str, Any] = {"run": str(data.out), "rounds": final.get("round")}
    for key in CURVES:
        rounds, values = data.series(key)
        if values:
            top = best(rounds, values, key)
            line[key] = {"final": values[-1], "best": top[0], "best_round": top[1]}
    line["MB"] = data.summary.get("bytes", {}).get("total", 0) / 2**20
    summary = data.summary
    line["seconds"] = summary.get("seconds", summary.get("seconds_this_session"))
    return line


def markdown(table: Table) -> str:
    """A rich table as a Markdown table (for benchmark pages)."""
    header = [str(c.header) for c in table.columns]
    rows = list(zip(*(c._cells for c in table.columns), strict=True))
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def compare_runs(run_dirs: list[Path], out: Path) -> tuple[Table, Path]:
    """Compare runs; returns the table and the HTML page's path."""
    if len(run_dirs) < 2:
        raise FedkitError("give at least two run directories to compare")
    runs = [RunData(path) for path in run_dirs]
    lines = [summarise(r) for r in runs]
    keys = [k for k in CURVES if any(k in line for line in lines)]
    table = Table(title="fedkit compare")
    for column in ("run", "rounds", *(f"{k} final / best (round)" for k in keys), "MB", "s"):
        table.add_column(column, overflow="fold")
    rows = []
    for line in lines:
        cells = [line["run"], str(line["rounds"])]
        for key in keys:
            c = line.get(key)
            cells.append(
                "–" if c is None else f"{c['final']:.4f} / {c['best']:.4f} ({c['best_round']})"
            )
        cells += [f"{line['MB']:.1f}", "–" if line["seconds"] is None else f"{line['seconds']:.0f}"]
        table.add_row(*cells)
        rows.append(cells)
    plt = pyplot()
    images = {}
    for key in keys:
        fig, ax = plt.subplots(figsize=(7, 3.4))
        for data in runs:
            rounds, values = data.series(key)
            if values:
                ax.plot(rounds, values, marker="o", markersize=3, label=data.out.name)
        ax.set(xlabel="round", ylabel=key, title=key)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
        plt.close(fig)
        images[key] = buffer.getvalue()
        write_bytes(out / f"{key}.png", images[key])
    header = "".join(f"<th>{html.escape(c.header)}</th>" for c in table.columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in cells) + "</tr>"
        for cells in rows
    )
    figures = "".join(figure(k, p) for k, p in images.items())
    target = out / "compare.html"
    write_text(
        target,
        page(
            "fedkit compare",
            f"<h1>fedkit compare</h1><table><tr>{header}</tr>{body}</table>{figures}",
        ),
    )
    return table, target
