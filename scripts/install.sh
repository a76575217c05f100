#!/usr/bin/env bash
# Creates .venv and installs the project with its test extras. Idempotent.
# TORCH_SPEC picks the torch build: the default is the CPU build these machines keep on disk;
# on a GPU host use e.g. TORCH_SPEC='torch>=2.11' (the CUDA build from PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# pip with the venv-location warning filtered out, failing when pip fails (under pipefail the pipeline's status is
# pip's; the grep, which finds nothing to print when pip is quiet, must not count): a failed install (a proto that
# does not compile, a dependency not found) used to pass, and the tests ran on what an earlier install left.
pip_install() {
  .venv/bin/python -m pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
}

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip_install --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  pip_install "${TORCH_SPEC:-torch==2.13.0}"
fi
pip_install -e ".[test]"
.venv/bin/python -c "import torch, triton, grpc, shared.rpc.qserve.v1.worker_pb2" \
  || { echo "install failed: see the pip output above" >&2; exit 1; }
