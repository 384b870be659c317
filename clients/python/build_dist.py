#!/usr/bin/env python3
"""Builds the client's wheel and sdist into OUT without writing into the
source tree: setuptools leaves build/ and an .egg-info beside the sources it
builds, so the build runs on a copy in a temporary directory.

    python3 clients/python/build_dist.py OUT
    pip install OUT/latchkey-*.whl

Needs only setuptools (no network: the build is not isolated)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = pathlib.Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="latchkey-dist-") as tmp:
        tree = pathlib.Path(tmp) / "latchkey"
        tree.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(HERE / name, tree / name)
        shutil.copytree(
            HERE / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
        )
        dist = pathlib.Path(tmp) / "dist"
        build = (
            "import sys\n"
            "from setuptools import build_meta as b\n"
            # Taken first: the build rewrites sys.argv as it goes.
            "out = sys.argv[1]\n"
            "print(b.build_wheel(out))\n"
            "print(b.build_sdist(out))\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", build, str(dist)], cwd=tree, capture_output=True, text=True
        )
        if done.returncode != 0:
            sys.stderr.write(done.stdout + done.stderr)
            return 1
        for artifact in dist.iterdir():
            shutil.copy2(artifact, out / artifact.name)
            print(out / artifact.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
