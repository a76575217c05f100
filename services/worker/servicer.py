"""The Worker gRPC servicer: from_pb -> engine call -> to_pb, the engine's outputs bridged to asyncio."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
import time
from collections.abc import AsyncIterator

import grpc
from google.protobuf import duration_pb2, timestamp_pb2

from services.worker.engine.outputs import EngineStats, FinishInfo, RequestOutput
from services.worker.errors import Draining, InvalidRequest, Stalled, WorkerError
from services.worker.metrics import WorkerMetrics
from services.worker.requests import PromptLimits, generation_from_pb
from services.worker.serving import ServedModel
from shared.rpc.qserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, served: ServedModel, metrics: WorkerMetrics):
        self.served = served
        self.engine = served.engine
        self.metrics = metrics
        self.engine.on_step = metrics.observe_step
        self.draining = False
        self.stalled = False  # set by the server's engine watch: requests in flight, no step for too long
        # Generate calls past the draining check and not in the engine yet (tokenizing): a drain waits for
        # them as for the engine's requests, or the server's stop would cut a stream it had accepted.
        self.admitting = 0
        # Set once a drain's grace is over: a request still being tokenized then is refused as draining (the
        # gateway sends it elsewhere, counting no failure) rather than started and cut by the server's stop.
        self.closing = False
        self.limits = PromptLimits(
            vocab_size=served.vocab_size, max_context=self.engine.limits.max_context,
            add_bos=served.add_bos, bos_token_id=served.bos_token_id,
            max_text_chars=self.engine.limits.max_context * served.tokenizer.longest_token_chars(),
        )

    async def Generate(self, request: worker_pb2.GenerateRequest, context) -> AsyncIterator[worker_pb2.GenerateResponse]:
        arrival = time.monotonic()  # time to first token and queue time count tokenizing, and waiting for a thread
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        try:
            if self.draining:
                raise Draining("this worker is draining and takes no new requests; send it to another worker")
            if self.stalled:
                raise Stalled("this worker's engine has made no progress for a while (a hung device?) and takes no "
                               "new requests; send it to another worker")
            self.admitting += 1
            try:
                # Off the event loop: tokenizing a long prompt takes a while (up to ~0.3 s per MB), and every
                # other stream, Abort, Info and the gateway's heartbeats share this loop.
                gen = await asyncio.to_thread(generation_from_pb, request, self.limits, self.served.tokenizer.encode)
                if self.closing:
                    raise Draining("this worker stopped while the prompt was tokenized; send it to another worker")

                def sink(out: RequestOutput) -> None:
                    # Counted here, on the engine's thread: the finish of a request whose caller
                    # cancelled never reaches the stream, and must be counted all the same.
                    if out.finish is not None:
                        self.metrics.observe_finish(out.finish)
                    elif out.error is not None:
                        self.metrics.observe_error(out.non_finite, out.generated_tokens)
                    loop.call_soon_threadsafe(queue.put_nowait, out)

                self.engine.add_request(gen.request_id, gen.prompt_ids, gen.sampling, sink, arrival, gen.cache_scope)
            except asyncio.CancelledError:
                self.metrics.observe_cancelled_before_admission()
                raise
            finally:
                self.admitting -= 1
        except WorkerError as exc:
            self.metrics.rejected.labels(exc.code.name).inc()
            await context.abort(exc.code, str(exc), exc.trailing_metadata)
        done = False
        try:
            while not done:
                out = await queue.get()
                if out.error is not None:
                    done = True
                    await context.abort(grpc.StatusCode.INTERNAL, out.error)
                done = out.finish is not None
                yield _response_pb(out)
        finally:
            if not done:  # the caller cancelled (or the stream broke): free the blocks now
                self.engine.abort(gen.request_id)

    def stats(self) -> EngineStats:
        """The engine's, with the requests still being tokenized (not in the engine yet) counted as waiting."""
        stats = self.engine.stats()
        return dataclasses.replace(stats, waiting=stats.waiting + self.admitting)

    async def Abort(self, request: worker_pb2.AbortRequest, context) -> worker_pb2.AbortResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(InvalidRequest("request_id is empty")))
        return worker_pb2.AbortResponse(found=self.engine.abort(request.request_id))

    async def Info(self, request: worker_pb2.InfoRequest, context) -> worker_pb2.WorkerInfo:
        return self.info()

    def info(self) -> worker_pb2.WorkerInfo:
        s = self.engine.stats()
        limits = self.engine.limits
        return worker_pb2.WorkerInfo(
            artifact=_artifact_pb(self.served),
            format=self.served.format,
            gpu_name=self.served.gpu_name,
            gpu_target=self.served.gpu_target,
            max_running_sequences=limits.max_running,
            max_waiting_requests=limits.max_waiting,
            max_context_tokens=limits.max_context,
            kv_blocks_total=s.kv_blocks_total,
            kv_blocks_free=s.kv_blocks_free,
            kv_blocks_used=s.kv_blocks_used,
            kv_block_size=self.engine.runner.block_size,
            running_requests=s.running,
            waiting_requests=s.waiting,
            draining=self.draining,
            probe_error=self.served.probe_error,
        )


def _response_pb(out: RequestOutput) -> worker_pb2.GenerateResponse:
    pb = worker_pb2.GenerateResponse(request_id=out.request_id, token_ids=out.token_ids, text=out.text)
    if out.finish is not None:
        pb.finish.CopyFrom(_finish_pb(out.finish))
    return pb


def _finish_pb(f: FinishInfo) -> common_pb2.Finish:
    return common_pb2.Finish(
        reason=int(f.reason),
        prompt_tokens=f.prompt_tokens,
        generated_tokens=f.generated_tokens,
        timings=common_pb2.Timings(
            queue=_duration(f.queue_s),
            time_to_first_token=_duration(f.time_to_first_token_s),
            time_per_output_token=_duration(f.time_per_output_token_s),
            total=_duration(f.total_s),
        ),
    )


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromTimedelta(dt.timedelta(seconds=max(0.0, seconds)))
    return d


def _artifact_pb(served: ServedModel) -> common_pb2.ArtifactInfo:
    a = served.artifact
    m = a.reader.manifest
    pb = common_pb2.ArtifactInfo(
        artifact_id=a.artifact_id,
        model_name=m.model_name,
        model_version=m.model_version,
        version_label=a.version_label,
        format=m.format,
        gpu_target=m.gpu_target,
        # The worker only loads verified artifacts; the registry's word wins when it was asked.
        state=common_pb2.ArtifactState.Value(f"ARTIFACT_STATE_{a.registry_state or 'READY'}"),
        object_key_prefix=a.object_prefix,
        size_bytes=a.size_bytes,
        vocabulary_digest=served.vocabulary_digest,
        manifest_sha256=a.reader.manifest_sha256,
    )
    if m.evaluation is not None:
        e = m.evaluation
        pb.evaluation.CopyFrom(common_pb2.Evaluation(
            data_name=e.data_name, perplexity_fp16=e.ppl_fp16, perplexity_quantized=e.ppl_quantized,
            seq_len=e.seq_len, num_windows=e.windows,
        ))
    try:
        created = dt.datetime.fromisoformat(m.created_at)
    except ValueError:
        created = None
    if created is not None:
        ts = timestamp_pb2.Timestamp()
        ts.FromDatetime(created.astimezone(dt.timezone.utc).replace(tzinfo=None))
        pb.created_at.CopyFrom(ts)
    return pb
