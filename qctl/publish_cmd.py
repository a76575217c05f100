"""`qctl publish`: ask the quantizer to publish a checkpoint, follow the job with a progress bar,
print the artifact id (stdout: the id alone, so scripts can capture it)."""

from __future__ import annotations

import functools
import sys
from enum import Enum
from pathlib import Path

import grpc
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from qctl.choices import UINT32_MAX, FormatName, bearer_token, service_address
from qctl.errors import rpc_errors
from qctl.gateway_client import RPC_TIMEOUT_S
from qctl.output import enum_label
from qctl.tls import open_channel, tls_options
from shared.formats.manifest import GPU_TARGETS
from shared.rpc.bearer import bearer_metadata
from shared.rpc.qserve.v1 import quantizer_pb2, quantizer_pb2_grpc

DEFAULT_QUANTIZER = "127.0.0.1:50061"
QUANTIZER_OPTION = typer.Option(DEFAULT_QUANTIZER, "--quantizer", envvar="QCTL_QUANTIZER", callback=service_address,
                                help="host:port of the quantizer service")
QUANTIZER_TOKEN_OPTION = typer.Option("", "--quantizer-token", envvar="QCTL_QUANTIZER_TOKEN", show_default=False,
                                      callback=bearer_token,
                                      help="bearer token for the quantizer, one of its QSERVE_QUANTIZER_TOKENS "
                                           "(scope read for listing, publish to publish or cancel); unset or "
                                           "empty: none sent, for a quantizer without tokens")
GpuTarget = Enum("GpuTarget", {name: name for name in GPU_TARGETS}, type=str)
Q = quantizer_pb2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped


class _WithToken:
    """A Quantizer stub that sends `authorization: Bearer <token>` with every call."""

    def __init__(self, stub: quantizer_pb2_grpc.QuantizerStub, token: str):
        self._stub, self._metadata = stub, bearer_metadata(token)

    def __getattr__(self, rpc: str):
        return functools.partial(getattr(self._stub, rpc), metadata=self._metadata)


def quantizer_stub(address: str, token: str = "") -> tuple[grpc.Channel, quantizer_pb2_grpc.QuantizerStub]:
    """Over TLS inside qctl.tls.tls_settings with a CA, else plaintext; with a token (--quantizer-token) on
    every call, none when it is empty."""
    channel = open_channel(address)
    stub = quantizer_pb2_grpc.QuantizerStub(channel)
    return channel, _WithToken(stub, token) if token else stub


def _location(value: str | None) -> str:
    """A local path made absolute (the quantizer may run elsewhere in the file system); URIs as they are."""
    if not value or "://" in value:
        return value or ""
    return str(Path(value).expanduser().resolve())


