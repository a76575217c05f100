"""`qctl workers` and `qctl events`: what the gateway's pool and the registry's event log hold."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from qctl.gateway_client import GATEWAY_OPTION, TOKEN_OPTION, admin_client, rpc_errors
from qctl.output import enum_label, id_column, table_console
from qctl.tls import tls_options
from shared.rpc.qserve.v1 import gateway_pb2

HEALTH_STYLE = {"HEALTHY": "green", "UNHEALTHY": "red", "DRAINING": "yellow"}


@rpc_errors
@tls_options
def workers(
    artifact: str = typer.Option("", "--artifact", help="only workers serving this artifact id"),
    gateway: str = GATEWAY_OPTION,
    token: str = TOKEN_OPTION,
):
    """List the workers registered with the gateway, their health and load."""
    with admin_client(gateway, token) as admin:
        listed = admin.ListWorkers(gateway_pb2.ListWorkersRequest(artifact_id=artifact)).workers
    if not listed:
        Console().print("no workers registered" + (f" for artifact {artifact}" if artifact else ""))
        return
    table = Table("worker", "address", id_column("artifact"), "format", "health", "in flight / capacity", "running",
                  "waiting", "kv blocks free", "context", "probe", "last heartbeat (UTC)", "why unhealthy")
    for w in listed:
        health = enum_label(gateway_pb2.WorkerHealth, w.health, "WORKER_HEALTH_")
        table.add_row(escape(w.worker_id), escape(w.address), w.artifact.artifact_id, w.artifact.format,
                      f"[{HEALTH_STYLE.get(health, 'white')}]{health}[/]", f"{w.in_flight} / {w.capacity}",
                      str(w.running_requests), str(w.waiting_requests), str(w.kv_blocks_free),
                      str(w.max_context_tokens or "?"), f"{w.probe_error:.3f}" if w.HasField("probe_error") else "-",
                      w.last_heartbeat.ToDatetime().strftime("%H:%M:%S"), escape(w.health_reason))
    table_console().print(table)


@rpc_errors
@tls_options
def events(
    deployment: str = typer.Option("", "--deployment", "-d", help="only this deployment's events"),
    limit: int = typer.Option(20, "--limit", min=1, max=1000, help="most events shown, newest first"),
    gateway: str = GATEWAY_OPTION,
    token: str = TOKEN_OPTION,
):
    """The registry's event log, newest first: rollouts, fallback switches (with reasons and actors)."""
    with admin_client(gateway, token) as admin:
        listed = admin.ListEvents(gateway_pb2.ListEventsRequest(deployment=deployment, limit=limit)).events
    table = Table("id", "time (UTC)", "deployment", "kind", "actor", id_column("artifact"), "detail")
    for e in listed:
        table.add_row(str(e.event_id), e.time.ToDatetime().strftime("%Y-%m-%d %H:%M:%S"), escape(e.deployment),
                      escape(e.kind), escape(e.actor), e.artifact_id, escape(e.detail))
    table_console().print(table if listed else "no events")
