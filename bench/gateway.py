"""Gateway overhead: tokens per second of N concurrent streams sent through the gateway, against
the same streams sent straight to the worker. CPU backend, the fixture model quantized with RTN.

    .venv/bin/python bench/gateway.py --format fp16 --rounds 7 --out bench/results/cpu/gateway.json
    .venv/bin/python bench/gateway.py --prompt-tokens 16 --new-tokens 16 \
        --out bench/results/cpu/gateway-w4a8kv4.json

gateway.json serves the fp16 artifact: the CPU worker's faster path (about 10x the tokens/s of
its W4A8KV4 reference path), so the gateway's per-message cost weighs most there.
gateway-w4a8kv4.json is the same comparison on the W4A8KV4 artifact, with shorter streams to keep
its rounds under a minute.

Every piece is a separate process, as deployed: the worker (`python -m services.worker.server`)
and the gateway (`python -m services.gateway.server`); the quantizer runs in this process only to
publish the artifacts, before anything is timed. With --pin (the default on 2+ cores) the worker
gets CPU 0 and the gateway and the client the other CPUs, as when the gateway runs on its own host:
both paths run under the same pinning, so the comparison prices the gateway's extra hop, not its
CPU taken from the worker's core. The client (this process) opens the streams with
grpc.aio. Rounds alternate direct / gateway so that drift in the machine's load (a shared host)
falls on both sides; the medians are compared. Greedy sampling with ignore_eos: every round makes
the same tokens, which the bench checks to be identical on both paths.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from shared.rpc.qserve.v1 import (  # noqa: E402
    common_pb2, gateway_pb2, gateway_pb2_grpc, quantizer_pb2, quantizer_pb2_grpc, worker_pb2, worker_pb2_grpc,
)

FIXTURES = REPO.parent / "shared"
ADMIN_TOKEN, WORKER_TOKEN = "bench-admin", "bench-worker"
ADMIN = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
TARGET_RATIO = 0.95


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=FIXTURES / "models" / "tiny-llama-pystdlib")
    p.add_argument("--calib", type=Path, default=FIXTURES / "data" / "pystdlib-calib.txt")
    p.add_argument("--eval-data", type=Path, default=FIXTURES / "data" / "pystdlib-eval.txt")
    p.add_argument("--format", default="w4a8kv4-g128", help="format of the served artifact")
    p.add_argument("--streams", type=int, default=64, help="concurrent streams")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64, help="generated tokens per stream")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per path (after one warm-up each)")
    p.add_argument("--worker-threads", type=int, default=1, help="torch threads of the worker")
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=len(os.sched_getaffinity(0)) >= 2,
                   help="worker on CPU 0; gateway and client on the others")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args()


def publish(quantizer_address: str, args: argparse.Namespace, fmt: str, work: Path) -> str:
    calib, evals = work / "calib.txt", work / "eval.txt"
    calib.write_text(args.calib.read_text()[:40_000])
    evals.write_text(args.eval_data.read_text()[:20_000])
    off = {} if fmt == "fp16" else dict(smooth_attention=False, rotation=False, smoothing=False, reorder=False,
                                        clipping=False, gptq=False, rotate_values=False)
    request = quantizer_pb2.PublishRequest(
        source=str(args.model), model_name="tiny-llama", format=fmt, gpu_target="cpu",
        calibration=quantizer_pb2.Calibration(data=str(calib), num_samples=4, seq_len=128),
        qoq=quantizer_pb2.QoQOptions(**off),
        eval=quantizer_pb2.EvalData(data=str(evals), seq_len=128, max_windows=4),
        max_relative_perplexity_increase=1.0,
    )
    with grpc.insecure_channel(quantizer_address) as channel:
        stub = quantizer_pb2_grpc.QuantizerStub(channel)
        job = stub.Publish(request)
        last = None
        for update in stub.WatchJob(quantizer_pb2.WatchJobRequest(job_id=job.job_id), timeout=600):
            last = update.job
    if last is None or last.state != quantizer_pb2.JOB_STATE_SUCCEEDED:
        raise SystemExit(f"publishing {fmt} failed: {last.error if last else 'no progress'}")
    return last.artifact.artifact_id


def start(command: list[str], log: Path, env: dict | None = None, cpus: set[int] | None = None) -> subprocess.Popen:
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    return subprocess.Popen(command, cwd=REPO, env={**os.environ, **(env or {})}, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, preexec_fn=pin)


def wait_for_worker(gateway: str, artifact_id: str, processes: list[subprocess.Popen], timeout_s: float = 300) -> str:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(gateway) as channel:
        admin = gateway_pb2_grpc.AdminStub(channel)
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in processes):
                raise SystemExit("a server process exited; see its log in the work folder")
            try:
                listed = admin.ListWorkers(gateway_pb2.ListWorkersRequest(artifact_id=artifact_id), metadata=ADMIN)
                if listed.workers and listed.workers[0].health == gateway_pb2.WORKER_HEALTH_HEALTHY:
                    return listed.workers[0].address
            except grpc.RpcError:
                pass  # the gateway is still starting
            time.sleep(0.2)
    raise SystemExit(f"the worker for {artifact_id} did not register within {timeout_s:.0f} s")


async def one_round(address: str, via_gateway: bool, prompts: list[list[int]], new_tokens: int
                    ) -> tuple[float, list[list[int]]]:
    """All streams at once; returns (seconds from the first call to the last final message, tokens)."""
    sampling = common_pb2.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    async with grpc.aio.insecure_channel(address) as channel:
        if via_gateway:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            requests = [gateway_pb2.GatewayGenerateRequest(deployment="bench", token_ids={"ids": p}, sampling=sampling)
                        for p in prompts]
        else:
            stub = worker_pb2_grpc.WorkerStub(channel)
            requests = [worker_pb2.GenerateRequest(token_ids={"ids": p}, sampling=sampling) for p in prompts]
        await channel.channel_ready()

        async def stream(request) -> list[int]:
            return [t async for reply in stub.Generate(request) for t in reply.token_ids]

        started = time.perf_counter()
        tokens = await asyncio.gather(*(stream(r) for r in requests))
        return time.perf_counter() - started, tokens


def main() -> None:
    args = parse_args()
    from bench.machine import cpu_machine
    from services.quantizer.config import QuantizerConfig
    from services.quantizer.server import BackgroundQuantizer
    from shared.registry import sqlite_url
    from shared.storage import StorageConfig

    work = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    registry_url = sqlite_url(work / "registry.db")
    store = work / "objects"
    quantizer = BackgroundQuantizer(QuantizerConfig(registry_url=registry_url, store=StorageConfig(kind="local",
                                    root=store), create_bucket=True, work_dir=work / "quantizer", listen="127.0.0.1:0"))
    try:
        served = publish(quantizer.address, args, args.format, work)
        baseline = served if args.format == "fp16" else publish(quantizer.address, args, "fp16", work)
    finally:
        quantizer.stop(0)

    worker_cpus = front_cpus = None
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        worker_cpus, front_cpus = {cpus[0]}, set(cpus[1:])
        os.sched_setaffinity(0, front_cpus)  # the client
    gateway_port = _free_port()
    gateway_address = f"127.0.0.1:{gateway_port}"
    tokens_env = {"QSERVE_ADMIN_TOKENS": f"ops={ADMIN_TOKEN}:admin,workers={WORKER_TOKEN}:worker"}
    gateway = start([sys.executable, "-m", "services.gateway.server", "--registry-url", registry_url, "--listen",
                     gateway_address, "--max-concurrent-streams", str(4 * args.streams), "--no-auto-fallback"],
                    work / "gateway.log", tokens_env, front_cpus)
    worker = start([sys.executable, "-m", "services.worker.server", "--artifact", served, "--store", str(store),
                    "--registry-url", registry_url, "--device", "cpu", "--port", "0", "--metrics-port", "-1",
                    "--cache-dir", str(work / "cache"), "--gateway-address", gateway_address,
                    "--torch-threads", str(args.worker_threads), "--max-running-sequences", str(args.streams),
                    "--drain-grace-seconds", "1"], work / "worker.log", {"QSERVE_GATEWAY_TOKEN": WORKER_TOKEN},
                   worker_cpus)
    try:
        worker_address = wait_for_worker(gateway_address, served, [gateway, worker])
        with grpc.insecure_channel(gateway_address) as channel:
            gateway_pb2_grpc.AdminStub(channel).CreateDeployment(gateway_pb2.CreateDeploymentRequest(
                name="bench", stable_artifact_id=served, baseline_artifact_id=baseline), metadata=ADMIN)
        # distinct prompts from the fixture's vocabulary, fixed so every round does the same work
        prompts = [[(97 * s + 13 * i) % 4000 + 50 for i in range(args.prompt_tokens)] for s in range(args.streams)]
        raw = {"direct": [], "gateway": []}
        reference = None
        for round_index in range(args.rounds + 1):  # round 0 warms both paths up and is not counted
            for path, address in (("direct", worker_address), ("gateway", gateway_address)):
                seconds, tokens = asyncio.run(one_round(address, path == "gateway", prompts, args.new_tokens))
                generated = sum(len(t) for t in tokens)
                if generated != args.streams * args.new_tokens:
                    raise SystemExit(f"{path}: {generated} tokens, expected {args.streams * args.new_tokens}")
                reference = reference or tokens
                if tokens != reference:
                    raise SystemExit(f"{path} round {round_index}: the tokens differ from the first round's")
                if round_index:
                    raw[path].append({"seconds": seconds, "tokens": generated, "tokens_per_s": generated / seconds})
                print(f"round {round_index} {path}: {generated / seconds:.0f} tokens/s ({seconds:.2f} s)", flush=True)
    finally:
        for process in (worker, gateway):
            process.terminate()
        for process in (worker, gateway):
            process.wait(60)

    median = {path: statistics.median(r["tokens_per_s"] for r in rounds) for path, rounds in raw.items()}
    # each gateway round over the direct round just before it: drift in the host's load cancels
    paired = [g["tokens_per_s"] / d["tokens_per_s"] for d, g in zip(raw["direct"], raw["gateway"])]
    ratio = median["gateway"] / median["direct"]
    result = {
        "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", "bench/gateway.py", *sys.argv[1:]]),
        "machine": cpu_machine(),
        "setup": {"model": args.model.name, "format": args.format, "streams": args.streams,
                  "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "rounds": args.rounds,
                  "worker_torch_threads": args.worker_threads, "sampling": "greedy, ignore_eos",
                  "processes": "worker, gateway and client are separate processes on this machine",
                  "pinning": {"worker": sorted(worker_cpus), "gateway_and_client": sorted(front_cpus)}
                  if args.pin else "none"},
        "raw": raw,
        "median_tokens_per_s": median,
        "round_ratios": [round(r, 4) for r in paired],
        "checks": [{"name": "gateway tokens/s over direct-to-worker tokens/s, 64 concurrent streams"
                    if args.streams == 64 else f"gateway/direct tokens/s, {args.streams} streams",
                    "value": round(ratio, 4), "target": TARGET_RATIO, "op": ">=", "met": ratio >= TARGET_RATIO}],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["median_tokens_per_s"]), f"ratio {ratio:.3f}", "met" if ratio >= TARGET_RATIO else "NOT met")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
