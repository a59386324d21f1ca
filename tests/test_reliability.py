"""Nothing silent, nothing lost: non-finite training stops clearly, clients without data
are excluded and reported, checkpoints are verified (a flipped byte anywhere is found,
and resume falls back or stops), damaged logs are rebuilt, recipe drift is refused, a run
directory has one writer and fedkit touches only its own files, and the machine's
refusals are one-line messages."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import checkpoint_round, run_fedkit, tiny_recipe
from typer.testing import CliRunner

from fedkit.cli.app import app
from fedkit.config.schema import validate
from fedkit.core import runs
from fedkit.core.engine import run_round
from fedkit.errors import FedkitError
from fedkit.rundir import atomic, checkpoint, logs
from fedkit.rundir.integrity import sha256_file

runner = CliRunner()
RECIPE = tiny_recipe(
    data={"num_clients": 4, "max_train": 200},
    federation={"rounds": 4, "clients_per_round": 2},
)


def invoke(*args: str):
    result = runner.invoke(app, list(args))
    assert "Traceback" not in result.output, result.output
    return result


def snapshot_files(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): sha256_file(p) for p in sorted(folder.rglob("*")) if p.is_file()
    }


# ------------------------------------------------------------------ non-finite training


@pytest.mark.parametrize("optimizer", [{"name": "adam", "lr": 1e30}, {"name": "sgd", "lr": 1e12}])
def test_a_learning_rate_that_explodes_stops_the_run_clearly(write_recipe, tmp_path, optimizer):
    path = write_recipe(tiny_recipe(federation={"optimizer": optimizer}))
    out = tmp_path / "run"
    result = invoke("run", str(path), "--out", str(out))
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "round 1: 0 of 3 clients answered" in text and "non-finite" in text
    assert "client 0" in text and f"federation.optimizer.lr = {optimizer['lr']:g}" in text
    assert checkpoint.read(out).round == 0  # the last good checkpoint is intact
    assert logs.read_metrics(out) == []


def test_the_global_model_is_checked_before_it_is_kept():
    from conftest import prepared

    from fedkit import hookimpl
    from fedkit.core.engine import run_round
    from fedkit.errors import RoundFailed

    class Poison:
        @hookimpl
        def aggregate(self, server, cluster, uploads):
            return {"classifier.bias": torch.full((10,), float("nan"))}

    run = prepared(tiny_recipe(plugins=["fedavg", "poison"]), poison=Poison())
    before = {k: v.clone() for k, v in run.server.pool[0].items()}
    with pytest.raises(RoundFailed, match="classifier.bias.*non-finite"):
        run_round(run, 1)
    assert all(torch.equal(before[k], v) for k, v in run.server.pool[0].items())


# ------------------------------------------------------------------ clients without data


def test_clients_without_data_are_reported_and_never_sampled(write_recipe, tmp_path):
    raw = tiny_recipe(
        data={
            "num_clients": 250,
            "max_train": 300,
            "partition": {"name": "dirichlet", "alpha": 0.05, "min_size": 0},
        },
        federation={"rounds": 2, "clients_per_round": 10},
        evaluation={"protocol": "none"},
    )
    out = tmp_path / "run"
    result = invoke("run", str(write_recipe(raw)), "--out", str(out))
    assert result.exit_code == 0, result.output
    sizes = {
        row["client"]: row["n_train"] for row in json.loads((out / "partition.json").read_text())
    }
    empty = [c for c, n in sizes.items() if n == 0]
    assert empty and f"{len(empty)} of 250 clients hold no training data" in result.output
    for row in logs.read_metrics(out):
        assert all(sizes[c] > 0 for c in row["clients"])
        assert row["train_loss"] > 0


# ------------------------------------------------------------------ verified checkpoints


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 4-round run, and a copy of the same run stopped after round 3
    (checkpoints of rounds 2 and 3 kept)."""
    root = tmp_path_factory.mktemp("reference")
    recipe = validate(RECIPE)
    full = runs.start(recipe, root / "full")
    runs.execute(full, root / "full")
    half = runs.start(recipe, root / "half")
    runs.commit(half, root / "half", [run_round(half, r) for r in (1,)], 1)
    for r in (2, 3):
        runs.commit(half, root / "half", [run_round(half, r)], r)
    half.close()
    return root


def results(out: Path) -> tuple:
    pool = checkpoint.read(out).pool
    flat = {f"{c}/{k}": v for c, s in pool.items() for k, v in s.items()}
    return logs.read_metrics(out), logs.read_clients(out), logs.read_ledger(out), flat


