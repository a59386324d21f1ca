"""Packaging: what a wheel ships and the name it ships under.

- Every folder of Python code under ``fedkit/``, ``plugins/`` and ``recipes/`` is a package
  that ``pyproject.toml`` lists (setuptools cannot discover ``plugins/`` as
  ``fedkit_plugins``), and the built wheel holds every module and every recipe.
- The wheel, installed in a fresh virtual environment outside the checkout, imports every
  one of its modules (``fedkit.flower`` with Flower's), runs a round and answers
  ``fedkit deploy --help`` with the checkout not importable. The environment
  borrows the dependencies (torch, Ray, Flower...) from this one through a folder of links
  that leaves out this environment's own fedkit, so the test takes seconds, not a download.
- The distribution is ``fedkit-fl``: ``fedkit`` on the package index is another project's,
  so no doc, error message, generated Flower app or plugin template names it as something
  to install or depend on.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib.metadata import distribution
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedkit.cli.app import app
from fedkit.plugin.entrypoints import DISTRIBUTION

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
BUILT_IN = sorted(PYPROJECT["project"]["entry-points"]["fedkit"])


def source_files(folder: Path) -> list[Path]:
    """The files a package folder ships: its modules and, for recipes, the YAML files."""
    return [
        p
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.suffix in (".py", ".yaml") and "__pycache__" not in p.parts
    ]


def packages_on_disk() -> set[str]:
    """Every folder holding Python code, named as it is imported (``plugins`` →
    ``fedkit_plugins``)."""
    found = set()
    for package, folder in SETUPTOOLS["package-dir"].items():
        for path in source_files(ROOT / folder):
            if path.suffix == ".py":
                relative = path.parent.relative_to(ROOT / folder).parts
                found.add(".".join((package, *relative)))
    return found


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(SETUPTOOLS["packages"])
    on_disk = packages_on_disk()
    assert "fedkit.flower" in on_disk
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - on_disk == set(), "these listed packages have no folder"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built without network from a copy of the checkout (the build leaves
    ``build/`` and an ``.egg-info`` beside the sources, so not in the checkout itself)."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    skip = shutil.ignore_patterns("__pycache__")
    for folder in SETUPTOOLS["package-dir"].values():
        shutil.copytree(ROOT / folder, source / folder, ignore=skip)
    dist = tmp_path_factory.mktemp("dist")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["--no-index", "-w", str(dist), str(source)],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr
    (found,) = dist.glob("*.whl")
    return found


@pytest.mark.slow
def test_the_wheel_holds_every_module_and_recipe_under_its_name(wheel):
    assert wheel.name.startswith(DISTRIBUTION.replace("-", "_") + "-")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        "/".join((package.replace(".", "/"), *path.relative_to(ROOT / folder).parts))
        for package, folder in SETUPTOOLS["package-dir"].items()
        for path in source_files(ROOT / folder)
    }
    assert {"fedkit/flower/runner.py", "fedkit_recipes/quickstart.yaml"} <= expected
    assert sorted(expected - names) == []
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    assert f"\nName: {DISTRIBUTION}\n" in zipfile.ZipFile(wheel).read(metadata).decode()


def lend_dependencies(venv_site: Path, lent: Path) -> None:
    """Make this environment's installed packages importable in the fresh one, except
    this environment's fedkit (its dist-info, the editable finder and ``.pth``), whose
    metadata and import hook would otherwise leak in beside the wheel's."""
    here = Path(sysconfig.get_paths()["purelib"])
    lent.mkdir()
    own = re.compile(r"(fedkit.*\.(dist|egg)-info|__editable__.*|.*fedkit.*\.pth|__pycache__)$")
    for entry in here.iterdir():
        if not own.match(entry.name):
            (lent / entry.name).symlink_to(entry)
    (venv_site / "zz_lent.pth").write_text(f"{lent}\n")


