"""The Quantizer gRPC servicer: from_pb -> domain call (on a thread: the registry blocks) -> to_pb."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator

import grpc
from sqlalchemy.exc import OperationalError

from services.quantizer.auth import QuantizerAuth
from services.quantizer.board import Update
from services.quantizer.catalog import ArtifactFilter, artifact_view, artifact_views, model_views
from services.quantizer.errors import Forbidden, InvalidRequest, JobEnded, MissingInput, QueueFull, Unauthenticated
from services.quantizer.job_admin import CancelOrder, JobFilter
from services.quantizer.jobs import JobRunner
from services.quantizer.publish_spec import PublishSpec
from services.quantizer.views import JobView, artifact_state_from_pb
from shared.registry import InvalidValue, NotFound
from shared.rpc.qserve.v1 import common_pb2, quantizer_pb2, quantizer_pb2_grpc

log = logging.getLogger(__name__)

REGISTRY_POLL_S = 1.0  # watching a job another quantizer runs: how often its row is read
_CODES = (
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (Forbidden, grpc.StatusCode.PERMISSION_DENIED),
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidValue, grpc.StatusCode.INVALID_ARGUMENT),
    (MissingInput, grpc.StatusCode.NOT_FOUND),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (JobEnded, grpc.StatusCode.FAILED_PRECONDITION),
    (OperationalError, grpc.StatusCode.UNAVAILABLE),  # the registry's database cannot be reached
)


_MAPPED = tuple(error for error, _ in _CODES)


def _code_of(exc: Exception) -> grpc.StatusCode:
    return next(code for error, code in _CODES if isinstance(exc, error))


def _statuses(method):
    """Checks the caller's token (QuantizerAuth: the method gets the token's name, None with tokens off) and
    turns the domain's errors into the status codes the proto promises."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            caller = self.auth.caller(context.invocation_metadata(), method.__name__)
            return await method(self, request, context, caller)
        except _MAPPED as exc:
            await context.abort(_code_of(exc), str(exc))

    return wrapper


class QuantizerServicer(quantizer_pb2_grpc.QuantizerServicer):
    def __init__(self, runner: JobRunner):
        self.runner = runner
        self.services = runner.services
        self.auth = QuantizerAuth(self.services.config.tokens)

    @_statuses
    async def Publish(self, request: quantizer_pb2.PublishRequest, context, caller: str | None) -> quantizer_pb2.Job:
        spec = await asyncio.to_thread(PublishSpec.from_pb, request, self.services.config)
        job = await asyncio.to_thread(self.runner.submit, spec, caller)
        # %r: the source is the caller's text (urlsplit lets an s3:// URI with a newline through), and
        # raw it could split this line in two, the second one forged.
        log.info("job %s: publish %s %s/%s from %r%s", job.job_id, spec.model_name, spec.format, spec.gpu_target,
                 spec.source, "" if caller is None else f" for token {caller!r}")
        return job.to_pb()

    @_statuses
    async def GetJob(self, request: quantizer_pb2.GetJobRequest, context, caller: str | None) -> quantizer_pb2.Job:
        job = await asyncio.to_thread(self.runner.view, _required("job_id", request.job_id))
        return job.to_pb()

    async def WatchJob(self, request: quantizer_pb2.WatchJobRequest, context) -> AsyncIterator[quantizer_pb2.JobProgress]:
        job_id = request.job_id
        try:
            self.auth.caller(context.invocation_metadata(), "WatchJob")
        except _MAPPED as exc:
            await context.abort(_code_of(exc), str(exc))
        latest, queue = self.runner.board.watch(job_id)
        try:
            if latest is None:  # not a job of this process (or before its first snapshot): the registry's row
                latest = Update(await asyncio.to_thread(self.runner.view, _required("job_id", job_id)))
            yield _progress(latest)
            while not latest.job.done:
                try:
                    latest = await asyncio.wait_for(queue.get(), REGISTRY_POLL_S)
                except asyncio.TimeoutError:
                    if self.runner.board.latest(job_id) is not None:
                        continue  # this process runs it: updates come through the queue
                    current = Update(await asyncio.to_thread(self.runner.view, job_id))
                    if _progress_of(current.job) == _progress_of(latest.job):
                        continue
                    latest = current
                yield _progress(latest)
        except _MAPPED as exc:  # (a stream: the decorator's rules, applied here)
            await context.abort(_code_of(exc), str(exc))
        finally:
            self.runner.board.unwatch(job_id, queue)

    @_statuses
    async def GetArtifact(self, request: quantizer_pb2.GetArtifactRequest, context, caller: str | None) -> common_pb2.ArtifactInfo:
        view = await asyncio.to_thread(
            artifact_view, self.services.registry, self.services.store,
            _required("artifact_id", request.artifact_id), self.runner.artifact_details,
        )
        return view.to_pb()

    @_statuses
    async def ListArtifacts(self, request: quantizer_pb2.ListArtifactsRequest, context, caller: str | None) -> quantizer_pb2.ListArtifactsResponse:
        where = ArtifactFilter(
            model_name=request.model_name, format=request.format, gpu_target=request.gpu_target,
            state=artifact_state_from_pb(request.state), model_version=request.model_version,
        )
        views = await asyncio.to_thread(artifact_views, self.services.registry, where, self.runner.artifact_details)
        return quantizer_pb2.ListArtifactsResponse(artifacts=[v.to_pb() for v in views])

    @_statuses
    async def ListModels(self, request: quantizer_pb2.ListModelsRequest, context, caller: str | None) -> quantizer_pb2.ListModelsResponse:
        views = await asyncio.to_thread(model_views, self.services.registry, request.model_name,
                                        self.runner.artifact_details)
        return quantizer_pb2.ListModelsResponse(models=[v.to_pb() for v in views])

    @_statuses
    async def ListJobs(self, request: quantizer_pb2.ListJobsRequest, context, caller: str | None) -> quantizer_pb2.ListJobsResponse:
        views = await asyncio.to_thread(self.runner.jobs, JobFilter.from_pb(request))
        return quantizer_pb2.ListJobsResponse(jobs=[v.to_pb() for v in views])

    @_statuses
    async def CancelJob(self, request: quantizer_pb2.CancelJobRequest, context, caller: str | None) -> quantizer_pb2.Job:
        order = CancelOrder.from_pb(request, context.peer(), caller)
        view = await asyncio.to_thread(self.runner.cancel, order)
        return view.to_pb()


def _required(field: str, value: str) -> str:
    if not value:
        raise InvalidRequest(f"{field} is required")
    return value


def _progress_of(job: JobView) -> tuple:
    return job.state, job.stage, job.block_index, job.block_count, job.error, job.artifact


def _progress(update: Update) -> quantizer_pb2.JobProgress:
    return quantizer_pb2.JobProgress(job=update.job.to_pb(), message=update.message)
