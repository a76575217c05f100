"""The serving path under concurrent load: a real gateway and two real CPU workers on loopback (a
small random-weight model), driven by ~75 Generate streams at once: streams read to the end (greedy,
seeded sampling, stop tokens, text prompts, session keys, a reused request id), streams the client
cancels, streams whose deadline expires mid-generation, and invalid requests. Every stream must end
as it should, a completed one with the very tokens (and text) of the same request run alone; and
nothing may be left behind: no running request, no KV block held, no open stream counted at the
gateway, no cancelled stream still generating on a worker. One worker overlaps its steps (the GPU
path) and a small KV cache makes streams preempt each other. A second scenario fills the workers'
admission while their engines are stalled, and checks that more requests are refused at once, that
clients giving up meanwhile are released, and that the stack recovers."""

from __future__ import annotations

import asyncio
import math
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.config import AdminToken, FallbackBudget, GatewayConfig
from services.gateway.server import BackgroundGateway
from services.worker.config import WorkerConfig
from services.worker.engine.engine import Engine, EngineLimits
from services.worker.engine.sequence import SamplingOptions
from services.worker.errors import QueueFull
from services.worker.server import BackgroundWorker
from shared.formats.artifact import sha256_file
from shared.quant.options import QoQOptions
from shared.quant.quantize_model import QuantizeSettings, quantize_checkpoint
from shared.registry import create_registry, mark_artifact_ready, register_model_version, reserve_artifact, sqlite_url
from shared.rpc.qserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.conftest import write_random_llama
from tests.worker.test_engine import ScriptedRunner, Text

ADMIN_TOKEN, WORKER_TOKEN = "soak-admin", "soak-worker"
ADMIN = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
WORKER = (("authorization", f"Bearer {WORKER_TOKEN}"),)
VOCAB = 4096
MAX_CONTEXT = 512  # per sequence, on the workers: keeps a runaway stream short
LONG = 400  # max_new_tokens of the streams that should be stopped long before
# Tokens a worker may still generate for a stream after its client went away (the cancel reaching the
# worker takes a step or two); a stream that kept generating would reach LONG.
ABORT_SLACK = 24


# ---------------------------------------------------------------- the stack


@dataclass(frozen=True)
class Published:
    folder: Path  # the fp16 artifact the workers load
    artifact_id: str  # its id in the registry (and in its manifest)
    registry_url: str


@pytest.fixture(scope="module")
def published(tmp_path_factory, tiny_llama: Path) -> Published:
    """A small random Llama as an fp16 artifact, READY in a SQLite registry under the manifest's id."""
    root = tmp_path_factory.mktemp("soak")
    model = write_random_llama(root / "model", hidden=128, ffn=256, heads=2, kv_heads=1, vocab=VOCAB,
                               tokenizer_from=tiny_llama)
    folder = root / "fp16"
    manifest = quantize_checkpoint(QuantizeSettings(model, folder, "fp16", options=QoQOptions.rtn()))
    url = sqlite_url(root / "registry.db")
    registry = create_registry(url)
    try:
        with registry.transaction() as session:
            version = register_model_version(session, "soak-llama", manifest.model_version)
            artifact_id = reserve_artifact(session, version.id, "fp16", "cpu").artifact.id
            # The worker serves the local folder and reports the manifest's id: it must be the
            # registry's (publish does the same; the manifest is not in its own file list).
            manifest.artifact_id = artifact_id
            manifest.write(folder)
            mark_artifact_ready(session, artifact_id, manifest_sha256=sha256_file(folder / "manifest.json"),
                                content_digest=artifact_id,
                                actor="test")
    finally:
        registry.close()
    return Published(folder, artifact_id, url)


@dataclass
class Serving:
    gateway: BackgroundGateway
    workers: list[BackgroundWorker]
    deployment: str

    def list_workers(self) -> list[gateway_pb2.WorkerStatus]:
        with grpc.insecure_channel(self.gateway.address) as channel:
            return list(gateway_pb2_grpc.AdminStub(channel).ListWorkers(
                gateway_pb2.ListWorkersRequest(), metadata=ADMIN, timeout=10).workers)

    def open_streams_gauge(self) -> float:
        return self.gateway.server.metrics.registry.get_sample_value("qserve_gateway_open_streams")


