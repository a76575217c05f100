#!/usr/bin/env bash
# Creates .venv and installs the project with its test extras. Idempotent.
# TORCH_SPEC picks the torch build: the default is the CPU build these machines keep on disk;
# on a GPU host use e.g. TORCH_SPEC='torch>=2.11' (the CUDA build from PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}" 2>&1 | grep -v "^WARNING: Location" || true
fi
.venv/bin/python -m pip install -q -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, triton, grpc, shared.rpc.qserve.v1.worker_pb2" \
  || { echo "install failed: see the pip output above" >&2; exit 1; }
