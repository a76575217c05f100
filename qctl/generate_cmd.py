"""`qctl generate`: stream a generation through the gateway to the terminal."""

from __future__ import annotations

import sys
import threading

import grpc
import typer

from qctl.choices import UINT32_MAX, UINT64_MAX, bearer_token
from qctl.gateway_client import GATEWAY_OPTION, gateway_client, ms, rpc_errors
from qctl.output import enum_label
from qctl.tls import tls_options
from shared.rpc.bearer import bearer_metadata
from shared.rpc.qserve.v1 import common_pb2, gateway_pb2

# SamplingParams.top_p is a float32 where 0 means no limit: a smaller positive value rounds to it (or to a denormal).
SMALLEST_TOP_P = 1.2e-38
EXIT_INCOMPLETE = 1  # the generation was aborted, or the stream ended without its finish: the text is cut short


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a list of token ids; use e.g. '1,15043,29892'") from None
    if not ids or any(not 0 <= i <= UINT32_MAX for i in ids):
        raise typer.BadParameter(f"{text!r}: give one or more token ids from 0 to {UINT32_MAX}")
    return ids


@rpc_errors
@tls_options
def generate(
    prompt: str = typer.Argument(None, help="prompt text (tokenized by the worker); or use --token-ids"),
    deployment: str = typer.Option(..., "--deployment", "-d", help="deployment name"),
    token_ids: str = typer.Option(None, "--token-ids", help="prompt as token ids, e.g. '1,15043,29892'"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=0, max=UINT32_MAX, help="0 = until EOS or the context is full"),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy"),
    top_k: int = typer.Option(0, "--top-k", min=0, max=UINT32_MAX, help="0 = no limit"),
    top_p: float = typer.Option(0.0, "--top-p", min=0.0, max=1.0, help="0 = no limit"),
    seed: int = typer.Option(None, "--seed", min=0, max=UINT64_MAX, help="for reproducible sampling"),
    session_key: str = typer.Option("", "--session-key", help="same key, same version during a rollout"),
    gateway: str = GATEWAY_OPTION,
    api_key: str = typer.Option(None, "--api-key", envvar="QCTL_API_KEY", help="when the gateway requires one",
                                callback=bearer_token),
    reply_timeout_s: float = typer.Option(300.0, "--reply-timeout-s", min=0.0,
                                          help="give up (exit 2) when the gateway sends nothing for this long, the "
                                               "first token included; 0 = wait for ever"),
):
    """Stream the generated text to stdout; the finish line (reason, artifact, timings) goes to stderr. Exit 1
    when the text is cut short: the generation was aborted (the worker or the stack stopped) or the stream
    ended without a finish."""
    if (prompt is None) == (token_ids is None):
        raise typer.BadParameter("give either a PROMPT or --token-ids (exactly one)")
    if 0 < top_p < SMALLEST_TOP_P:  # sent as a float32: it would arrive as 0, "no limit", the opposite
        raise typer.BadParameter(f"--top-p {top_p:g} is below {SMALLEST_TOP_P:g}, which the request cannot carry "
                                 f"(it would mean no limit); use --top-k 1 for the most likely token alone")
    sampling = common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                         max_new_tokens=max_new_tokens)
    if seed is not None:
        sampling.seed = seed
    request = gateway_pb2.GatewayGenerateRequest(deployment=deployment, sampling=sampling, session_key=session_key)
    if prompt is not None:
        request.text = prompt
    else:
        request.token_ids.ids.extend(_token_ids(token_ids))
    metadata = bearer_metadata(api_key)
    try:
        finished = _stream(gateway, request, metadata, reply_timeout_s)
    except KeyboardInterrupt:
        # The partial text ends its line, and the shell's prompt does not land after it.
        print(file=sys.stdout)
        print("interrupted", file=sys.stderr)
        raise typer.Exit(code=130) from None
    # A script reading the exit code must not take a cut-short text for a whole one (it exited 0 after an abort).
    if finished is None:
        print(file=sys.stdout)
        print("error: the stream ended without a finish: the text may be cut short", file=sys.stderr)
        raise typer.Exit(code=EXIT_INCOMPLETE)
    if finished == common_pb2.FINISH_REASON_ABORT:
        print("error: the generation was aborted: the text is cut short", file=sys.stderr)
        raise typer.Exit(code=EXIT_INCOMPLETE)


def _stream(gateway: str, request: gateway_pb2.GatewayGenerateRequest, metadata, reply_timeout_s: float) -> int | None:
    """Writes the text as it comes; returns the finish reason (None when the stream ended without one)."""
    finished, wrote = None, False
    with gateway_client(gateway) as stub:
        call = stub.Generate(request, metadata=metadata)
        watchdog = _SilenceWatchdog(call, reply_timeout_s)
        try:
            for reply in call:
                watchdog.heard()
                sys.stdout.write(reply.text)
                sys.stdout.flush()
                wrote = wrote or bool(reply.text)
                if reply.HasField("finish"):
                    finished = _print_finish(reply)
        except grpc.RpcError:
            if wrote:
                print(file=sys.stdout)  # the error line goes to stderr: the partial text ends its own line
            if watchdog.fired:
                print(f"error: no reply from the gateway at {gateway} for {reply_timeout_s:g} s "
                      f"(--reply-timeout-s): gave up", file=sys.stderr)
                raise typer.Exit(code=2) from None
            raise
        finally:
            watchdog.stop()
    return finished


class _SilenceWatchdog:
    """Cancels the call when nothing arrives for `seconds` (0: never): without it a gateway that accepted the
    stream and went silent (hung, or a connection dropped without a reset) held qctl for ever."""

    def __init__(self, call, seconds: float):
        self.call, self.seconds, self.fired = call, seconds, False
        self._timer: threading.Timer | None = None
        self.heard()

    def heard(self) -> None:
        self.stop()
        if self.seconds > 0:
            self._timer = threading.Timer(self.seconds, self._fire)
            self._timer.daemon = True
            self._timer.start()

    def _fire(self) -> None:
        self.fired = True
        self.call.cancel()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def _print_finish(reply) -> int:
    """The text's end, then the finish line on stderr; returns the finish reason."""
    f = reply.finish
    arm = enum_label(gateway_pb2.Arm, reply.arm, "ARM_").lower()
    reason = enum_label(common_pb2.FinishReason, f.reason, "FINISH_REASON_").lower()
    print(file=sys.stdout)
    print(f"[{reason}] {f.generated_tokens} tokens from {arm} {reply.artifact_id}; "
          f"ttft {ms(f.timings.time_to_first_token)}, tpot {ms(f.timings.time_per_output_token)}, "
          f"total {ms(f.timings.total)}", file=sys.stderr)
    return f.reason
