"""``fedkit compare RUN_DIR...``: several runs side by side — a table of final and best
metrics, bytes, wall time and the recipe keys that differ between them, and the curves of
every metric they share, as a rich table and as one self-contained HTML page
(``OUT/compare.html``, plots in ``OUT/``; each run keeps one colour in every plot).

``--group-by KEY`` (a recipe key: ``federation.optimizer.lr``) adds a table with one row
per value: every metric's final and best value as mean ± std over the group's runs (its
seeds), and, for the first accuracy metric, each group against the next best one, paired
by seed: the mean difference and the exact two-sided p-value of a sign-flip permutation
test (every sign pattern of the paired differences; no distribution assumed).

``--x virtual_time`` lines runs up by the virtual clock's seconds (``systems:``) instead of
rounds, which is how a synchronous run and an asynchronous one (whose steps are not
rounds) compare: the curves are drawn against virtual seconds, the table gains each run's
final virtual time, and a second table gives the virtual seconds at which each run first
reaches each accuracy target (``--target``; by default the best accuracy every run
reaches, and 95 % and 90 % of it), with its ratio to the first run's."""

from __future__ import annotations

import html
import io
import itertools
import math
import statistics
from pathlib import Path
from typing import Any

import yaml
from rich.table import Table

from fedkit.cli.report import (
    ACCURACY,
    RunData,
    evaluation_label,
    figure,
    is_number,
    page,
    pyplot,
)
from fedkit.errors import FedkitError
from fedkit.rundir.atomic import write_bytes, write_text

CURVES = (*ACCURACY, "train_loss", "ari")
AXES = ("round", "virtual_time")
"""What ``--x`` may line runs up by."""


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


def need_axis(runs: list[RunData], x: str) -> None:
    """Refuse an axis some run lacks, naming the run."""
    if x not in AXES:
        raise FedkitError(f"--x {x}: expected one of {', '.join(AXES)}")
    for data in runs:
        if not any(is_number(r.get(x)) for r in data.rows):
            raise FedkitError(
                f"--x {x}: {data.out} has no {x} in its metrics.jsonl (it ran without a "
                "systems: section, so without the virtual clock); compare it by round, or "
                "rerun it with systems:"
            )


def reached(data: RunData, key: str, target: float, x: str) -> tuple[float, int] | None:
    """Where a run first reaches ``target`` on ``key`` (its x value and round), if it does."""
    for at, value, round_ in zip(*data.along(key, x), strict=True):
        if value >= target:
            return at, round_
    return None


def default_targets(runs: list[RunData], key: str) -> list[float]:
    """The best value every run reaches (the lowest of their bests), and 95 % and 90 % of
    it, rounded down to 0.01."""
    top = min(max(data.series(key)[1]) for data in runs)
    return sorted({math.floor(top * f * 100 + 1e-9) / 100 for f in (0.9, 0.95, 1.0)})


def to_targets(runs: list[RunData], x: str, targets: list[float] | None) -> Table | None:
    """The x value (virtual seconds or round) at which each run first reaches each target
    of the first accuracy metric every run has, and its ratio to the first run's."""
    key = next((k for k in ACCURACY if all(data.series(k)[1] for data in runs)), None)
    if key is None:
        if targets:
            shared = ", ".join(ACCURACY)
            raise FedkitError(f"--target: the runs share no accuracy metric ({shared})")
        return None
    unit = "virtual seconds" if x == "virtual_time" else "rounds"
    title = f"{unit} to reach {key} (the first evaluated round at or above; × the first run's)"
    table = Table(title=title)
    for column in (f"{key} ≥", *(data.out.name for data in runs)):
        table.add_column(column, overflow="fold")
    for target in sorted(targets) if targets else default_targets(runs, key):
        cells, first = [f"{target:.4f}"], None
        for index, data in enumerate(runs):
            hit = reached(data, key, target, x)
            if hit is None:
                cells.append(f"not reached (best {max(data.series(key)[1]):.4f})")
                continue
            at, round_ = hit
            ratio = ""
            if index == 0:
                first = at
            elif first:
                ratio = f", {at / first:.2f}×"
            if x == "virtual_time":
                cells.append(f"{at:.1f} s (round {round_}{ratio})")
            else:
                cells.append(f"round {round_}{ratio}")
        table.add_row(*cells)
    return table