def worker_info(worker: BackgroundWorker) -> worker_pb2.WorkerInfo:
    with grpc.insecure_channel(worker.address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(), timeout=10)


def worker_metrics(worker: BackgroundWorker) -> dict[tuple[str, tuple], float]:
    """The worker's /metrics page: (sample name, sorted labels) -> value."""
    url = f"http://127.0.0.1:{worker.server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as page:
        text = page.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def aborted_and_generated(workers: list[BackgroundWorker]) -> tuple[float, float]:
    """Requests ended by an abort, and tokens generated, summed over the workers."""
    aborted = generated = 0.0
    for worker in workers:
        samples = worker_metrics(worker)
        aborted += samples.get(("qserve_worker_requests_total", (("reason", "abort"),)), 0.0)
        generated += samples.get(("qserve_worker_generated_tokens_total", ()), 0.0)
    return aborted, generated


@contextmanager
def serving(published: Published, deployment: str, *, capacity: int = 0, per_worker: tuple[dict, dict] = ({}, {}),
            **worker_settings) -> Iterator[Serving]:
    """A gateway and two workers of the artifact, registered by hand (so a test chooses the capacity the
    gateway routes up to; 0 = the worker's running + waiting limits), and a deployment serving it."""
    gateway = BackgroundGateway(GatewayConfig(
        registry_url=published.registry_url, listen="127.0.0.1:0", grace_s=0.5, budget=FallbackBudget(enabled=False),
        admin_tokens={"ops": AdminToken(ADMIN_TOKEN, "admin"), "workers": AdminToken(WORKER_TOKEN, "worker")},
        # registered by hand, the workers send no heartbeats: they must stay healthy all the same
        heartbeat_timeout_s=600.0, worker_forget_s=1200.0))
    workers: list[BackgroundWorker] = []
    try:
        for own in per_worker:
            settings = dict(artifact=str(published.folder), port=0, metrics_port=0, block_size=16, kv_blocks=160,
                            max_context_tokens=MAX_CONTEXT, max_running_sequences=16, max_waiting_requests=64,
                            torch_threads=1, drain_grace_s=0.5)
            settings.update(worker_settings, **own)
            workers.append(BackgroundWorker(WorkerConfig(**settings)))
        with grpc.insecure_channel(gateway.address) as channel:
            admin = gateway_pb2_grpc.AdminStub(channel)
            for worker in workers:
                admin.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
                    address=worker.address, artifact_id=published.artifact_id, capacity=capacity),
                    metadata=WORKER, timeout=10)
            admin.CreateDeployment(gateway_pb2.CreateDeploymentRequest(
                name=deployment, stable_artifact_id=published.artifact_id, baseline_artifact_id=published.artifact_id),
                metadata=ADMIN, timeout=10)
        yield Serving(gateway, workers, deployment)
    finally:
        for worker in workers:
            worker.stop(grace_s=0)
        gateway.stop(0)


def wait_until(what: str, check: Callable[[], str | None], timeout_s: float = 10.0) -> None:
    """Polls check() (None when satisfied, else what is still wrong) until it holds or timeout_s passes."""
    deadline = time.monotonic() + timeout_s
    while (problem := check()) is not None:
        assert time.monotonic() < deadline, f"{what} not reached after {timeout_s:.0f} s: {problem}"
        time.sleep(0.05)


def leftovers(stack: Serving) -> str | None:
    """What the stack still holds of finished streams, or None when it is all released."""
    problems = []
    for worker in stack.workers:
        info = worker_info(worker)
        if info.running_requests or info.waiting_requests or info.kv_blocks_free != info.kv_blocks_total:
            problems.append(f"worker {worker.address}: running {info.running_requests}, waiting "
                            f"{info.waiting_requests}, KV blocks free {info.kv_blocks_free}/{info.kv_blocks_total}")
        engine = worker.server.served.engine
        if engine.num_in_flight:
            problems.append(f"worker {worker.address}: engine has requests in flight {engine.in_flight()}")
    for status in stack.list_workers():
        if status.in_flight:
            problems.append(f"gateway counts {status.in_flight} streams open on {status.address}")
    if stack.gateway.server.gateway.open_streams:
        problems.append(f"gateway counts {stack.gateway.server.gateway.open_streams} open streams")
    if stack.open_streams_gauge() != 0:
        problems.append(f"gauge qserve_gateway_open_streams is {stack.open_streams_gauge()}")
    return "; ".join(problems) or None


