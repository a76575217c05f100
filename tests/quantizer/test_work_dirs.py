"""A quantizer killed mid-job leaves the job's work folder (a downloaded checkpoint, the artifact before
upload) behind; the next quantizer on that work_dir removes those of ended jobs, and only those."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

from shared.registry import create_job, fail_job, heartbeat, start_job
from shared.registry.models import utcnow
from shared.storage import StorageConfig

DEAD, ALIVE = "quantizer@gone:4242:deadbeef", "quantizer@other:7:cafe"


def _work_dir_of(work_dir: Path, job_id: str) -> Path:
    """A job folder as the pipeline leaves it when its process is killed mid-download."""
    folder = work_dir / "jobs" / job_id
    (folder / "source" / ".source.download-1234").mkdir(parents=True)
    (folder / "source" / ".source.download-1234" / "model.safetensors").write_bytes(b"\0" * 4096)
    return folder


def _running_job(registry, owner: str) -> str:
    with registry.transaction() as session:
        job = create_job(session, owner=owner)
        start_job(session, job.id, owner=owner)
        return job.id


def test_a_new_quantizer_removes_the_work_folders_of_ended_jobs(tmp_path, start_quantizer, registry_url,
                                                                open_registry):
    registry = open_registry(registry_url)
    killed, other, failed_later = (_running_job(registry, owner) for owner in (DEAD, ALIVE, ALIVE))
    with registry.transaction() as session:
        heartbeat(session, DEAD, now=utcnow() - timedelta(minutes=5))  # it was killed five minutes ago
    work_dir = tmp_path / "shared-work"
    left = {job_id: _work_dir_of(work_dir, job_id) for job_id in (killed, other, failed_later)}
    stranger = _work_dir_of(work_dir, "not-a-job-of-this-registry")
    store = StorageConfig(kind="local", root=tmp_path / "store")

    start_quantizer(store, registry_url, work_dir=work_dir, create_bucket=True, heartbeat_s=0.1)

    assert not left[killed].exists()  # failed as an orphan at start-up
    assert left[other].exists()  # another quantizer sharing the work_dir still runs it
    assert stranger.exists()

    with registry.transaction() as session:  # the other quantizer's job ends without it cleaning up
        fail_job(session, failed_later, "the quantizer running it was killed")
    deadline = time.monotonic() + 10
    while left[failed_later].exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left[failed_later].exists()  # removed by a later heartbeat
    assert left[other].exists() and stranger.exists()
