"""Disk claims of writers sharing a disk (shared/disk_space.py SharedSpace): a job counts what the others have
claimed and not yet written, so two jobs that each fit alone but not together do not both start."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from shared import disk_space
from shared.disk_space import SharedSpace, tree_bytes

DISK = 1000  # bytes the pretend disk holds


@pytest.fixture
def disk(tmp_path, monkeypatch):
    """A pretend disk of DISK bytes whose free space is what the files under tmp_path/jobs leave."""
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    monkeypatch.setattr(disk_space, "free_bytes", lambda path: DISK - tree_bytes(jobs))
    return jobs


def _write(folder, n: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"part{len(list(folder.iterdir()))}").write_bytes(b"x" * n)


def test_a_second_job_is_refused_what_the_first_has_claimed_and_not_yet_written(disk, tmp_path):
    claims = tmp_path / "claims"
    first, second = SharedSpace(claims, disk / "a"), SharedSpace(claims, disk / "b")
    assert first.shortage(disk, 600, "job a's artifact") is None
    refused = second.shortage(disk, 500, "job b's artifact")
    assert refused is not None and "of which 0.00 GiB is claimed by 1 other job(s) still writing" in refused
    _write(disk / "a", 300)  # half written: the disk has 700 free, 300 of them still claimed
    assert second.shortage(disk, 401, "job b's artifact") is not None
    assert second.shortage(disk, 400, "job b's artifact") is None
    first.release()  # its files stay until its folder is removed: counted as used, as they are
    assert second.shortage(disk, 301, "job b's source") is not None  # 700 free, 400 of them b's: 300 left
    assert second.shortage(disk, 300, "job b's source") is None
    assert second.shortage(disk, 1, "more") is not None


def test_a_jobs_own_earlier_claims_count(disk, tmp_path):
    job = SharedSpace(tmp_path / "claims", disk / "a")
    assert job.shortage(disk, 600, "the download") is None
    assert job.shortage(disk, 401, "the artifact") is not None  # the download is not written yet
    _write(disk / "a", 600)  # downloaded: 400 free, none of the claim left to write
    assert job.shortage(disk, 400, "the artifact") is None


def test_without_claims_it_is_the_plain_free_space_check(disk, tmp_path):
    job = SharedSpace(tmp_path / "claims", disk / "a")
    assert job.shortage(disk, DISK, "all of it") is None
    refused = SharedSpace(tmp_path / "claims2", disk / "b").shortage(disk, DISK + 1, "more than all")
    assert refused == disk_space.shortage(disk, DISK + 1, "more than all")


def test_another_processs_claim_counts_while_it_lives_and_is_removed_once_it_is_dead(disk, tmp_path):
    claims = tmp_path / "claims"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from shared.disk_space import SharedSpace
        SharedSpace({str(claims)!r}, {str(disk / "other")!r}).shortage({str(disk)!r}, 900, "its artifact")
        print("claimed", flush=True)
        sys.stdin.read()  # holds the claim until killed
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "claimed"
        job = SharedSpace(claims, disk / "a")
        assert job.shortage(disk, 101, "job a") is not None
        assert len(list(claims.glob("*.claim"))) == 1
    finally:
        holder.kill()
        holder.wait()
    assert job.shortage(disk, 101, "job a") is None  # the dead process's claim is not counted
    assert len(list(claims.glob("*.claim"))) == 1  # and its file is gone: the one left is job a's