# ---------------------------------------------------------------- the clients


@dataclass
class Case:
    name: str
    request: gateway_pb2.GatewayGenerateRequest
    expect: grpc.StatusCode  # OK: read to the end; CANCELLED: the client cancels after cancel_after tokens
    cancel_after: int = 0
    timeout_s: float = 30.0  # the client's deadline; every call has one, so no stream can hang the test


@dataclass
class Result:
    case: Case
    code: grpc.StatusCode
    details: str = ""
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finishes: list[common_pb2.Finish] = field(default_factory=list)  # from every message that carried one
    last_has_finish: bool = False
    elapsed_s: float = 0.0


async def run_case(stub: gateway_pb2_grpc.GatewayStub, case: Case) -> Result:
    start = time.monotonic()
    call = stub.Generate(case.request, timeout=case.timeout_s)
    result = Result(case, grpc.StatusCode.OK)
    try:
        async for reply in call:
            result.tokens.extend(reply.token_ids)
            result.text += reply.text
            result.last_has_finish = reply.HasField("finish")
            if result.last_has_finish:
                result.finishes.append(reply.finish)
            if case.cancel_after and len(result.tokens) >= case.cancel_after:
                call.cancel()
                break
        result.code = await call.code()
    except grpc.aio.AioRpcError as err:
        result.code, result.details = err.code(), err.details() or ""
    result.elapsed_s = time.monotonic() - start
    return result


async def run_all(address: str, cases: list[Case], timeout_s: float = 60.0) -> list[Result]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        return await asyncio.wait_for(asyncio.gather(*(run_case(stub, c) for c in cases)), timeout_s)


def request(deployment: str, prompt: list[int] | str, *, session_key: str = "", request_id: str = "", **sampling
            ) -> gateway_pb2.GatewayGenerateRequest:
    out = gateway_pb2.GatewayGenerateRequest(deployment=deployment, session_key=session_key, request_id=request_id,
                                             sampling=common_pb2.SamplingParams(**sampling))
    if isinstance(prompt, str):
        out.text = prompt
    else:
        out.token_ids.ids.extend(prompt)
    return out


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (int(n),), generator=g).tolist()
            for n in torch.randint(3, 40, (count,), generator=g)]


@dataclass(frozen=True)
class Expected:
    """What a stream read to the end must give."""

    tokens: list[int]
    text: str | None = None  # None: not compared (a prefix of a reference's tokens)
    reason: int = common_pb2.FINISH_REASON_LENGTH


def solo(address: str, req: gateway_pb2.GatewayGenerateRequest) -> Expected:
    """What one request gives run alone (nothing else on the stack)."""
    [result] = asyncio.run(run_all(address, [Case("solo", req, grpc.StatusCode.OK)]))
    assert result.code == grpc.StatusCode.OK and result.last_has_finish, (result.code, result.details)
    return Expected(result.tokens, result.text, result.finishes[0].reason)


# ---------------------------------------------------------------- the soak


GREEDY_LENGTHS = (3, 8, 13, 21)
LONG_GREEDY = 150  # long enough that a few of them outgrow a worker's small KV cache and preempt others
SAMPLED = dict(temperature=0.9, top_k=50, top_p=0.9, max_new_tokens=10, ignore_eos=True)
TEXT = "def main(argv):"


def invalid_cases(deployment: str, prompt: list[int]) -> list[Case]:
    bad = grpc.StatusCode.INVALID_ARGUMENT
    return [
        Case("empty text", request(deployment, ""), bad),
        Case("empty token ids", request(deployment, []), bad),
        Case("no deployment", request("", prompt), bad),
        Case("unknown deployment", request("no-such-deployment", prompt), grpc.StatusCode.NOT_FOUND),
        Case("negative temperature", request(deployment, prompt, temperature=-1.0), bad),
        Case("NaN temperature", request(deployment, prompt, temperature=math.nan), bad),
        Case("top_p above 1", request(deployment, prompt, top_p=1.5), bad),
        Case("token id outside the vocabulary", request(deployment, prompt + [VOCAB + 5]), bad),
        Case("stop token id outside the vocabulary", request(deployment, prompt, stop_token_ids=[70_000]), bad),
        Case("prompt as long as the context", request(deployment, (prompt * MAX_CONTEXT)[:MAX_CONTEXT]), bad),
        Case("empty stop string", request(deployment, prompt, stop=[""]), bad),
    ]


