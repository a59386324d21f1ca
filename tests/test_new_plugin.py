"""`fedkit new-plugin myprox` makes a package that installs (`pip install -e`) and whose
tests pass as generated, in a fresh virtual environment."""

from __future__ import annotations

import subprocess
import sys
import sysconfig

import pytest
from typer.testing import CliRunner

from fedkit.cli.app import app

pytestmark = pytest.mark.slow  # installs a generated package and runs its tests in a subprocess


def test_a_new_plugin_installs_and_its_tests_pass(tmp_path):
    made = CliRunner().invoke(app, ["new-plugin", "myprox", "--dir", str(tmp_path)])
    assert made.exit_code == 0, made.output
    package = tmp_path / "myprox"
    assert (package / "myprox" / "plugin.py").is_file() and (package / "recipes").is_dir()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    here = sysconfig.get_paths()["purelib"]  # pip, fedkit, torch, pytest: lent, not downloaded
    (tmp_path / "venv" / purelib.split(str(venv) + "/", 1)[1] / "lend.pth").write_text(
        f"import site; site.addsitedir({here!r})\n"
    )
    install = subprocess.run(
        [
            python,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-e",
            str(package),
        ],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stderr
    tested = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(package)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "5 passed" in tested.stdout
    again = CliRunner().invoke(app, ["new-plugin", "myprox", "--dir", str(tmp_path)])
    assert again.exit_code == 2 and "already exists" in again.output
    bad = CliRunner().invoke(app, ["new-plugin", "My-Prox", "--dir", str(tmp_path)])
    assert bad.exit_code == 2 and "cannot name a plugin" in bad.output
