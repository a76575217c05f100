"""`qctl deploy create|ls`: deployments on the gateway (a deployment is needed before a rollout)."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from qctl.gateway_client import GATEWAY_OPTION, TOKEN_OPTION, admin_client, rpc_errors
from qctl.output import id_column, table_console
from qctl.tls import tls_options
from shared.rpc.qserve.v1 import gateway_pb2

app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Create and list deployments.")


def _ref(r) -> str:
    return f"{r.artifact_id} ({r.format}, {r.gpu_target})"


def show_deployment(d: gateway_pb2.Deployment, console: Console | None = None) -> None:
    console = console or Console()
    ref = _ref
    lines = [f"deployment {d.name}", f"  stable    {ref(d.stable)}"]
    if d.HasField("canary"):
        lines.append(f"  canary    {ref(d.canary)} at {d.canary_percent}%")
    if d.HasField("baseline"):
        lines.append(f"  baseline  {ref(d.baseline)}")
    switch = "[red]ON[/] (all traffic to the baseline)" if d.fallback else "off"
    reason = f" - {escape(d.fallback_reason)}" if d.fallback_reason else ""
    lines.append(f"  fallback  {switch}{reason}")
    console.print("\n".join(lines))


@app.command("create")
@rpc_errors
@tls_options
def create(
    name: str = typer.Argument(..., help="deployment name: 1-64 characters of a-z 0-9 . _ -"),
    stable: str = typer.Option(..., "--stable", help="artifact id served to all traffic"),
    baseline: str = typer.Option(..., "--baseline", help="fp16 artifact id of the same model (the fallback)"),
    gateway: str = GATEWAY_OPTION,
    token: str = TOKEN_OPTION,
):
    """Create a deployment serving STABLE, with BASELINE as its fallback."""
    with admin_client(gateway, token) as admin:
        deployment = admin.CreateDeployment(gateway_pb2.CreateDeploymentRequest(
            name=name, stable_artifact_id=stable, baseline_artifact_id=baseline))
    show_deployment(deployment)


@app.command("ls")
@rpc_errors
@tls_options
def ls(gateway: str = GATEWAY_OPTION, token: str = TOKEN_OPTION):
    """List deployments."""
    with admin_client(gateway, token) as admin:
        deployments = admin.ListDeployments(gateway_pb2.ListDeploymentsRequest()).deployments
    table = Table("deployment", id_column("stable"), id_column("canary"), id_column("baseline"), "fallback")
    for d in deployments:
        canary = f"{d.canary.artifact_id} {d.canary_percent}%" if d.HasField("canary") else "-"
        table.add_row(d.name, d.stable.artifact_id, canary, d.baseline.artifact_id,
                      "[red]ON[/]" if d.fallback else "off")
    table_console().print(table if deployments else "no deployments")
