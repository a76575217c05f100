"""Two jobs claiming one binding at the same time on PostgreSQL: exactly one builds it."""

from __future__ import annotations

import threading

import pytest

from services.quantizer import allocation
from services.quantizer.allocation import Binding, _try_claim, model_version_row
from shared.registry import create_job, create_registry, register_model_version, reserve_artifact, sqlite_url
from tests.conftest import fresh_postgres_schema

BINDING = Binding(model_name="tiny", model_version="c" * 64, version_label="", format="w4a8kv4-g128", gpu_target="sm90")


@pytest.mark.postgres
def test_a_pending_artifact_left_by_a_dead_job_is_taken_over_by_one_job_only():
    """Job A takes over an artifact left PENDING by a job that no longer runs; job B, claiming it
    meanwhile, must wait for A's commit and then see A as the holder, not take it over a second time."""
    with fresh_postgres_schema("test_allocation") as url:
        registry = create_registry(url)
        try:
            with registry.transaction() as session:
                version = register_model_version(session, BINDING.model_name, BINDING.model_version)
                reserve_artifact(session, version.id, BINDING.format, BINDING.gpu_target)  # no job: orphaned
                job_a, job_b = create_job(session, owner="a").id, create_job(session, owner="b").id
            a_claimed, a_commit = threading.Event(), threading.Event()
            results = {}

            def claim_a():
                with registry.transaction() as session:
                    results["a"] = _try_claim(session, job_a, BINDING, "a")
                    a_claimed.set()
                    a_commit.wait(10)

            def claim_b():
                with registry.transaction() as session:
                    results["b"] = _try_claim(session, job_b, BINDING, "b")

            a = threading.Thread(target=claim_a)
            a.start()
            assert a_claimed.wait(10)
            b = threading.Thread(target=claim_b)
            b.start()
            b.join(0.5)
            assert b.is_alive(), "job B decided while job A's claim was not committed"
            a_commit.set()
            a.join(10)
            b.join(10)
            claim_a_result, _ = results["a"]
            assert claim_a_result is not None and claim_a_result.owned
            assert results["b"] == (None, job_a)
        finally:
            registry.close()


def test_a_version_registered_meanwhile_under_another_label_is_taken_as_registered(tmp_path, monkeypatch):
    """Two publishes of one new checkpoint with different labels: one after the other, the second takes the version
    with the first's label; at the same time (PostgreSQL), the second's insert lost the race and its Conflict failed
    the job. The race is played here by registering the version, under the other label, just before the insert."""
    registry = create_registry(sqlite_url(tmp_path / "registry.db"))
    register = allocation.register_model_version

    def raced(session, model_name, content_hash, label=None):
        register(session, model_name, content_hash, "first")  # the other publish's insert, committed first
        return register(session, model_name, content_hash, label)

    monkeypatch.setattr(allocation, "register_model_version", raced)
    try:
        with registry.transaction() as session:
            version = model_version_row(session, Binding("tiny", "d" * 64, "second", "w4a8kv4-g128", "sm90"))
            assert (version.content_hash, version.label) == ("d" * 64, "first")
    finally:
        registry.close()
