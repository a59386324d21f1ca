"""Run reports, run comparison and the observers: what ``fedkit run`` writes at the end,
``fedkit report`` / ``fedkit compare`` on finished runs, the page checked in a real
headless browser (when Chromium is installed), and TensorBoard's scalars."""

from __future__ import annotations

import base64
import json
import re
import shutil
import statistics
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import COMBOS, blobs_recipe, make_blobs, ssl_recipe
from typer.testing import CliRunner

from fedkit.cli.app import app
from fedkit.cli.compare import sign_flip_p
from fedkit.cli.report import (
    CAPTIONS,
    RunData,
    bytes_plot,
    client_values_plot,
    clusters_plot,
    confusion,
    curves,
    partition_plot,
    privacy_levels,
    pyplot,
    render_html,
    roster_order,
    round_times,
    server_saw,
    server_values,
    server_values_plot,
    write_report,
)
from fedkit.config.schema import validate
from fedkit.core import runs
from fedkit.rundir import logs
from fedkit.testing import run_recipe, tiny_recipe

runner = CliRunner()
PNG = b"\x89PNG\r\n\x1a\n"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def cli_run(path: Path, out: Path, *extra: str):
    result = runner.invoke(app, ["run", str(path), "--out", str(out), "--report", *extra])
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def ifca_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four IFCA rounds on 9 generated clients in 3 groups, run through the CLI."""
    root = tmp_path_factory.mktemp("ifca")
    raw = blobs_recipe(
        make_blobs(root / "blobs"),
        {"ifca": {"restarts": 3}},
        **{"federation.rounds": 4, "federation.local_epochs": 2},
    ).model_dump(mode="json")
    path = root / "ifca.yaml"
    path.write_text(yaml.safe_dump(raw))
    cli_run(path, root / "run")
    return root / "run"


@pytest.fixture(scope="module")
def fedavg_runs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two tiny FedAvg runs (seeds 0 and 1): one with ``--json``, one with ``--quiet``."""
    root = tmp_path_factory.mktemp("fedavg")
    outs = []
    for seed, flag in ((0, "--json"), (1, "--quiet")):
        path = root / f"seed{seed}.yaml"
        path.write_text(yaml.safe_dump({**tiny_recipe(), "seed": seed}))
        result = cli_run(path, root / f"seed{seed}", flag)
        (root / f"seed{seed}.out").write_text(result.stdout)
        outs.append(root / f"seed{seed}")
    return outs


def images_of(page: Path) -> list[bytes]:
    sources = re.findall(r'<img [^>]*src="([^"]+)"', page.read_text())
    assert sources and all(s.startswith("data:image/png;base64,") for s in sources)
    return [base64.b64decode(s.split(",", 1)[1]) for s in sources]


@pytest.mark.slow
def test_run_writes_a_self_contained_report_with_every_plot(ifca_run: Path) -> None:
    plots = {p.stem: p.read_bytes() for p in (ifca_run / "report").glob("*.png")}
    assert {"accuracy", "loss", "bytes", "client_accuracy", "clusters", "partition"} <= set(plots)
    assert all(png.startswith(PNG) for png in plots.values())
    inlined = images_of(ifca_run / "report.html")
    assert sorted(inlined) == sorted(plots.values())  # every plot, inlined, nothing linked
    text = (ifca_run / "report.html").read_text()
    assert "<h2>Partition</h2>" in text and text.count("<tr><td>") >= 9  # a row per client
    assert "<h2>Recipe</h2>" in text and "ifca" in text


@pytest.mark.slow
def test_report_command_rewrites_the_page_from_the_run_directory(ifca_run: Path) -> None:
    (ifca_run / "report.html").unlink()
    result = runner.invoke(app, ["report", str(ifca_run)])
    assert result.exit_code == 0, result.output
    assert len(images_of(ifca_run / "report.html")) >= 6


@pytest.mark.slow
def test_cluster_plot_reads_every_client_every_round(ifca_run: Path) -> None:
    data = RunData(ifca_run)
    assert [row["round"] for row in data.clients] == [1, 2, 3, 4]
    assert all(len(row["clusters"]) == 9 for row in data.clients)
    assert data.series("ari")[0] == [1, 2, 3, 4]


