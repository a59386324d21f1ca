"""Screenshots of two run reports for the docs, taken in headless Chromium.

    OMP_NUM_THREADS=1 python benchmarks/report_screenshots.py \
        --root ../shared/data/cifar10 --out runs/screenshots

Runs FedU + DAPU (``fedu-cifar10-noniid-small``: a kNN monitor every 2 rounds, a linear
probe at the end) and
IFCA (``ifca-small``) side by side on the CIFAR-10 ImageFolder at ``--root``, checks each
``report.html`` in Chromium (every image decoded, no error) and writes
``docs/images/report-fedu-dapu.png`` and ``docs/images/report-ifca.png``. Runs that have
already finished are reused. About 10 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from PIL import Image, ImageOps

DOCS = Path(__file__).resolve().parent.parent / "docs" / "images"
RUNS = {
    "report-fedu-dapu": ["fedu-cifar10-noniid-small"],
    "report-ifca": ["ifca-small"],
}


def browser() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        sys.exit("needs headless Chromium (Debian: apt-get install chromium)")
    return found


def check(chromium: str, page: Path) -> str:
    """Load the page and return its ``data-images``/``data-errors`` record; fail when an
    image did not decode or the page reported an error."""
    dom = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    found = re.search(r'data-images="(\d+)/(\d+)" data-errors="(\d+)"', dom)
    if not found or found[1] != found[2] or found[3] != "0":
        sys.exit(f"{page}: {found.group(0) if found else 'the check script did not run'}")
    return found.group(0)


def screenshot(chromium: str, page: Path, target: Path, width: int = 1100) -> None:
    """A full-length screenshot, scaled to ``width`` // 1.4 pixels wide for the docs."""
    raw = target.with_suffix(".raw.png")
    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--screenshot={raw}",
            f"--window-size={width},4200",
            page.as_uri(),
        ],
        capture_output=True,
        timeout=120,
        check=True,
    )
    image = Image.open(raw).convert("RGB")
    content = ImageOps.invert(image).getbbox()  # the page's white background ends here
    bottom = image.height if content is None else min(image.height, content[3] + 20)
    image = image.crop((0, 0, width, bottom))
    small = image.resize((int(width / 1.4), int(image.height / 1.4)), Image.Resampling.LANCZOS)
    small.save(target, optimize=True)
    raw.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="CIFAR-10 in ImageFolder layout")
    parser.add_argument("--out", type=Path, default=Path("runs/screenshots"))
    args = parser.parse_args()
    chromium = browser()
    fedkit = str(Path(sys.executable).with_name("fedkit"))
    data = ["--set", "data.dataset=imagefolder", "--set", f"data.root={args.root}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    running = {}
    for name, recipe in RUNS.items():
        out = args.out / name
        if not (out / "report.html").exists():
            cmd = [fedkit, "run", *recipe, *data, "--out", str(out), "--quiet"]
            running[name] = subprocess.Popen(cmd, env=env)
    for name, process in running.items():
        if process.wait() != 0:
            sys.exit(f"{name}: fedkit run failed")
    DOCS.mkdir(parents=True, exist_ok=True)
    for name in RUNS:
        page = (args.out / name / "report.html").resolve()
        print(name, check(chromium, page))
        screenshot(chromium, page, DOCS / f"{name}.png")


if __name__ == "__main__":
    main()
