"""Worker pool and routing: registration checks, least-loaded choice, heartbeats, baseline when an
arm has no worker."""

from __future__ import annotations

import asyncio
import sqlite3
import time

import grpc
import pytest
from sqlalchemy.exc import OperationalError

from services.gateway import deployments as deployments_module
from services.gateway.deployments import DeploymentCache, read_deployments
from services.gateway.servicer_gateway import MAX_REQUEST_BYTES
from shared.registry import NotFound, create_registry
from shared.rpc.qserve.v1 import gateway_pb2
from tests.gateway.conftest import ADMIN, DEPLOYMENT, WORKER, arm_of, gateway_stack, run, tokens_of
from tests.gateway.fake_worker import FakeWorker, FakeWorkerServer, expected_tokens


def test_stream_relays_the_workers_tokens_once_and_in_order(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            await stack.add_worker(artifacts.stable, tokens=5)
            replies = await stack.generate("hi")
            assert tokens_of(replies) == expected_tokens(list(b"hi"), 5)
            assert "".join(r.text for r in replies) == "".join(f"<{t}>" for t in expected_tokens(list(b"hi"), 5))
            assert {r.artifact_id for r in replies} == {artifacts.stable}
            assert arm_of(replies) == gateway_pb2.ARM_STABLE
            final = replies[-1].finish
            assert final.generated_tokens == 5 and final.prompt_tokens == 2
            assert final.timings.total.ToNanoseconds() >= final.timings.time_to_first_token.ToNanoseconds() > 0
            assert all(not r.HasField("finish") for r in replies[:-1])
            assert len({r.request_id for r in replies}) == 1 and replies[0].request_id

    run(scenario())


def test_requests_go_to_the_least_loaded_healthy_worker(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            a = await stack.add_worker(artifacts.stable, tokens=3, delay_s=0.5)
            b = await stack.add_worker(artifacts.stable, tokens=3, delay_s=0.5)
            streams = [asyncio.create_task(stack.generate(f"p{i}")) for i in range(6)]
            for _ in range(50):  # until all six reached a worker (each stays open at least 1.5 s)
                listed = await stack.admin.ListWorkers(gateway_pb2.ListWorkersRequest(), metadata=ADMIN)
                if sum(w.in_flight for w in listed.workers) == 6:
                    break
                await asyncio.sleep(0.02)
            assert sorted(w.in_flight for w in listed.workers) == [3, 3]
            await asyncio.gather(*streams)
            assert len(a.worker.started) == len(b.worker.started) == 3
            # one worker is now busy with a slow stream: the next request goes to the other
            slow = asyncio.create_task(stack.generate("slow", max_new_tokens=3))
            while len(a.worker.started) + len(b.worker.started) < 7:
                await asyncio.sleep(0.01)
            busy = a if len(a.worker.started) == 4 else b
            idle = b if busy is a else a
            await stack.generate("quick", max_new_tokens=1)
            assert len(idle.worker.started) == 4
            await slow

    run(scenario())


def test_a_sessions_requests_stay_on_one_worker_while_it_is_not_much_busier(artifacts):
    """A conversation's next turn starts with the previous ones, whose K/V its worker's prefix cache holds: a
    session key keeps its requests on one worker (the same choice on every gateway replica, by address), the
    keys spread over the workers, and a session's worker loaded past the slack loses the request to load."""
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            fakes = [await stack.add_worker(artifacts.stable, capacity=4, tokens=1) for _ in range(3)]

            async def worker_of(key: str):
                before = [len(f.worker.started) for f in fakes]
                await stack.generate("turn", session_key=key)
                return next(f for f, n in zip(fakes, before) if len(f.worker.started) > n)

            homes = {}
            for key in (f"user-{i}" for i in range(30)):
                homes[key] = await worker_of(key)
                assert await worker_of(key) is homes[key]
            assert len({id(h) for h in homes.values()}) == 3  # the keys spread over the 3 workers
            key, home = next(iter(homes.items()))
            pool = stack.gateway.pool
            for _ in range(2):  # 2 of its 4 slots taken: 0.5 above the idle others, past the slack
                pool.acquire(pool.get(home.worker_id))
            assert await worker_of(key) is not home
            await pool.release(pool.get(home.worker_id))  # 0.25 above: within the slack, back home
            assert await worker_of(key) is home
            await pool.release(pool.get(home.worker_id))

    run(scenario())


def test_a_worker_at_capacity_gets_no_more_and_a_full_pool_is_resource_exhausted(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            worker = await stack.add_worker(artifacts.stable, capacity=2, tokens=2, delay_s=0.5)
            streams = [asyncio.create_task(stack.generate(f"p{i}")) for i in range(2)]
            while len(worker.worker.started) < 2:
                await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stack.generate("third")
            assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "capacity" in raised.value.details()
            await asyncio.gather(*streams)
            assert len(await stack.generate("after")) >= 1

    run(scenario())


def test_a_canary_at_capacity_overflows_to_the_stable_as_when_its_workers_answer_full(artifacts):
    """A small canary worker at its capacity by the gateway's count sends the request to the stable, as the
    same canary answering full itself does: before, the client got RESOURCE_EXHAUSTED with the stable idle.
    With no room on any route the request is shed (RESOURCE_EXHAUSTED), as before."""
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            stable = await stack.add_worker(artifacts.stable, capacity=1, tokens=2)
            canary = await stack.add_worker(artifacts.canary, capacity=1, tokens=2)
            await stack.admin.StartRollout(gateway_pb2.StartRolloutRequest(
                deployment=DEPLOYMENT, canary_artifact_id=artifacts.canary, canary_percent=100), metadata=ADMIN)
            pool = stack.gateway.pool
            pool.acquire(pool.get(canary.worker_id))  # a stream open on the canary's only slot
            replies = await stack.generate("x")
            assert arm_of(replies) == gateway_pb2.ARM_STABLE and not canary.worker.started
            pool.acquire(pool.get(stable.worker_id))
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stack.generate("no room anywhere")
            assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "capacity" in raised.value.details()
            assert artifacts.canary in raised.value.details()  # named for the arm that was chosen

    run(scenario())


def test_register_checks_the_address_the_artifact_and_the_worker(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            fake = await FakeWorkerServer(FakeWorker(artifacts.stable)).start()
            stack.workers.append(fake)

            async def register(address, artifact_id):
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await stack.admin.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
                        address=address, artifact_id=artifact_id), metadata=WORKER)
                return raised.value

            for address in ("no-port", "10.0.0.7:0", "10.0.0.7:65536", "::1:50071"):  # port 0 was accepted
                bad = await register(address, artifacts.stable)
                assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and repr(address) in bad.details()
            assert (await register(fake.address, "")).code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (await register(fake.address, "f" * 32)).code() == grpc.StatusCode.NOT_FOUND
            pending = await register(fake.address, artifacts.pending)
            assert pending.code() == grpc.StatusCode.FAILED_PRECONDITION and "PENDING" in pending.details()
            other = await register(fake.address, artifacts.baseline)  # the worker loaded the stable
            assert other.code() == grpc.StatusCode.FAILED_PRECONDITION and artifacts.stable in other.details()
            down = await register("127.0.0.1:1", artifacts.stable)
            assert down.code() == grpc.StatusCode.UNAVAILABLE and "127.0.0.1:1" in down.details()
            first = await stack.admin.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
                address=fake.address, artifact_id=artifacts.stable), metadata=WORKER)
            again = await stack.admin.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
                address=fake.address, artifact_id=artifacts.stable), metadata=WORKER)
            assert first.worker_id == again.worker_id
            listed = (await stack.admin.ListWorkers(gateway_pb2.ListWorkersRequest(), metadata=ADMIN)).workers
            assert [(w.address, w.capacity, w.artifact.format) for w in listed] == [(fake.address, 16, "w4a8kv4-g128")]

    run(scenario())


