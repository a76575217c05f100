"""`qctl up`: the whole stack in one process on loopback, and the product's path through it.

Starts a quantizer, the gateway and two workers (SQLite registry and a local-folder store under
--workdir; the CPU reference backend when there is no GPU), then: publishes the model as the fp16
baseline and as a quantized artifact (QoQ, evaluated against fp16), deploys the baseline, rolls the
quantized artifact out as a canary and shows where sticky sessions land, promotes it, and streams a
generation through the gateway. Then it keeps serving (Ctrl-C stops it) unless --once is given.
"""

from __future__ import annotations

import concurrent.futures
import functools
import re
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import typer
from rich.console import Console
from rich.table import Table

from qctl.choices import QuantizedFormatName
from qctl.devices import resolve_device, resolve_gpu_target
from qctl.errors import user_errors
from qctl.gateway_client import admin_client, gateway_client
from qctl.publish_cmd import follow_job, quantizer_stub
from services.worker.errors import WorkerError
from shared.rpc.qserve.v1 import common_pb2, gateway_pb2, quantizer_pb2
from shared.storage import StorageError

if TYPE_CHECKING:
    from qctl.stack import LocalStack

Q, G = quantizer_pb2, gateway_pb2
SESSIONS = 20  # session keys sent during the canary, to show the split and its stickiness
WORKER_WAIT_S = 60.0
# How long a worker may take to load: on a GPU its first start on a machine compiles every Triton kernel
# its artifact uses and captures the CUDA graphs (2 min for the demo model on a fresh H100, longer for a 7B).
WORKER_START_S = {"cpu": 300.0, "cuda": 1200.0}
WORKER_GPU_SHARE = 0.45


def stack_errors(fn):
    """A service refusing a step of the demo path (a gRPC error) or a step failing (a job, a worker
    that cannot start or never registers) ends `qctl up` with one line instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        # Imported when `qctl up` runs, not with qctl: shared.registry loads SQLAlchemy and alembic (half a second).
        from shared.registry import RegistryError

        try:
            return fn(*args, **kwargs)
        except grpc.RpcError as exc:
            print(f"error: {exc.details()} ({exc.code().name})", file=sys.stderr)
            raise typer.Exit(code=2) from None
        except StackError as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise typer.Exit(code=1) from None
        except (WorkerError, StorageError, RegistryError) as exc:  # a worker that cannot load or serve its artifact
            print(f"error: {exc}", file=sys.stderr)
            raise typer.Exit(code=2) from None

    return wrapper



def print_serving_help(console: Console, gateway: str, admin_token: str, quantizer: str, quantizer_token: str,
                       deployment: str) -> None:
    """The commands to use the running stack from another shell. Not wrapped at the terminal's width: a pasted
    export line split in two would leave the second half's variables unexported (qctl then dials its defaults)."""
    console.print(
        f"\n[bold]serving[/]; in another shell:\n"
        f"  export QCTL_GATEWAY={gateway} QCTL_TOKEN={admin_token} QCTL_QUANTIZER={quantizer} "
        f"QCTL_QUANTIZER_TOKEN={quantizer_token}\n"
        f"  qctl generate -d {deployment} 'def main():'    qctl rollout status {deployment}    "
        f"qctl fallback on {deployment}\n"
        f"Ctrl-C stops the stack.",
        soft_wrap=True,
    )

class StackError(RuntimeError):
    """A step of the demo path failed; the message says which and why."""