@pytest.mark.slow
def test_report_of_a_dapu_run_plots_its_divergences_and_decisions(tmp_path: Path) -> None:
    raw = ssl_recipe("fedu", ("dapu", {"mu": 0.4}), rounds=3)
    path = tmp_path / "dapu.yaml"
    path.write_text(yaml.safe_dump(raw))
    cli_run(path, tmp_path / "run")
    assert (tmp_path / "run" / "report" / "client_values.png").read_bytes().startswith(PNG)
    plt = pyplot()
    fig = client_values_plot(plt, RunData(tmp_path / "run"))
    labels = {ax.get_ylabel() for ax in fig.axes}
    plt.close(fig)
    assert {"dapu_divergence", "dapu_global"} <= labels


@pytest.mark.slow
def test_no_report_writes_no_page(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(federation={"rounds": 1})))
    result = runner.invoke(app, ["run", str(path), "--out", str(tmp_path / "run"), "--no-report"])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "run" / "report.html").exists()
    assert not (tmp_path / "run" / "report").exists()


def test_report_of_a_folder_that_is_not_a_run_exits_2(tmp_path: Path) -> None:
    result = runner.invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2
    assert "expected a run directory" in result.output and "Traceback" not in result.output


@pytest.mark.slow
def test_json_prints_a_parseable_summary_and_quiet_prints_no_table(
    fedavg_runs: list[Path],
) -> None:
    summary = json.loads((fedavg_runs[0].parent / "seed0.out").read_text())
    assert summary["run_dir"] == str(fedavg_runs[0])
    assert summary["report"] == str(fedavg_runs[0] / "report.html")
    last = logs.read_metrics(fedavg_runs[0])[-1]
    assert summary["final"]["test_accuracy"] == last["test_accuracy"]
    quiet = (fedavg_runs[1].parent / "seed1.out").read_text()
    assert quiet.strip() == str(fedavg_runs[1])  # only the run directory


