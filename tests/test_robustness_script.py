"""benchmarks/robustness.py's bookkeeping: the command a cell runs, which cells a results
file already holds, and the table and published-point lines it writes (the runs
themselves take hours and live in benchmarks/)."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import benchmark_script


@pytest.fixture(scope="module")
def robustness():
    return benchmark_script("robustness")


def sets_of(cmd: list[str]) -> dict[str, str]:
    return dict(cmd[i + 1].split("=", 1) for i, x in enumerate(cmd) if x == "--set")


def test_a_cell_runs_fedavg_with_its_attack_and_defence_and_resumes(robustness, tmp_path):
    args = robustness.parse(["--quick", "--out", str(tmp_path / "runs"), "--root", "fm"])
    assert args.out == tmp_path / "runs-quick" and args.results.name.endswith("-quick.jsonl")
    assert (args.attacks, args.defences) == (
        list(robustness.QUICK["attacks"]),
        ["none", "median", "krum"],
    )
    cmd = robustness.cell_command("alie", "krum", "dirichlet-0.5", 7, args)
    sets = sets_of(cmd)
    plugins = yaml.safe_load(sets["plugins"])
    assert plugins == ["fedavg", {"alie": {"fraction": 0.2, "seed": 7}}, {"krum": {"f": 2, "m": 8}}]
    assert "draw_seed: 7" in sets["data.partition"] and sets["data.root"] == "fm"
    assert sets["federation.rounds"] == "5" and "data.server_fraction" not in sets
    clean = sets_of(robustness.cell_command("none", "fltrust", "iid", 7, args))
    assert yaml.safe_load(clean["plugins"]) == ["fedavg", "fltrust"]
    # FLTrust's root set: 100 of the images the cell keeps (10,000 under --quick), not of 60,000
    assert round(float(clean["data.server_fraction"]) * 10000) == 100
    full = robustness.parse(["--out", str(tmp_path / "runs"), "--root", "fm"])
    root = sets_of(robustness.cell_command("none", "fltrust", "iid", 7, full))
    assert round(float(root["data.server_fraction"]) * 60000) == 100
    out = robustness.cell_out("alie", "krum", "dirichlet-0.5", 7, args)
    out.mkdir(parents=True)
    (out / "recipe.yaml").write_text("{}")
    assert robustness.cell_command("alie", "krum", "dirichlet-0.5", 7, args)[2:4] == [
        "--resume",
        str(out),
    ]
    with pytest.raises(SystemExit):
        robustness.parse(["--defences", "mean"])


def test_cells_in_the_results_file_are_skipped(robustness, tmp_path):
    results = tmp_path / "r.jsonl"
    row = {"attack": "none", "defence": "none", "partition": "iid", "seed": 42, "accuracy": 80}
    results.write_text(json.dumps(row) + "\n" + '{"attack": "cut sho')  # a killed append
    args = robustness.parse(["--quick", "--results", str(results)])
    cells = robustness.todo(args)
    assert len(cells) == 11 and ("none", "none", "iid", 42) not in cells


def test_the_table_marks_failed_defences_and_the_published_point(robustness):
    def row(attack, defence, accuracy, **more):
        base = {"attack": attack, "defence": defence, "partition": "iid", "seed": 42}
        return {**base, "accuracy": accuracy, **more}

    rows = [
        row("none", "none", 89.5),
        row("none", "krum", 88.0),
        row("sign_flip", "none", 10.0, diverged=3),
        row("sign_flip", "krum", 87.0),
        row("backdoor", "krum", 86.0, backdoor_success=93.0),
    ]
    lines = {line.split(" | ")[0]: line for line in robustness.table(rows).splitlines()}
    assert lines["| none"] == "| none | 89.5 | 88.0 |"
    assert lines["| sign_flip"] == "| sign_flip | 10.0‡ ✗ | 87.0 |"
    assert lines["| backdoor"] == "| backdoor | – | 86.0 / 93 ✗ |"
    said = robustness.published(rows).splitlines()
    assert "iid: fedkit 89.5 (n 1), paper 89.3, Flower 89.0: within ±2.0 points" in said[1]
    assert "no full-length run" in said[2]
    short = [{**rows[0], "accuracy": 50.0, "sets": ["federation.rounds=5"]}]
    assert "no full-length run" in robustness.published(short).splitlines()[1]


def test_a_paper_preset_runs_only_its_cells_and_checks_the_claim(robustness, tmp_path):
    args = robustness.parse(["--paper", "shejwalkar2021", "--out", str(tmp_path / "runs")])
    paper = robustness.PAPERS["shejwalkar2021"]
    assert args.out == tmp_path / "runs-shejwalkar2021"
    assert args.results.name == "robustness_fmnist-shejwalkar2021.jsonl"
    assert (args.attacks, args.defences, args.seeds) == (
        list(paper["attacks"]),
        list(paper["defences"]),
        list(paper["seeds"]),
    )
    assert (
        sets_of(robustness.cell_command("min_sum", "median", "iid", 1, args))["federation.rounds"]
        == "20"
    )
    assert robustness.parse(["--paper", "shejwalkar2021", "--seeds", "5"]).seeds == [5]
    with pytest.raises(SystemExit):
        robustness.parse(["--paper", "shejwalkar2021", "--quick"])

    def row(attack, defence, seed, accuracy):
        return {
            "attack": attack,
            "defence": defence,
            "partition": "iid",
            "seed": seed,
            "accuracy": accuracy,
        }

    rows = [row("none", "krum", s, 70.0) for s in (1, 2)]
    rows += [row("alie", "krum", 1, 68.0), row("alie", "krum", 2, 67.0)]  # loses 2.5
    rows += [row("min_max", "krum", 1, 60.0), row("min_max", "krum", 2, 62.0)]  # loses 9
    rows += [row("min_sum", "krum", 1, 66.0)]  # only one seed: loses 4
    rows += [row("none", "median", 1, 70.0), row("alie", "median", 1, 69.0)]
    rows += [row("min_sum", "median", 1, 68.5)]  # 1.5 points: within the noise
    said = robustness.paper_check(rows, "shejwalkar2021").splitlines()
    krum = next(line for line in said if line.strip().startswith("krum"))
    assert "alie +2.5, min_max +9.0, min_sum +4.0" in krum and krum.endswith(": agrees")
    median = next(line for line in said if line.strip().startswith("median"))
    assert median.endswith("does NOT agree")
    assert "trimmed_mean: not all cells run yet" in said[2]
    # a seed's attacked cell is judged against that seed's no-attack cell
    seeded = [row("none", "krum", 1, 80.0), row("none", "krum", 2, 60.0)]
    seeded += [row("min_max", "krum", 1, 75.0), row("min_max", "krum", 2, 55.0)]
    lines = robustness.table(seeded).splitlines()
    assert "| min_max | 65.0 |" in lines
    seeded[-1] = row("min_max", "krum", 2, 49.0)
    assert "| min_max | 62.0 ✗ |" in robustness.table(seeded).splitlines()