@dataclass
class References:
    """Each request of the soak that reads to the end, run alone first: what it must give in the crowd."""

    greedy: list[Expected]  # per prompt, LONG_GREEDY greedy tokens
    sampled: list[Expected]  # per prompt, SAMPLED with seed 100 + its index
    text: Expected  # TEXT, 6 greedy tokens

    @classmethod
    def run(cls, address: str, name: str, ps: list[list[int]]) -> References:
        return cls(
            greedy=[solo(address, request(name, p, max_new_tokens=LONG_GREEDY, ignore_eos=True)) for p in ps],
            sampled=[solo(address, request(name, p, seed=100 + i, **SAMPLED)) for i, p in enumerate(ps)],
            text=solo(address, request(name, TEXT, max_new_tokens=6, ignore_eos=True)),
        )


def soak_cases(name: str, ps: list[list[int]], refs: References) -> tuple[list[Case], dict[str, Expected]]:
    """~75 streams of every kind, and what each stream read to the end must give."""
    cases, expected = [], {}

    def complete(case_name: str, req: gateway_pb2.GatewayGenerateRequest, want: Expected | None) -> None:
        cases.append(Case(case_name, req, grpc.StatusCode.OK))
        if want is not None:
            expected[case_name] = want

    for i in range(24):
        n = GREEDY_LENGTHS[i % len(GREEDY_LENGTHS)]
        complete(f"greedy {i}", request(name, ps[i % 6], session_key=f"user-{i % 7}", max_new_tokens=n,
                                        ignore_eos=True), Expected(refs.greedy[i % 6].tokens[:n]))
    for i in range(len(ps)):
        complete(f"long greedy {i}", request(name, ps[i], max_new_tokens=LONG_GREEDY, ignore_eos=True), refs.greedy[i])
        complete(f"sampled {i}", request(name, ps[i], seed=100 + i, **SAMPLED), refs.sampled[i])
        # a stop token: the stream ends at its first occurrence in the greedy continuation, with it
        stop = refs.greedy[i].tokens[5 + i]
        until = refs.greedy[i].tokens.index(stop) + 1
        complete(f"stop token {i}", request(name, ps[i], max_new_tokens=LONG_GREEDY, stop_token_ids=[stop]),
                 Expected(refs.greedy[i].tokens[:until], reason=common_pb2.FINISH_REASON_STOP))
    for i in range(3):  # clients may reuse a request id: the gateway keeps them apart on the workers
        complete(f"text {i}", request(name, TEXT, max_new_tokens=6, ignore_eos=True, request_id="same-id"), refs.text)
    # max_new_tokens beyond the context window is an upper bound: the generation ends at the window
    complete("max_new_tokens past the context", request(name, ps[0], max_new_tokens=2**32 - 1, ignore_eos=True), None)
    for i in range(10):
        cases.append(Case(f"cancelled {i}", request(name, ps[i % 6], session_key=f"user-{i % 7}",
                                                    max_new_tokens=LONG, ignore_eos=True),
                          grpc.StatusCode.CANCELLED, cancel_after=(1, 2, 3, 5, 8)[i % 5]))
    for i in range(8):
        cases.append(Case(f"deadline {i}", request(name, ps[i % 6], max_new_tokens=LONG, ignore_eos=True),
                          grpc.StatusCode.DEADLINE_EXCEEDED, timeout_s=0.3 + 0.1 * i))
    cases += invalid_cases(name, ps[1])
    return cases, expected


# One worker overlaps its steps (the GPU default: each step launched before the previous one's tokens
# are read back), the other does not; a small KV cache makes long streams preempt each other.
SOAK_WORKERS = ({"overlap_steps": True}, {"overlap_steps": False})


def test_concurrent_streams_end_right_and_leave_nothing_behind(published: Published):
    with serving(published, "soak", per_worker=SOAK_WORKERS, kv_blocks=36) as stack:
        address, name = stack.gateway.address, stack.deployment
        ps = prompts(6)
        refs = References.run(address, name, ps)
        for _ in range(2):  # a second round on the stack the first one left behind
            soak_round(stack, ps, refs)