@rpc_errors("quantizer")
@tls_options
def publish(
    source: str = typer.Option(..., "--source", help="checkpoint folder or s3://bucket/prefix"),
    model_name: str = typer.Option(..., "--model-name", help="registry name: [a-z0-9._-], up to 64 characters"),
    format: FormatName = typer.Option(..., "--format", help="artifact format"),
    gpu_target: GpuTarget = typer.Option(..., "--gpu-target", help="GPU the artifact is bound to"),
    quantizer: str = QUANTIZER_OPTION,
    quantizer_token: str = QUANTIZER_TOKEN_OPTION,
    version_label: str = typer.Option("", "--version-label", help="human label of the model version"),
    calib: str = typer.Option(None, "--calib", help="calibration text file or s3:// URI [default: the quantizer's]"),
    calib_samples: int = typer.Option(0, min=0, max=UINT32_MAX, help="calibration windows (0: the quantizer's default)"),
    calib_seq_len: int = typer.Option(0, min=0, max=UINT32_MAX, help="tokens per calibration window (0: the quantizer's "
                                      "default, 512 or the model's context if shorter)"),
    budget: float = typer.Option(None, "--budget",
                                 help="largest accepted relative perplexity increase, e.g. 0.05 [default: the quantizer's]"),
    eval_data: str = typer.Option(None, "--eval-data", help="eval text file or s3:// URI [default: the quantizer's]"),
    eval_seq_len: int = typer.Option(0, min=0, max=UINT32_MAX, help="eval window length (0: 512, or the model's "
                                     "context if shorter)"),
    eval_max_windows: int = typer.Option(0, min=0, max=UINT32_MAX, help="score at most this many eval windows (0: all)"),
    calib_sha256: str = typer.Option("", "--calib-sha256", help="pin the calibration file's content: the job fails "
                                     "if it reads otherwise (`sha256sum FILE`)"),
    eval_sha256: str = typer.Option("", "--eval-sha256", help="pin the eval file's content likewise"),
    smooth_attention: bool = typer.Option(None, "--smooth-attention/--no-smooth-attention", help="SmoothAttention"),
    rotation: bool = typer.Option(None, "--rotation/--no-rotation", help="Hadamard rotation of block inputs"),
    smoothing: bool = typer.Option(None, "--smoothing/--no-smoothing", help="smoothing of block outputs"),
    reorder: bool = typer.Option(None, "--reorder/--no-reorder", help="activation-aware channel reordering"),
    clipping: bool = typer.Option(None, "--clipping/--no-clipping", help="weight clip-ratio search"),
    gptq: bool = typer.Option(None, "--gptq/--no-gptq", help="GPTQ error-compensated rounding"),
    rotate_values: bool = typer.Option(None, "--rotate-values/--no-rotate-values", help="per-head rotation of V"),
    kv_range_search: bool = typer.Option(None, "--kv-range-search/--no-kv-range-search",
                                         help="per-layer KV4 range ratio of V, searched"),
    compensate_inputs: bool = typer.Option(None, "--compensate-inputs/--no-compensate-inputs",
                                           help="fit each linear to its fp output from quantized inputs"),
    key_feedback: bool = typer.Option(None, "--key-feedback/--no-key-feedback",
                                      help="KV4 keys rounded against each layer's query statistics"),
    rtn: bool = typer.Option(False, "--rtn", help="every QoQ step off: plain round-to-nearest (fast; for tests "
                             "and smoke runs). A step switched on explicitly stays on."),
):
    """Publish a checkpoint as an evaluated artifact; prints its id. Exit 1 when the job fails; Ctrl-C stops
    following the job, which keeps running."""
    steps = {"smooth_attention": smooth_attention, "rotation": rotation, "smoothing": smoothing,
             "reorder": reorder, "clipping": clipping, "gptq": gptq, "rotate_values": rotate_values,
             "kv_range_search": kv_range_search, "compensate_inputs": compensate_inputs, "key_feedback": key_feedback}
    if rtn and format.value != "fp16":
        steps = {name: False if value is None else value for name, value in steps.items()}
    qoq = {name: value for name, value in steps.items() if value is not None}
    request = Q.PublishRequest(
        source=_location(source), model_name=model_name, version_label=version_label, format=format.value,
        gpu_target=gpu_target.value,
        calibration=Q.Calibration(data=_location(calib), num_samples=calib_samples, seq_len=calib_seq_len,
                                  sha256=calib_sha256),
        qoq=Q.QoQOptions(**qoq),
        eval=Q.EvalData(data=_location(eval_data), seq_len=eval_seq_len, max_windows=eval_max_windows,
                        sha256=eval_sha256),
    )
    if budget is not None:
        request.max_relative_perplexity_increase = budget
    console = Console(stderr=True)
    channel, stub = quantizer_stub(quantizer, quantizer_token)
    with channel:
        try:
            job = stub.Publish(request, timeout=RPC_TIMEOUT_S)  # without one, a quantizer that never answered hung qctl
        except KeyboardInterrupt:
            print(f"interrupted: the request may have reached the quantizer at {quantizer} and queued a job; "
                  f"`qctl jobs list` shows it", file=sys.stderr)
            raise typer.Exit(code=EXIT_INTERRUPTED) from None
        console.print(f"job {job.job_id} queued at {quantizer}")
        job_id = job.job_id
        try:
            job = follow_job(stub, job_id, console)
        except KeyboardInterrupt:
            # Ctrl-C stops the watching, not the job: say so, or the user takes the job for cancelled while it
            # goes on to publish an artifact.
            print(f"interrupted: job {job_id} keeps running on the quantizer at {quantizer}; `qctl jobs list` "
                  f"shows it, `qctl jobs cancel {job_id}` stops it", file=sys.stderr)
            raise typer.Exit(code=EXIT_INTERRUPTED) from None
    if job is None:  # the stream ended before its first snapshot
        print(f"error: the quantizer ended the progress stream of job {job_id} without its state; "
              f"it may still run: see `qctl ls`", file=sys.stderr)
        raise typer.Exit(code=1)
    if job.state != Q.JOB_STATE_SUCCEEDED:
        print(f"error: job {job.job_id} failed: {job.error}", file=sys.stderr)
        raise typer.Exit(code=1)
    e = job.artifact.evaluation
    console.print(
        f"artifact {job.artifact.artifact_id} READY: {job.artifact.format} for {job.artifact.gpu_target}, "
        f"perplexity {e.perplexity_quantized:.4f} vs fp16 {e.perplexity_fp16:.4f} on {escape(e.data_name)} "
        f"({e.perplexity_quantized / e.perplexity_fp16 - 1:+.2%}); objects at {escape(job.artifact.object_key_prefix)}"
    )
    print(job.artifact.artifact_id)


def follow_job(stub: quantizer_pb2_grpc.QuantizerStub, job_id: str, console: Console) -> Q.Job | None:
    """Shows stage and block i of n until the job ends; returns its last snapshot (None if none came)."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[note]}", style="dim"))
    job, shown = None, ""
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("queued", total=None, note="")
        for update in stub.WatchJob(Q.WatchJobRequest(job_id=job_id)):
            job = update.job
            stage = enum_label(Q.JobStage, job.stage, "JOB_STAGE_").lower() if job.stage else "queued"
            if job.block_count:
                description = f"{stage} block {job.block_index}/{job.block_count}"
                bar.update(task, description=description, completed=job.block_index - 1, total=job.block_count,
                           note=escape(update.message))
            else:
                description = stage
                bar.update(task, description=stage, completed=0, total=None, note=escape(update.message))
            if description != shown:  # one line per stage and block, also in logs where no bar is drawn
                bar.console.print(description, style="dim")
                shown = description
        if job is not None and job.state == Q.JOB_STATE_SUCCEEDED:
            bar.update(task, description="published", completed=1, total=1, note="")
    return job