def test_a_worker_whose_manifest_is_not_the_published_one_is_refused(artifacts):
    """A copy of the artifact changed after publishing (its manifest signed again), or a local folder given a
    published id: its worker registered as the vetted artifact and served its own weights under that name."""
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            fake = await FakeWorkerServer(FakeWorker(artifacts.stable)).start()
            stack.workers.append(fake)
            request = gateway_pb2.RegisterWorkerRequest(address=fake.address, artifact_id=artifacts.stable)
            fake.worker.manifest_sha256 = "c" * 64  # the registry's is "b" * 64 (conftest)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stack.admin.RegisterWorker(request, metadata=WORKER)
            assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "not the published one" in raised.value.details() and "cccccccccccc" in raised.value.details()
            assert not (await stack.admin.ListWorkers(gateway_pb2.ListWorkersRequest(), metadata=ADMIN)).workers
            for told in ("b" * 64, ""):  # the published manifest; a worker that does not tell (older): let in
                fake.worker.manifest_sha256 = told
                await stack.admin.RegisterWorker(request, metadata=WORKER)

    run(scenario())


def test_missed_heartbeats_mark_a_worker_unhealthy_and_a_heartbeat_restores_it(artifacts):
    async def scenario():
        async with gateway_stack(artifacts, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.3) as stack:
            silent = await stack.add_worker(artifacts.stable)
            beating = await stack.add_worker(artifacts.stable)
            for _ in range(6):
                await stack.admin.Heartbeat(gateway_pb2.HeartbeatRequest(worker_id=beating.worker_id,
                                                                         running_requests=1), metadata=WORKER)
                await asyncio.sleep(0.1)
            health = {w.worker_id: w.health for w in
                      (await stack.admin.ListWorkers(gateway_pb2.ListWorkersRequest(), metadata=ADMIN)).workers}
            assert health == {silent.worker_id: gateway_pb2.WORKER_HEALTH_UNHEALTHY,
                              beating.worker_id: gateway_pb2.WORKER_HEALTH_HEALTHY}
            for i in range(4):
                await stack.generate(f"p{i}", max_new_tokens=1)
            assert len(silent.worker.started) == 0 and len(beating.worker.started) == 4
            await stack.admin.Heartbeat(gateway_pb2.HeartbeatRequest(worker_id=silent.worker_id), metadata=WORKER)
            listed = await stack.admin.ListWorkers(gateway_pb2.ListWorkersRequest(), metadata=ADMIN)
            assert {w.health for w in listed.workers} == {gateway_pb2.WORKER_HEALTH_HEALTHY}
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stack.admin.Heartbeat(gateway_pb2.HeartbeatRequest(worker_id="nope"), metadata=WORKER)
            assert raised.value.code() == grpc.StatusCode.NOT_FOUND

    run(scenario())


