"""qctl starts without torch: its commands and their --help imported torch, transformers and the services'
servers (through qctl.errors and qctl.up_cmd), 2-3 s before anything happened. Only quantize, eval, demo
and up load them, when they run."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

HEAVY = ("torch", "transformers", "sqlalchemy", "alembic", "services.gateway.server", "services.quantizer.server",
         "services.worker.server")

# In a fresh interpreter: this test process has torch loaded already (tests/conftest.py).
SCRIPT = textwrap.dedent("""
    import sys
    from typer.testing import CliRunner
    from qctl.main import app

    runner = CliRunner()
    for args in ([], ["quantize"], ["eval"], ["demo"], ["up"], ["publish"], ["ls"], ["deploy"], ["deploy", "create"],
                 ["deploy", "ls"], ["rollout"], ["rollout", "start"], ["rollout", "promote"], ["rollout", "abort"],
                 ["rollout", "status"], ["fallback"], ["workers"], ["events"], ["generate"], ["jobs"],
                 ["jobs", "list"], ["jobs", "cancel"]):
        result = runner.invoke(app, [*args, "--help"])
        assert result.exit_code == 0, (args, result.output)
    # A light command run to its end, through its error handling: nothing listens on port 1.
    for args in (["ls"], ["jobs", "list"], ["jobs", "cancel", "some-job"]):
        result = runner.invoke(app, [*args, "--quantizer", "127.0.0.1:1"])
        assert result.exit_code == 2 and "cannot reach the quantizer" in result.stderr, (args, result.output)
    print(" ".join(name for name in sys.argv[1:] if name in sys.modules))
""")


def test_light_commands_and_every_help_start_without_torch():
    done = subprocess.run([sys.executable, "-c", SCRIPT, *HEAVY], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [], f"imported at start-up: {done.stdout.strip()}"


def test_the_user_errors_qctl_catches_as_value_errors_are_value_errors():
    """qctl.errors catches them as ValueError, so as not to import their (torch-importing) modules."""
    from qctl.errors import USER_ERRORS
    from shared.formats.artifact import ArtifactError
    from shared.formats.manifest import ManifestError
    from shared.formats.weights import FormatError
    from shared.model.config import CheckpointError
    from shared.quant.calibration import CalibrationError

    for error in (CheckpointError, CalibrationError, ArtifactError, ManifestError, FormatError):
        assert issubclass(error, USER_ERRORS), error
