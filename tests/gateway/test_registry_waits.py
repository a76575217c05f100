"""The gateway when the registry makes it wait: a deployment's row lock held elsewhere (another replica
mid-transaction, a session left open in psql) or a table locked behind a migration.

* Admin changes that wait run on their own threads: they once took every thread of the event loop's default
  executor, and each Generate whose deployment was due a re-read then waited behind them to its deadline.
* A re-read that does not answer within ROUTING_READ_WAIT_S routes on the last view, as an outage does.
* An admin change is made within its client's deadline or not at all (it was applied seconds after the client
  was told DEADLINE_EXCEEDED, and the client's retry then logged a second change)."""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
import sqlalchemy as sa

from services.gateway.deployments import DeploymentCache
from shared.registry import create_registry, get_deployment
from shared.rpc.qserve.v1 import gateway_pb2
from tests.conftest import fresh_postgres_schema
from tests.gateway.conftest import ADMIN, DEPLOYMENT, Artifacts, Stack, gateway_stack, run, seed_artifacts

CACHE_S = 0.2


@pytest.fixture
def artifacts(artifacts_on_each_backend: Artifacts) -> Artifacts:
    return artifacts_on_each_backend


@asynccontextmanager
async def locked(url: str, statement: str | None = None):
    """Another service's transaction holding the deployment's row lock (on SQLite: the write lock), or running
    `statement` (PostgreSQL), until the block ends."""
    other = create_registry(url)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with other.transaction() as session:
            if statement is None:
                get_deployment(session, DEPLOYMENT, for_update=True)
            else:
                session.execute(sa.text(statement))
            held.set()
            release.wait(60)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    await asyncio.to_thread(held.wait, 10)
    try:
        yield
    finally:
        release.set()
        await asyncio.to_thread(thread.join, 60)
        other.close()


async def timed_generate(stack: Stack) -> float:
    started = time.monotonic()
    request = gateway_pb2.GatewayGenerateRequest(deployment=DEPLOYMENT, text="hi")
    assert [r async for r in stack.gw.Generate(request, timeout=10)]
    return time.monotonic() - started


def test_admin_calls_waiting_on_a_lock_do_not_hold_up_routing(artifacts: Artifacts) -> None:
    async def scenario():
        async with gateway_stack(artifacts, deployment_cache_s=CACHE_S) as stack:
            await stack.add_worker(artifacts.stable, tokens=2)
            await timed_generate(stack)
            async with locked(artifacts.url):
                # An operator's retries (or clients' calls) with a 1 s deadline: more than the default executor's
                # threads on a 2-core host.
                calls = [stack.admin.SetFallback(gateway_pb2.SetFallbackRequest(deployment=DEPLOYMENT),
                                                 metadata=ADMIN, timeout=1.0) for _ in range(12)]
                outcomes = await asyncio.gather(*calls, return_exceptions=True)
                assert {o.code() for o in outcomes} == {grpc.StatusCode.DEADLINE_EXCEEDED}
                await asyncio.sleep(2 * CACHE_S)  # the deployment is due a re-read
                assert await timed_generate(stack) < 1.0

    run(scenario(), timeout_s=60)


def test_a_lock_wait_that_runs_out_just_before_the_deadline_answers_deadline_exceeded(artifacts: Artifacts,
                                                                                        monkeypatch) -> None:
    """SQLite's busy handler gives up up to 100 ms before its timeout (the time left to the client's deadline):
    a lock held to the deadline reached the client as UNAVAILABLE, the registry unreachable, when the client's
    own clock had not run out yet (seen under load in CI)."""
    from contextlib import contextmanager

    from sqlalchemy.exc import OperationalError

    async def scenario():
        async with gateway_stack(artifacts) as stack:
            registry = stack.gateway.admin.registry

            @contextmanager
            def locked_until_just_before(lock_wait_s=None):
                time.sleep(max(0.0, lock_wait_s - 0.08))
                raise OperationalError("BEGIN IMMEDIATE", {}, Exception("database is locked"))
                yield

            monkeypatch.setattr(registry, "transaction", locked_until_just_before)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await stack.admin.SetFallback(gateway_pb2.SetFallbackRequest(deployment=DEPLOYMENT), metadata=ADMIN,
                                              timeout=1.0)
            assert failed.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED, failed.value.details()

    run(scenario(), timeout_s=60)