def soak_round(stack: Serving, ps: list[list[int]], refs: References) -> None:
    aborted_before, generated_before = aborted_and_generated(stack.workers)
    cases, expected = soak_cases(stack.deployment, ps, refs)
    results = asyncio.run(run_all(stack.gateway.address, cases))

    for r in results:
        check_outcome(r, expected.get(r.case.name))
    overlong = next(r for r in results if r.case.name == "max_new_tokens past the context")
    assert len(ps[0]) + len(overlong.tokens) == MAX_CONTEXT
    assert overlong.tokens[:LONG_GREEDY] == refs.greedy[0].tokens

    wait_until("every stream released on the workers and the gateway", lambda: leftovers(stack))
    assert {s.health for s in stack.list_workers()} == {gateway_pb2.WORKER_HEALTH_HEALTHY}

    # The cancelled and expired streams stopped on the workers: each ended by an abort, having
    # generated little more than its client saw (not its max_new_tokens).
    stopped = [r for r in results if r.case.expect in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)]
    completed = [r for r in results if r.case.expect == grpc.StatusCode.OK]
    aborted, generated = aborted_and_generated(stack.workers)
    # A stream that saw a token was on a worker, which must have aborted it; one whose deadline expired
    # before the gateway dispatched it (a 0.3 s deadline on a loaded host) never reached one.
    reached = sum(1 for r in stopped if r.tokens)
    assert reached <= aborted - aborted_before <= len(stopped), (reached, aborted - aborted_before, len(stopped))
    after_clients_left = generated - generated_before - sum(len(r.tokens) for r in completed + stopped)
    assert after_clients_left <= ABORT_SLACK * len(stopped), after_clients_left


def check_outcome(r: Result, expected: Expected | None) -> None:
    case, where = r.case, f"{r.case.name}: {r.code.name} {r.details!r} after {r.elapsed_s:.2f} s"
    assert r.code == case.expect, where
    if case.expect == grpc.StatusCode.OK:
        assert len(r.finishes) == 1 and r.last_has_finish, where
        finish = r.finishes[0]
        assert finish.generated_tokens == len(r.tokens), where
        if case.request.WhichOneof("prompt") == "token_ids":
            assert finish.prompt_tokens == len(case.request.token_ids.ids), where
        want = expected or Expected(r.tokens)
        assert finish.reason == want.reason, where
        assert r.tokens == want.tokens, f"{where}: tokens {r.tokens}, alone {want.tokens}"
        assert want.text is None or r.text == want.text, f"{where}: text {r.text!r}, alone {want.text!r}"
    elif case.expect == grpc.StatusCode.CANCELLED:
        assert len(r.tokens) >= case.cancel_after and not r.finishes, where
    elif case.expect == grpc.StatusCode.DEADLINE_EXCEEDED:
        assert r.elapsed_s < case.timeout_s + 2.0 and not r.finishes, where
    else:  # refused: at once, before any token
        assert r.elapsed_s < 5.0 and not r.tokens, where


# ---------------------------------------------------------------- full admission

# Each worker runs 2 sequences and queues 2 more. Registered with a capacity of 0, the gateway routes up
# to those 4 per worker and refuses the rest itself; registered with a larger capacity than the workers
# can take, the workers refuse (RESOURCE_EXHAUSTED) and the gateway, having tried both, refuses too.
SMALL_ADMISSION = dict(max_running_sequences=2, max_waiting_requests=2)
HELD = 8  # streams that fill both workers
EXPIRES_S = 2.0  # the deadline of two of them, which expires while the workers are stalled


class Gate:
    """Holds a worker's engine inside its model steps until opened: the worker is busy and its batch and
    queue fill up, whatever the speed of the host (the tiny model alone would finish any stream first)."""

    def __init__(self, worker: BackgroundWorker, monkeypatch: pytest.MonkeyPatch):
        self.opened = threading.Event()
        runner = worker.server.served.engine.runner
        step = runner.step

        def gated_step(batch):
            self.opened.wait(30)
            return step(batch)

        monkeypatch.setattr(runner, "step", gated_step)


def full(stack: Serving) -> str | None:
    """None once the gateway has 4 streams open on each worker and each worker holds 4 requests."""
    infos = [worker_info(w) for w in stack.workers]
    in_flight = [s.in_flight for s in stack.list_workers()]
    if in_flight == [4, 4] and all(i.running_requests + i.waiting_requests == 4 for i in infos):
        return None
    return f"gateway in flight {in_flight}, workers " + ", ".join(
        f"running {i.running_requests} waiting {i.waiting_requests}" for i in infos)