@stack_errors
@user_errors
def up(
    model: Path = typer.Option(None, "--model", help="checkpoint folder [default: make a small random demo model]"),
    workdir: Path = typer.Option(Path(".qserve-up"), "--workdir", help="registry, store and caches go here"),
    format: QuantizedFormatName = typer.Option("w4a8kv4-g128", "--format", help="the quantized format to roll out"),
    device: str = typer.Option("auto", "--device", help="auto (a GPU when there is one), cpu or cuda"),
    eval_data: Path = typer.Option(None, "--eval-data",
                                   help="held-out text for the accuracy check [default: Python stdlib sources]"),
    eval_windows: int = typer.Option(8, "--eval-windows", min=1, help="eval windows of 256 tokens to score"),
    canary_percent: int = typer.Option(20, "--canary-percent", min=1, max=100, help="canary share during rollout"),
    prompt: str = typer.Option("def fibonacci(n):", "--prompt", help="prompt streamed at the end"),
    new_tokens: int = typer.Option(32, "--new-tokens", min=1, help="tokens to generate for the prompt"),
    once: bool = typer.Option(False, "--once", help="stop after the demo instead of serving until Ctrl-C"),
):
    """Quantizer + gateway + workers on loopback: publish, roll out, stream tokens; then keep serving."""
    # Imported here, not at the top: the services' servers import torch and the registry, which only
    # this command's run needs.
    from qctl.stack import LocalStack

    console = Console(stderr=True)
    workdir = workdir.resolve()
    device = resolve_device(device)
    gpu_target = "cpu" if device == "cpu" else resolve_gpu_target("auto")
    model, demo = _model(model, workdir, console)
    eval_path = eval_data.resolve() if eval_data else _builtin_eval_text(workdir)
    name = _deployment_name(model.name if not demo else "demo")

    stack = LocalStack(workdir, device)
    try:
        console.print(f"[bold]starting[/] the stack in {workdir} on {device} (gpu target {gpu_target})")
        quantizer = stack.start_quantizer(eval_path)
        gateway = stack.start_gateway()
        console.print(f"  quantizer {quantizer}, gateway {gateway}")

        small = dict(num_samples=8, seq_len=256) if demo else {}  # the random demo model learns nothing more
        token = stack.quantizer_token
        baseline_id = _publish(quantizer, token, model, name, "fp16", gpu_target, eval_windows, {}, console)
        quantized_id = _publish(quantizer, token, model, name, format.value, gpu_target, eval_windows, small,
                                console)

        budget = _worker_budget(device)
        for artifact_id in (baseline_id, quantized_id):
            console.print(f"starting a worker for {artifact_id}")
            _start_worker(stack, artifact_id, budget, device, console)
        with admin_client(gateway, stack.admin_token) as admin:
            _wait_for_workers(admin, {baseline_id, quantized_id})
            _deploy_baseline(admin, name, baseline_id, workdir, console)
            console.print(f"deployment [bold]{name}[/]: stable = fp16 {baseline_id}")
            admin.StartRollout(G.StartRolloutRequest(
                deployment=name, canary_artifact_id=quantized_id, canary_percent=canary_percent))
            console.print(f"rollout: {format.value} {quantized_id} takes {canary_percent}% as the canary")
            _show_canary_split(gateway, name, console)
            admin.PromoteRollout(G.PromoteRolloutRequest(deployment=name, canary_artifact_id=quantized_id))
            console.print(f"promoted: {format.value} {quantized_id} is now stable (fp16 stays the baseline)")
        _stream(gateway, name, prompt, new_tokens, console)

        if once:
            return
        print_serving_help(console, gateway, stack.admin_token, quantizer, stack.quantizer_token, name)
        _wait_for_interrupt()
    finally:
        console.print("stopping the stack")
        stack.stop()


def _model(model: Path | None, workdir: Path, console: Console) -> tuple[Path, bool]:
    if model is not None:
        if not (model / "config.json").is_file():
            raise FileNotFoundError(f"--model {model} has no config.json: give a Hugging Face Llama checkpoint folder")
        return model.resolve(), False
    from shared.model.demo import write_demo_checkpoint  # here, not at the top: it imports torch

    model = workdir / "demo-model"
    if not (model / "config.json").is_file():
        console.print(f"no --model given: writing a small random-weight Llama to {model} (no download); "
                      "its text is noise, give --model for a trained checkpoint")
        write_demo_checkpoint(model, "tiny")
    return model, True


def _worker_budget(device: str) -> int | None:
    """Two workers share the GPU: each may take WORKER_GPU_SHARE of the memory free now (a worker
    left to its default would take most of the GPU for itself). None on the CPU: the default."""
    if device == "cpu":
        return None
    import torch  # here, not at the top: qctl imports this module for every command, --help included

    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return int(free * WORKER_GPU_SHARE)


def _builtin_eval_text(workdir: Path) -> Path:
    """Held-out text for the accuracy check: the tail of the built-in text (calibration reads its head)."""
    path = workdir / "eval.txt"
    if not path.is_file():
        from shared.quant.calibration import default_calibration_text  # here, not at the top: it imports torch

        _, text = default_calibration_text(max_bytes=400_000)
        workdir.mkdir(parents=True, exist_ok=True)
        path.write_text(text[-60_000:], encoding="utf-8")
    return path


def _deployment_name(text: str) -> str:
    name = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-._")[:64]
    return name or "model"


def _publish(quantizer: str, token: str, model: Path, name: str, fmt: str, gpu_target: str, eval_windows: int,
             calibration: dict, console: Console) -> str:
    request = Q.PublishRequest(
        source=str(model), model_name=name, format=fmt, gpu_target=gpu_target,
        calibration=Q.Calibration(**calibration), eval=Q.EvalData(seq_len=256, max_windows=eval_windows),
    )
    console.print(f"[bold]publishing[/] {model.name} as {fmt}")
    channel, stub = quantizer_stub(quantizer, token)
    with channel:
        job = follow_job(stub, stub.Publish(request).job_id, console)
    if job is None or job.state != Q.JOB_STATE_SUCCEEDED:
        raise StackError(f"publishing {fmt} failed: {job.error if job else 'the progress stream ended empty'}")
    e = job.artifact.evaluation
    console.print(f"  {fmt} artifact {job.artifact.artifact_id} READY: perplexity {e.perplexity_quantized:.3f} "
                  f"vs fp16 {e.perplexity_fp16:.3f} ({e.perplexity_quantized / e.perplexity_fp16 - 1:+.2%})")
    return job.artifact.artifact_id


