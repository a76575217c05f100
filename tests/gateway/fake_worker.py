"""A small Worker service for gateway tests: deterministic tokens at a set pace, and switches that
make it fail before or after the first token, or hang; it records what the gateway asked of it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from services.gateway.pool import PooledWorker, WorkerPool
from shared.rpc.qserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from shared.rpc.refusal import DRAINING_METADATA

VOCAB = 4096


def expected_tokens(prompt_ids: list[int], count: int) -> list[int]:
    """The tokens FakeWorker generates for this prompt: a pure function, so tests can check the
    gateway delivered each exactly once, in order."""
    base = sum(prompt_ids) % VOCAB
    return [(base + 7 * i + 1) % VOCAB for i in range(count)]


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, artifact_id: str, *, tokens: int = 4, delay_s: float = 0.0, max_running: int = 8,
                 max_waiting: int = 8, context_tokens: int = 2048):
        self.artifact_id = artifact_id
        # its context window (prompt + generated): told in Info, and a generation stops at it with LENGTH
        self.context_tokens = context_tokens
        self.probe_error: float | None = 0.0312  # its start-up probe's, told in Info (None: not checked)
        self.manifest_sha256 = ""  # the sha256 of the manifest.json it loaded, told in Info ("": not told)
        self.tokens = tokens  # generated when the request's max_new_tokens is 0
        self.delay_s = delay_s  # before each token
        self.max_running, self.max_waiting = max_running, max_waiting
        self.fail_before_first = False  # every Generate fails UNAVAILABLE before any token
        self.fail_delay_s = 0.0  # ... after this long (a worker dying in prefill)
        self.fail_after: int | None = None  # every Generate fails UNAVAILABLE after this many tokens
        # every Generate ends after this many tokens with an OK final message of reason ABORT, as a worker whose
        # drain's grace ran out (or whose engine stops) ends the requests it still holds
        self.abort_after: int | None = None
        # every Generate stops after this many tokens and waits until cancelled (a hung device)
        self.hang_after: int | None = None
        self.hung: list[str] = []  # request ids of Generate calls that reached hang_after
        self.text_padding = ""  # appended to every reply's text (replies big enough to fill a stream's buffers)
        self.full = False  # every Generate answers RESOURCE_EXHAUSTED (its admission queue is full)
        # every Generate is refused as a draining worker refuses it (UNAVAILABLE + shared.rpc.refusal's metadata)
        self.refuse_draining = False
        # prompts longer than this are refused INVALID_ARGUMENT, as a worker with a shorter context window does
        self.max_prompt_tokens: int | None = None
        self.started: list[str] = []  # request ids of Generate calls, in arrival order
        self.cache_scopes: list[str] = []  # GenerateRequest.cache_scope of each, in the same order
        self.finished: list[str] = []
        self.cancelled: list[str] = []  # Generate calls whose caller went away
        self.aborts: list[str] = []  # request ids of Abort calls
        self.running = 0

    async def Generate(self, request: worker_pb2.GenerateRequest, context) -> AsyncIterator[worker_pb2.GenerateResponse]:
        self.started.append(request.request_id)
        self.cache_scopes.append(request.cache_scope)
        if self.full:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "fake worker's waiting queue is full")
        if self.refuse_draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fake worker draining", DRAINING_METADATA)
        if self.fail_before_first:
            await asyncio.sleep(self.fail_delay_s)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fake worker failing before the first token")
        if request.WhichOneof("prompt") == "text":
            prompt = list(request.text.encode())
        else:
            prompt = list(request.token_ids.ids)
        if any(t >= VOCAB for t in prompt):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"token id outside the vocabulary of {VOCAB}")
        if self.max_prompt_tokens is not None and len(prompt) > self.max_prompt_tokens:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the prompt has {len(prompt)} tokens; this fake "
                                                                  f"worker takes at most {self.max_prompt_tokens}")
        count = min(request.sampling.max_new_tokens or self.tokens, self.context_tokens - len(prompt))
        ids = expected_tokens(prompt, count)
        self.running += 1
        try:
            for i, token in enumerate(ids):
                if self.fail_after is not None and i == self.fail_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"fake worker failing after {i} tokens")
                if self.abort_after is not None and i == self.abort_after:
                    yield worker_pb2.GenerateResponse(request_id=request.request_id, finish=common_pb2.Finish(
                        reason=common_pb2.FINISH_REASON_ABORT, prompt_tokens=len(prompt), generated_tokens=i))
                    return
                if self.hang_after is not None and i == self.hang_after:
                    self.hung.append(request.request_id)
                    await asyncio.Event().wait()
                await asyncio.sleep(self.delay_s)
                reply = worker_pb2.GenerateResponse(request_id=request.request_id, token_ids=[token],
                                                    text=f"<{token}>{self.text_padding}")
                if i == count - 1:
                    reply.finish.CopyFrom(common_pb2.Finish(reason=common_pb2.FINISH_REASON_LENGTH,
                                                            prompt_tokens=len(prompt), generated_tokens=count))
                yield reply
            self.finished.append(request.request_id)
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        finally:
            self.running -= 1

    async def Abort(self, request: worker_pb2.AbortRequest, context) -> worker_pb2.AbortResponse:
        self.aborts.append(request.request_id)
        return worker_pb2.AbortResponse(found=request.request_id in self.started)

    async def Info(self, request: worker_pb2.InfoRequest, context) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(
            artifact=common_pb2.ArtifactInfo(artifact_id=self.artifact_id, state=common_pb2.ARTIFACT_STATE_READY,
                                             manifest_sha256=self.manifest_sha256),
            gpu_name="cpu", gpu_target="cpu", max_running_sequences=self.max_running,
            max_waiting_requests=self.max_waiting, max_context_tokens=self.context_tokens, running_requests=self.running,
            probe_error=self.probe_error,
        )


class FakeWorkerServer:
    """A FakeWorker on a loopback port of the running event loop."""

    def __init__(self, worker: FakeWorker):
        self.worker = worker
        self.server: grpc.aio.Server | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> FakeWorkerServer:
        """port: a fixed one, e.g. the port of a worker that stopped (a restart at the same address)."""
        self.server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(self.worker, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()
        return self

    async def stop(self, grace_s: float | None = None) -> None:
        """grace_s=0 ends open streams at once, like a killed worker process."""
        if self.server is not None:
            await self.server.stop(grace_s)
            self.server = None


@contextlib.asynccontextmanager
async def pool_of_one(artifact) -> AsyncIterator[tuple[WorkerPool, PooledWorker]]:
    """A WorkerPool holding one fake worker of `artifact` (capacity 4), served on loopback; closed after."""
    server = await FakeWorkerServer(FakeWorker(artifact.artifact_id)).start()
    pool = WorkerPool(heartbeat_timeout_s=6.0)
    try:
        yield pool, await pool.add(server.address, artifact, capacity=4)
    finally:
        await pool.close()
        await server.stop(0)
