"""`qctl ls`: models, their versions and every artifact of each, as a table."""

from __future__ import annotations

import typer
from rich.markup import escape
from rich.table import Table

from qctl.errors import rpc_errors
from qctl.gateway_client import RPC_TIMEOUT_S
from qctl.output import enum_label, id_column, table_console
from qctl.publish_cmd import QUANTIZER_OPTION, QUANTIZER_TOKEN_OPTION, quantizer_stub
from qctl.tls import tls_options
from shared.disk_space import gib
from shared.rpc.qserve.v1 import common_pb2, quantizer_pb2

Q = quantizer_pb2
STATE_STYLE = {"READY": "green", "PENDING": "yellow", "FAILED": "red"}


@rpc_errors("quantizer")
@tls_options
def ls(
    quantizer: str = QUANTIZER_OPTION,
    quantizer_token: str = QUANTIZER_TOKEN_OPTION,
    model: str = typer.Option("", "--model", help="only this model"),
):
    """List models, versions and artifacts (state, format, GPU, size, perplexity fp16 -> quantized, vocabulary)."""
    channel, stub = quantizer_stub(quantizer, quantizer_token)
    with channel:
        models = stub.ListModels(Q.ListModelsRequest(model_name=model), timeout=RPC_TIMEOUT_S).models
        listed = stub.ListArtifacts(Q.ListArtifactsRequest(model_name=model), timeout=RPC_TIMEOUT_S).artifacts
        artifacts = {a.artifact_id: a for a in listed}
    console = table_console()
    if not models:
        console.print("no models registered" + (f" under the name {model!r}" if model else ""))
        return
    table = Table("model", "version", id_column("artifact"), "state", "format", "gpu", "size", "ppl fp16 -> quantized",
                  "vocabulary", "note")
    for m in models:
        for version in m.versions:
            label = escape(version.version_label)
            shown_version = f"{label} ({version.model_version[:12]})" if label != version.model_version[:12] else label
            if not version.artifacts:
                table.add_row(m.model_name, shown_version, "-", "", "", "", "", "", "", "")
            for ref in version.artifacts:
                info = artifacts.get(ref.artifact_id)
                state = enum_label(common_pb2.ArtifactState, info.state, "ARTIFACT_STATE_") if info else "?"
                table.add_row(m.model_name, shown_version, ref.artifact_id,
                              f"[{STATE_STYLE.get(state, 'white')}]{state}[/]", ref.format, ref.gpu_target,
                              _size(info), _perplexities(info), _vocabulary(info),
                              escape(info.failure_reason) if info else "")
    console.print(table)


def _size(info: common_pb2.ArtifactInfo | None) -> str:
    """The bytes a worker's cache takes for it; empty while unknown (not READY, or published by a quantizer
    that has not read its manifest back)."""
    if info is None or not info.size_bytes:
        return ""
    return gib(info.size_bytes) if info.size_bytes >= 1 << 30 else f"{info.size_bytes / (1 << 20):.1f} MiB"


def _vocabulary(info: common_pb2.ArtifactInfo | None) -> str:
    """The digest's first 12 hex digits: enough to tell which artifacts can share a deployment."""
    return info.vocabulary_digest[:12] if info is not None and info.vocabulary_digest else ""


def _perplexities(info: common_pb2.ArtifactInfo | None) -> str:
    if info is None or not info.HasField("evaluation"):
        return ""
    e = info.evaluation
    return f"{e.perplexity_fp16:.3f} -> {e.perplexity_quantized:.3f} ({e.perplexity_quantized / e.perplexity_fp16 - 1:+.2%})"
