"""Run reports: PNG plots of a run directory and one self-contained HTML page.

``fedkit report RUN_DIR`` (and the end of every ``fedkit run``, unless ``--no-report``)
writes ``RUN_DIR/report/*.png`` and ``RUN_DIR/report.html``, whose images are inlined so
the page opens from disk anywhere. What is plotted depends on what the run logged:

* accuracy per round: global test, personalised, kNN, linear probe, semi-supervised;
* the training loss, and every extra loss term;
* bytes per round, down and up, by ledger category (model, auxiliary, data-derived);
* each client's accuracy on its local test set, per evaluated round;
* the cluster every client chose in every round, with the adjusted Rand index;
* every other number clients report (divergences, update decisions, mixing weights,
  update norms: whatever plugins log), per client and per round;
* every other value the server logs (relevance, a frozen encoder, clusters in use, F1):
  per round, or in a table when it was logged once; curves a plugin logs as a list (a
  server pre-training's loss per epoch);
* wall time per round (client training, aggregation, evaluation), from ``times.jsonl``;
* the partition: each client's training images per class, by class name;
* privacy, when the run booked any or ran under secure aggregation: ε per round per level
  (metrics rows' ``privacy``, clients' ``*_epsilon`` values), each level's final ε, δ and
  accountant, and what the server saw each round (each upload, or only their sum) with
  the secure-aggregation protocol's own messages and bytes beside the model's.

Needs matplotlib (the ``report`` extra); the page carries a small script that records
whether every image loaded and any error, which a headless browser can read back.
"""

from __future__ import annotations

import base64
import html
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedkit.errors import FedkitError
from fedkit.plugin.ledger import FIELDS
from fedkit.rundir.atomic import write_bytes, write_text
from fedkit.rundir.logs import (
    CLASSES,
    FAILURES,
    RECIPE,
    read_clients,
    read_evaluations,
    read_jsonl,
    read_ledger,
    read_metrics,
    read_times,
)

ACCURACY = ("test_accuracy", "personalized_accuracy", "knn_accuracy", "linear_accuracy")
CHECK = """<script>
window.__errors = [];
window.addEventListener("error", e => window.__errors.push(String(e.message)));
const shown = console.error;
console.error = (...a) => { window.__errors.push(a.join(" ")); shown(...a); };
window.addEventListener("load", () => {
  const images = Array.from(document.images);
  const loaded = images.filter(i => i.complete && i.naturalWidth > 0).length;
  document.body.dataset.images = loaded + "/" + images.length;
  document.body.dataset.errors = String(window.__errors.length);
});
</script>"""


def pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise FedkitError(
            "fedkit report needs matplotlib (pip install 'fedkit-fl[report]')"
        ) from None
    return plt


class RunData:
    """Everything a report reads from a run directory."""

    def __init__(self, out: Path) -> None:
        if not (out / "metrics.jsonl").exists():
            raise FedkitError(f"{out}: no metrics.jsonl here; expected a run directory")
        self.out = out
        self.rows = read_metrics(out)
        self.clients = read_clients(out)
        self.ledger = read_ledger(out)
        self.failures = read_jsonl(out / FAILURES)
        self.partition = json_file(out / "partition.json", list, [])
        recipe = out / RECIPE
        self.recipe = recipe.read_text(errors="replace") if recipe.exists() else ""
        self.summary = json_file(out / "summary.json", dict, {})
        self.evaluations = read_evaluations(out)
        self.times = read_times(out)
        self.classes: list[str] = json_file(out / CLASSES, list, [])

    def series(self, key: str) -> tuple[list[int], list[float]]:
        pairs = [(r["round"], r[key]) for r in self.rows if isinstance(r.get(key), (int, float))]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def along(self, key: str, x: str) -> tuple[list[float], list[float], list[int]]:
        """A curve of ``key`` against ``x`` (``round`` or ``virtual_time``): the x values,
        the metric's values and their rounds, over the rows that have both as numbers."""
        rows = [r for r in self.rows if is_number(r.get(key)) and is_number(r.get(x))]
        return [r[x] for r in rows], [r[key] for r in rows], [r["round"] for r in rows]

    def keys(self, test: Callable[[str], bool]) -> list[str]:
        found: dict[str, None] = {}
        for row in self.rows:
            found.update({k: None for k, v in row.items() if test(k) and is_number(v)})
        return list(found)


