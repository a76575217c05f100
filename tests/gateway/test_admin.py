"""Admin auth, deployment validation, events, health, reflection, metrics and the config."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.gateway.config import ApiKey, ConfigError, GatewayConfig, parse_admin_tokens, parse_api_keys
from shared.rpc.qserve.v1 import common_pb2, gateway_pb2
from tests.gateway.conftest import ADMIN, DEPLOYMENT, WORKER, gateway_stack, run


def test_admin_calls_need_a_known_token_of_the_right_scope(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            request = gateway_pb2.SetFallbackRequest(deployment=DEPLOYMENT, enabled=True, force=True)  # no workers
            cases = ((None, grpc.StatusCode.UNAUTHENTICATED),
                     ((("authorization", "admin-secret"),), grpc.StatusCode.UNAUTHENTICATED),  # no Bearer
                     ((("authorization", "Bearer wrong"),), grpc.StatusCode.UNAUTHENTICATED),
                     (WORKER, grpc.StatusCode.PERMISSION_DENIED))
            for metadata, code in cases:
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await stack.admin.SetFallback(request, metadata=metadata)
                assert raised.value.code() == code, metadata
            assert not (await stack.deployment()).fallback  # nothing was switched
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stack.admin.ListWorkers(gateway_pb2.ListWorkersRequest(), metadata=WORKER)
            assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED and "'workers'" in raised.value.details()
            await stack.add_worker(artifacts.stable)  # the worker scope may register
            assert (await stack.admin.SetFallback(request, metadata=ADMIN)).fallback

    run(scenario())


def test_generate_needs_an_api_key_when_keys_are_configured(artifacts):
    async def scenario():
        async with gateway_stack(artifacts, api_keys=frozenset({"key-1"})) as stack:
            await stack.add_worker(artifacts.stable, tokens=1)
            for metadata in (None, (("authorization", "Bearer key-2"),)):
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await stack.generate(metadata=metadata)
                assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert len(await stack.generate(metadata=(("authorization", "Bearer key-1"),))) == 1

    run(scenario())


def test_each_api_key_gets_a_prefix_cache_scope_of_its_own_on_the_workers(artifacts):
    """The workers' prefix cache was shared by every client: the time to first token told one whether another's
    prompt prefix (a system prompt, a document) had been seen. A digest of the key, never the key itself."""
    async def scenario():
        async with gateway_stack(artifacts, api_keys=frozenset({"key-1", "key-2"})) as stack:
            worker = await stack.add_worker(artifacts.stable, tokens=1)
            for key in ("key-1", "key-2", "key-1"):
                await stack.generate(metadata=(("authorization", f"Bearer {key}"),))
            first, second, again = worker.worker.cache_scopes
            assert first == again and first != second and "" not in (first, second)
            assert not any("key-" in scope for scope in (first, second))

    run(scenario())


def test_api_keys_take_an_optional_name_and_bad_entries_are_named_without_the_key():
    config = GatewayConfig.from_args(
        ["--registry-url", "sqlite:///x.db", "--max-streams-per-client", "4"],
        environ={"QSERVE_API_KEYS": " team-a = k1 , pad=c2VjcmV0== ,plain, b.2=x=y"})
    assert [(k.name, k.key) for k in config.api_keys] == [("team-a", "k1"), ("pad", "c2VjcmV0=="), ("", "plain"),
                                                          ("b.2", "x=y")]
    assert config.max_streams_per_client == 4 and "k1" not in repr(config)
    for text, message in (("a=s3cr3t,a=other", "key name 'a' appears twice"),
                          ("a=s3cr3t,b=s3cr3t", "entry 2 repeats another entry's key"),
                          ("bad name=s3cr3t", "key name 'bad name' is not accepted"),
                          ("-x=s3cr3t", "key name '-x' is not accepted"),
                          # an unset variable in team-b=${KEY}: not the key "team-b=", which anyone could guess
                          ("a=k1,team-b=", "entry 2 has an empty key"),
                          ("s3cr3t==", "entry 1 has an empty key"), ("s3cr3t=", "a key ending in '=' needs a name")):
        with pytest.raises(ConfigError, match=re.escape(message)) as raised:
            GatewayConfig(registry_url="sqlite:///x.db", api_keys=parse_api_keys(text))
        assert "s3cr3t" not in str(raised.value)
    with pytest.raises(ConfigError, match="needs API keys"):
        GatewayConfig(registry_url="sqlite:///x.db", max_streams_per_client=2)
    with pytest.raises(ConfigError, match="whole number of streams"):
        GatewayConfig(registry_url="sqlite:///x.db", api_keys=["k"], max_streams_per_client=-1)


def test_one_api_key_is_held_to_its_stream_limit_while_others_are_served(artifacts):
    """--max-streams-per-client: a client at its limit gets RESOURCE_EXHAUSTED naming its key, and only it; its
    streams, tokens and refusals are counted under its name."""
    keys = (ApiKey("team-a", "key-a"), ApiKey("", "key-b"))
    a, b = (("authorization", "Bearer key-a"),), (("authorization", "Bearer key-b"),)

    async def scenario():
        async with gateway_stack(artifacts, api_keys=keys, max_streams_per_client=1) as stack:
            await stack.add_worker(artifacts.stable, tokens=3, delay_s=0.05)
            long = stack.gw.Generate(gateway_pb2.GatewayGenerateRequest(
                deployment=DEPLOYMENT, text="long", sampling=common_pb2.SamplingParams(max_new_tokens=40)), metadata=a)
            await long.read()  # team-a's one stream is open
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stack.generate(metadata=a)
            assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "API key 'team-a' has 1 streams open, its limit (max_streams_per_client) is 1" in raised.value.details()
            assert len(await stack.generate(metadata=b)) == 3  # another client is served meanwhile
            long.cancel()
            deadline = time.monotonic() + 5.0
            while stack.gateway.gateway.open_by_client:  # the gateway has seen the cancel
                assert time.monotonic() < deadline, "the cancelled stream was not released"
                await asyncio.sleep(0.01)
            assert len(await stack.generate(metadata=a)) == 3  # its slot is free again
            metrics = stack.gateway.metrics
            assert metrics.client_requests.labels("team-a")._value.get() == 2
            assert metrics.client_requests.labels("unnamed")._value.get() == 1
            assert metrics.client_limited.labels("team-a")._value.get() == 1
            assert metrics.client_tokens.labels("unnamed")._value.get() == 3
            assert metrics.client_tokens.labels("team-a")._value.get() >= 4  # 3, and the long stream's first

    run(scenario())


def test_create_deployment_validates_the_name_and_the_artifacts(artifacts):
    async def scenario():
        async with gateway_stack(artifacts, create_deployment=False) as stack:
            def create(name, stable=artifacts.stable, baseline=artifacts.baseline):
                return stack.admin.CreateDeployment(gateway_pb2.CreateDeploymentRequest(
                    name=name, stable_artifact_id=stable, baseline_artifact_id=baseline), metadata=ADMIN)

            cases = (("Bad Name", artifacts.stable, artifacts.baseline, grpc.StatusCode.INVALID_ARGUMENT),
                     ("x" * 65, artifacts.stable, artifacts.baseline, grpc.StatusCode.INVALID_ARGUMENT),
                     ("ok", "", artifacts.baseline, grpc.StatusCode.INVALID_ARGUMENT),
                     ("ok", "f" * 32, artifacts.baseline, grpc.StatusCode.NOT_FOUND),
                     ("ok", artifacts.stable, artifacts.canary, grpc.StatusCode.FAILED_PRECONDITION),  # not fp16
                     ("ok", artifacts.other_model, artifacts.baseline, grpc.StatusCode.FAILED_PRECONDITION),
                     ("ok", artifacts.pending, artifacts.baseline, grpc.StatusCode.FAILED_PRECONDITION))
            for name, stable, baseline, code in cases:
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await create(name, stable, baseline)
                assert raised.value.code() == code, (name, raised.value.details())
            created = await create("chat-v1.2_b")
            assert created.stable.format == "w4a8kv4-g128" and created.baseline.format == "fp16"
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await create("chat-v1.2_b")
            assert raised.value.code() == grpc.StatusCode.ALREADY_EXISTS
            listed = await stack.admin.ListDeployments(gateway_pb2.ListDeploymentsRequest(), metadata=ADMIN)
            assert [d.name for d in listed.deployments] == ["chat-v1.2_b"]
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stack.admin.GetDeployment(gateway_pb2.GetDeploymentRequest(deployment="nope"), metadata=ADMIN)
            assert raised.value.code() == grpc.StatusCode.NOT_FOUND and "chat-v1.2_b" in raised.value.details()

    run(scenario())


def test_list_events_of_a_deployment_that_does_not_exist_is_not_found(artifacts):
    """It answered an empty list: a misspelt name looked like a deployment with no history."""
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stack.admin.ListEvents(gateway_pb2.ListEventsRequest(deployment="caht"), metadata=ADMIN)
            assert raised.value.code() == grpc.StatusCode.NOT_FOUND and "'caht'" in raised.value.details()
            assert (await stack.admin.ListEvents(gateway_pb2.ListEventsRequest(deployment=DEPLOYMENT),
                                                 metadata=ADMIN)).events

    run(scenario())


def test_list_events_is_newest_first_and_bounded(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            for enabled in (True, False, True):
                await stack.admin.SetFallback(gateway_pb2.SetFallbackRequest(
                    deployment=DEPLOYMENT, enabled=enabled, reason=f"r{enabled}", force=True), metadata=ADMIN)
            events = (await stack.admin.ListEvents(gateway_pb2.ListEventsRequest(limit=2), metadata=ADMIN)).events
            assert [e.kind for e in events] == ["fallback_on", "fallback_off"]
            assert events[0].event_id > events[1].event_id and events[0].deployment == DEPLOYMENT
            since = events[1].time
            recent = (await stack.admin.ListEvents(gateway_pb2.ListEventsRequest(since=since), metadata=ADMIN)).events
            assert [e.kind for e in recent] == ["fallback_on", "fallback_off"]
            everything = (await stack.admin.ListEvents(gateway_pb2.ListEventsRequest(), metadata=ADMIN)).events
            assert {"artifact_ready", "deployment_create"} <= {e.kind for e in everything}
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stack.admin.ListEvents(gateway_pb2.ListEventsRequest(limit=1001), metadata=ADMIN)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "1001" in raised.value.details()

    run(scenario())


def test_list_events_since_a_time_out_of_range_is_invalid_argument_naming_it(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            for seconds in (2**40, -2**40):
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await stack.admin.ListEvents(gateway_pb2.ListEventsRequest(since=Timestamp(seconds=seconds)),
                                                 metadata=ADMIN)
                assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "since" in raised.value.details() and str(seconds) in raised.value.details()

    run(scenario())


def test_health_reflection_and_prometheus_metrics(artifacts):
    async def scenario():
        async with gateway_stack(artifacts, metrics_port=0, metrics_host="127.0.0.1") as stack:
            health = health_pb2_grpc.HealthStub(stack.channel)
            for service in ("", "qserve.v1.Gateway", "qserve.v1.Admin"):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(stack.channel)
            names = set()
            async for reply in reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
                    list_services="")])):
                names |= {s.name for s in reply.list_services_response.service}
            assert {"qserve.v1.Gateway", "qserve.v1.Admin", "grpc.health.v1.Health"} <= names
            await stack.add_worker(artifacts.stable, tokens=3)
            await stack.generate()
            url = f"http://127.0.0.1:{stack.gateway.metrics_port}/metrics"
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            labels = f'artifact="{artifacts.stable}",deployment="chat"'
            assert f'qserve_gateway_requests_total{{arm="stable",{labels}}} 1.0' in text
            assert f'qserve_gateway_generated_tokens_total{{arm="stable",{labels}}} 3.0' in text
            assert f'qserve_gateway_time_to_first_token_seconds_count{{arm="stable",{labels}}} 1.0' in text
            assert f'qserve_gateway_time_per_output_token_seconds_count{{arm="stable",{labels}}} 1.0' in text

    run(scenario())


def test_config_names_the_bad_value():
    tokens = parse_admin_tokens("ops=s3cret:admin, w=abc:worker")
    assert tokens["ops"].token == "s3cret" and tokens["w"].scope == "worker"
    with pytest.raises(ConfigError, match="name=token:scope"):
        parse_admin_tokens("ops")
    with pytest.raises(ConfigError, match="'root'.*admin, worker"):
        GatewayConfig(registry_url="sqlite:///x.db", admin_tokens=parse_admin_tokens("a=b:root"))
    with pytest.raises(ConfigError, match="'nowhere'"):
        GatewayConfig(registry_url="sqlite:///x.db", listen="nowhere")
    with pytest.raises(ConfigError, match="heartbeat_timeout_s=1"):
        GatewayConfig(registry_url="sqlite:///x.db", heartbeat_interval_s=2, heartbeat_timeout_s=1)
    config = GatewayConfig.from_args(
        ["--registry-url", "sqlite:///x.db", "--listen", "127.0.0.1:0", "--max-tpot-p95-ms", "80",
         "--max-ttft-p95-ms", "1500", "--no-auto-fallback"],
        environ={"QSERVE_ADMIN_TOKENS": "ops=t:admin", "QSERVE_API_KEYS": "k1,k2"})
    assert config.budget.max_tpot_p95_s == pytest.approx(0.08) and not config.budget.enabled
    assert config.budget.max_ttft_p95_s == pytest.approx(1.5)
    unset = GatewayConfig.from_args(["--registry-url", "sqlite:///x.db"], environ={})
    assert unset.budget.max_ttft_p95_s == 0  # not judged unless asked
    assert [k.key for k in config.api_keys] == ["k1", "k2"] and config.admin_tokens["ops"].scope == "admin"


def test_a_malformed_token_entry_is_named_without_echoing_the_secret():
    # A forgotten ":scope" must not print the secret itself into the gateway's stderr / logs.
    for text in ("ops=s3cret-token-value", "ops=s3cret-token-value,w=abc:worker", "=s3cret-token-value:admin"):
        with pytest.raises(ConfigError) as raised:
            parse_admin_tokens(text)
        message = str(raised.value)
        assert "s3cret-token-value" not in message, message
        assert "name=token:scope" in message
    with pytest.raises(ConfigError, match="entry ops=\\.\\.\\. is not"):  # still says which entry
        parse_admin_tokens("ops=s3cret-token-value")
