#!/usr/bin/env bash
# Installs everything, then runs the whole test suite (what CI runs, via .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# tests/test_compose.py validates docker-compose.yml with docker-compose itself (Debian's package).
if ! command -v docker-compose >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    { apt-get install -y -q docker-compose || { apt-get update -q && apt-get install -y -q docker-compose; }; } \
      >/dev/null 2>&1 || echo "could not install docker-compose: tests/test_compose.py will fail" >&2
  else
    echo "docker-compose is missing (install Debian's docker-compose package): tests/test_compose.py will fail" >&2
  fi
fi
# Two runs: the fast tests spread over QSERVE_TEST_WORKERS processes (pytest-xdist; most of them
# wait on subprocesses, sockets or Triton's single-threaded interpreter), then the tests marked
# slow, alone: they run the fixture model on every core and two of them assert the issue's time
# limits (quantize < 2 min, publish < 3 min on 2 cores), which sharing the CPU would falsify.
workers=${QSERVE_TEST_WORKERS:-2}
set +e
.venv/bin/python -m pytest -m "not slow" -n "$workers" "$@"
fast=$?
.venv/bin/python -m pytest -m slow "$@"
slow=$?
set -e
# 5 is pytest's "no tests collected": fine for one run when a selection holds only fast or only
# slow tests, a failure when neither ran anything.
if [ "$fast" -eq 5 ] && [ "$slow" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure, not a pass" >&2
  exit 5
fi
for rc in "$fast" "$slow"; do
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
    exit "$rc"
  fi
done
exit 0
