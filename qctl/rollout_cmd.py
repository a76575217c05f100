"""`qctl rollout start|promote|abort|status`: canary rollouts of a deployment."""

from __future__ import annotations

import typer
from rich.table import Table

from qctl.deploy_cmd import show_deployment
from qctl.gateway_client import GATEWAY_OPTION, TOKEN_OPTION, admin_client, ms, rpc_errors
from qctl.output import table_console
from qctl.tls import tls_options
from shared.rpc.qserve.v1 import gateway_pb2

app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Canary rollouts: start, promote, abort, status.")
DEPLOYMENT_ARG = typer.Argument(..., help="deployment name")


@app.command("start")
@rpc_errors
@tls_options
def start(
    deployment: str = DEPLOYMENT_ARG,
    canary: str = typer.Option(..., "--canary", help="artifact id of the canary"),
    percent: int = typer.Option(..., "--percent", min=1, max=100, help="share of traffic for the canary, 1-100"),
    force: bool = typer.Option(False, "--force", help="start it even if the automatic guard aborted it last"),
    gateway: str = GATEWAY_OPTION,
    token: str = TOKEN_OPTION,
):
    """Send PERCENT of traffic to CANARY (sticky per session key). Again with the same canary: new percent."""
    with admin_client(gateway, token) as admin:
        show_deployment(admin.StartRollout(gateway_pb2.StartRolloutRequest(
            deployment=deployment, canary_artifact_id=canary, canary_percent=percent, force=force)))


@app.command("promote")
@rpc_errors
@tls_options
def promote(
    deployment: str = DEPLOYMENT_ARG,
    canary: str = typer.Option("", "--canary", help="artifact id of the canary you reviewed: refused if the rollout "
                                                    "now has another canary (aborted and restarted meanwhile)"),
    force: bool = typer.Option(False, "--force", help="even when no healthy worker serves the canary (all of its "
                                                      "traffic would be refused), or it has served no request yet"),
    gateway: str = GATEWAY_OPTION,
    token: str = TOKEN_OPTION,
):
    """Make the canary the stable artifact (instant); refused until it has served a request."""
    with admin_client(gateway, token) as admin:
        show_deployment(admin.PromoteRollout(gateway_pb2.PromoteRolloutRequest(
            deployment=deployment, canary_artifact_id=canary, force=force)))


@app.command("abort")
@rpc_errors
@tls_options
def abort(
    deployment: str = DEPLOYMENT_ARG,
    reason: str = typer.Option("", "--reason", help="recorded in the event log"),
    canary: str = typer.Option("", "--canary", help="artifact id of the canary to abort: refused if the rollout now "
                                                    "has another canary; a retry of this abort succeeds unchanged"),
    gateway: str = GATEWAY_OPTION,
    token: str = TOKEN_OPTION,
):
    """Send all traffic back to the stable artifact (instant)."""
    with admin_client(gateway, token) as admin:
        show_deployment(admin.AbortRollout(gateway_pb2.AbortRolloutRequest(
            deployment=deployment, reason=reason, canary_artifact_id=canary)))


@app.command("status")
@rpc_errors
@tls_options
def status(deployment: str = DEPLOYMENT_ARG, gateway: str = GATEWAY_OPTION, token: str = TOKEN_OPTION):
    """The deployment and its arms' metrics side by side."""
    with admin_client(gateway, token) as admin:
        reply = admin.RolloutStatus(gateway_pb2.RolloutStatusRequest(deployment=deployment))
    console = table_console()
    show_deployment(reply.deployment, console)
    arms = [(name, getattr(reply, name)) for name in ("stable", "canary", "baseline") if reply.HasField(name)]
    window = reply.window_start.ToDatetime().strftime("%Y-%m-%d %H:%M:%S UTC")
    table = Table("", *(name for name, _ in arms), title=f"since {window}")
    # An arm that served nothing shows "-", not "0 (0.0%)" and "0.0 ms": a canary no worker serves (its share
    # goes to the stable) looked like a flawless one.
    rows = (
        ("artifact", lambda m: f"{m.artifact.artifact_id} {m.artifact.format}"),
        ("healthy workers", lambda m: str(m.healthy_workers)),
        ("requests", lambda m: str(m.requests)),
        ("errors", lambda m: f"{m.errors} ({m.error_rate:.1%})" if m.requests else "-"),
        ("ttft p50 / p95", lambda m: f"{ms(m.ttft_p50)} / {ms(m.ttft_p95)}" if m.requests else "-"),
        ("tpot p50 / p95", lambda m: f"{ms(m.tpot_p50)} / {ms(m.tpot_p95)}" if m.requests else "-"),
        ("generated tokens", lambda m: str(m.generated_tokens)),
        # what the automatic guard counts: this gateway replica's requests and the others' reports
        ("all replicas: requests / errors", lambda m: f"{m.fleet_requests} / {m.fleet_errors}"),
        ("all replicas: ttft / tpot p95",
         lambda m: f"{ms(m.fleet_ttft_p95)} / {ms(m.fleet_tpot_p95)}" if m.fleet_requests else "-"),
    )
    for label, cell in rows:
        table.add_row(label, *(cell(metrics) for _, metrics in arms))
    console.print(table)