def test_draining_and_deregistered_workers_get_no_new_requests(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            draining = await stack.add_worker(artifacts.stable)
            gone = await stack.add_worker(artifacts.stable)
            serving = await stack.add_worker(artifacts.stable)
            await stack.admin.Heartbeat(gateway_pb2.HeartbeatRequest(worker_id=draining.worker_id, draining=True),
                                        metadata=WORKER)
            await stack.admin.DeregisterWorker(gateway_pb2.DeregisterWorkerRequest(worker_id=gone.worker_id),
                                               metadata=WORKER)
            for i in range(4):
                await stack.generate(f"p{i}", max_new_tokens=1)
            assert (len(draining.worker.started), len(gone.worker.started), len(serving.worker.started)) == (0, 0, 4)

    run(scenario())


def test_an_arm_without_workers_goes_to_the_baseline_and_none_at_all_is_unavailable(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stack.generate()
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
            assert artifacts.stable in raised.value.details() and artifacts.baseline in raised.value.details()
            await stack.add_worker(artifacts.baseline)
            replies = await stack.generate()
            assert arm_of(replies) == gateway_pb2.ARM_BASELINE and replies[0].artifact_id == artifacts.baseline

    run(scenario())


def test_a_worker_silent_past_the_forget_time_is_removed_and_must_register_again(artifacts):
    """Workers that went away for good (replaced at new addresses) must not pile up in the pool with their
    channels open: silent past worker_forget_s, a worker is removed; its late heartbeat gets NOT_FOUND,
    which tells it to register again."""
    async def scenario():
        async with gateway_stack(artifacts, heartbeat_interval_s=0.05, heartbeat_timeout_s=0.15,
                                 worker_forget_s=0.4) as stack:
            gone = await stack.add_worker(artifacts.stable)
            beating = await stack.add_worker(artifacts.stable)
            for _ in range(12):
                await stack.admin.Heartbeat(gateway_pb2.HeartbeatRequest(worker_id=beating.worker_id), metadata=WORKER)
                await asyncio.sleep(0.05)
            listed = await stack.admin.ListWorkers(gateway_pb2.ListWorkersRequest(), metadata=ADMIN)
            assert [w.worker_id for w in listed.workers] == [beating.worker_id]
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stack.admin.Heartbeat(gateway_pb2.HeartbeatRequest(worker_id=gone.worker_id), metadata=WORKER)
            assert raised.value.code() == grpc.StatusCode.NOT_FOUND

    run(scenario())


def test_a_canary_without_workers_goes_to_the_stable_then_the_baseline(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            await stack.admin.StartRollout(gateway_pb2.StartRolloutRequest(
                deployment=DEPLOYMENT, canary_artifact_id=artifacts.canary, canary_percent=100), metadata=ADMIN)
            baseline = await stack.add_worker(artifacts.baseline)
            assert arm_of(await stack.generate()) == gateway_pb2.ARM_BASELINE  # neither canary nor stable workers
            await stack.add_worker(artifacts.stable)
            replies = await stack.generate()
            assert arm_of(replies) == gateway_pb2.ARM_STABLE and replies[0].artifact_id == artifacts.stable
            await stack.add_worker(artifacts.canary)
            assert arm_of(await stack.generate()) == gateway_pb2.ARM_CANARY
            assert len(baseline.worker.started) == 1

    run(scenario())


def test_a_registry_outage_keeps_routing_on_the_last_view_without_its_canary(artifacts, monkeypatch):
    """A deployment read before the outage keeps serving, its canary's sessions on the stable (the guard
    cannot abort a canary while the registry is down); a deployment never read fails UNAVAILABLE."""
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            await stack.add_worker(artifacts.stable)
            await stack.add_worker(artifacts.canary)
            await stack.admin.StartRollout(gateway_pb2.StartRolloutRequest(
                deployment=DEPLOYMENT, canary_artifact_id=artifacts.canary, canary_percent=100), metadata=ADMIN)
            assert arm_of(await stack.generate()) == gateway_pb2.ARM_CANARY

            def down(*_):
                raise OperationalError("SELECT deployments", {}, ConnectionRefusedError("registry down"))

            monkeypatch.setattr(deployments_module, "read_deployments", down)
            monkeypatch.setattr(deployments_module, "deployment_names", down)
            await asyncio.sleep(2 * stack.gateway.deployments.max_age_s)  # every cached view is now stale
            for _ in range(3):
                replies = await stack.generate()
                assert arm_of(replies) == gateway_pb2.ARM_STABLE and replies[0].artifact_id == artifacts.stable
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stack.generate(deployment="never-read")
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
            # the database's own words (its SQL, its host and port) stay in the gateway's log
            assert raised.value.details() == "the registry's database cannot be reached; retry later"
            monkeypatch.undo()
            await asyncio.sleep(2 * stack.gateway.deployments.max_age_s)
            assert arm_of(await stack.generate()) == gateway_pb2.ARM_CANARY  # back once the registry is

    run(scenario())


def test_generate_rejects_bad_requests(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            await stack.add_worker(artifacts.stable)
            for deployment, prompt, code in (("", "x", grpc.StatusCode.INVALID_ARGUMENT),
                                             ("chat", "", grpc.StatusCode.INVALID_ARGUMENT),
                                             ("nope", "x", grpc.StatusCode.NOT_FOUND),
                                             # no deployment has such a name (CreateDeployment's rule)
                                             ("Chat", "x", grpc.StatusCode.INVALID_ARGUMENT),
                                             ("c" * 65, "x", grpc.StatusCode.INVALID_ARGUMENT)):
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await stack.generate(prompt, deployment=deployment)
                assert raised.value.code() == code, raised.value.details()
            # A 2 MB name was looked up, cached, and echoed in the NOT_FOUND (past the client's metadata limit:
            # RESOURCE_EXHAUSTED, "retry later"); it is refused in a line, and never reaches the cache.
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stack.generate("x", deployment="n" * (2 << 20))
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(raised.value.details()) < 200
            assert not any(len(name) > 64 for name in stack.gateway.deployments._entries)
            # the worker's own INVALID_ARGUMENT reaches the client as it is, without a retry elsewhere
            request = gateway_pb2.GatewayGenerateRequest(deployment="chat", token_ids={"ids": [1, 99999]})
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                async for _ in stack.gw.Generate(request):
                    pass
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in raised.value.details()
            assert len(stack.workers[0].worker.started) == 1

    run(scenario())


def test_request_ids_and_session_keys_past_their_limits_are_refused(artifacts):
    """The request_id is echoed in every message of the stream and in log lines, the session_key hashed per
    candidate worker: a 3 MiB request_id made the gateway send megabytes per token. Refused before any worker
    is asked, naming the field and its limit (worded as the worker words its own limit)."""
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            worker = (await stack.add_worker(artifacts.stable, tokens=2)).worker
            for field, size, limit in (("request_id", 129, 128), ("request_id", 3 << 20, 128),
                                       ("session_key", 257, 256)):
                request = gateway_pb2.GatewayGenerateRequest(deployment=DEPLOYMENT, text="hi", **{field: "r" * size})
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    async for _ in stack.gw.Generate(request):
                        pass
                assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert raised.value.details() == f"{field} has {size} characters; at most {limit}"
            assert worker.started == []
            request = gateway_pb2.GatewayGenerateRequest(deployment=DEPLOYMENT, text="hi", request_id="r" * 128,
                                                         session_key="s" * 256)
            replies = [reply async for reply in stack.gw.Generate(request)]
            assert {r.request_id for r in replies} == {"r" * 128} and replies[-1].HasField("finish")
            assert worker.started[0].startswith("r" * 128 + ".")

    run(scenario())


def test_a_request_too_large_for_a_worker_is_refused_not_shed_as_full(artifacts):
    """A request just under the gateway's 4 MiB message limit becomes one just over the worker's (the worker's
    request id is the gateway's): every worker refused it RESOURCE_EXHAUSTED, read as full, and the client was told
    to retry later a request that could never pass. Refused at once, naming its size and the limit."""
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            worker = (await stack.add_worker(artifacts.stable, tokens=2, context_tokens=8 << 20)).worker
            text = "a" * (MAX_REQUEST_BYTES + 16)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stack.generate(text)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"at most {MAX_REQUEST_BYTES} (a worker's message limit)" in raised.value.details()
            assert worker.started == []
            assert len(await stack.generate("a" * (MAX_REQUEST_BYTES - 64))) == 2  # just under it passes

    run(scenario())


def test_routing_reads_of_the_registry_take_no_write_lock(artifacts):
    """On SQLite a transaction() holds the write lock: the deployment cache's re-reads waited out any writer
    (the quantizer, another gateway's admin call) for up to the busy timeout, and every request with them."""
    registry = create_registry(artifacts.url)
    writer = sqlite3.connect(artifacts.url.removeprefix("sqlite:///"), isolation_level=None)
    try:
        writer.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        assert read_deployments(registry, [DEPLOYMENT]) == {DEPLOYMENT: None}
        assert time.monotonic() - started < 2.0
    finally:
        writer.execute("ROLLBACK")
        writer.close()
        registry.close()


def test_clients_reusing_a_request_id_get_distinct_worker_request_ids(artifacts):
    """request_id is the caller's id for logs: two clients may both send "1". The worker refuses a
    duplicate in-flight id, and the gateway's Worker.Abort (on a cancel) names the request by id, so
    the id the gateway gives the worker must be unique per gateway request."""
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            worker = (await stack.add_worker(artifacts.stable, tokens=3, delay_s=0.1)).worker
            request = gateway_pb2.GatewayGenerateRequest(deployment=DEPLOYMENT, text="hi", request_id="1")

            async def generate():
                return [reply async for reply in stack.gw.Generate(request)]

            first, second = await asyncio.gather(generate(), generate())
            assert len(worker.started) == 2
            assert len(set(worker.started)) == 2, f"one worker request id for two client requests: {worker.started}"
            # the client still sees its own id
            assert {r.request_id for r in first + second} == {"1"}

    run(scenario())


def test_the_deployment_cache_forgets_unknown_names_once_idle(artifacts):
    """Every Generate for a name that does not exist put an entry in the cache that was never removed:
    a client sending random deployment names grew the gateway's memory without bound."""
    async def scenario():
        registry = create_registry(artifacts.url)
        try:
            cache = DeploymentCache(registry, max_age_s=0.02)
            cache.IDLE_S = 0.05
            for i in range(20):
                with pytest.raises(NotFound):
                    await cache.get(f"nope-{i}")
            refresh = asyncio.create_task(cache.refresh())
            await asyncio.sleep(0.3)
            refresh.cancel()
            await asyncio.gather(refresh, return_exceptions=True)
            left = [name for name in cache._entries if name.startswith("nope-")]
            assert left == [], f"{len(left)} unknown names still cached long after their last use"
        finally:
            registry.close()

    run(scenario())


def test_the_background_refresh_does_not_re_read_names_that_do_not_exist(artifacts, monkeypatch):
    """Every unknown name a client sent was re-read by each refresh (twice per max_age) for IDLE_S: random
    names made every refresh's registry query grow with them. A request still re-reads a stale one."""
    read_names: list[list[str]] = []
    read = deployments_module.read_deployments

    def recording(registry, names):
        read_names.append(list(names))
        return read(registry, names)

    monkeypatch.setattr(deployments_module, "read_deployments", recording)

    async def scenario():
        async with gateway_stack(artifacts) as stack:  # creates the deployment
            cache = DeploymentCache(stack.gateway.registry, max_age_s=0.05)
            await cache.get(DEPLOYMENT)
            for i in range(20):
                with pytest.raises(NotFound):
                    await cache.get(f"nope-{i}")
            read_names.clear()
            refresh = asyncio.create_task(cache.refresh())
            await asyncio.sleep(0.2)
            refresh.cancel()
            await asyncio.gather(refresh, return_exceptions=True)
            assert read_names, "the refresh never ran"
            assert all(names == [DEPLOYMENT] for names in read_names), read_names[:2]
            read_names.clear()
            lists = []
            monkeypatch.setattr(deployments_module, "deployment_names",
                                lambda registry: lists.append(True) or names_of(registry))
            await asyncio.sleep(0.06)
            with pytest.raises(NotFound):  # stale: the request reads the list of names again itself
                await cache.get("nope-3")
            assert read_names == [] and lists == [True]

    names_of = deployments_module.deployment_names
    run(scenario())


def test_unknown_names_cost_one_read_of_the_names_per_max_age(artifacts, monkeypatch):
    """With no API key required (the default) a client sending random deployment names cost one registry read
    each (3,000 in 4 s), and an entry each (security audit)."""
    reads = []
    for name in ("read_deployments", "deployment_names"):
        real = getattr(deployments_module, name)
        monkeypatch.setattr(deployments_module, name,
                            lambda *args, real=real, name=name: reads.append(name) or real(*args))

    async def scenario():
        async with gateway_stack(artifacts) as stack:  # creates the deployment
            cache = DeploymentCache(stack.gateway.registry, max_age_s=60.0)
            await cache.get(DEPLOYMENT)
            reads.clear()
            for i in range(300):
                with pytest.raises(NotFound):
                    await cache.get(f"nope-{i}")
            assert reads == [] and cache.names() == [DEPLOYMENT] and len(cache._entries) == 1

    run(scenario())
