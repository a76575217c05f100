"""A canary's refusal for the client's reason is put to the stable first (services/gateway/servicer_gateway.py):
a canary that takes less than the stable (here, shorter prompts) fails its share of those requests otherwise,
as the clients' fault, where the automatic guard never looks."""

from __future__ import annotations

import grpc
import pytest

from shared.rpc.qserve.v1 import common_pb2, gateway_pb2
from tests.gateway.conftest import ADMIN, DEPLOYMENT, arm_of, gateway_stack, run, tokens_of
from tests.gateway.fake_worker import VOCAB, expected_tokens

LONG, SHORT = "a prompt longer than eight tokens", "hi"  # one token per byte


async def _full_canary(stack, artifacts, tokens: int, **canary_fake):
    """A stable and a canary worker (the canary's FakeWorker given canary_fake), the canary at 100%."""
    stable = await stack.add_worker(artifacts.stable, tokens=tokens)
    canary = await stack.add_worker(artifacts.canary, tokens=tokens, **canary_fake)
    await stack.admin.StartRollout(gateway_pb2.StartRolloutRequest(
        deployment=DEPLOYMENT, canary_artifact_id=artifacts.canary, canary_percent=100), metadata=ADMIN)
    return stable, canary


async def _canary_taking_short_prompts(stack, artifacts):
    stable, canary = await _full_canary(stack, artifacts, 2)
    canary.worker.max_prompt_tokens = 8
    return stable, canary


async def _refused_as_out_of_vocabulary(stack) -> None:
    """A request every worker refuses as the client's fault: a token id past the vocabulary (INVALID_ARGUMENT)."""
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stack.gw.Generate(gateway_pb2.GatewayGenerateRequest(
            deployment=DEPLOYMENT, token_ids=common_pb2.TokenIds(ids=[VOCAB + 1]))).read()
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the vocabulary" in raised.value.details()


def test_what_the_canary_refuses_and_the_stable_serves_is_served_and_counted_against_the_canary(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            stable, canary = await _canary_taking_short_prompts(stack, artifacts)
            replies = await stack.generate(LONG)
            assert arm_of(replies) == gateway_pb2.ARM_STABLE and replies[-1].artifact_id == artifacts.stable
            assert tokens_of(replies) == expected_tokens(list(LONG.encode()), 2)
            assert (len(canary.worker.started), len(stable.worker.started)) == (1, 1)
            assert arm_of(await stack.generate(SHORT)) == gateway_pb2.ARM_CANARY  # what it takes, it serves
            canary_stats = stack.gateway.metrics.stats(DEPLOYMENT, artifacts.canary, since=0.0)
            assert (canary_stats.requests, canary_stats.errors) == (2, 1)  # the guard sees the refusal
            stable_stats = stack.gateway.metrics.stats(DEPLOYMENT, artifacts.stable, since=0.0)
            assert (stable_stats.requests, stable_stats.errors) == (1, 0)
            worker = stack.gateway.pool.get(canary.worker_id)
            assert worker.failure_streak == 0  # the worker validated and said no: not a broken worker

    run(scenario())


def test_what_the_stable_refuses_too_is_the_clients_and_counts_against_nobody(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            stable, canary = await _canary_taking_short_prompts(stack, artifacts)
            await _refused_as_out_of_vocabulary(stack)
            assert (len(canary.worker.started), len(stable.worker.started)) == (1, 1)
            for artifact_id in (artifacts.canary, artifacts.stable):
                assert stack.gateway.metrics.stats(DEPLOYMENT, artifact_id, since=0.0).errors == 0

    run(scenario())


def test_with_no_stable_worker_the_canarys_refusal_stands(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            stable, canary = await _canary_taking_short_prompts(stack, artifacts)
            await stack.admin.DeregisterWorker(gateway_pb2.DeregisterWorkerRequest(worker_id=stable.worker_id),
                                               metadata=ADMIN)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stack.generate(LONG)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "takes at most 8" in raised.value.details()

    run(scenario())


@pytest.mark.parametrize("stable_state", ["full", "refuse_draining", "fail_before_first"])
def test_a_canary_refusal_the_stable_never_judged_is_not_the_canarys_error(artifacts, stable_state):
    """Only a stable that serves what the canary refused makes the refusal the canary's error: a stable worker
    that is full, draining or failing never looked at the request. Charging the canary then let a client's bad
    input (refused by both) abort a healthy canary whenever the stable was busy; the client gets the canary's
    refusal, the answer to its request."""
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            stable, canary = await _full_canary(stack, artifacts, 2)
            setattr(stable.worker, stable_state, True)
            await _refused_as_out_of_vocabulary(stack)
            assert (len(canary.worker.started), len(stable.worker.started)) == (1, 1)
            assert stack.gateway.metrics.stats(DEPLOYMENT, artifacts.canary, since=0.0).errors == 0

    run(scenario())


async def _canary_with_a_shorter_window(stack, artifacts):
    return await _full_canary(stack, artifacts, 20, context_tokens=12)


def test_a_canary_generation_cut_short_by_its_context_window_counts_against_the_canary(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            await _canary_with_a_shorter_window(stack, artifacts)
            replies = await stack.generate(SHORT)  # 2 prompt tokens: the canary stops after 10 of the 20
            assert arm_of(replies) == gateway_pb2.ARM_CANARY
            assert tokens_of(replies) == expected_tokens(list(SHORT.encode()), 10)  # the client keeps them
            assert replies[-1].finish.reason == common_pb2.FINISH_REASON_LENGTH
            stats = stack.gateway.metrics.stats(DEPLOYMENT, artifacts.canary, since=0.0)
            assert (stats.requests, stats.errors) == (1, 1)

    run(scenario())


def test_a_canary_generation_ended_by_the_clients_limit_or_a_window_like_the_stables_is_not_an_error(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            stable, canary = await _canary_with_a_shorter_window(stack, artifacts)
            replies = await stack.generate(SHORT, max_new_tokens=5)  # the client's limit comes first
            assert len(tokens_of(replies)) == 5 and arm_of(replies) == gateway_pb2.ARM_CANARY
            replies = await stack.generate(SHORT, max_new_tokens=10)  # both limits at once: the client's
            assert len(tokens_of(replies)) == 10
            assert stack.gateway.metrics.stats(DEPLOYMENT, artifacts.canary, since=0.0).errors == 0
            stack.gateway.pool.get(stable.worker_id).max_context_tokens = 12  # the stable's window is as short
            assert len(tokens_of(await stack.generate(SHORT))) == 10
            stats = stack.gateway.metrics.stats(DEPLOYMENT, artifacts.canary, since=0.0)
            assert (stats.requests, stats.errors) == (3, 0)

    run(scenario())