@pytest.mark.slow
def test_compare_puts_runs_side_by_side(fedavg_runs: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    args = ["compare", *map(str, fedavg_runs), "--out", str(out), "--markdown"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    table = [line for line in result.stdout.splitlines() if line.startswith("|")]
    assert len(table) == 4 and "test_accuracy final / best (round)" in table[0]
    finals = [logs.read_metrics(run)[-1]["test_accuracy"] for run in fedavg_runs]
    for line, run, final in zip(table[2:], fedavg_runs, finals, strict=True):
        assert str(run) in line and f"{final:.4f}" in line
    assert len(images_of(out / "compare.html")) >= 3  # accuracy, personalised, loss


@pytest.mark.slow
def test_compare_needs_two_runs(fedavg_runs: list[Path]) -> None:
    result = runner.invoke(app, ["compare", str(fedavg_runs[0])])
    assert result.exit_code == 2 and "at least two" in result.output


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed")
def test_pages_load_in_headless_chromium_with_every_image_and_no_error(
    ifca_run: Path, fedavg_runs: list[Path], tmp_path: Path
) -> None:
    runner.invoke(app, ["compare", *map(str, fedavg_runs), "--out", str(tmp_path)])
    for page in (ifca_run / "report.html", tmp_path / "compare.html"):
        dom = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
        found = re.search(r'<body data-images="(\d+)/(\d+)" data-errors="(\d+)"', dom)
        assert found, f"{page.name}: the page's check did not run"
        loaded, total, errors = map(int, found.groups())
        assert loaded == total == len(images_of(page)) and errors == 0
    assert 'alt="cluster_confusion"' in (ifca_run / "report.html").read_text()


@pytest.mark.slow
def test_tensorboard_observer_logs_each_rows_numbers(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = tmp_path / "tb"
    raw = tiny_recipe(plugins=["fedavg", {"tensorboard": {"logdir": str(logdir)}}])
    result = run_recipe(raw)
    events = EventAccumulator(str(logdir))
    events.Reload()
    for tag in ("test_accuracy", "train_loss", "bytes/up_model"):
        logged = [(e.step, e.value) for e in events.Scalars(tag)]
        wanted = [
            (r["round"], r[tag] if "/" not in tag else r["bytes"]["up_model"]) for r in result.rows
        ]
        assert [s for s, _ in logged] == [s for s, _ in wanted]
        assert [v for _, v in logged] == pytest.approx([v for _, v in wanted], rel=1e-6)


@pytest.mark.slow
def test_mlflow_observer_logs_each_rows_numbers_and_resumes_into_the_same_run(
    tmp_path: Path,
) -> None:
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    observer = {"mlflow": {"tracking_uri": uri, "experiment": "tiny", "run_name": "r"}}
    raw = tiny_recipe(plugins=["fedavg", observer], federation={"rounds": 3})
    out = tmp_path / "run"
    the_run = runs.start(validate({**raw, "federation": {**raw["federation"], "rounds": 2}}), out)
    runs.execute(the_run, out)
    resumed, done = runs.resume(out, ["federation.rounds=3"])
    runs.execute(resumed, out, done)
    rows = logs.read_metrics(out)
    client = MlflowClient(tracking_uri=uri)
    found = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert len(found) == 1  # the resumed run logged into the same MLflow run
    run_id = found[0].info.run_id
    assert found[0].data.params["federation.optimizer.lr"] == "0.003"
    for tag, value in (
        ("test_accuracy", lambda r: r["test_accuracy"]),
        ("train_loss", lambda r: r["train_loss"]),
        ("bytes/up_model", lambda r: r["bytes"]["up_model"]),
    ):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, tag))
        assert history == [(r["round"], pytest.approx(value(r), rel=1e-12)) for r in rows]


@pytest.mark.slow
def test_compare_groups_seeds_and_names_the_recipe_differences(
    fedavg_runs: list[Path], tmp_path: Path
) -> None:
    args = ["compare", *map(str, fedavg_runs), "--out", str(tmp_path / "c"), "--markdown"]
    result = runner.invoke(app, [*args, "--group-by", "federation.rounds"])
    assert result.exit_code == 0, result.output
    assert "seed=0" in result.output and "seed=1" in result.output  # the one key that differs
    finals = [logs.read_metrics(r)[-1]["test_accuracy"] for r in fedavg_runs]
    mean, std = statistics.fmean(finals), statistics.stdev(finals)
    grouped_row = next(line for line in result.output.splitlines() if line.startswith("| 2 | 2 |"))
    assert f"{mean:.4f} ± {std:.4f}" in grouped_row
    missing = runner.invoke(app, [*args, "--group-by", "no.such.key"])
    assert missing.exit_code == 2 and "no run's recipe has this key" in missing.output


def test_the_sign_flip_test_is_exact():
    assert sign_flip_p([0.01, 0.02]) == 0.5  # (+,+) and (-,-) are as extreme: 2 of 4
    assert sign_flip_p([0.01] * 6) == 2 / 64
    assert sign_flip_p([0.01, -0.01]) == 1.0


def synthetic_run(root: Path) -> Path:
    """A run directory by hand: 4 clients in groups a, a, b, b; client 1 never sampled."""
    root.mkdir()
    rows = [{"round": r, "ari": 1.0} for r in (1, 2, 3)]
    clusters = [{"0": 0, "2": 1}, {"3": 1}, {"0": 0, "2": 1, "3": 0}]
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "clients.jsonl").write_text(
        "".join(
            json.dumps({"round": r, "clusters": c}) + "\n"
            for r, c in zip((1, 2, 3), clusters, strict=True)
        )
    )
    partition = [{"client": c, "group": g} for c, g in zip((3, 1, 0, 2), "baab", strict=True)]
    (root / "partition.json").write_text(json.dumps(partition))
    return root


def test_the_cluster_map_lists_every_client_by_id_and_group_and_the_confusion_counts(tmp_path):
    data = RunData(synthetic_run(tmp_path / "run"))
    assert roster_order(data) == ([0, 1, 2, 3], ["a", "a", "b", "b"])
    assert confusion(data) == (["a", "b"], [0, 1], [[1, 0], [1, 1]])  # client 1: not counted
    plt = pyplot()
    fig = clusters_plot(plt, data)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    plt.close(fig)
    assert labels == ["0", "1", "2", "3"]
    page = write_report(data.out)
    assert (data.out / "report" / "cluster_confusion.png").read_bytes().startswith(PNG)
    assert page.is_file()


