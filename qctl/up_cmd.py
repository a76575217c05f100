"""`qctl up`: the whole stack in one process on loopback, and the product's path through it.

Starts a quantizer, the gateway and two workers (SQLite registry and a local-folder store under
--workdir; the CPU reference backend when there is no GPU), then: publishes the model as the fp16
baseline and as a quantized artifact (QoQ, evaluated against fp16), deploys the baseline, rolls the
quantized artifact out as a canary and shows where sticky sessions land, promotes it, and streams a
generation through the gateway. Then it keeps serving (Ctrl-C stops it) unless --once is given.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import functools
import os
import re
import shutil
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
from rich.markup import escape
from rich.table import Table

from qctl.choices import QuantizedFormatName
from qctl.demo_cmd import demo_model
from qctl.devices import resolve_device, resolve_gpu_target
from qctl.errors import user_errors
from qctl.gateway_client import admin_client, gateway_client
from qctl.output import enum_label
from qctl.publish_cmd import follow_job, quantizer_stub
from services.worker.errors import WorkerError
from shared.model.config import LlamaConfig
from shared.rpc.qserve.v1 import common_pb2, gateway_pb2, quantizer_pb2
from shared.storage import StorageError

if TYPE_CHECKING:
    from qctl.stack import LocalStack
    from services.quantizer.evaluate import EvalWindows

Q, G = quantizer_pb2, gateway_pb2
SESSIONS = 20  # session keys sent during the canary, to show the split and its stickiness
WORKER_WAIT_S = 60.0
# How long a worker may take to load: on a GPU its first start on a machine compiles every Triton kernel
# its artifact uses and captures the CUDA graphs (2 min for the demo model on a fresh H100, longer for a 7B).
WORKER_START_S = {"cpu": 300.0, "cuda": 1200.0}  # by device type: --device cuda:1 is a "cuda" device
WORKER_GPU_SHARE = 0.45
EVAL_SEQ_LEN = 256  # the accuracy check's window, or the model's context if that is shorter


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
    device: str = typer.Option("auto", "--device", help="auto (a GPU when there is one), cpu, cuda or cuda:N"),
    eval_data: Path = typer.Option(None, "--eval-data",
                                   help="held-out text for the accuracy check [default: Python stdlib sources]. "
                                        "In a --workdir used before, the artifacts published there are reused: "
                                        "one evaluated on other text or another number of windows is evaluated "
                                        "again on this run's, so the perplexities printed are always this run's"),
    eval_windows: int = typer.Option(8, "--eval-windows", min=1,
                                     help="eval windows of 256 tokens (or the model's context, if shorter) to score"),
    canary_percent: int = typer.Option(20, "--canary-percent", min=1, max=100, help="canary share during rollout"),
    prompt: str = typer.Option("def fibonacci(n):", "--prompt", help="prompt streamed at the end"),
    new_tokens: int = typer.Option(32, "--new-tokens", min=1, help="tokens to generate for the prompt"),
    once: bool = typer.Option(False, "--once", help="stop after the demo instead of serving until Ctrl-C"),
):
    """Quantizer + gateway + workers on loopback: publish, roll out, stream tokens; then keep serving.
    One run at a time per --workdir."""
    if not prompt:  # refused now, not by the worker after minutes of publishing and starting
        raise typer.BadParameter("give a non-empty prompt to stream", param_hint="--prompt")
    device = resolve_device(device)  # before the lock: a device refused leaves no --workdir behind
    workdir = workdir.resolve()
    with _workdir_lock(workdir):
        _up(model, workdir, format, device, eval_data, eval_windows, canary_percent, prompt, new_tokens, once)


def _up(model: Path | None, workdir: Path, format: QuantizedFormatName, device: str, eval_data: Path | None,
        eval_windows: int, canary_percent: int, prompt: str, new_tokens: int, once: bool) -> None:
    # Imported here, not at the top: the services' servers import torch and the registry, which only
    # this command's run needs.
    from qctl.stack import LocalStack

    console = Console(stderr=True)
    gpu_target = "cpu" if device == "cpu" else resolve_gpu_target("auto", device)
    model, demo = _model(model, workdir, console)
    eval_path = eval_data.resolve() if eval_data else _builtin_eval_text(workdir)
    eval_seq_len = _eval_seq_len(model)
    name = _deployment_name(model.name if not demo else "demo")

    stack = LocalStack(workdir, device)
    try:
        console.print(f"[bold]starting[/] the stack in {workdir} on {device} (gpu target {gpu_target})")
        quantizer = stack.start_quantizer(eval_path)
        gateway = stack.start_gateway()
        console.print(f"  quantizer {quantizer}, gateway {gateway}")

        small = dict(num_samples=8, seq_len=256) if demo else {}  # the random demo model learns nothing more
        token = stack.quantizer_token
        check = _AccuracyCheck(stack.store.root, model, eval_path, eval_seq_len, eval_windows, device, console)
        baseline_id = check.show(_publish(quantizer, token, model, name, "fp16", gpu_target, check.request, {},
                                          console))
        quantized_id = check.show(_publish(quantizer, token, model, name, format.value, gpu_target, check.request,
                                           small, console))

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
            served = _show_canary_split(gateway, name, console)
            if not served:
                console.print(f"the canary got none of these session keys at {canary_percent}%: promoting it with "
                              f"force (the gateway promotes a canary only once it has served a request)")
            admin.PromoteRollout(G.PromoteRolloutRequest(deployment=name, canary_artifact_id=quantized_id,
                                                         force=not served))
            console.print(f"promoted: {format.value} {quantized_id} is now stable (fp16 stays the baseline)")
        _stream(gateway, name, prompt, new_tokens, console)

        if once:
            return
        print_serving_help(console, gateway, stack.admin_token, quantizer, stack.quantizer_token, name)
        _wait_for_interrupt()
    finally:
        console.print("stopping the stack")
        stack.stop()


@contextlib.contextmanager
def _workdir_lock(workdir: Path):
    """Holds <workdir>/.lock (an exclusive flock) for the run. A second run in the same folder is refused: its
    quantizer would fail the first run's live jobs as orphans (the stack's quantizer takes every RUNNING job as
    left by a killed run) and delete their objects, and it would reset the first run's deployment. The kernel
    releases the lock when the process ends, killed too, so a killed run leaves nothing to clean up."""
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / ".lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            pid = lock.read().strip()
            print(f"error: another qctl up{f' (pid {pid})' if pid else ''} is using {workdir}: stop it, or give "
                  f"this one another --workdir", file=sys.stderr)
            raise typer.Exit(code=2) from None
        lock.truncate(0)
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        yield


def _model(model: Path | None, workdir: Path, console: Console) -> tuple[Path, bool]:
    if model is not None:
        if not (model / "config.json").is_file():
            raise FileNotFoundError(f"--model {model} has no config.json: give a Hugging Face Llama checkpoint folder")
        return model.resolve(), False
    # What a run killed while writing the demo model left (write_demo_checkpoint's temporary folder): this run
    # holds the --workdir's lock, so none of them is being written.
    for stale in workdir.glob(".demo-model.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    note = "; its text is noise, give --model for a trained checkpoint"
    return demo_model(workdir / "demo-model", console, note), True


def _eval_seq_len(model: Path) -> int:
    """EVAL_SEQ_LEN, or the model's context if shorter (LlamaConfig.window's rule): a window past the context
    scores positions the model was never trained on nor serves, and the quantizer refuses it."""
    try:
        config = LlamaConfig.from_folder(model)
    except (ValueError, TypeError, ArithmeticError, OSError):
        return EVAL_SEQ_LEN  # a config.json the quantizer refuses, naming what is wrong, when it is published
    return config.window(None, EVAL_SEQ_LEN, "--eval-windows", "an eval")


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


def _publish(quantizer: str, token: str, model: Path, name: str, fmt: str, gpu_target: str, eval: Q.EvalData,
             calibration: dict, console: Console) -> common_pb2.ArtifactInfo:
    request = Q.PublishRequest(
        source=str(model), model_name=name, format=fmt, gpu_target=gpu_target,
        calibration=Q.Calibration(**calibration), eval=eval,
    )
    console.print(f"[bold]publishing[/] {model.name} as {fmt}")
    channel, stub = quantizer_stub(quantizer, token)
    with channel:
        job = follow_job(stub, stub.Publish(request).job_id, console)
    if job is None or job.state != Q.JOB_STATE_SUCCEEDED:
        raise StackError(f"publishing {fmt} failed: {job.error if job else 'the progress stream ended empty'}")
    return job.artifact


class _AccuracyCheck:
    """Prints each published artifact's perplexities against fp16, and the text and windows they were measured on.

    The quantizer evaluates an artifact once, when it builds it. In a --workdir used before, a publish hands back
    the READY artifact of the same binding with the evaluation an earlier run made, maybe on other text or another
    number of windows (--eval-data, --eval-windows). Printing that as this run's check would report an accuracy
    never measured on this run's text: such an artifact is evaluated again here, with the quantizer's own
    functions on the same windows, so the figures are those a fresh --workdir would print."""

    def __init__(self, store_root: Path, model: Path, eval_path: Path, seq_len: int, max_windows: int, device: str,
                 console: Console):
        self.store_root, self.model, self.eval_path, self.device, self.console = (
            store_root, model, eval_path, device, console)
        self.request = Q.EvalData(seq_len=seq_len, max_windows=max_windows)
        self._windows: EvalWindows | None = None
        self._ppl_fp16: float | None = None

    def show(self, artifact: common_pb2.ArtifactInfo) -> str:
        """Prints artifact's check (measured again when its evaluation is not this run's); returns its id."""
        from services.quantizer.config import DEFAULT_BUDGET, over_budget
        from shared.formats.manifest import Manifest

        e = Manifest.read(self.store_root / artifact.object_key_prefix).evaluation
        windows = self.windows()
        what = f"{artifact.format} artifact {artifact.artifact_id}"
        ours = _on(windows.name, windows.count, windows.seq_len)
        if e is not None and (e.data_sha256, e.seq_len, e.windows) == (windows.sha256, windows.seq_len, windows.count):
            ppl_fp16, ppl_quantized = e.ppl_fp16, e.ppl_quantized
        else:
            theirs = _on(e.data_name, e.windows, e.seq_len) if e else "no text"
            self.console.print(f"  {what}, published by an earlier run in this --workdir, was evaluated on {theirs}: "
                               f"evaluating it again on {ours}")
            ppl_fp16, ppl_quantized = self._measure(artifact)
            # The budget this run's publish was held to: it asks none, so the stack's quantizer's default.
            budget = DEFAULT_BUDGET
            if over_budget(ppl_fp16, ppl_quantized, budget):  # what the quantizer refuses to publish
                raise StackError(f"{what}: on {ours} its perplexity {ppl_quantized:.3f} is "
                                 f"{ppl_quantized / ppl_fp16 - 1:+.2%} over fp16's {ppl_fp16:.3f}, above the "
                                 f"accuracy budget of {budget:.2%}")
        self.console.print(f"  {what} READY: perplexity {ppl_quantized:.3f} vs fp16 {ppl_fp16:.3f} "
                           f"({ppl_quantized / ppl_fp16 - 1:+.2%}) on {ours}")
        return artifact.artifact_id

    def windows(self) -> EvalWindows:
        """This run's eval windows, as the quantizer cuts them (the same function on the same request)."""
        from services.quantizer.evaluate import eval_windows  # here, not at the top: it imports torch

        if self._windows is None:
            self._windows = eval_windows(self.eval_path, self.eval_path.stem, self.model, self.request.seq_len,
                                         self.request.max_windows)
        return self._windows

    def _measure(self, artifact: common_pb2.ArtifactInfo) -> tuple[float, float]:
        from services.quantizer.evaluate import artifact_perplexity, checkpoint_perplexity
        from shared.model.checkpoint import HfCheckpoint

        if self._ppl_fp16 is None:  # both artifacts' reference: measured once
            self._ppl_fp16 = checkpoint_perplexity(HfCheckpoint(self.model), self.windows(), self.device)
        if artifact.format == "fp16":  # the artifact is the checkpoint's own weights, as the quantizer takes it
            return self._ppl_fp16, self._ppl_fp16
        folder = self.store_root / artifact.object_key_prefix
        return self._ppl_fp16, artifact_perplexity(folder, self.windows(), self.device)


