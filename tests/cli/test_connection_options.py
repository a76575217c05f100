"""qctl's connection options: every service address and credential has a QCTL_* variable, named alike."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from qctl.main import app

runner = CliRunner()


@pytest.mark.parametrize("command, variables", [(["publish"], ["QCTL_QUANTIZER"]), (["ls"], ["QCTL_QUANTIZER"]),
                                                (["workers"], ["QCTL_GATEWAY", "QCTL_TOKEN"]),
                                                (["generate"], ["QCTL_GATEWAY", "QCTL_API_KEY"])])
def test_connection_options_read_qctl_variables(command, variables):
    # The quantizer's address was read from QSERVE_QUANTIZER beside QCTL_GATEWAY and QCTL_TOKEN.
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())  # the help wraps at the terminal's width
    assert not [v for v in variables if f"env var: {v}" not in text], result.stdout


def test_the_quantizer_address_comes_from_qctl_quantizer():
    result = runner.invoke(app, ["ls"], env={"QCTL_QUANTIZER": "127.0.0.1:1", "COLUMNS": "250"})
    assert result.exit_code == 2 and "cannot reach the quantizer at 127.0.0.1:1" in result.stderr


def test_a_token_in_the_environment_is_not_shown_by_help():
    result = runner.invoke(app, ["workers", "--help"], env={"QCTL_TOKEN": "s3cret-token", "COLUMNS": "250"})
    assert result.exit_code == 0 and "s3cret-token" not in result.stdout
