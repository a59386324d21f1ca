"""An installed wheel (not an editable checkout) ships every recipe: `fedkit recipes` and
`fedkit validate quickstart` work from it in a fresh virtual environment.

The fresh environment has no pip and no fedkit; the wheel is unpacked into its
site-packages (that is what installing a pure-Python wheel does), and a ``.pth`` line
lends it this environment's site-packages for torch and the other dependencies, so the
test takes seconds, not a download."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_ships_every_recipe_and_works_installed(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(dist), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("fedkit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    recipes = {p.name for p in (ROOT / "recipes").glob("*.yaml")}
    assert recipes and recipes <= {Path(n).name for n in names if n.startswith("fedkit_recipes/")}
    assert any(n.endswith("entry_points.txt") for n in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    zipfile.ZipFile(wheel).extractall(site)
    (site / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FEDKIT_RECIPES")}

    def fedkit(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(python), "-m", "fedkit", *args],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={**env, "COLUMNS": "200"},
        )

    where = subprocess.run(
        [str(python), "-c", "import fedkit, fedkit_recipes; print(fedkit.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr
    listed = fedkit("recipes")
    assert listed.returncode == 0, listed.stderr
    assert all(name[: -len(".yaml")] in listed.stdout for name in recipes)
    checked = fedkit("validate", "quickstart")
    assert checked.returncode == 0, checked.stderr
    assert "ok" in checked.stdout and str(site) in checked.stdout