@pytest.mark.slow
def test_the_wheel_installed_in_a_fresh_venv_imports_every_module_and_runs(wheel, tmp_path):
    pytest.importorskip("flwr", reason="the flower extra is not installed")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
        + ["--no-index", str(wheel)],
        capture_output=True,
        text=True,
    )
    assert installed.returncode == 0, installed.stderr
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    lend_dependencies(site, tmp_path / "lent")
    work = tmp_path / "work"  # outside the checkout: nothing of it on sys.path
    work.mkdir()
    keep = ("PATH", "HOME", "TMPDIR", "LANG", "FEDKIT_CACHE_DIR")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env |= {"OMP_NUM_THREADS": "1", "FEDKIT_REPORT": "0", "COLUMNS": "200"}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"

    def call(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, cwd=work, env=env)

    probe = call(
        str(python),
        "-c",
        "import json, fedkit, fedkit_plugins, fedkit_recipes\n"
        "from importlib.metadata import distributions, entry_points, version\n"
        "plugins = [d for d in distributions() if d.entry_points.select(group='fedkit')]\n"
        "print(json.dumps({'fedkit': fedkit.__file__, 'plugins': fedkit_plugins.__file__,"
        f" 'recipes': fedkit_recipes.__file__, 'version': version({DISTRIBUTION!r}),"
        " 'entry_points': sorted(ep.name for ep in entry_points(group='fedkit')),"
        " 'registered_by': [str(d.locate_file('')) for d in plugins]}))",
    )
    assert probe.returncode == 0, probe.stderr
    where = json.loads(probe.stdout)
    for key in ("fedkit", "plugins", "recipes"):
        assert where[key].startswith(str(site)), where
    assert where["entry_points"] == BUILT_IN
    assert where["registered_by"] == [str(site)]  # no metadata leaks in from this venv
    assert where["version"] == PYPROJECT["project"]["version"]

    fedkit = str(venv / "bin" / "fedkit")
    assert (venv / "bin" / "fedkit").is_file()
    listed = call(fedkit, "recipes")  # the recipes ship as package data
    assert listed.returncode == 0, listed.stderr
    shipped = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
    assert [name for name in shipped if name not in listed.stdout] == []
    imported = call(
        str(python),
        "-c",
        "import importlib, pkgutil, fedkit, fedkit_plugins\n"
        "names = [m.name for p in (fedkit, fedkit_plugins)"
        " for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.')"
        " if not m.name.endswith('.__main__')]\n"
        "[importlib.import_module(name) for name in names]\n"
        "print(len(names), *sorted(n for n in names if n.startswith('fedkit.flower.')))",
    )
    assert imported.returncode == 0, imported.stderr[-4000:]
    count, *flower = imported.stdout.split()
    modules = [p for p in source_files(ROOT / "fedkit") if p.suffix == ".py"]
    assert "fedkit.flower.runner" in flower and int(count) >= len(modules) - 1  # __main__
    helped = call(fedkit, "deploy", "--help")
    assert helped.returncode == 0, helped.stderr
    assert all(command in helped.stdout for command in ("node", "app", "run"))
    out = tmp_path / "run"
    ran = call(
        fedkit, "run", "quickstart", "--set", "federation.rounds=1",
        "--out", str(out), "-q", "--no-report",
        # a smaller round (the quickstart's defaults take 2-3 times as long under load)
        "--set", "federation.local_epochs=1", "--set", "data.max_train=300",
        "--set", "federation.clients_per_round=4",
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr[-4000:]
    rows = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(row)["round"] for row in rows] == [1]


def test_the_built_in_plugins_are_registered_once_by_this_distribution():
    points = distribution(DISTRIBUTION).entry_points
    assert sorted(ep.name for ep in points if ep.group == "fedkit") == BUILT_IN
    assert PYPROJECT["project"]["name"] == DISTRIBUTION == "fedkit-fl"