@pytest.mark.postgres
def test_a_registry_slow_to_answer_routes_on_the_last_view(tmp_path: Path) -> None:
    with fresh_postgres_schema("test_registry_waits") as url:
        artifacts = seed_artifacts(url)

        async def scenario():
            async with gateway_stack(artifacts, deployment_cache_s=CACHE_S) as stack:
                await stack.add_worker(artifacts.stable, tokens=2)
                await timed_generate(stack)
                # A migration's ALTER TABLE queued behind a long transaction holds such a lock: reads wait on it.
                async with locked(url, "LOCK TABLE deployments IN ACCESS EXCLUSIVE MODE"):
                    await asyncio.sleep(2 * CACHE_S)
                    waited = await timed_generate(stack)
                    assert DeploymentCache.ROUTING_READ_WAIT_S - 0.2 < waited < DeploymentCache.ROUTING_READ_WAIT_S + 1
                assert await timed_generate(stack) < 1.0

        run(scenario(), timeout_s=60)


def test_an_admin_change_past_its_deadline_is_not_made(artifacts: Artifacts) -> None:
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            await stack.add_worker(artifacts.canary)
            start = gateway_pb2.StartRolloutRequest(deployment=DEPLOYMENT, canary_artifact_id=artifacts.canary,
                                                    canary_percent=5)
            async with locked(artifacts.url):
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await stack.admin.StartRollout(start, metadata=ADMIN, timeout=0.5)
                assert failed.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
                await asyncio.sleep(1.0)  # the lock is held past the deadline, then released
            await asyncio.sleep(0.5)
            assert not (await stack.deployment()).HasField("canary")
            events = await stack.admin.ListEvents(gateway_pb2.ListEventsRequest(deployment=DEPLOYMENT), metadata=ADMIN)
            assert [e.kind for e in events.events] == ["deployment_create"]

            # The client's retries: the start, then the same start again (no second event), then a promote twice
            # (its answer lost to a deadline: the retry is answered as done, not "no rollout in progress").
            await stack.admin.StartRollout(start, metadata=ADMIN)
            await stack.admin.StartRollout(start, metadata=ADMIN)
            promote = gateway_pb2.PromoteRolloutRequest(deployment=DEPLOYMENT, canary_artifact_id=artifacts.canary,
                                                        force=True)  # it has served no request
            await stack.admin.PromoteRollout(promote, metadata=ADMIN)
            again = await stack.admin.PromoteRollout(promote, metadata=ADMIN)
            assert again.stable.artifact_id == artifacts.canary and not again.HasField("canary")
            events = await stack.admin.ListEvents(gateway_pb2.ListEventsRequest(deployment=DEPLOYMENT), metadata=ADMIN)
            assert [e.kind for e in reversed(events.events)] == ["deployment_create", "rollout_start", "promote"]

    run(scenario(), timeout_s=60)


def test_an_abort_names_its_canary_and_its_retry_succeeds_unchanged(artifacts: Artifacts) -> None:
    """AbortRollout had no canary to name: a client retrying an abort whose answer it lost could abort a rollout
    started since (or be told there is no rollout)."""
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            start = gateway_pb2.StartRolloutRequest(deployment=DEPLOYMENT, canary_artifact_id=artifacts.canary,
                                                    canary_percent=5)
            abort = gateway_pb2.AbortRolloutRequest(deployment=DEPLOYMENT, canary_artifact_id=artifacts.canary)
            await stack.admin.StartRollout(start, metadata=ADMIN)
            await stack.admin.AbortRollout(abort, metadata=ADMIN)
            again = await stack.admin.AbortRollout(abort, metadata=ADMIN)  # the retry
            assert not again.HasField("canary")
            await stack.admin.StartRollout(start, metadata=ADMIN)
            other = gateway_pb2.AbortRolloutRequest(deployment=DEPLOYMENT, canary_artifact_id=artifacts.stable)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stack.admin.AbortRollout(other, metadata=ADMIN)
            assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "the canary is now" in refused.value.details()
            assert (await stack.deployment()).canary.artifact_id == artifacts.canary
            events = await stack.admin.ListEvents(gateway_pb2.ListEventsRequest(deployment=DEPLOYMENT), metadata=ADMIN)
            assert [e.kind for e in reversed(events.events)] == ["deployment_create", "rollout_start", "abort",
                                                                 "rollout_start"]

    run(scenario(), timeout_s=60)
