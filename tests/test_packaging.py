"""A wheel built from a clean checkout (no generated stubs yet) carries the gRPC stubs."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

from tests.conftest import REPO


def test_a_wheel_from_a_clean_checkout_carries_the_grpc_stubs(tmp_path):
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    source = tmp_path / "src"
    for name in filter(None, tracked.decode().split("\0")):
        if (REPO / name).is_file() and not name.startswith(("bench/", "tests/", "docs/")):
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    assert not (source / "shared" / "rpc" / "qserve").exists()  # as in a fresh clone
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for stub in ("worker_pb2.py", "worker_pb2_grpc.py", "gateway_pb2.py", "quantizer_pb2.py", "common_pb2.py"):
        assert f"shared/rpc/qserve/v1/{stub}" in names, f"{stub} missing from {wheel.name}"
