"""A wheel built from a clean checkout (no generated stubs yet) carries the gRPC stubs, and so does one built
from the source distribution (which must carry the .proto files the build generates them from)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from tests.conftest import REPO

STUBS = ("worker_pb2.py", "worker_pb2_grpc.py", "gateway_pb2.py", "quantizer_pb2.py", "common_pb2.py")


def _clean_checkout(tmp_path: Path) -> Path:
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    source = tmp_path / "src"
    for name in filter(None, tracked.decode().split("\0")):
        if (REPO / name).is_file() and not name.startswith(("bench/", "tests/", "docs/")):
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    assert not (source / "shared" / "rpc" / "qserve").exists()  # as in a fresh clone
    return source


def _wheel_names(source: Path, dist: Path) -> set[str]:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(dist), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = dist.glob("*.whl")
    return set(zipfile.ZipFile(wheel).namelist())


def test_a_wheel_from_a_clean_checkout_carries_the_grpc_stubs(tmp_path):
    names = _wheel_names(_clean_checkout(tmp_path), tmp_path / "dist")
    for stub in STUBS:
        assert f"shared/rpc/qserve/v1/{stub}" in names, f"{stub} missing"


def test_a_wheel_from_the_source_distribution_carries_the_grpc_stubs(tmp_path):
    """`python -m build` and `pip install <sdist>` build the wheel from the sdist: without the .proto files in
    it (protos/ is no Python package: MANIFEST.in adds it), the build failed ("no .proto files")."""
    source = _clean_checkout(tmp_path)
    subprocess.run([sys.executable, "-c", "from setuptools import build_meta; build_meta.build_sdist('sdist')"],
                   cwd=source, check=True, capture_output=True, timeout=300)
    (sdist,) = (source / "sdist").glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        archive.extractall(tmp_path / "unpacked", filter="data")
    (unpacked,) = (tmp_path / "unpacked").iterdir()
    names = _wheel_names(unpacked, tmp_path / "dist-from-sdist")
    for stub in STUBS:
        assert f"shared/rpc/qserve/v1/{stub}" in names, f"{stub} missing"
