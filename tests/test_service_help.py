"""Every service's --help works: it is what the compose file and the README point operators to."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.parametrize("service", ["quantizer", "gateway", "worker"])
def test_the_service_prints_its_help(service):
    result = subprocess.run([sys.executable, "-m", f"services.{service}.server", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout and "Traceback" not in result.stderr