def flat_recipe(text: str) -> dict[str, Any]:
    """A run's recipe as ``a.b.c → value`` (empty when it cannot be read)."""
    try:
        raw = yaml.safe_load(text) if text else {}
    except yaml.YAMLError:
        return {}
    out: dict[str, Any] = {}

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{prefix}{key}.")
        else:
            out[prefix[:-1]] = value

    walk(raw if isinstance(raw, dict) else {}, "")
    return out


def differences(recipes: list[dict[str, Any]]) -> list[str]:
    """The recipe keys whose values are not the same in every run (not the description)."""
    keys = dict.fromkeys(k for r in recipes for k in r if k != "description")
    return [k for k in keys if len({repr(r.get(k)) for r in recipes}) > 1]


def sign_flip_p(differences: list[float]) -> float:
    """Exact two-sided p-value of the paired differences' mean under random signs."""
    observed = abs(statistics.fmean(differences))
    patterns = list(itertools.product((1, -1), repeat=len(differences)))
    extreme = sum(
        abs(statistics.fmean(s * d for s, d in zip(signs, differences, strict=True)))
        >= observed - 1e-12
        for signs in patterns
    )
    return extreme / len(patterns)


def grouped(runs: list[RunData], key: str) -> tuple[Table, list[str]]:
    """One row per value of ``key``: metrics as mean ± std (n), and the paired orderings."""
    recipes = [flat_recipe(r.recipe) for r in runs]
    if not any(key in r for r in recipes):
        raise FedkitError(f"--group-by {key}: no run's recipe has this key")
    groups: dict[str, list[tuple[RunData, dict[str, Any]]]] = {}
    for data, recipe in zip(runs, recipes, strict=True):
        groups.setdefault(str(recipe.get(key, "–")), []).append((data, recipe))
    metrics = [k for k in CURVES if any(data.series(k)[1] for data in runs)]
    table = Table(title=f"grouped by {key} (mean ± std over the group's runs)")
    for column in (key, "n", *(f"{m} final" for m in metrics), *(f"{m} best" for m in metrics)):
        table.add_column(column, overflow="fold")
    finals: dict[str, dict[Any, float]] = {}
    for value, members in groups.items():
        lines = [(summarise(d), r.get("seed")) for d, r in members]
        cells = [value, str(len(members))]
        for kind in ("final", "best"):
            for metric in metrics:
                values = [line[metric][kind] for line, _ in lines if metric in line]
                if not values:
                    cells.append("–")
                    continue
                std = statistics.stdev(values) if len(values) > 1 else 0.0
                cells.append(f"{statistics.fmean(values):.4f} ± {std:.4f}")
        table.add_row(*cells)
        if metrics:
            first = metrics[0]
            finals[value] = {seed: line[first]["final"] for line, seed in lines if first in line}
    return table, orderings(finals, metrics[0] if metrics else "")


def orderings(finals: dict[str, dict[Any, float]], metric: str) -> list[str]:
    """Each group against the next in the order of their mean, paired by seed."""
    ranked = sorted(finals, key=lambda g: -statistics.fmean(finals[g].values()))
    lines = []
    for better, worse in itertools.pairwise(ranked):
        seeds = sorted(set(finals[better]) & set(finals[worse]), key=str)
        if not seeds:
            lines.append(f"{better} vs {worse}: no seed in common, not paired")
            continue
        diffs = [finals[better][s] - finals[worse][s] for s in seeds]
        p = sign_flip_p(diffs)
        lines.append(
            f"{metric}: {better} > {worse} by {statistics.fmean(diffs):+.4f} "
            f"(paired over {len(seeds)} seeds, sign-flip p = {p:.3f})"
        )
    return lines


