"""The client as a package: a wheel and an sdist built without writing into
the source tree, and the wheel installed on its own imports with its
generated stubs and type information. No stack, no network."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

HERE = pathlib.Path(__file__).resolve().parent.parent


def _tree() -> set:
    return {
        p.relative_to(HERE)
        for p in HERE.rglob("*")
        if "__pycache__" not in p.parts and ".pytest_cache" not in p.parts
    }


def test_a_built_wheel_installs_and_imports(tmp_path):
    before = _tree()
    out = tmp_path / "dist"
    done = subprocess.run(
        [sys.executable, str(HERE / "build_dist.py"), str(out)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert _tree() == before, "the build wrote into the source tree"
    wheels = list(out.glob("latchkey-*.whl"))
    sdists = list(out.glob("latchkey-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list(out.iterdir())
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    for needed in ("latchkey/py.typed", "latchkey/lock/v1/lock_pb2.pyi", "latchkey/lock/v1/lock_pb2_grpc.py"):
        assert needed in names, needed
    target = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target", str(target), str(wheels[0])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    probe = "import latchkey, latchkey.lock.v1.lock_pb2 as p; print(latchkey.__file__); print(p.AcquireRequest.DESCRIPTOR.full_name)"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(target), "PATH": ""}
    )
    assert done.returncode == 0, done.stderr
    where, name = done.stdout.split()
    assert where.startswith(str(target)), where
    assert name == "latchkey.lock.v1.AcquireRequest"
