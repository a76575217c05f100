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


def test_install_sh_fails_when_pip_fails(tmp_path):
    """Its pip lines ended in `| grep ... || true`: a failed install (a proto that does not compile, a dependency
    not found) passed, and the tests ran on what an earlier install left in .venv. Here a stand-in python whose pip
    fails and whose imports succeed (the earlier install)."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "install.sh", tmp_path / "scripts" / "install.sh")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\nif [ "$1" = "-m" ]; then echo "ERROR: protoc failed" >&2; exit 1; fi\nexit 0\n')
    python.chmod(0o755)
    result = subprocess.run(["bash", str(tmp_path / "scripts" / "install.sh")], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0 and "protoc failed" in result.stdout + result.stderr, result


def test_the_declared_grpcio_and_protobuf_floors_admit_what_the_stubs_need():
    """The stubs refuse a grpcio older than the grpcio-tools that wrote them and a protobuf older than its protoc's
    code: floors of 1.62 / 5.26 admitted runtimes the built wheel failed to import on (VersionError)."""
    import re
    import tomllib

    from packaging.version import Version

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    floors = {m[1]: Version(m[2]) for d in project["project"]["dependencies"]
              if (m := re.fullmatch(r"([a-z-]+)>=([0-9.]+)", d))}
    stubs = REPO / "shared" / "rpc" / "qserve" / "v1"
    grpc_version = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", (stubs / "common_pb2_grpc.py").read_text())[1]
    protobuf_version = re.search(r"# Protobuf Python Version: ([0-9.]+)", (stubs / "common_pb2.py").read_text())[1]
    assert floors["grpcio"] >= Version(grpc_version) and floors["protobuf"] >= Version(protobuf_version), floors
    assert f"grpcio-tools=={grpc_version}" in project["build-system"]["requires"]
