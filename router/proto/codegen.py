"""Generates router/proto/pdserve_pb2.py and pdserve_pb2_grpc.py from pdserve.proto (the build
step; the generated files are not committed). `ensure_generated()` regenerates when the .proto
is newer than its outputs."""

from __future__ import annotations

import sys
from pathlib import Path

PROTO = Path(__file__).resolve().with_name("pdserve.proto")
ROOT = PROTO.parents[2]  # the repository root: imports in the output read `from router.proto import ...`
OUTPUTS = [PROTO.with_name("pdserve_pb2.py"), PROTO.with_name("pdserve_pb2_grpc.py")]


def is_stale() -> bool:
    return any(not f.is_file() or f.stat().st_mtime < PROTO.stat().st_mtime for f in OUTPUTS)


def generate() -> None:
    try:
        from grpc_tools import protoc
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "generating the gRPC code needs grpcio-tools (pip install grpcio-tools), or run "
            "`python -m router.proto.codegen` where it is installed and carry router/proto/*_pb2*.py"
        ) from err
    relative = PROTO.relative_to(ROOT)
    code = protoc.main(["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={ROOT}", f"--grpc_python_out={ROOT}",
                        str(relative)])
    if code != 0:
        raise RuntimeError(f"protoc failed on {relative} with exit code {code}")


def ensure_generated() -> None:
    if is_stale():
        generate()


if __name__ == "__main__":
    generate()
    print("generated", *[str(f) for f in OUTPUTS], file=sys.stderr)