@pytest.mark.slow
def test_the_report_shows_server_values_curves_time_and_class_names(tmp_path):
    """What a CP-CFL run logs beyond accuracy: a flag and a count every round, a score and
    a pre-training curve once; the rounds' wall time; the classes by name."""
    root = tmp_path / "run"
    root.mkdir()
    rows = [
        {"round": 1, "encoder_frozen": True, "clusters_used": 2, "relevance_score": 0.25,
         "pretrain_losses": [3.0, 2.5, 2.0], "clients": [0, 1]},
        {"round": 2, "encoder_frozen": False, "clusters_used": 3, "clients": [0, 1]},
    ]  # fmt: skip
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    times = [
        {"session": 1, "setup": 4.0, "after": 0},
        {"session": 1, "round": 1, "train": 1.0, "aggregate": 0.1, "evaluate": 0.5},
        {"session": 1, "round": 2, "train": 9.0, "aggregate": 0.1, "evaluate": 0.5},
        {"session": 2, "setup": 2.0, "after": 1},
        {"session": 2, "round": 2, "train": 2.0, "aggregate": 0.2, "evaluate": 0.4},
    ]
    (root / "times.jsonl").write_text("".join(json.dumps(t) + "\n" for t in times))
    counts = {"n_train": 5, "n_test": 1}
    partition = [{"client": 0, "train_counts": [3, 0, 2], **counts},
                 {"client": 1, "train_counts": [0, 5, 0], **counts}]  # fmt: skip
    (root / "partition.json").write_text(json.dumps(partition))
    (root / "classes.json").write_text(json.dumps(["cat", "dog", "eel"]))
    data = RunData(root)
    assert server_values(data) == {
        "encoder_frozen": [(1, 1.0), (2, 0.0)],
        "clusters_used": [(1, 2.0), (2, 3.0)],
        "relevance_score": [(1, 0.25)],
    }
    assert curves(data) == {"pretrain_losses (round 1)": [3.0, 2.5, 2.0]}  # not "clients"
    assert round_times(data) == {
        1: {"train": 1.0, "aggregate": 0.1, "evaluate": 0.5},
        2: {"train": 2.0, "aggregate": 0.2, "evaluate": 0.4},  # the round's last run
    }
    plt = pyplot()
    fig = partition_plot(plt, data)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["cat", "dog", "eel"]
    fig = server_values_plot(plt, data)
    assert [ax.get_ylabel() for ax in fig.axes] == ["encoder_frozen", "clusters_used"]
    plt.close("all")
    page = write_report(root).read_text()
    for name in ("server_values", "curves", "time", "partition"):
        assert f'alt="{name}"' in page and (root / "report" / f"{name}.png").is_file()
    assert f"<figcaption>{CAPTIONS['time']}</figcaption>" in page  # says how to read it
    assert "<th>relevance_score (round 1)</th><td>0.2500</td>" in page
    assert "<td>2: cat eel</td>" in page and "<td>1: dog</td>" in page


@pytest.mark.slow
def test_a_run_directory_records_its_class_names(fedavg_runs: list[Path]) -> None:
    names = json.loads((fedavg_runs[0] / "classes.json").read_text())
    assert names == [str(d) for d in range(10)]  # scikit-learn's digits


def _privacy_section(page: str) -> str:
    """The report page's privacy section, from its heading to the next one."""
    start = page.index('<h2 id="privacy">')
    return page[start : page.index("<h2>", start)]


def test_the_privacy_panel_reads_booked_levels_and_clients_epsilon_values(tmp_path):
    """Levels come from the metrics rows' ``privacy`` field and from the clients' values
    named ``*_epsilon``, whatever plugin booked them; a run that booked none has no panel."""
    root = tmp_path / "run"
    root.mkdir()
    booked = {"epsilon": 0.5, "delta": 1e-05, "accountant": "rdp"}
    rows = [{"round": 1, "privacy": {"client": booked}},
            {"round": 2, "privacy": {"client": {**booked, "epsilon": 0.75}}}]  # fmt: skip
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    clients = [
        {"round": 1, "per_client": {"0": {"x_epsilon": 1.0, "loss": 2.0}, "1": {"x_epsilon": 3.0}}},
        {"round": 2, "per_client": {"0": {"x_epsilon": 2.0}, "1": {"x_epsilon": None}}},
    ]
    (root / "clients.jsonl").write_text("".join(json.dumps(c) + "\n" for c in clients))
    found = privacy_levels(RunData(root))
    levels = {k: [(r, b["epsilon"]) for r, b in v] for k, v in found.items()}
    assert levels == {
        "client": [(1, 0.5), (2, 0.75)],
        "sample (per client, max)": [(1, 3.0), (2, 2.0)],  # a missing value is left out
        "sample (per client, mean)": [(1, 2.0), (2, 2.0)],
    }
    section = _privacy_section(render_html(RunData(root), {}))
    assert "<tr><td>client</td><td>0.7500</td><td>1e-05</td><td>rdp</td></tr>" in section
    assert "<td>sample (per client, max)</td><td>2.0000</td><td>–</td><td>–</td>" in section
    (root / "clients.jsonl").unlink()
    (root / "metrics.jsonl").write_text(json.dumps({"round": 1, "dp_epsilon": 3.0}) + "\n")
    assert not privacy_levels(RunData(root))  # a number alone is not booked privacy
    assert 'id="privacy"' not in render_html(RunData(root), {})