FORBIDDEN = {
    "a requirement on `fedkit[extra]`": re.compile(r"(?<![\w.-])fedkit\[[a-z]"),
    "`pip install fedkit`": re.compile(r"pip install\s+(-\S+\s+)*['\"]?fedkit(?![\w-])"),
    "a versioned requirement on `fedkit`": re.compile(r"['\"]fedkit\s*(>=|==|~=|<|>|!=)"),
    "a metadata lookup of `fedkit`": re.compile(
        r"\b(version|distribution|metadata|requires|files)\(\s*['\"]fedkit['\"]\s*\)"
    ),
}


def named_files() -> list[Path]:
    """Everything that tells someone what to install or depend on."""
    patterns = ["README.md", "Makefile", "pyproject.toml", "mkdocs.yml", ".ci/*"]
    patterns += ["docs/**/*.md", "fedkit/**/*.py", "plugins/**/*.py", "recipes/*.yaml"]
    patterns += ["benchmarks/*.py", "benchmarks/*.md", "tests/*.py"]
    files = {p for pattern in patterns for p in ROOT.glob(pattern) if p.is_file()}
    return sorted(files - {Path(__file__).resolve()})


def test_nothing_tells_anyone_to_install_the_name_fedkit():
    found = [
        f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}: {what}"
        for path in named_files()
        for text in [path.read_text(errors="replace")]
        for what, pattern in FORBIDDEN.items()
        for m in pattern.finditer(text)
    ]
    assert found == []
    assert len(named_files()) > 50  # the globs found the tree


def test_every_install_line_in_the_docs_names_the_distribution():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    wheel_file = re.escape(DISTRIBUTION.replace("-", "_")) + r"-[\w.]+-py3-none-any\.whl"
    ours = re.compile(rf"({re.escape(DISTRIBUTION)}|([\w.-]+/)*{wheel_file})(\[[\w,]+\])?")
    named = []
    for page in pages:
        for m in re.finditer(r"pip install\s+(?:-\S+\s+)*['\"]?([^\s'\"`)]+)", page.read_text()):
            requirement = m.group(1)
            if requirement.startswith((".", "/")) or "fedkit" not in requirement:
                continue  # a folder (`pip install -e .`) or another project (`pandas`)
            assert ours.fullmatch(requirement), f"{page.relative_to(ROOT)}: {m.group(0)}"
            named.append(page.name)
    assert {"README.md", "install.md", "deploy.md"} <= set(named)
    install = (ROOT / "docs" / "install.md").read_text()
    assert "import name" in install and f"pip install '{DISTRIBUTION}[flower]'" in install


def test_the_flower_app_and_the_plugin_template_depend_on_the_distribution(tmp_path):
    made = CliRunner().invoke(app, ["deploy", "app", str(tmp_path / "app")])
    assert made.exit_code == 0, made.output
    flower_app = tomllib.loads((tmp_path / "app" / "pyproject.toml").read_text())
    assert flower_app["project"]["dependencies"] == [f"{DISTRIBUTION}[flower]"]

    made = CliRunner().invoke(app, ["new-plugin", "myprox", "--dir", str(tmp_path)])
    assert made.exit_code == 0, made.output
    plugin = tomllib.loads((tmp_path / "myprox" / "pyproject.toml").read_text())
    version = PYPROJECT["project"]["version"]
    assert plugin["project"]["dependencies"] == [f"{DISTRIBUTION}>={version}"]
    assert "fedkit" in plugin["project"]["entry-points"]  # the group keeps its name


def test_a_missing_flower_extra_names_the_distribution(monkeypatch):
    from fedkit.errors import RecipeError
    from fedkit.flower import import_flwr

    monkeypatch.setitem(sys.modules, "flwr", None)  # `import flwr` raises ImportError
    with pytest.raises(RecipeError, match=re.escape(f"pip install '{DISTRIBUTION}[flower]'")):
        import_flwr()
