"""`qctl fallback on|off`: the switch that sends all of a deployment's traffic to its fp16 baseline."""

from __future__ import annotations

from enum import Enum

import typer

from qctl.deploy_cmd import show_deployment
from qctl.gateway_client import GATEWAY_OPTION, TOKEN_OPTION, admin_client, rpc_errors
from qctl.tls import tls_options
from shared.rpc.qserve.v1 import gateway_pb2


class Switch(str, Enum):
    on = "on"
    off = "off"


@rpc_errors
@tls_options
def fallback(
    switch: Switch = typer.Argument(..., help="on: all traffic to the baseline; off: back to stable/canary"),
    deployment: str = typer.Argument(..., help="deployment name"),
    reason: str = typer.Option("", "--reason", help="recorded in the event log"),
    force: bool = typer.Option(False, "--force", help="on: even when no healthy worker serves the baseline (every "
                                                      "request would be refused)"),
    gateway: str = GATEWAY_OPTION,
    token: str = TOKEN_OPTION,
):
    """Turn a deployment's fallback switch on or off (takes effect within a second)."""
    with admin_client(gateway, token) as admin:
        show_deployment(admin.SetFallback(gateway_pb2.SetFallbackRequest(
            deployment=deployment, enabled=switch is Switch.on, reason=reason, force=force)))