def json_file(path: Path, kind: type, missing: Any) -> Any:
    """A run directory's JSON file (``missing`` when absent); a damaged one stops with an
    error naming it."""
    if not path.exists():
        return missing
    try:
        value = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as exc:
        raise FedkitError(f"{path}: not valid JSON ({exc}); the file is damaged") from None
    if not isinstance(value, kind):
        raise FedkitError(f"{path}: expected a JSON {kind.__name__}, found {type(value).__name__}")
    return value


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool): what a curve can plot."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_accuracy(key: str) -> bool:
    """Keys the accuracy plot shows."""
    return (
        key in ACCURACY
        or key.startswith("semi_accuracy")
        or (key.startswith("personalized_") and key.endswith("accuracy"))
    )


def accuracy_plot(plt: Any, data: RunData) -> Any:
    keys = data.keys(is_accuracy)
    if not keys:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for key in keys:
        rounds, values = data.series(key)
        ax.plot(rounds, values, marker="o", markersize=3, label=key)
    ax.set(xlabel="round", ylabel="accuracy", title="Accuracy per round")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def loss_plot(plt: Any, data: RunData) -> Any:
    keys = data.keys(lambda k: k == "train_loss" or k.startswith("train_loss_"))
    if not keys:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for key in keys:
        ax.plot(*data.series(key), marker="o", markersize=3, label=key)
    ax.set(xlabel="round", ylabel="loss", title="Local training loss (sample-weighted mean)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def bytes_plot(plt: Any, data: RunData) -> Any:
    rows = [r for r in data.rows if isinstance(r.get("bytes"), dict)]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.6))
    rounds = [r["round"] for r in rows]
    bottom = [0.0] * len(rows)
    for field in FIELDS:
        values = [r["bytes"].get(field, 0) / 2**20 for r in rows]
        if any(values):
            ax.bar(rounds, values, bottom=bottom, label=field)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    title = "Bytes per round by ledger category"
    for way in ("down", "up"):  # the protocol's messages, in rows from before the ledger had them
        values = [
            0 if f"{way}_secagg" in r["bytes"] else protocol_cost(r).get(f"bytes_{way}", 0) / 2**20
            for r in rows
        ]
        if any(values):
            ax.bar(rounds, values, bottom=bottom, hatch="//", alpha=0.6, label=f"SecAgg+ {way}")
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
            title = "Bytes per round: ledger categories, then SecAgg+'s own messages"
    ax.set(xlabel="round", ylabel="MB", title=title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars
    return fig


def client_accuracy_plot(plt: Any, data: RunData) -> Any:
    rows = [(c["round"], c.get("client_accuracy") or {}) for c in data.clients]
    rows = [(r, list(v.values())) for r, v in rows if v]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.6))
    positions = [r for r, _ in rows]
    ax.boxplot([v for _, v in rows], positions=positions, widths=0.6, manage_ticks=False)
    ax.set_xlim(min(positions) - 0.6, max(positions) + 0.6)
    ax.set(xlabel="round", ylabel="accuracy", title="Each client's accuracy on its local test set")
    ax.grid(alpha=0.3)
    return fig


def roster_order(data: RunData) -> tuple[list[int], list[Any]]:
    """Every client of the run (sampled or not), grouped by true group when the
    partition knows one, and each client's group."""
    known = {int(r["client"]): r.get("group") for r in data.partition if "client" in r}
    sampled = {int(k) for c in data.clients for k in c.get("clusters", {})}
    groups = {**dict.fromkeys(sampled), **known}
    order = sorted(groups, key=lambda c: (str(groups[c]) if groups[c] is not None else "", c))
    return order, [groups[c] for c in order]


def latest_clusters(data: RunData) -> dict[int, int]:
    """Each client's last reported cluster."""
    last: dict[int, int] = {}
    for row in data.clients:
        last.update({int(k): int(v) for k, v in row.get("clusters", {}).items()})
    return last