def test_the_privacy_panel_says_what_the_server_saw_and_what_secure_aggregation_cost(tmp_path):
    """Rounds whose row says ``server_saw: sum`` are shown as only the sum, with the
    protocol's clients, dropped clients, messages and bytes beside the ledger's model
    bytes; a round without it as each upload. The protocol's bytes are stacked on the
    bytes plot. A DP run without secure aggregation says the server saw each upload."""
    root = tmp_path / "run"
    root.mkdir()
    mb = 2**20
    booked = {"down_model": 3 * mb, "up_model": 3 * mb}
    cost = {"clients": 3, "dropped": [], "messages": 24, "bytes_down": mb, "bytes_up": 6 * mb}
    rows = [
        {"round": 1, "bytes": booked, "server_saw": "sum", "secagg": cost},
        {"round": 2, "bytes": booked, "server_saw": "sum",
         "secagg": {**cost, "clients": 2, "dropped": [1, 4], "bytes_up": mb // 2}},
        {"round": 3, "bytes": booked},
    ]  # fmt: skip
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = RunData(root)
    assert [(r["round"], r["saw"], r["messages"]) for r in server_saw(data)] == [
        (1, "sum", 24), (2, "sum", 24), (3, "each", None)
    ]  # fmt: skip
    section = _privacy_section(render_html(data, {}))
    assert "only the sum of the uploads in 2 of 3 rounds" in section
    assert "each client's upload in the others" in section
    cells = "<td>1</td><td>only the sum</td><td>3</td><td>–</td><td>24</td>"
    assert cells + "<td>1.00</td><td>6.00</td><td>3.00</td><td>3.00</td>" in section
    assert "<td>2</td><td>only the sum</td><td>2</td><td>1 4</td><td>24</td>" in section
    assert "<td>0.50</td>" in section
    assert "<td>3</td><td>each upload</td><td>–</td><td>–</td><td>–</td><td>–</td>" in section
    plt = pyplot()
    fig = bytes_plot(plt, data)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    heights = [p.get_height() for c in fig.axes[0].containers for p in c]
    plt.close(fig)
    assert labels == ["down_model", "up_model", "SecAgg+ down", "SecAgg+ up"]
    assert heights[-3:] == [6.0, 0.5, 0.0]  # SecAgg+ up per round; round 3 had none
    ledgered = {"down_model": 3 * mb, "down_secagg": mb, "up_secagg": 6 * mb}  # decision 0029
    (root / "metrics.jsonl").write_text(json.dumps({**rows[0], "bytes": ledgered}) + "\n")
    fig = bytes_plot(plt, RunData(root))
    labels = fig.axes[0].get_legend_handles_labels()[1]
    plt.close(fig)
    assert labels == ["down_model", "down_secagg", "up_secagg"]  # not stacked twice

    dp = {"epsilon": 0.5, "delta": 1e-05, "accountant": "rdp"}
    (root / "metrics.jsonl").write_text(json.dumps({"round": 1, "privacy": {"client": dp}}))
    section = _privacy_section(render_html(RunData(root), {}))
    assert "The server saw each client's upload in every round" in section
    assert "SecAgg+ messages" not in section


@pytest.mark.slow
@pytest.mark.parametrize("combo", ["dp", "dpsgd"])
def test_the_privacy_panel_of_a_dp_run_shows_its_final_epsilon(combo: str, tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(COMBOS[combo]))
    cli_run(path, tmp_path / "run")
    section = _privacy_section((tmp_path / "run" / "report.html").read_text())
    assert 'alt="privacy"' in section
    if combo == "dp":
        final = logs.read_metrics(tmp_path / "run")[-1]["privacy"]["client"]
        row = f"<td>client</td><td>{final['epsilon']:.4f}</td><td>{final['delta']}</td>"
        assert f"{row}<td>{final['accountant']}</td>" in section
    else:
        last = logs.read_clients(tmp_path / "run")[-1]["per_client"].values()
        final = max(v["dpsgd_epsilon"] for v in last)
        assert f"<td>sample (per client, max)</td><td>{final:.4f}</td>" in section


@pytest.mark.slow
def test_a_run_without_privacy_has_no_privacy_panel(fedavg_runs: list[Path]) -> None:
    page = (fedavg_runs[0] / "report.html").read_text()
    assert 'id="privacy"' not in page and 'alt="privacy"' not in page