def _start_worker(stack: LocalStack, artifact_id: str, budget: int | None, device: str, console: Console) -> None:
    """Starts a worker with a spinner: a GPU worker's first start compiles kernels for minutes, silently."""
    timeout_s = WORKER_START_S[device]
    doing = "loading" if device == "cpu" else "loading, compiling kernels and capturing CUDA graphs (minutes the first time)"
    try:
        with console.status(f"worker {artifact_id}: {doing}"):
            stack.start_worker(artifact_id, budget, timeout_s=timeout_s)
    except concurrent.futures.TimeoutError:
        raise StackError(f"the worker for {artifact_id} did not start in {timeout_s:.0f} s") from None


def _wait_for_workers(admin, artifact_ids: set[str]) -> None:
    deadline = time.monotonic() + WORKER_WAIT_S
    while time.monotonic() < deadline:
        workers = admin.ListWorkers(G.ListWorkersRequest()).workers
        healthy = {w.artifact.artifact_id for w in workers if w.health == G.WORKER_HEALTH_HEALTHY}
        if artifact_ids <= healthy:
            return
        time.sleep(0.2)
    raise StackError(f"workers for {sorted(artifact_ids)} did not register with the gateway in {WORKER_WAIT_S:.0f} s")


def _deploy_baseline(admin, name: str, baseline_id: str, workdir: Path, console: Console) -> None:
    """The deployment with the fp16 baseline as its stable, no rollout and fallback off: created, or, on a
    run in a --workdir used before, the one the last run left (its canary promoted) brought back to that."""
    try:
        admin.CreateDeployment(G.CreateDeploymentRequest(
            name=name, stable_artifact_id=baseline_id, baseline_artifact_id=baseline_id))
        return
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.ALREADY_EXISTS:
            raise
    d = admin.GetDeployment(G.GetDeploymentRequest(deployment=name))
    if d.baseline.artifact_id != baseline_id:
        raise StackError(f"deployment {name!r} in {workdir} has baseline {d.baseline.artifact_id}, not this "
                         f"run's fp16 artifact {baseline_id} (another checkpoint of that name): use another "
                         f"--workdir")
    console.print(f"deployment {name} exists from an earlier run in {workdir}: resetting it to the fp16 baseline")
    reason = "qctl up: restarting the demo"
    if d.HasField("canary"):
        admin.AbortRollout(G.AbortRolloutRequest(deployment=name, reason=reason))
    if d.fallback:
        admin.SetFallback(G.SetFallbackRequest(deployment=name, enabled=False, reason=reason))
    if d.stable.artifact_id != baseline_id:
        admin.StartRollout(G.StartRolloutRequest(deployment=name, canary_artifact_id=baseline_id, canary_percent=100))
        admin.PromoteRollout(G.PromoteRolloutRequest(deployment=name, canary_artifact_id=baseline_id))


def _show_canary_split(gateway: str, name: str, console: Console) -> None:
    """A few short requests under distinct session keys, each sent twice: where they land, and that
    a key always lands on the same arm."""
    arms: dict[str, set[str]] = {}
    sampling = common_pb2.SamplingParams(max_new_tokens=4)
    with gateway_client(gateway) as stub:
        for round_ in range(2):
            for i in range(SESSIONS):
                key = f"user-{i}"
                request = G.GatewayGenerateRequest(deployment=name, text="import ", sampling=sampling, session_key=key)
                last = list(stub.Generate(request))[-1]
                arms.setdefault(key, set()).add(G.Arm.Name(last.arm).removeprefix("ARM_").lower())
    counts = Counter(next(iter(a)) for a in arms.values() if len(a) == 1)
    table = Table("arm", "session keys", title=f"{SESSIONS} session keys, each sent twice")
    for arm, count in sorted(counts.items()):
        table.add_row(arm, str(count))
    console.print(table)
    moved = [key for key, a in arms.items() if len(a) > 1]
    if moved:
        raise StackError(f"session keys {moved} reached both arms: stickiness is broken")
    console.print("every key reached the same arm both times (sticky)")


def _stream(gateway: str, name: str, prompt: str, new_tokens: int, console: Console) -> None:
    console.print(f"[bold]streaming[/] through the gateway: {prompt!r}")
    request = G.GatewayGenerateRequest(deployment=name, text=prompt,
                                       sampling=common_pb2.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    with gateway_client(gateway) as stub:
        sys.stdout.write(prompt)
        for reply in stub.Generate(request):
            sys.stdout.write(reply.text)
            sys.stdout.flush()
            if reply.HasField("finish"):
                f = reply.finish
                print()
                ttft = f.timings.time_to_first_token.ToTimedelta().total_seconds() * 1000
                tpot = f.timings.time_per_output_token.ToTimedelta().total_seconds() * 1000
                console.print(f"  {f.generated_tokens} tokens from {G.Arm.Name(reply.arm).removeprefix('ARM_').lower()} "
                              f"{reply.artifact_id}; ttft {ttft:.0f} ms, {tpot:.1f} ms/token")


def _wait_for_interrupt() -> None:
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
