"""Regenerates the gRPC stubs under src/latchkey from the repository's proto/.

    python3 clients/python/generate.py            # rewrite the committed stubs
    python3 clients/python/generate.py --out DIR  # write them under DIR instead

The stubs are committed (so `pip install` needs no protoc); the test
tests/test_generated.py regenerates them into a temporary directory and fails
if they differ from the committed ones.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
PROTO_ROOT = HERE.parent.parent / "proto"
PACKAGE_ROOT = HERE / "src"
# lock.v1 and election.v1: the client makes no admin.v1 calls.
PROTOS = ["latchkey/lock/v1/lock.proto", "latchkey/election/v1/election.proto"]
# Generated files, relative to the output root.
GENERATED = [
    "latchkey/lock/v1/lock_pb2.py",
    "latchkey/lock/v1/lock_pb2.pyi",
    "latchkey/lock/v1/lock_pb2_grpc.py",
    "latchkey/election/v1/election_pb2.py",
    "latchkey/election/v1/election_pb2.pyi",
    "latchkey/election/v1/election_pb2_grpc.py",
]


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    """Runs protoc (grpcio-tools) for PROTOS into `out`; returns the files written."""
    from grpc_tools import protoc  # a build-time tool, not a runtime dependency

    import importlib.resources

    well_known = importlib.resources.files("grpc_tools") / "_proto"
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *PROTOS,
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}: {' '.join(args)}")
    return [out / name for name in GENERATED]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=PACKAGE_ROOT)
    args = parser.parse_args()
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
