"""Render the run's `dvc plots` to one PNG (for the README): `dvc plots show`, then headless Chromium.

    python bench/plots_png.py --repo . --out bench/learning_curve.png

Needs Debian's chromium and the offline vega bundle in .vega/ (both installed by `.ci/install --tests`).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--virtual-time-budget=15000"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", default=".", help="the pipeline's checkout (with metrics/ of a finished run)")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--size", default="1300,1900", help="window width,height in pixels")
    args = p.parse_args()
    repo, out = Path(args.repo).resolve(), Path(args.out).resolve()
    chromium = shutil.which("chromium") or sys.exit("chromium not found (apt-get install chromium)")
    subprocess.run([sys.executable, "-m", "dvc", "plots", "show"], cwd=repo, check=True, capture_output=True)
    html = repo / "dvc_plots/index.html"
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([chromium, *FLAGS, f"--user-data-dir={profile}", f"--window-size={args.size}",
                        f"--screenshot={out}", html.as_uri()], check=True, capture_output=True, timeout=300)
    print(f"wrote {out} from {html}")


if __name__ == "__main__":
    main()