def holds(stack: Serving, streams: int) -> str | None:
    """None once the gateway has `streams` open and the workers hold as many requests."""
    infos = [worker_info(w) for w in stack.workers]
    in_flight = sum(s.in_flight for s in stack.list_workers())
    held = sum(i.running_requests + i.waiting_requests for i in infos)
    return None if in_flight == held == streams else f"gateway in flight {in_flight}, workers hold {held}"


@pytest.mark.parametrize("capacity", [0, 100], ids=["gateway-capacity", "worker-queue"])
def test_full_admission_is_refused_at_once_and_the_stack_recovers(published: Published, capacity: int, monkeypatch):
    with serving(published, f"full-{capacity}", capacity=capacity, **SMALL_ADMISSION) as stack:
        gates = [Gate(w, monkeypatch) for w in stack.workers]
        name, ps = stack.deployment, prompts(4, seed=1)
        held = [Case(f"held {i}", request(name, ps[i % 4], max_new_tokens=20, ignore_eos=True), grpc.StatusCode.OK)
                for i in range(HELD)]
        # Two clients give up while the engines are stuck: the first stream is in the stalled step, the
        # last one queued behind it. Both must be released at once, not when the engines move again.
        for i in (0, HELD - 1):
            held[i].expect, held[i].timeout_s = grpc.StatusCode.DEADLINE_EXCEEDED, EXPIRES_S
        extra = [Case(f"extra {i}", request(name, ps[i % 4], max_new_tokens=5), grpc.StatusCode.RESOURCE_EXHAUSTED,
                      timeout_s=10) for i in range(6)]

        async def scenario() -> None:
            async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                holding = [asyncio.create_task(run_case(stub, c)) for c in held]
                try:
                    await asyncio.to_thread(wait_until, "both workers full", lambda: full(stack))
                    for r in await asyncio.gather(*(run_case(stub, c) for c in extra)):
                        check_outcome(r, None)
                        assert r.elapsed_s < 2.0, f"{r.case.name} refused only after {r.elapsed_s:.1f} s"
                    await asyncio.wait([holding[0], holding[-1]], timeout=EXPIRES_S + 5)
                    await asyncio.to_thread(wait_until, "the expired streams released", lambda: holds(stack, HELD - 2))
                finally:
                    for gate in gates:
                        gate.opened.set()
                for r in await asyncio.gather(*holding):  # the streams held up while full end as usual
                    check_outcome(r, None)

        asyncio.run(asyncio.wait_for(scenario(), 60))
        wait_until("the held streams released", lambda: leftovers(stack))
        assert {s.health for s in stack.list_workers()} == {gateway_pb2.WORKER_HEALTH_HEALTHY}
        # recovered: a full load of new streams is served again
        again = [Case(f"after {i}", request(name, ps[i % 4], max_new_tokens=5, ignore_eos=True), grpc.StatusCode.OK)
                 for i in range(HELD)]
        for r in asyncio.run(run_all(stack.gateway.address, again)):
            check_outcome(r, None)


def test_requests_arriving_within_one_step_fill_the_free_batch_slots_before_the_queue():
    """Found by the gateway-capacity case above: the gateway routes max_running + max_waiting requests
    to a worker, but the engine counted requests not yet scheduled as queued, so a burst arriving
    between two steps was refused while the batch had free slots."""
    limits = EngineLimits(num_blocks=32, max_running=2, max_waiting=2, max_batch_tokens=16, max_context=64)
    engine = Engine(ScriptedRunner([3]), Text(), limits, eos_token_ids=(0,), overlap=False)
    outputs = []
    for i in range(4):  # no step in between: all four are in the waiting list
        engine.add_request(f"r{i}", [1, 2], SamplingOptions(max_new_tokens=3), outputs.append)
    with pytest.raises(QueueFull, match=r"\(2 requests\)"):
        engine.add_request("r4", [1, 2], SamplingOptions(max_new_tokens=3), outputs.append)
    while engine.step():
        pass
    assert sorted(o.request_id for o in outputs if o.finish is not None) == [f"r{i}" for i in range(4)]
