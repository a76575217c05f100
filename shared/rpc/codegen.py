"""Generates the Python gRPC stubs from protos/qserve/v1/*.proto into shared/rpc/qserve/v1/.

Run by setup.py at install time (`pip install -e .` or `pip install .`); run it by hand after
editing a .proto: `python shared/rpc/codegen.py`. The stubs are build outputs and are not committed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
OUT_ROOT = Path(__file__).resolve().parent

# protoc writes `from qserve.v1 import x_pb2`; the stubs live under shared.rpc, so rewrite the prefix.
_IMPORT = re.compile(r"^from qserve\.v1 import ", re.MULTILINE)


def generate(proto_root: Path = PROTO_ROOT, out_root: Path = OUT_ROOT) -> list[Path]:
    from grpc_tools import protoc  # build-time dependency only

    protos = sorted(proto_root.glob("qserve/v1/*.proto"))
    if not protos:
        raise FileNotFoundError(f"no .proto files under {proto_root / 'qserve/v1'}")
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{proto_root}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {[p.name for p in protos]}")
    written = []
    for package in (out_root / "qserve", out_root / "qserve" / "v1"):
        (package / "__init__.py").touch()
    for path in sorted((out_root / "qserve" / "v1").glob("*.py*")):
        text = path.read_text()
        fixed = _IMPORT.sub("from shared.rpc.qserve.v1 import ", text)
        if fixed != text:
            path.write_text(fixed)
        written.append(path)
    return written


if __name__ == "__main__":
    for p in generate():
        print(p.relative_to(REPO_ROOT))
    sys.exit(0)
