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
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure, not a pass" >&2
fi
exit "$rc"
