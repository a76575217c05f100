"""`qctl jobs list|cancel`: the publish jobs of every quantizer sharing the registry, and stopping one."""

from __future__ import annotations

import getpass
import json
import socket
from enum import Enum

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from qctl.errors import rpc_errors
from qctl.gateway_client import RPC_TIMEOUT_S
from qctl.output import enum_label, id_column, table_console
from qctl.publish_cmd import QUANTIZER_OPTION, QUANTIZER_TOKEN_OPTION, quantizer_stub
from qctl.tls import tls_options
from shared.rpc.qserve.v1 import quantizer_pb2

Q = quantizer_pb2
app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="List and cancel publish jobs.")
StateName = Enum("StateName", {name: name for name in ("queued", "running", "succeeded", "failed", "cancelled")},
                 type=str)
STATE_STYLE = {"SUCCEEDED": "green", "RUNNING": "yellow", "QUEUED": "white", "FAILED": "red", "CANCELLED": "magenta"}


@app.command("list")
@rpc_errors("quantizer")
@tls_options
def list_jobs(
    state: list[StateName] = typer.Option(None, "--state", case_sensitive=False,
                                          help="only jobs in this state; repeat for several"),
    model: str = typer.Option("", "--model", help="only jobs publishing this model"),
    limit: int = typer.Option(20, "--limit", min=1, max=1000, help="most jobs shown, newest first"),
    as_json: bool = typer.Option(False, "--json", help="print a JSON list of jobs instead of a table"),
    quantizer: str = QUANTIZER_OPTION,
    quantizer_token: str = QUANTIZER_TOKEN_OPTION,
):
    """List publish jobs, newest first: state, stage, model, artifact, and why a job failed or was cancelled."""
    request = Q.ListJobsRequest(states=[Q.JobState.Value(f"JOB_STATE_{s.value.upper()}") for s in state or ()],
                                model_name=model, limit=limit)
    channel, stub = quantizer_stub(quantizer, quantizer_token)
    with channel:
        jobs = stub.ListJobs(request, timeout=RPC_TIMEOUT_S).jobs
    if as_json:
        print(json.dumps([job_dict(job) for job in jobs], indent=2))
        return
    if not jobs:
        table_console().print("no jobs" + (f" of model {model!r}" if model else ""))
        return
    table = Table(id_column("job"), "created (UTC)", "model", "state", "stage", "elapsed", id_column("artifact"),
                  "note")
    for job in jobs:
        d = job_dict(job)
        shown_state = f"[{STATE_STYLE.get(d['state'], 'white')}]{d['state']}[/]"
        if d["state"] == "RUNNING" and d["cancel_requested_at"]:
            shown_state += " (cancelling)"
        table.add_row(job.job_id, d["created_at"][:19].replace("T", " "), escape(job.model_name), shown_state,
                      _stage(d), f"{d['elapsed_s']:.0f}s", d["artifact_id"], escape(job.error))
    table_console().print(table)


@app.command("cancel")
@rpc_errors("quantizer")
@tls_options
def cancel(
    job_id: str = typer.Argument(..., help="the job's whole id (`qctl jobs list` shows it)"),
    reason: str = typer.Option("", "--reason", help="why; recorded with the job and in the event log"),
    by: str = typer.Option(None, "--by", help="who asks, recorded likewise [default: user@host]"),
    as_json: bool = typer.Option(False, "--json", help="print the job as JSON"),
    quantizer: str = QUANTIZER_OPTION,
    quantizer_token: str = QUANTIZER_TOKEN_OPTION,
):
    """Cancel a queued or running publish job. A queued job ends at once; a running one stops at its next step
    (within about a heartbeat of its quantizer), deleting what it wrote; its artifact ends FAILED."""
    channel, stub = quantizer_stub(quantizer, quantizer_token)
    with channel:
        job = stub.CancelJob(Q.CancelJobRequest(job_id=job_id, reason=reason, requested_by=_whoami() if by is None else by),
                             timeout=RPC_TIMEOUT_S)
    if as_json:
        print(json.dumps(job_dict(job), indent=2))
    elif job.state == Q.JOB_STATE_CANCELLED:
        Console().print(f"job {job.job_id} cancelled: {escape(job.error)}")
    else:
        Console().print(f"job {job.job_id} is stopping ({escape(job.error)}): it ends CANCELLED at its next step; "
                        f"`qctl jobs list` shows when")


def job_dict(job: Q.Job) -> dict:
    """The job as plain JSON values: the fields an operator or a script looks at."""
    return {
        "job_id": job.job_id,
        "state": enum_label(Q.JobState, job.state, "JOB_STATE_"),
        "model_name": job.model_name,
        "stage": enum_label(Q.JobStage, job.stage, "JOB_STAGE_").lower() if job.stage else "",
        "block_index": job.block_index,
        "block_count": job.block_count,
        "created_at": job.created_at.ToJsonString() if job.HasField("created_at") else "",
        "elapsed_s": job.elapsed.ToTimedelta().total_seconds(),
        "error": job.error,
        "cancel_requested_at": job.cancel_requested_at.ToJsonString() if job.HasField("cancel_requested_at") else "",
        "artifact_id": job.artifact.artifact_id,
    }


def _stage(d: dict) -> str:
    if d["block_count"]:
        return f"{d['stage']} {d['block_index']}/{d['block_count']}"
    return d["stage"] or "-"


def _whoami() -> str:
    """user@host, or "" (the quantizer then records the caller's address) where the user has no name."""
    try:
        return f"{getpass.getuser()}@{socket.gethostname()}"[:128]
    except (OSError, KeyError):  # no USER/LOGNAME and no passwd entry (some containers)
        return ""