def clusters_plot(plt: Any, data: RunData) -> Any:
    chosen = {k for c in data.clients for k in c.get("clusters", {}).values()}
    if len(chosen) < 2:  # one model for everyone: nothing to show
        return None
    clients, groups = roster_order(data)
    index = {c: i for i, c in enumerate(clients)}
    grid, last = [], [math.nan] * len(clients)
    for row in data.clients:
        for cid, cluster in row.get("clusters", {}).items():
            last[index[int(cid)]] = cluster
        grid.append(list(last))
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(7, 5), gridspec_kw={"height_ratios": [3, 1]}, sharex=True
    )
    rounds = [c["round"] for c in data.clients]
    count = int(max(chosen)) + 1
    image = top.imshow(
        list(map(list, zip(*grid, strict=True))),
        aspect="auto",
        interpolation="nearest",
        extent=(rounds[0] - 0.5, rounds[-1] + 0.5, len(clients) - 0.5, -0.5),
        cmap=plt.get_cmap("tab10", count),
        vmin=-0.5,
        vmax=count - 0.5,
    )
    step = max(1, len(clients) // 30)  # at most about 30 labels
    top.set_yticks(range(0, len(clients), step), [str(c) for c in clients[::step]], fontsize=7)
    for i in range(1, len(clients)):  # a line where the true group changes
        if groups[i] != groups[i - 1]:
            top.axhline(i - 0.5, color="black", linewidth=1)
    rows = "rows grouped by true group" if any(g is not None for g in groups) else "rows by id"
    top.set(
        ylabel="client id",
        title=f"Cluster identity of every client ({rows}; blank: not sampled yet)",
    )
    fig.colorbar(image, ax=top, label="cluster", ticks=range(count))
    if data.keys(lambda k: k == "ari"):
        bottom.plot(*data.series("ari"), marker="o", markersize=3, label="ARI (all clients)")
    if data.keys(lambda k: k == "ari_round"):
        bottom.plot(*data.series("ari_round"), marker=".", label="ARI (this round's clients)")
    bottom.set(xlabel="round", ylabel="ARI", ylim=(-0.1, 1.05))
    if bottom.get_legend_handles_labels()[0]:
        bottom.legend(fontsize=8)
    return fig


def confusion(data: RunData) -> tuple[list[Any], list[int], list[list[int]]] | None:
    """Found cluster (each client's last choice) against true group: the groups, the
    clusters and the counts (rows: groups), or ``None`` without both."""
    clients, groups = roster_order(data)
    found = latest_clusters(data)
    pairs = [
        (g, found[c]) for c, g in zip(clients, groups, strict=True) if g is not None and c in found
    ]
    if not pairs or len({k for _, k in pairs}) < 2:
        return None
    names = sorted({g for g, _ in pairs}, key=str)
    clusters = sorted({k for _, k in pairs})
    counts = [
        [sum(1 for g, k in pairs if g == name and k == c) for c in clusters] for name in names
    ]
    return names, clusters, counts


def confusion_plot(plt: Any, data: RunData) -> Any:
    table = confusion(data)
    if table is None:
        return None
    names, clusters, counts = table
    fig, ax = plt.subplots(figsize=(1.2 + 0.7 * len(clusters), 1.2 + 0.5 * len(names)))
    ax.imshow(counts, cmap="Blues", aspect="auto")
    peak = max(max(row) for row in counts) or 1
    for i, row in enumerate(counts):
        for j, n in enumerate(row):
            ax.text(
                j, i, str(n), ha="center", va="center", color="white" if n > peak / 2 else "black"
            )
    ax.set_xticks(range(len(clusters)), [str(c) for c in clusters])
    ax.set_yticks(range(len(names)), [str(g) for g in names])
    ax.set(xlabel="found cluster (last choice)", ylabel="true group",
           title="Found clusters against true groups")  # fmt: skip
    return fig


def client_values_plot(plt: Any, data: RunData) -> Any:
    names: dict[str, None] = {}
    for row in data.clients:
        for values in row.get("per_client", {}).values():
            names.update(
                {k: None for k, v in values.items() if not k.startswith("loss") and _value(v)}
            )
    if not names:
        return None
    fig, axes = plt.subplots(len(names), 1, figsize=(7, 2.4 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        xs, ys = [], []
        for row in data.clients:
            for values in row.get("per_client", {}).values():
                if _value(values.get(name)):
                    xs.append(row["round"])
                    ys.append(float(values[name]))
        ax.scatter(xs, ys, s=10, alpha=0.6, label="a client")
        mean_rounds, mean_values = data.series(f"train_{name}")
        ax.plot(mean_rounds, mean_values, color="black", label="sample-weighted mean")
        ax.set(ylabel=name)
        ax.legend(fontsize=7)
    axes[0, 0].set_title("What clients report, per client and round")
    axes[-1, 0].set_xlabel("round")
    fig.tight_layout()
    return fig


def virtual_time_plot(plt: Any, data: RunData) -> Any:
    """Accuracy against the virtual clock's time (``systems:``), for runs that have one."""
    keys = data.keys(is_accuracy)
    if not keys or not any(is_number(r.get("virtual_time")) for r in data.rows):
        return None
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for key in keys:
        times, values, _ = data.along(key, "virtual_time")
        ax.plot(times, values, marker="o", markersize=3, label=key)
    ax.set(xlabel="virtual seconds", ylabel="accuracy", title="Accuracy against virtual time")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def _value(v: Any) -> bool:
    return isinstance(v, (int, float)) and (isinstance(v, bool) or math.isfinite(v))


SHOWN_ELSEWHERE = ("round", "ari", "ari_round", "clients", "virtual_time", "flagged")


def server_values(data: RunData) -> dict[str, list[tuple[int, float]]]:
    """Every number or flag in the metrics rows that no other plot shows, by key: its
    (round, value) pairs. Booleans read as 0 and 1."""
    found: dict[str, list[tuple[int, float]]] = {}
    for row in data.rows:
        for key, value in row.items():
            if key in SHOWN_ELSEWHERE or key.startswith("train_") or is_accuracy(key):
                continue
            if _value(value):
                found.setdefault(key, []).append((row["round"], float(value)))
    return found


def server_values_plot(plt: Any, data: RunData) -> Any:
    shown = {k: v for k, v in server_values(data).items() if len(v) > 1}
    if not shown:
        return None
    fig, axes = plt.subplots(
        len(shown), 1, figsize=(7, 1.9 * len(shown) + 0.6), squeeze=False, sharex=True
    )
    flags = {k for row in data.rows for k, v in row.items() if isinstance(v, bool)}
    for ax, (key, pairs) in zip(axes[:, 0], shown.items(), strict=True):
        rounds, values = zip(*pairs, strict=True)
        if key in flags:
            ax.step(rounds, values, where="mid")
            ax.set_yticks([0, 1], ["no", "yes"])
            ax.set_ylim(-0.2, 1.2)
        else:
            ax.plot(rounds, values, marker="o", markersize=3)
        ax.set(ylabel=key)
        ax.grid(alpha=0.3)
    axes[0, 0].set_title("Other values logged each round")
    axes[-1, 0].set_xlabel("round")
    fig.tight_layout()
    return fig


def curves(data: RunData) -> dict[str, list[float]]:
    """Lists of numbers a plugin logged in a metrics row (a pre-training's loss per
    epoch), by ``key (round N)``."""
    found = {}
    for row in data.rows:
        for key, value in row.items():
            if key in SHOWN_ELSEWHERE:
                continue
            if isinstance(value, list) and value and all(is_number(v) for v in value):
                found[f"{key} (round {row['round']})"] = [float(v) for v in value]
    return found


def curves_plot(plt: Any, data: RunData) -> Any:
    shown = curves(data)
    if not shown:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for key, values in shown.items():
        ax.plot(range(1, len(values) + 1), values, marker="o", markersize=3, label=key)
    ax.set(xlabel="step (epoch)", title="Curves logged by plugins")
    ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def round_times(data: RunData) -> dict[int, dict[str, float]]:
    """Each round's wall time by phase; a round run twice (a kill before its
    checkpoint) shows its last run."""
    found = {}
    for row in data.times:
        if isinstance(row.get("round"), int):
            found[row["round"]] = {
                k: float(row[k])
                for k in ("train", "aggregate", "evaluate")
                if is_number(row.get(k))
            }
    return dict(sorted(found.items()))


def time_plot(plt: Any, data: RunData) -> Any:
    times = round_times(data)
    if not times:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.2))
    rounds = list(times)
    bottom = [0.0] * len(rounds)
    for phase in ("train", "aggregate", "evaluate"):
        values = [times[r].get(phase, 0.0) for r in rounds]
        ax.bar(rounds, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    setup = sum(float(r.get("setup", 0.0)) for r in data.times)
    ax.set(
        xlabel="round",
        ylabel="seconds",
        title=f"Wall time per round (set-up, all sessions: {setup:.1f} s)",
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def class_names(data: RunData, count: int) -> list[str]:
    """The run's class names when it recorded them, else the class ids."""
    if len(data.classes) == count:
        return [str(c) for c in data.classes]
    return [str(i) for i in range(count)]


def partition_plot(plt: Any, data: RunData) -> Any:
    counts = [row.get("train_counts") for row in data.partition]
    if not counts or any(c is None for c in counts):
        return None
    fig, ax = plt.subplots(figsize=(7, min(6.0, max(2.5, 0.18 * len(counts) + 1))))
    image = ax.imshow(counts, aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set(xlabel="class", ylabel="client", title="Training images per client and class")
    names = class_names(data, len(counts[0]))
    if len(names) <= 20:
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
    fig.colorbar(image, ax=ax)
    return fig


EPSILON = "_epsilon"
"""A value a client reports under a name ending in this (through ``ctx.log``) is read as
that client's sample-level ε (docs/plugins.md, "Privacy accounting")."""


def privacy_levels(data: RunData) -> dict[str, list[tuple[int, dict[str, Any]]]]:
    """What the run booked as privacy, by level: each round's entry of the metrics rows'
    ``privacy`` field, and the max and mean over clients of every ``*_epsilon`` value they
    report (one level per statistic, and per name when there are several)."""
    found: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for row in data.rows:
        for level, booked in (row.get("privacy") or {}).items():
            if isinstance(booked, dict) and is_number(booked.get("epsilon")):
                found.setdefault(str(level), []).append((row["round"], booked))
    names = {
        k for c in data.clients for v in c.get("per_client", {}).values() for k in v
        if k.endswith(EPSILON)
    }  # fmt: skip
    for name in sorted(names):
        what = "" if len(names) == 1 else f" {name}"
        for row in data.clients:
            eps = [float(v[name]) for v in row.get("per_client", {}).values()
                   if is_number(v.get(name))]  # fmt: skip
            for stat, value in (("max", max), ("mean", statistics.fmean)):
                if eps:
                    level = f"sample{what} (per client, {stat})"
                    found.setdefault(level, []).append((row["round"], {"epsilon": value(eps)}))
    return found


def privacy_plot(plt: Any, data: RunData) -> Any:
    levels = privacy_levels(data)
    if not levels:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for level, pairs in levels.items():
        style = "--" if level.endswith("mean)") else "-"
        ax.plot([r for r, _ in pairs], [b["epsilon"] for _, b in pairs], style, marker="o",
                markersize=3, label=level)  # fmt: skip
    ax.set(xlabel="round", ylabel="ε", title="Privacy spent so far, by level")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


PLOTS = {
    "accuracy": accuracy_plot,
    "virtual_time": virtual_time_plot,
    "loss": loss_plot,
    "bytes": bytes_plot,
    "client_accuracy": client_accuracy_plot,
    "clusters": clusters_plot,
    "cluster_confusion": confusion_plot,
    "client_values": client_values_plot,
    "server_values": server_values_plot,
    "curves": curves_plot,
    "time": time_plot,
    "partition": partition_plot,
    "privacy": privacy_plot,
}
CAPTIONS = {
    "accuracy": "The global model's scores and the mean of the clients' personal scores, "
    "on every evaluated round.",
    "virtual_time": "The same scores against the virtual clock's seconds (systems:): how "
    "long the federation would have taken on the clients' devices and links.",
    "loss": "The clients' training loss (and each loss term), weighted by their samples.",
    "bytes": "What the ledger booked per round, down and up, by category: model, auxiliary "
    "(a plugin's own tensors) and data-derived (features or statistics of client data); "
    "hatched on top, secure aggregation's own protocol messages, when the run used it.",
    "client_accuracy": "The spread of personal accuracy over the evaluated clients.",
    "clusters": "Each client's cluster, round by round (rows are client ids, grouped by "
    "true group when the partition has one), and the adjusted Rand index below.",
    "cluster_confusion": "Found cluster (each client's last choice) against true group: "
    "a perfect clustering has one filled cell per row and per column.",
    "client_values": "Every other number clients report, one dot per client and round, "
    "with the sample-weighted mean.",
    "server_values": "Numbers and flags the server logged in more than one round.",
    "curves": "Lists of numbers a plugin logged once, such as the loss of each epoch of a "
    "server's pre-training.",
    "time": "Wall time of each round: waiting for the clients, aggregating, evaluating "
    "(from times.jsonl; a round run twice shows its last run).",
    "partition": "How many training images each client holds of each class.",
    "privacy": "The (ε, δ) spent by the end of each round over every round so far, per level "
    "the run booked (metrics.jsonl's privacy field), and the clients' own sample-level ε "
    "(values named *_epsilon): their max (solid) and mean (dashed) over the round's clients.",
}


def _table(rows: list[tuple[str, str]]) -> str:
    cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table>{cells}</table>"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def partition_html(data: RunData) -> str:
    """Each client's training images and the classes it holds, as an HTML table."""
    rows = []
    for row in data.partition:
        counts = row.get("train_counts") or []
        names = class_names(data, len(counts))
        held = [names[c] for c, n in enumerate(counts) if n]
        group = "" if row.get("group") is None else row["group"]
        rows.append(
            f"<tr><td>{row.get('client')}</td><td>{row.get('n_train', '')}</td>"
            f"<td>{row.get('n_test', '')}</td><td>{group}</td>"
            f"<td>{len(held)}: {html.escape(' '.join(held))}</td></tr>"
        )
    if not rows:
        return ""
    head = "<tr><th>client</th><th>train</th><th>test</th><th>group</th><th>classes</th></tr>"
    return f"<h2>Partition</h2><table>{head}{''.join(rows)}</table>"


def evaluation_label(row: dict[str, Any], with_round: bool = True) -> str:
    """What a ``fedkit eval`` measured: protocol, data set, whose encoder (which round)."""
    whose = "global" if row.get("client") is None else f"client {row['client']}"
    at = f", round {row.get('round')}" if with_round else ""
    return f"{row.get('protocol')} on {row.get('dataset')} ({whose}{at})"


def evaluations_html(data: RunData) -> str:
    """Every ``fedkit eval`` result, oldest first: what it measured, its numbers, when."""
    rows = "".join(
        "<tr>"
        + f"<td>{html.escape(evaluation_label(r))}</td>"
        + "<td>"
        + html.escape(
            ", ".join(
                f"{k} {_fmt(v)}"
                for k, v in r.items()
                if is_number(v) and k not in ("round", "client")
            )
        )
        + f"</td><td>{html.escape(str(r.get('when', '')))}</td></tr>"
        for r in data.evaluations
    )
    return f"<table><tr><th>evaluation</th><th>scores</th><th>when</th></tr>{rows}</table>"


def figure(name: str, png: bytes, caption: str = "") -> str:
    """An inlined PNG with a caption that says how to read it."""
    encoded = base64.b64encode(png).decode()
    return (
        f'<figure><img alt="{html.escape(name)}" src="data:image/png;base64,{encoded}">'
        f"<figcaption>{html.escape(caption or name)}</figcaption></figure>"
    )


def once_html(data: RunData) -> str:
    """Values the server logged in a single round (a relevance score, a final
    pre-training loss), as a table."""
    once = [
        (f"{key} (round {pairs[0][0]})", _fmt(pairs[0][1]))
        for key, pairs in server_values(data).items()
        if len(pairs) == 1 and len(data.rows) > 1
    ]
    return f"<h2>Logged once</h2>{_table(once)}" if once else ""


def protocol_cost(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row's ``secagg`` entry (what secure aggregation's own messages cost that
    round: clients summed, dropped, messages, bytes_down, bytes_up), or ``{}``."""
    cost = row.get("secagg")
    return cost if isinstance(cost, dict) else {}


def _mb(value: Any) -> str:
    return f"{value / 2**20:.2f}" if is_number(value) else "–"


SEEN = {"sum": "only the sum", "each": "each upload"}
"""What a round's ``saw`` means (``server_saw`` in its metrics row; a row without it: the
server saw each client's upload)."""

COST = ("clients", "dropped", "messages", "bytes_down", "bytes_up")


def server_saw(data: RunData) -> list[dict[str, Any]]:
    """Per round, what the server saw of the uploads and what it cost: ``saw`` (``sum``
    under secure aggregation, else ``each``), the protocol's ``COST`` entries (``None``
    without it) and the ledger's model bytes each way."""
    found = []
    for row in data.rows:
        cost, booked = protocol_cost(row), row.get("bytes") or {}
        found.append({
            "round": row["round"],
            "saw": str(row.get("server_saw", "each")),
            **{k: cost.get(k) for k in COST},
            "model_down": booked.get("down_model"),
            "model_up": booked.get("up_model"),
        })  # fmt: skip
    return found


def _cell(value: Any) -> str:
    if isinstance(value, list):
        value = " ".join(map(str, value))
    return f"<td>{html.escape('–' if value in (None, '') else str(value))}</td>"


def server_saw_html(data: RunData) -> str:
    """The panel's part on what the server saw: a sentence over the whole run and, when
    any round ran under secure aggregation, a table per round of the protocol's messages
    and bytes beside the model's (folded away beyond 20 rounds)."""
    rounds = server_saw(data)
    summed = [r for r in rounds if r["saw"] != "each"]
    if not summed:
        return "<p>The server saw each client's upload in every round (no secure aggregation).</p>"
    words = ", ".join(sorted({SEEN.get(r["saw"], r["saw"]) for r in summed}))
    others = "" if len(summed) == len(rounds) else "; each client's upload in the others"
    sentence = (
        f"<p>The server saw {html.escape(words)} of the uploads in {len(summed)} of "
        f"{len(rounds)} rounds (engine.secure_aggregation){others}.</p>"
    )
    head = "".join(
        f"<th>{h}</th>"
        for h in ("round", "server saw", "clients summed", "dropped", "SecAgg+ messages",
                  "SecAgg+ MB down", "SecAgg+ MB up", "model MB down", "model MB up")
    )  # fmt: skip
    body = "".join(
        "<tr>"
        + _cell(r["round"])
        + _cell(SEEN.get(r["saw"], r["saw"]))
        + "".join(_cell(r[k]) for k in ("clients", "dropped", "messages"))
        + "".join(_cell(_mb(r[k])) for k in ("bytes_down", "bytes_up", "model_down", "model_up"))
        + "</tr>"
        for r in rounds
    )
    table = f"<table><tr>{head}</tr>{body}</table>"
    if len(rounds) > 20:
        table = f"<details><summary>every round</summary>{table}</details>"
    return sentence + table


def privacy_html(data: RunData, png: bytes | None) -> str:
    """The privacy section (only when the run booked privacy or ran under secure
    aggregation): the plot, per level the final ε, δ and accountant, and what the server
    saw each round."""
    levels = privacy_levels(data)
    if not levels and not any("server_saw" in r for r in data.rows):
        return ""
    rows = "".join(
        f"<tr><td>{html.escape(level)}</td><td>{_fmt(float(b['epsilon']))}</td>"
        f"<td>{html.escape(str(b.get('delta', '–')))}</td>"
        f"<td>{html.escape(str(b.get('accountant', '–')))}</td></tr>"
        for level, pairs in levels.items()
        for b in [pairs[-1][1]]
    )
    head = "<tr><th>level</th><th>final ε</th><th>δ</th><th>accountant</th></tr>"
    shown = figure("privacy", png, CAPTIONS["privacy"]) if png else ""
    spent = f"<table>{head}{rows}</table>" if levels else "<p>No ε booked.</p>"
    return f'<h2 id="privacy">Privacy</h2>{shown}{spent}{server_saw_html(data)}'


DETECTION = ("defence", "flagged", "detection_precision", "detection_recall", "backdoor_success")


def detection_html(data: RunData) -> str:
    """The attacks and defences section (only when a row has one of ``DETECTION``): per
    round, the defence, whom it flagged, its precision and recall against the simulation's
    truth and a backdoor's success rate."""
    rows = [r for r in data.rows if any(k in r for k in DETECTION)]
    if not rows:
        return ""
    head = "<tr><th>round</th>" + "".join(f"<th>{k}</th>" for k in DETECTION) + "</tr>"
    body = "".join(
        f"<tr><td>{r['round']}</td>"
        + "".join(f"<td>{html.escape(_fmt(r[k])) if k in r else '–'}</td>" for k in DETECTION)
        + "</tr>"
        for r in rows
    )
    return f'<h2 id="detection">Attacks and defences</h2><table>{head}{body}</table>'


def page(title: str, body: str) -> str:
    """A self-contained HTML page that records, for a headless browser, how many of its
    images loaded (``body[data-images]``) and how many errors it saw (``data-errors``)."""
    style = (
        "body{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222}"
        "table{border-collapse:collapse;margin-bottom:1em}"
        "th,td{border:1px solid #ccc;padding:2px 8px;text-align:left;font-size:0.9em}"
        "img{max-width:100%}pre{background:#f6f6f6;padding:1em;overflow-x:auto}"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{style}</style>{CHECK}</head><body>{body}</body></html>"
    )


def render_html(data: RunData, images: dict[str, bytes]) -> str:
    """The report page: summary tables, every plot inlined, the recipe, failures."""
    final = data.rows[-1] if data.rows else {}
    summary = [(k, _fmt(v)) for k, v in final.items() if is_number(v) or isinstance(v, str)]
    totals = data.summary.get("bytes", {})
    sections = [
        f"<h1>fedkit run report</h1><p>{html.escape(str(data.out))}</p>",
        f"<h2>Last round ({final.get('round', '–')})</h2>{_table(summary)}",
    ]
    if totals:
        moved = [(k, f"{v / 2**20:.1f} MB") for k, v in totals.items()]
        sections.append(f"<h2>Bytes moved</h2>{_table(moved)}")
    shown = {k: v for k, v in images.items() if k != "privacy"}  # in its own section
    sections += [figure(name, png, CAPTIONS.get(name, "")) for name, png in shown.items()]
    sections.append(privacy_html(data, images.get("privacy")))
    sections.append(detection_html(data))
    sections.append(once_html(data))
    sections.append(partition_html(data))
    if data.evaluations:
        sections.append(f"<h2>Offline evaluations (fedkit eval)</h2>{evaluations_html(data)}")
    if data.failures:
        failed = [(f"round {f['round']}, client {f['client']}", f["error"]) for f in data.failures]
        sections.append(f"<h2>Failures</h2>{_table(failed)}")
    sections.append(f"<h2>Recipe</h2><pre>{html.escape(data.recipe)}</pre>")
    return page("fedkit report", "".join(sections))


def write_report(out: Path) -> Path:
    """Write ``out/report/*.png`` and ``out/report.html``; returns the page's path."""
    import io

    plt = pyplot()
    data = RunData(out)
    images: dict[str, bytes] = {}
    for name, plot in PLOTS.items():
        fig = plot(plt, data)
        if fig is None:
            continue
        for ax in fig.axes:  # rounds are whole numbers
            if ax.get_xlabel() == "round":
                ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
        plt.close(fig)
        images[name] = buffer.getvalue()
        write_bytes(out / "report" / f"{name}.png", images[name])
    page = out / "report.html"
    write_text(page, render_html(data, images))
    return page
