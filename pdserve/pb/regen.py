"""Regenerates pdserve/pb/ from protos/ (needs grpcio-tools, from the `test` extra).

Run `python -m pdserve.pb.regen` after editing a .proto. The generated modules are committed;
tests/test_pb_current.py regenerates into a temporary folder and fails if they differ.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
PB_DIR = Path(__file__).resolve().parent
PROTO_PACKAGE_DIR = Path("pdserve") / "v1"
# protoc writes `from pdserve.v1 import x_pb2`; our modules live flat in pdserve.pb.
_IMPORT_FIX = re.compile(r"^from pdserve\.v1 import (\w+)", re.MULTILINE)


def generate(out_dir: Path) -> list[Path]:
    """Writes the *_pb2.py, *_pb2.pyi and *_pb2_grpc.py of every proto into out_dir.

    protoc runs in a child process: its compiler module crashes a process that also loaded
    another libprotobuf (NIXL's bundled one, for instance)."""
    tools = importlib.util.find_spec("grpc_tools")
    if tools is None or not tools.submodule_search_locations:
        raise RuntimeError("regenerating pdserve/pb needs grpcio-tools (the `test` extra)")
    protos = sorted((PROTO_ROOT / PROTO_PACKAGE_DIR).glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        include = str(Path(tools.submodule_search_locations[0]) / "_proto")
        args = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
        ]
        args += [str(p.relative_to(PROTO_ROOT)) for p in protos]
        result = subprocess.run(args, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"protoc failed on {protos}: {result.stderr.strip()}")
        written = []
        for generated in sorted((Path(tmp) / PROTO_PACKAGE_DIR).iterdir()):
            text = _IMPORT_FIX.sub(r"from pdserve.pb import \1", generated.read_text())
            target = out_dir / generated.name
            target.write_text(text)
            written.append(target)
    return written


if __name__ == "__main__":
    for path in generate(PB_DIR):
        print(path.relative_to(REPO_ROOT), file=sys.stderr)