def _on(name: str, windows: int, seq_len: int) -> str:
    return f"{escape(name)}, {windows} window{'s' if windows != 1 else ''} of {seq_len} tokens"


def _start_worker(stack: LocalStack, artifact_id: str, budget: int | None, device: str, console: Console) -> None:
    """Starts a worker with a spinner: a GPU worker's first start compiles kernels for minutes, silently."""
    timeout_s = WORKER_START_S["cpu" if device == "cpu" else "cuda"]
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
        # Forced: the run's own fp16 baseline, promoted before it has served a request.
        admin.PromoteRollout(G.PromoteRolloutRequest(deployment=name, canary_artifact_id=baseline_id, force=True))


def _show_canary_split(gateway: str, name: str, console: Console) -> int:
    """A few short requests under distinct session keys, each sent twice: where they land, and that
    a key always lands on the same arm. Returns how many keys the canary served."""
    arms: dict[str, set[str]] = {}
    sampling = common_pb2.SamplingParams(max_new_tokens=4)
    with gateway_client(gateway) as stub:
        for round_ in range(2):
            for i in range(SESSIONS):
                key = f"user-{i}"
                request = G.GatewayGenerateRequest(deployment=name, text="import ", sampling=sampling, session_key=key)
                last = list(stub.Generate(request))[-1]
                arms.setdefault(key, set()).add(enum_label(G.Arm, last.arm, "ARM_").lower())
    counts = Counter(next(iter(a)) for a in arms.values() if len(a) == 1)
    table = Table("arm", "session keys", title=f"{SESSIONS} session keys, each sent twice")
    for arm, count in sorted(counts.items()):
        table.add_row(arm, str(count))
    console.print(table)
    moved = [key for key, a in arms.items() if len(a) > 1]
    if moved:
        raise StackError(f"session keys {moved} reached both arms: stickiness is broken")
    console.print("every key reached the same arm both times (sticky)")
    return counts.get("canary", 0)


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
                console.print(f"  {f.generated_tokens} tokens from {enum_label(G.Arm, reply.arm, 'ARM_').lower()} "
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