def latest_evaluations(data: RunData) -> str:
    """The newest ``fedkit eval`` accuracy of each kind (protocol, data set, encoder)."""
    latest: dict[str, float] = {}
    for row in data.evaluations:
        score = next((v for k, v in row.items() if k.endswith("accuracy")), None)
        if isinstance(score, int | float):
            latest[evaluation_label(row, with_round=False)] = score
    return "; ".join(f"{k}: {v:.4f}" for k, v in latest.items()) or "–"


def markdown(table: Table) -> str:
    """A rich table as a Markdown table (for benchmark pages)."""
    header = [str(c.header) for c in table.columns]
    rows = list(zip(*(c._cells for c in table.columns), strict=True))
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def compare_runs(
    run_dirs: list[Path],
    out: Path,
    group_by: str | None = None,
    x: str = "round",
    targets: list[float] | None = None,
) -> tuple[list[Table], list[str], Path]:
    """Compare runs along ``x`` (``round`` or ``virtual_time``); returns the tables (then,
    with ``group_by``, the grouped one; with ``virtual_time`` or ``targets``, the one to
    each target), the paired orderings and the HTML page's path."""
    if len(run_dirs) < 2:
        raise FedkitError("give at least two run directories to compare")
    runs = [RunData(path) for path in run_dirs]
    need_axis(runs, x)
    virtual = x == "virtual_time"
    lines = [summarise(r) for r in runs]
    recipes = [flat_recipe(r.recipe) for r in runs]
    differ = differences(recipes)
    keys = [k for k in CURVES if any(k in line for line in lines)]
    table = Table(title="fedkit compare")
    columns = ("run", "rounds", *(f"{k} final / best (round)" for k in keys), "MB", "s")
    columns += ("virtual s",) if virtual else ()
    evaluated = any(r.evaluations for r in runs)
    for column in (*columns, "recipe differences", *(["fedkit eval"] if evaluated else [])):
        table.add_column(column, overflow="fold")
    rows = []
    for data, line, recipe in zip(runs, lines, recipes, strict=True):
        cells = [line["run"], str(line["rounds"])]
        for key in keys:
            c = line.get(key)
            cells.append(
                "–" if c is None else f"{c['final']:.4f} / {c['best']:.4f} ({c['best_round']})"
            )
        cells += [f"{line['MB']:.1f}", "–" if line["seconds"] is None else f"{line['seconds']:.0f}"]
        if virtual:
            cells.append(f"{data.along('round', x)[0][-1]:.1f}")
        cells.append("; ".join(f"{k}={recipe.get(k, '–')}" for k in differ) or "–")
        if evaluated:
            cells.append(latest_evaluations(data))
        table.add_row(*cells)
        rows.append(cells)
    plt = pyplot()
    images = {}
    for key in keys:
        fig, ax = plt.subplots(figsize=(7, 3.4))
        for index, data in enumerate(runs):  # a run's colour is its place in the list
            xs, values, _ = data.along(key, x)
            if values:
                ax.plot(
                    xs, values, marker="o", markersize=3, label=data.out.name,
                    color=f"C{index % 10}",
                )  # fmt: skip
        ax.set(xlabel="virtual seconds" if virtual else "round", ylabel=key, title=key)
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
    tables, ordered = [table], []
    extra = ""
    if group_by is not None:
        by_group, ordered = grouped(runs, group_by)
        tables.append(by_group)
        extra = html_table(by_group) + "".join(f"<p>{html.escape(o)}</p>" for o in ordered)
    if virtual or targets:
        reach = to_targets(runs, x, targets)
        if reach is not None:
            tables.append(reach)
            extra += html_table(reach)
    figures = "".join(figure(k, p) for k, p in images.items())
    target = out / "compare.html"
    write_text(
        target,
        page(
            "fedkit compare",
            f"<h1>fedkit compare</h1><table><tr>{header}</tr>{body}</table>{extra}{figures}",
        ),
    )
    return tables, ordered, target


def html_table(table: Table) -> str:
    """A rich table as an HTML table."""
    header = "".join(f"<th>{html.escape(str(c.header))}</th>" for c in table.columns)
    rows = zip(*(c._cells for c in table.columns), strict=True)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in row) + "</tr>"
        for row in rows
    )
    return f"<h2>{html.escape(str(table.title))}</h2><table><tr>{header}</tr>{body}</table>"
