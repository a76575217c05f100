"""The job runner: a thread pool of pipelines, their progress in the registry, heartbeats, orphans, cancels.

Every job is a registry row owned by this process (config.owner). A heartbeat thread keeps the rows
of live jobs fresh and fails the jobs of owners that stopped heartbeating (a killed quantizer), at
start-up and then periodically, so that their bindings can be published again. It also polls for cancels
of this process's jobs, which CancelJob may have recorded on another quantizer (see cancels.py).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from services.quantizer import leftovers
from services.quantizer.board import JobBoard, Update
from services.quantizer.cancels import Cancels
from services.quantizer.errors import AccuracyBudgetExceeded, JobCancelled, JobEnded, QuantizerError, QueueFull
from services.quantizer.job_admin import CancelOrder, JobFilter
from services.quantizer.pipeline import Pipeline, Services
from services.quantizer.publish_spec import PublishSpec
from services.quantizer.views import ArtifactDetails, ArtifactView, JobView, Stage
from shared.registry import (
    InvalidState,
    JobState,
    NotFound,
    QuantJob,
    RegistryError,
    cancel_job,
    cancel_requests,
    create_job,
    fail_job,
    fail_orphaned_jobs,
    finish_job,
    get_artifact,
    get_job,
    heartbeat,
    list_jobs,
    report_progress,
    start_job,
)
from shared.storage import StorageError

log = logging.getLogger(__name__)

KEEP_REQUESTS = 1000  # accepted requests remembered for GetJob after their jobs end
ORPHAN_REASON = "the quantizer running this job stopped (killed or crashed) before it ended"
# The registry refuses a job error or failure reason over 10,000 characters; a refused failure would be
# retried for ever, the job left RUNNING and heartbeating, its binding held. The head says what failed.
MAX_ERROR_CHARS = 4000
SHORTENED = " ... (error shortened)"
EXPECTED_ERRORS = (QuantizerError, StorageError, RegistryError, ValueError, OSError)


@dataclass(slots=True)
class _Live:
    """What the registry does not keep about a job this process runs."""

    spec: PublishSpec
    stage: Stage | None = None
    remaining_s: float | None = None
    future: Future | None = None  # its turn in the pool: cancelled when the job is cancelled while queued


class JobRunner:
    def __init__(self, services: Services):
        self.services = services
        self.config = services.config
        self.board = JobBoard()
        self.details: dict[str, ArtifactDetails] = {}  # artifact id -> size and full evaluation
        self._live: dict[str, _Live] = {}
        self._requests: OrderedDict[str, PublishSpec] = OrderedDict()
        self._unsettled: dict[str, tuple[Pipeline | None, str]] = {}  # failures the registry did not take yet
        # Artifacts whose leftovers in the store could not be deleted yet (_delete_orphaned_objects): every round.
        self._leftovers_due: set[str] = set()
        self.cancels = Cancels()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        # Set once no job runs any more: until then heartbeats go on (also while stopping), or another
        # quantizer could take a job still winding down for an orphan and retry its artifact meanwhile.
        self._jobs_over = threading.Event()
        self._pool = ThreadPoolExecutor(self.config.workers, thread_name_prefix="quantize")
        self._heartbeats = threading.Thread(target=self._heartbeat_loop, name="quantizer-heartbeat", daemon=True)
        # Orphans and work folders on a thread of their own: deleting what an orphan left can take minutes (an
        # object store retrying), and meanwhile heartbeats must go on, or a peer fails this quantizer's live jobs
        # as orphans in turn.
        self._housekeeping = threading.Thread(target=self._housekeeping_loop, name="quantizer-housekeeping",
                                              daemon=True)

    # ---- lifecycle ----

    def start(self) -> list[str]:
        """Fails what dead quantizers left running and removes their work folders, then starts
        heartbeating; -> the failed job ids."""
        failed = self._sweep_orphans()
        self._remove_ended_work_dirs()
        self._heartbeats.start()
        self._housekeeping.start()
        return failed

    def stop(self) -> None:
        """Cancels queued jobs, makes running ones stop at their next progress report, fails them all."""
        with self._lock:  # no submit slips in between
            self._stopping.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            left = [job_id for job_id in self._live]
        for job_id in left:  # cancelled before they started
            self._fail(job_id, None, "the quantizer stopped before the job ran; publish again")
        self._jobs_over.set()
        for thread in (self._heartbeats, self._housekeeping):
            if thread.is_alive():
                thread.join(timeout=self.config.heartbeat_s + 5)

    # ---- the API the servicer uses ----

    def submit(self, spec: PublishSpec, requested_by: str | None = None) -> JobView:
        """`requested_by`: the caller's token name, recorded as the actor of the job's JOB_QUEUED event
        (None, tokens off: that actor is this quantizer, config.owner, as the job's owner)."""
        with self._lock:
            if self._stopping.is_set():
                raise QueueFull("the quantizer is stopping; publish to another quantizer or retry later")
            if len(self._live) >= self.config.workers + self.config.max_queued:
                raise QueueFull(
                    f"{len(self._live)} jobs are queued or running (limit {self.config.workers} running + "
                    f"{self.config.max_queued} queued); retry later"
                )
            with self.services.registry.transaction() as session:
                job = create_job(session, owner=self.config.owner, model_name=spec.model_name, actor=requested_by)
                job_id = job.id
            # Only a committed job takes a queue slot: a failed commit must not leave a slot taken forever.
            live = self._live[job_id] = _Live(spec)
            self._requests[job_id] = spec
            while len(self._requests) > KEEP_REQUESTS:
                self._requests.popitem(last=False)
            view = JobView.from_row(job, None, spec)  # a new job: no artifact yet, nothing left to estimate
            self.board.post(Update(view, "queued"))
            live.future = self._pool.submit(self._execute, job.id)
        return view

    def view(self, job_id: str) -> JobView:
        """The job's current snapshot (raises the registry's NotFound for an unknown id)."""
        with self.services.registry.sessions() as session:
            return self._view(session, get_job(session, job_id))

    def jobs(self, where: JobFilter) -> list[JobView]:
        """Jobs of every quantizer sharing the registry, newest first."""
        with self.services.registry.sessions() as session:
            rows = list_jobs(session, states=where.states or None, model_name=where.model_name or None,
                             newest_first=True, limit=where.limit)
            return [self._view(session, job) for job in rows]

    def cancel(self, order: CancelOrder) -> JobView:
        """Cancels a job of any quantizer sharing the registry (see shared.registry.cancel_job). This process
        acts on its own jobs at once; another quantizer acts on its jobs at its next heartbeat."""
        try:
            with self.services.registry.transaction() as session:
                job = cancel_job(session, order.job_id, actor=order.actor, reason=order.reason)
                view = self._view(session, job)
        except InvalidState as exc:  # the job has ended
            raise JobEnded(str(exc)) from None
        log.info("job %s: %s", order.job_id, view.error)
        self._act_on_cancel(job.id, view)
        return view

    def artifact_details(self, artifact_id: str) -> ArtifactDetails | None:
        return self.details.get(artifact_id)

    # ---- running a job (worker threads) ----

    def _execute(self, job_id: str) -> None:
        live = self._live[job_id]
        work_dir = self._jobs_dir / job_id
        pipeline = Pipeline(self.services, live.spec, job_id, _Reporter(self, job_id), work_dir)
        try:
            if not self._start(job_id):
                return
            artifact_id = pipeline.run(lambda session, artifact_id: finish_job(session, job_id, artifact_id=artifact_id))
            self._keep_details(pipeline)
            self._post_now(job_id, f"published artifact {artifact_id}")
        except Exception as exc:
            self._keep_details(pipeline)
            if not isinstance(exc, EXPECTED_ERRORS):
                log.exception("job %s failed unexpectedly", job_id)
            stage = live.stage.value if live.stage is not None else "start"
            where = "" if isinstance(exc, AccuracyBudgetExceeded) else f"{stage} failed: "
            self._fail(job_id, pipeline, f"{where}{_describe(exc)}")
        finally:
            with self._lock:
                self._live.pop(job_id, None)
            self.cancels.forget(job_id)
            pipeline.space.release()  # before the folder goes: its files are then counted as used, as they are
            shutil.rmtree(work_dir, ignore_errors=True)

    def _start(self, job_id: str) -> bool:
        """QUEUED -> RUNNING; False when the job ended while it waited for a worker (cancelled, on any quantizer,
        after this process's last heartbeat): nothing ran, so there is nothing to clean up."""
        try:
            with self.services.registry.transaction() as session:
                view = self._view(session, start_job(session, job_id, owner=self.config.owner))
        except InvalidState:
            view = self.view(job_id)
            if not view.done:
                raise
            self.board.post(Update(view, view.error or f"the job ended {view.state.value} before it started"))
            return False
        self.board.post(Update(view, "started"))
        return True

    def _keep_details(self, pipeline: Pipeline) -> None:
        if pipeline.claim is not None and pipeline.details is not None:
            self.details[pipeline.claim.artifact_id] = pipeline.details

    def _fail(self, job_id: str, pipeline: Pipeline | None, error: str) -> None:
        error = _shorten(error)
        try:
            with self.services.registry.transaction() as session:
                job = get_job(session, job_id)
                if job.cancel_reason is not None and job.state in (JobState.QUEUED, JobState.RUNNING):
                    # It stopped because it was cancelled: that is the reason, not how the stop surfaced (a
                    # refused finish, an interrupted upload); also for the artifact's failure reason.
                    error = job.cancel_reason
                if pipeline is not None:
                    pipeline.fail(session, error)
                if job.state in (JobState.QUEUED, JobState.RUNNING):
                    fail_job(session, job_id, error)  # ends it CANCELLED when a cancel was requested
                view = self._view(session, job)
        except Exception as exc:  # the registry itself is failing: the housekeeping loop tries again
            log.warning("could not record the failure of job %s (%s): %s", job_id, error, exc)
            self._unsettled[job_id] = (pipeline, error)
            return
        finally:
            with self._lock:
                self._live.pop(job_id, None)
        self._unsettled.pop(job_id, None)
        self.board.post(Update(view, error))

    def _progress(self, job_id: str, stage: Stage, block_index: int, block_count: int,
                  message: str, remaining_s: float | None) -> None:
        live = self._live.get(job_id)
        if live is not None:
            live.stage, live.remaining_s = stage, remaining_s
        with self.services.registry.transaction() as session:
            job = report_progress(session, job_id, stage=stage.value, block_index=block_index, block_count=block_count)
            view = self._view(session, job)
        self.board.post(Update(view, message))
        if job.cancel_reason is not None:  # the row says so before the heartbeat loop would
            self._act_on_cancel(job_id, view)

    # ---- cancels ----

    def _act_on_cancel(self, job_id: str, view: JobView) -> None:
        """What this process does about a cancel of a job it holds: drop it from the queue, or have its
        pipeline stop at its next step. Nothing for a job of another quantizer."""
        if view.state == JobState.CANCELLED:
            self._drop_queued(job_id, view)
        elif view.state == JobState.RUNNING and job_id in self._live and self.cancels.note(job_id, view.error):
            log.info("job %s: stopping it at its next step (%s)", job_id, view.error)
            self.board.post(Update(view, f"stopping: {view.error}"))

    def _drop_queued(self, job_id: str, view: JobView) -> None:
        """A job cancelled while queued gives its place back (if its turn came meanwhile, _start sees it ended).
        Its end goes on the board from the cancel's own view: read again, a registry error at that moment left
        the board's 'queued' for good (the job no longer live, nothing posted again), and WatchJob never ended."""
        with self._lock:
            live = self._live.get(job_id)
            if live is None or live.future is None or not live.future.cancel():
                return
            self._live.pop(job_id, None)
        self.board.post(Update(view, "cancelled before it started"))

    def _notice_cancels(self) -> None:
        """Acts on the cancels of this process's jobs that CancelJob recorded on another quantizer."""
        with self._lock:
            job_ids = list(self._live)
        if not job_ids:
            return
        with self.services.registry.sessions() as session:
            views = [self._view(session, job) for job in cancel_requests(session, job_ids)]
        for view in views:
            self._act_on_cancel(view.job_id, view)

    def _post_now(self, job_id: str, message: str) -> None:
        self.board.post(Update(self.view(job_id), message))

    def _view(self, session, job: QuantJob) -> JobView:
        artifact = None
        if job.artifact_id is not None:
            artifact = ArtifactView.from_row(get_artifact(session, job.artifact_id), self.details.get(job.artifact_id))
        live = self._live.get(job.id)
        return JobView.from_row(job, artifact, self._requests.get(job.id), live.remaining_s if live else None)

    # ---- heartbeats and orphans ----

    def _heartbeat_loop(self) -> None:
        while not self._jobs_over.wait(self.config.heartbeat_s):
            try:
                with self.services.registry.transaction() as session:
                    heartbeat(session, self.config.owner)
                self._notice_cancels()
            except Exception as exc:  # a registry outage must not kill the heartbeat thread
                log.warning("heartbeat failed: %s", exc)

    def _housekeeping_loop(self) -> None:
        """Other quantizers' orphans, failures the registry did not take yet, ended jobs' work folders, and
        now and then stale staging in the store (leftovers.py)."""
        purged = time.monotonic()  # at start-up (server.start)
        while not self._jobs_over.wait(self.config.heartbeat_s):
            try:
                self._sweep_orphans()
                for job_id, (pipeline, error) in list(self._unsettled.items()):
                    self._fail(job_id, pipeline, error)
                self._remove_ended_work_dirs()
                for artifact_id in sorted(self._leftovers_due):
                    self._delete_orphaned_objects(artifact_id)
                if time.monotonic() - purged >= leftovers.PURGE_INTERVAL_S:
                    purged = time.monotonic()
                    leftovers.purge_stale_staging(self.services.store)
            except Exception as exc:  # a registry outage must not kill the thread
                log.warning("sweeping orphaned jobs failed: %s", exc)

    def _sweep_orphans(self) -> list[str]:
        with self.services.registry.transaction() as session:
            orphans = fail_orphaned_jobs(
                session, ORPHAN_REASON, current_owner=self.config.owner,
                stale_after=timedelta(seconds=self.config.orphan_after_s),
            )
            ids = [job.id for job in orphans]
            artifact_ids = sorted({job.artifact_id for job in orphans if job.artifact_id is not None})
        for job_id in ids:
            log.warning("failed job %s: %s", job_id, ORPHAN_REASON)
        for artifact_id in artifact_ids:
            self._delete_orphaned_objects(artifact_id)
        return ids

    def _delete_orphaned_objects(self, artifact_id: str) -> None:
        """Deletes what an orphaned job left under its artifact's final prefix: a quantizer killed while its
        publish moved objects there leaves some, and only a retry of the binding would ever remove them. Only
        while the artifact is FAILED, and not under its row lock (leftovers.py). Tried again every housekeeping
        round until done: the killed publish's claim on the prefix holds it off until it is stale."""
        left_by = f"the orphaned job of artifact {artifact_id}"
        if leftovers.delete_leftover_objects(self.services, artifact_id, left_by) is None:
            self._leftovers_due.add(artifact_id)
        else:
            self._leftovers_due.discard(artifact_id)

    # ---- work folders ----

    @property
    def _jobs_dir(self) -> Path:
        return self.config.work_dir / "jobs"

    def _remove_ended_work_dirs(self) -> None:
        """Deletes the work folders of jobs that have ended: a job removes its own folder (a downloaded
        checkpoint, the artifact before upload: gigabytes) when it ends, but a quantizer killed mid-job
        cannot, and the disk would fill up with them. A folder is kept while its job is QUEUED or RUNNING
        (another quantizer may share this work_dir) and when the registry does not know the job."""
        try:
            names = sorted(path.name for path in self._jobs_dir.iterdir() if path.is_dir())
        except FileNotFoundError:
            return
        with self._lock:
            names = [name for name in names if name not in self._live]
        if not names:
            return
        with self.services.registry.sessions() as session:
            ended = [name for name in names if _has_ended(session, name)]
        for job_id in ended:
            log.info("removing the work folder of ended job %s", job_id)
            shutil.rmtree(self._jobs_dir / job_id, ignore_errors=True)


class _Reporter:
    """The pipeline's view of its job: progress goes to the registry and to watchers."""

    def __init__(self, runner: JobRunner, job_id: str):
        self._runner = runner
        self._job_id = job_id

    def check(self) -> None:
        if self._runner._stopping.is_set():
            raise JobCancelled("the quantizer is stopping; publish again")
        self._runner.cancels.check(self._job_id)

    def progress(self, stage: Stage, block_index: int = 0, block_count: int = 0, *,
                 message: str = "", remaining_s: float | None = None) -> None:
        self.check()
        self._runner._progress(self._job_id, stage, block_index, block_count, message, remaining_s)
        self.check()  # a cancel this report read from the registry stops the job at this step


def _has_ended(session, job_id: str) -> bool:
    try:
        return get_job(session, job_id).state not in (JobState.QUEUED, JobState.RUNNING)
    except NotFound:  # not a job of this registry: not ours to delete
        return False


def _describe(exc: BaseException) -> str:
    text = str(exc)
    if isinstance(exc, (KeyError, IndexError, TypeError, AttributeError, RuntimeError)) or not text:
        return f"{type(exc).__name__}: {text}"
    return text


def _shorten(error: str) -> str:
    """The error as the registry can record it: at most MAX_ERROR_CHARS, no NUL character (an exception's
    message may quote one from the request; PostgreSQL refuses it) and no lone surrogate (a file name that is
    not UTF-8, quoted from a checkpoint folder; neither database can encode it). Either way the failure was
    never recorded: the job stayed RUNNING, retried every heartbeat, and its watchers never saw an end."""
    error = error.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")
    if len(error) <= MAX_ERROR_CHARS:
        return error
    return error[: MAX_ERROR_CHARS - len(SHORTENED)] + SHORTENED