def finish(out: Path) -> None:
    run, done = runs.resume(out)
    runs.execute(run, out, done)


def same(a: tuple, b: tuple) -> bool:
    return (
        a[:3] == b[:3]
        and a[3].keys() == b[3].keys()
        and all(torch.equal(a[3][k], b[3][k]) for k in a[3])
    )


def damageable(half: Path) -> list[str]:
    """Every file a resume reads: the newest checkpoint's, its client files, logs, copies."""
    names = [
        str(p.relative_to(half)) for p in sorted((half / "checkpoints").rglob("*")) if p.is_file()
    ]
    names += [str(p.relative_to(half)) for p in sorted((half / "clients").glob("*"))]
    names += [*logs.LOGS, logs.RECIPE]
    return [n for n in names if (half / n).stat().st_size > 0]


@pytest.mark.slow
def test_a_flipped_byte_in_any_file_is_found_and_never_used(reference, tmp_path):
    expected = results(reference / "full")
    outcomes = {}
    for name in damageable(reference / "half"):
        out = tmp_path / name.replace("/", "_")
        shutil.copytree(reference / "half", out)
        data = bytearray((out / name).read_bytes())
        data[len(data) // 2] ^= 0x40
        (out / name).write_bytes(bytes(data))
        try:
            finish(out)
        except FedkitError as exc:  # a clear stop is allowed: never a silent continue
            outcomes[name] = f"stopped: {exc}"
            assert "damaged" in str(exc) or "differs" in str(exc), exc
            continue
        assert same(results(out), expected), name
        outcomes[name] = "identical"
    assert sum(o == "identical" for o in outcomes.values()) >= len(outcomes) // 2, outcomes
    assert outcomes["checkpoints/round-0003/pool.safetensors"] == "identical"  # fell back


def test_a_damaged_newest_checkpoint_falls_back_and_says_so(reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference / "half", out)
    (out / "checkpoints" / "round-0003" / "pool.safetensors").write_bytes(b"")
    run, done = runs.resume(out)
    assert done == 2
    assert any("round-0003 is damaged" in note and "pool.safetensors" in note for note in run.notes)
    runs.execute(run, out, done)
    assert same(results(out), results(reference / "full"))


def test_no_intact_checkpoint_is_a_clear_stop(reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference / "half", out)
    for folder in checkpoint.folders(out):
        (folder / "state.json").write_text("{}")
    result = invoke("run", "--resume", str(out))
    assert result.exit_code == 2 and "no intact checkpoint" in result.output


@pytest.mark.parametrize("damage", ["delete", "truncate", "drop_row"])
def test_a_damaged_metrics_log_is_rebuilt_and_reported(reference, tmp_path, damage):
    out = tmp_path / "run"
    shutil.copytree(reference / "half", out)
    path = out / logs.METRICS
    lines = path.read_text().splitlines(keepends=True)
    if damage == "delete":
        path.unlink()
    elif damage == "truncate":
        path.write_text("".join(lines)[:40])
    else:
        path.write_text("".join(lines[:1] + lines[2:]))
    run, done = runs.resume(out)
    assert done == 3 and any("metrics.jsonl was damaged or missing" in n for n in run.notes)
    runs.execute(run, out, done)
    assert same(results(out), results(reference / "full"))


def test_temporary_files_of_a_killed_write_are_removed(reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference / "half", out)
    leftovers = [
        out / ".metrics.jsonl.x1y2z3.tmp",
        out / "clients" / ".0.r000003.safetensors.ab_9.tmp",
    ]
    for path in leftovers:
        path.write_bytes(b"half a write")
    keep = out / "notes.tmp"  # not a name fedkit gives temporary files
    keep.write_text("mine")
    finish(out)
    assert not any(p.exists() for p in leftovers) and keep.read_text() == "mine"


# ------------------------------------------------------------------ recipe drift


def test_an_edited_recipe_is_refused_with_the_changes(reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference / "half", out)
    text = (out / "recipe.yaml").read_text().replace("lr: 0.003", "lr: 0.1")
    (out / "recipe.yaml").write_text(text)
    before = snapshot_files(out)
    result = invoke("run", "--resume", str(out))
    assert result.exit_code == 2
    assert "federation.optimizer.lr: 0.003 → 0.1" in " ".join(result.output.split())
    assert snapshot_files(out) == before


def test_a_run_from_before_a_new_recipe_key_resumes_with_its_default(reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference / "half", out)
    saved = checkpoint.read(out).sidecar["recipe"]
    del saved["data"]["standardize"]  # what a fedkit without data.standardize wrote
    old = yaml.safe_load((out / "recipe.yaml").read_text())
    del old["data"]["standardize"]
    (out / "recipe.yaml").write_text(yaml.safe_dump(old))
    recipe, notes = runs.resumed_recipe(out, saved, [])
    assert recipe.data.standardize is True and notes == []
    edited = json.loads(json.dumps(saved))
    edited["data"]["standardize"] = False  # one copy naming another value is a change
    with pytest.raises(FedkitError, match="data.standardize: False → True"):
        runs.resumed_recipe(out, edited, [])


def test_resume_accepts_only_safe_changes_and_extends_a_finished_run(reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference / "full", out)
    refused = invoke("run", "--resume", str(out), "--set", "federation.optimizer.lr=0.1")
    assert refused.exit_code == 2 and "only federation.rounds or evaluation" in refused.output
    shorter = invoke("run", "--resume", str(out), "--set", "federation.rounds=2")
    assert shorter.exit_code == 2 and "at least 4" in shorter.output
    longer = invoke("run", "--resume", str(out), "--set", "federation.rounds=6")
    assert longer.exit_code == 0, longer.output
    assert [r["round"] for r in logs.read_metrics(out)] == [1, 2, 3, 4, 5, 6]
    assert "rounds: 6" in (out / "recipe.yaml").read_text()


@pytest.mark.parametrize("damage", ["truncate", "binary"])
def test_a_damaged_recipe_file_is_named_and_rebuilt_from_the_checkpoint(
    reference, tmp_path, damage
):
    out = tmp_path / "run"
    shutil.copytree(reference / "half", out)
    if damage == "truncate":  # still YAML, so it reads as a changed recipe: refused
        (out / "recipe.yaml").write_text((out / "recipe.yaml").read_text()[:50])
        refused = invoke("run", "--resume", str(out))
        assert refused.exit_code == 2 and "changed since its checkpoint" in refused.output
        (out / "recipe.yaml").unlink()  # as the message says: delete it to rebuild it
    else:
        (out / "recipe.yaml").write_bytes(bytes(range(256)))
    run, done = runs.resume(out)
    assert any("recipe.yaml was missing or unreadable" in n for n in run.notes)
    runs.execute(run, out, done)
    assert same(results(out), results(reference / "full"))


# ------------------------------------------------------------------ ownership


def test_an_existing_directory_of_someone_else_is_left_alone(write_recipe, tmp_path):
    out = tmp_path / "mine"
    (out / "checkpoints" / "round-0007").mkdir(parents=True)
    (out / "notes.txt").write_text("my notes")
    (out / "summary.json").write_text('{"mine": true}')
    (out / "checkpoints" / "round-0007" / "model.pt").write_bytes(b"weights")
    before = snapshot_files(out)
    result = invoke("run", str(write_recipe(RECIPE)), "--out", str(out))
    assert result.exit_code == 2 and "not a fedkit run" in result.output
    assert snapshot_files(out) == before and not (out / "run.lock").exists()


SLOW = tiny_recipe(federation={"rounds": 30}, faults={"straggler": 1.0, "delay": 1.0})
"""A run that takes over a minute: every client sleeps a second each round."""


@pytest.mark.slow
def test_a_second_writer_is_refused_while_a_run_is_live(write_recipe, tmp_path):
    path = write_recipe(SLOW)
    out = tmp_path / "run"
    proc = run_fedkit("run", str(path), "--out", str(out), wait=False)
    try:
        deadline = time.monotonic() + 120
        while checkpoint.latest_round(out) is None:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        again = CliRunner().invoke(app, ["run", "--resume", str(out)])
        message = f"in use by another fedkit process (pid {proc.pid})"
        assert again.exit_code == 2 and message in " ".join(again.output.split())
        other = CliRunner().invoke(app, ["run", str(path), "--out", str(out)])
        assert other.exit_code == 2 and "in use" in other.output
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_ctrl_c_exits_130_and_says_how_to_resume(write_recipe, tmp_path):
    path = write_recipe(SLOW)
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedkit", "run", str(path), "--out", str(out)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        # a shell without job control starts background jobs with Ctrl-C ignored, and
        # the child would inherit that: give it the terminal's default, as a user has
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while checkpoint.latest_round(out) is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert f"fedkit run --resume {out}" in " ".join(err.split())
    assert "Traceback" not in err


# ------------------------------------------------------------------ the machine says no


def test_out_that_is_a_file_or_under_a_file(write_recipe, tmp_path):
    path = write_recipe(RECIPE)
    afile = tmp_path / "afile"
    afile.write_text("x")
    is_file = invoke("run", str(path), "--out", str(afile))
    assert is_file.exit_code == 2 and str(afile) in is_file.output
    under = invoke("run", str(path), "--out", str(afile / "run"))
    assert under.exit_code == 2 and "a part of this path is a file" in under.output
    assert afile.read_text() == "x"


@pytest.mark.slow
@pytest.mark.parametrize(
    "code,advice",
    [
        (errno.ENOSPC, "free some space"),
        (errno.EROFS, "read-only"),
        (errno.EACCES, "no permission"),
    ],
)
def test_a_refusing_disk_is_one_line_and_keeps_the_last_checkpoint(
    reference, tmp_path, monkeypatch, code, advice
):
    out = tmp_path / "run"
    shutil.copytree(reference / "half", out)
    before = snapshot_files(out / "checkpoints" / "round-0003")
    real = atomic.write_bytes

    def refuse(path, data):
        if "round-0004" in str(path):
            raise OSError(code, os.strerror(code), str(path))
        return real(path, data)

    monkeypatch.setattr(atomic, "write_bytes", refuse)
    monkeypatch.setattr(checkpoint, "write_bytes", refuse)
    result = invoke("run", "--resume", str(out))
    assert result.exit_code == 2 and advice in result.output and "round-0004" in result.output
    assert snapshot_files(out / "checkpoints" / "round-0003") == before
    assert checkpoint.read(out).round == 3


# ------------------------------------------------------------------ smaller things


def test_eval_of_an_unfinished_run_says_so(reference):
    result = invoke(
        "eval", str(reference / "half"), "--protocol", "knn", "--set", "evaluation.max_eval=50"
    )
    assert result.exit_code == 0, result.output
    assert "stopped after round 3 of 4" in result.output


def test_a_binary_file_among_recipes_is_listed_not_fatal(tmp_path, monkeypatch):
    (tmp_path / "broken.yaml").write_bytes(bytes(range(256)))
    monkeypatch.setenv("FEDKIT_RECIPES", str(tmp_path))
    result = invoke("recipes")
    assert result.exit_code == 0 and "not a text file" in result.output


# ------------------------------------------------------------------ recipes that cannot work


@pytest.mark.parametrize(
    "override, named",
    [
        ("seed=-7", "seed"),
        ("federation.min_clients=3", "min_clients (3) at most clients_per_round (2)"),
        ("data.num_clients=2", "min_clients (3) at most data.num_clients (2)"),
        ("plugins=[fedavg, fedbn]", "a backbone with BatchNorm layers"),
    ],
)
def test_a_recipe_that_cannot_work_is_refused_before_round_one(
    write_recipe, tmp_path, override, named
):
    raw = copy_recipe(RECIPE)
    if override.startswith("data.num_clients"):
        raw["federation"] = {**raw["federation"], "min_clients": 3, "clients_per_round": 3}
    if "fedbn" in override:
        raw["backbone"] = {"name": "test_convnext"}  # LayerNorm, no BatchNorm
        raw["data"] = {**raw["data"], "image_size": 32}
    out = tmp_path / "run"
    result = invoke("run", str(write_recipe(raw)), "--out", str(out), "--set", override)
    assert result.exit_code == 2 and named in result.output, result.output
    assert not (out / "metrics.jsonl").exists()


def copy_recipe(raw: dict) -> dict:
    return json.loads(json.dumps(raw))


def test_a_quorum_message_without_failures_has_no_empty_list():
    from fedkit.core.engine import RoundFailed, check_quorum, prepare

    run = prepare(validate(RECIPE))
    run.record.round = 1
    with pytest.raises(RoundFailed) as caught:
        check_quorum(run, [], [])
    assert "; ." not in str(caught.value) and "(1). " in str(caught.value)


@pytest.mark.parametrize("name", ["fedavg", "fedkit", "fedkit_extra", "torch", "json", "os"])
def test_new_plugin_refuses_a_name_something_installed_answers_to(tmp_path, name):
    result = invoke("new-plugin", name, "--dir", str(tmp_path))
    assert result.exit_code == 2 and "choose another name" in result.output
    assert list(tmp_path.iterdir()) == []


def test_new_plugin_on_a_full_disk_leaves_nothing_and_a_retry_works(tmp_path, monkeypatch):
    original, written = Path.write_text, []

    def full(self, *args, **kwargs):
        if len(written) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        written.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    result = invoke("new-plugin", "myprox", "--dir", str(tmp_path))
    assert result.exit_code == 2 and "No space left" in result.output
    assert list(tmp_path.iterdir()) == []  # no partial package, no staging folder
    monkeypatch.setattr(Path, "write_text", original)
    again = invoke("new-plugin", "myprox", "--dir", str(tmp_path))
    assert again.exit_code == 0 and (tmp_path / "myprox" / "myprox" / "plugin.py").is_file()


@pytest.mark.slow
def test_a_runs_numbers_do_not_depend_on_the_processes_thread_count():
    """Clients train at ``engine.num_cpus`` threads; more threads would change the sums'
    order (the 8th digit of the loss here)."""
    from fedkit.core.engine import prepare

    def rows(threads: int, num_cpus: float = 1.0):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            run = prepare(validate({**RECIPE, "engine": {"num_cpus": num_cpus}}))
            return [run_round(run, r) for r in (1, 2)]
        finally:
            torch.set_num_threads(before)

    assert rows(2) == rows(1)
    assert rows(1, num_cpus=2)[-1]["train_loss"] != rows(1)[-1]["train_loss"]  # it can fail


def test_run_files_have_the_mode_an_ordinary_write_gives(tmp_path):
    """Not mkstemp's 0600: a colleague the umask lets in can report, evaluate, resume."""
    plain = tmp_path / "plain"
    plain.write_text("x")
    out = tmp_path / "run"
    runs.execute(runs.start(validate(RECIPE), out), out)
    modes = {p.stat().st_mode & 0o777 for p in out.rglob("*") if p.is_file()}
    assert modes == {plain.stat().st_mode & 0o777} == {atomic.FILE_MODE}


def test_two_packages_registering_one_plugin_name_are_refused_naming_both(monkeypatch):
    from importlib.metadata import EntryPoint

    from fedkit.plugin import entrypoints

    mine = EntryPoint("fedavg", "my_fedavg.plugin:FedAvg", "fedkit")
    real = entrypoints.entry_points

    def doubled(group: str):
        return [*real(group=group), mine]

    monkeypatch.setattr(entrypoints, "entry_points", doubled)
    with pytest.raises(FedkitError, match="fedkit_plugins.fedavg:FedAvg.*my_fedavg.plugin"):
        entrypoints.discover()
    for args in (["plugins"], ["plugins", "--check"], ["run", "quickstart", "--out", "x"]):
        result = invoke(*args)
        assert result.exit_code == 2 and "two installed packages" in result.output, args


def test_eval_says_which_checkpoint_it_scored_when_the_newest_is_damaged(tmp_path):
    out = tmp_path / "run"
    runs.execute(runs.start(validate(RECIPE), out), out)
    newest = checkpoint.latest_folder(out)
    (newest / "pool.safetensors").write_bytes(b"")  # truncated
    result = invoke("eval", str(out), "--protocol", "knn", "--set", "evaluation.knn_k=5")
    assert result.exit_code == 0, result.output
    scored = json.loads(result.stdout.strip().splitlines()[-1])
    older = int(checkpoint.folders(out)[1].name.split("-")[1])
    assert scored["round"] == older < 4
    assert f"{newest.name} is damaged" in result.output
    assert f"scored the checkpoint of round {older} instead" in result.output
    assert logs.read_evaluations(out)[-1]["round"] == older


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    raw = {**RECIPE, "federation": {**RECIPE["federation"], "rounds": 2}}
    runs.execute(runs.start(validate(raw), out), out)
    return out


DAMAGE = {
    "metrics.jsonl cut mid-line": ("metrics.jsonl", b'{"round": 1, "train_lo'),
    "metrics.jsonl binary": ("metrics.jsonl", bytes(range(128, 256))),
    "metrics.jsonl foreign list row": ("metrics.jsonl", None, b"[1, 2]\n"),
    "metrics.jsonl foreign object row": ("metrics.jsonl", None, b'{"a": 1}\n'),
    "clients.jsonl foreign row": ("clients.jsonl", None, b"[3]\n"),
    "ledger.jsonl binary": ("ledger.jsonl", bytes(range(128, 256))),
    "partition.json corrupt": ("partition.json", b"{not json"),
    "summary.json corrupt": ("summary.json", b"[1,"),
    "summary.json a list": ("summary.json", b"[1]"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DAMAGE))
def test_report_and_compare_name_a_damaged_file_without_a_traceback(finished_run, tmp_path, case):
    name, replace, *append = DAMAGE[case]
    damaged = tmp_path / "damaged"
    shutil.copytree(finished_run, damaged)
    if replace is not None:
        (damaged / name).write_bytes(replace)
    else:
        with open(damaged / name, "ab") as handle:
            handle.write(append[0])
    for args in (
        ["report", str(damaged)],
        ["compare", str(finished_run), str(damaged), "--out", str(tmp_path / "c")],
    ):
        result = invoke(*args)
        assert result.exit_code == 2 and str(damaged / name) in result.output, (args, result.output)


@pytest.mark.slow
def test_report_shows_a_recipe_that_is_not_text(finished_run, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(finished_run, damaged)
    (damaged / "recipe.yaml").write_bytes(bytes(range(128, 256)))
    assert invoke("report", str(damaged)).exit_code == 0
    assert (
        invoke("compare", str(finished_run), str(damaged), "--out", str(tmp_path / "c")).exit_code
        == 0
    )


@pytest.mark.slow
def test_sigterm_exits_143_with_a_resume_line_and_the_checkpoint_intact(write_recipe, tmp_path):
    raw = {**RECIPE, "federation": {**RECIPE["federation"], "rounds": 30}}
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "fedkit", "run", str(write_recipe(raw)), "--out", str(out)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while checkpoint_round(out) < 1:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    stderr = proc.communicate(timeout=60)[1].decode()
    assert proc.returncode == 143
    assert stderr.strip().endswith(f"continue with: fedkit run --resume {out}")
    assert "Traceback" not in stderr
    assert checkpoint.read(out).round >= 1


@pytest.mark.slow
def test_a_checkpoint_of_another_run_is_ignored_and_resume_falls_back_to_its_own(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    short = {**RECIPE, "federation": {**RECIPE["federation"], "rounds": 2}}
    runs.execute(runs.start(validate(short), ours), ours)
    runs.execute(runs.start(validate({**RECIPE, "seed": 5}), theirs), theirs)
    shutil.copytree(theirs / "checkpoints" / "round-0004", ours / "checkpoints" / "round-0004")
    for path in (theirs / "clients").iterdir():  # with its client files
        if not (ours / "clients" / path.name).exists():
            shutil.copy(path, ours / "clients" / path.name)
    snapshot = checkpoint.read(ours)
    assert snapshot.round == 2 and "round-0004 was written by another run" in snapshot.notes[0]
    result = invoke("run", "--resume", str(ours), "--set", "federation.rounds=4")
    assert result.exit_code == 0, result.output
    assert [r["round"] for r in logs.read_metrics(ours)] == [1, 2, 3, 4]


def test_os_errors_name_the_file_and_advise_for_the_command_given():
    from fedkit.cli.app import os_message

    full = OSError(errno.ENOSPC, "No space left on device", "/runs/x/metrics.jsonl")
    assert os_message(full).endswith("free some space or choose another --out")
    assert "then resume again" in os_message(full, resuming=True)
    readonly = OSError(errno.EROFS, "Read-only file system", "/runs/x/summary.json")
    assert "copy the run directory" in os_message(readonly, resuming=True)
    nameless = ConnectionError("ray client connection timeout")
    assert (
        os_message(nameless)
        == "ray client connection timeout — check the address, and that the server runs"
    )
    assert "a file" not in os_message(nameless)


def test_a_failed_write_names_the_file_it_was_writing(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", full)
    target = tmp_path / "summary.json"
    with pytest.raises(OSError) as caught:
        atomic.write_text(target, "{}")
    assert caught.value.filename == str(target) and caught.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []  # no temporary file left


def test_a_ray_address_nobody_answers_at_is_a_recipe_error(monkeypatch):
    ray = pytest.importorskip("ray")
    from fedkit.core.engine import prepare
    from fedkit.errors import RecipeError

    def refuse(**options):
        raise ConnectionError("ray client connection timeout")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    raw = {**RECIPE, "engine": {"executor": "ray", "address": "ray://127.0.0.1:1"}}
    with pytest.raises(RecipeError, match=r"engine.address.*ray://127.0.0.1:1.*connection timeout"):
        prepare(validate(raw))
