"""The Worker.Abort the gateway sends for a stream it ends without a final message (the client left, the gateway
stops) reaches the worker even where the stream was the last user of the worker's channel: a worker that
deregistered to drain (its streams are left to finish), and every worker at gateway stop. It used to find the
channel closed under it, and die as an unretrieved task exception."""

from __future__ import annotations

import asyncio
import gc

from shared.rpc.qserve.v1 import gateway_pb2
from tests.gateway.conftest import DEPLOYMENT, WORKER, gateway_stack, run

WITHIN_S = 5.0


async def _until(predicate, timeout_s: float = WITHIN_S) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _record_loop_errors() -> list[dict]:
    """What reaches the loop's exception handler ("Task exception was never retrieved" among others)."""
    errors: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
    return errors


def test_a_cancel_on_a_deregistered_workers_stream_still_aborts_it_there(artifacts):
    async def scenario():
        errors = _record_loop_errors()
        async with gateway_stack(artifacts) as stack:
            server = await stack.add_worker(artifacts.stable, tokens=100, delay_s=0.05)
            pooled = stack.gateway.pool.get(server.worker_id)
            call = stack.gw.Generate(gateway_pb2.GatewayGenerateRequest(deployment=DEPLOYMENT, text="x"))
            assert (await call.read()).token_ids
            # the worker begins to drain: it deregisters, and its open stream is left to finish...
            await stack.admin.DeregisterWorker(gateway_pb2.DeregisterWorkerRequest(worker_id=server.worker_id),
                                               metadata=WORKER)
            assert (await call.read()).token_ids
            call.cancel()  # ...until its client leaves
            await _until(lambda: server.worker.aborts and not stack.gateway.gateway._aborts)
            assert server.worker.aborts == server.worker.started
            assert pooled.in_flight == 0  # and the last user, the Abort, closed the channel
            gc.collect()
            await asyncio.sleep(0)
            assert errors == []

    run(scenario())


def test_the_streams_a_stopping_gateway_ends_are_aborted_on_their_workers(artifacts):
    async def scenario():
        errors = _record_loop_errors()
        async with gateway_stack(artifacts) as stack:
            server = await stack.add_worker(artifacts.stable, tokens=100, delay_s=0.05)
            call = stack.gw.Generate(gateway_pb2.GatewayGenerateRequest(deployment=DEPLOYMENT, text="x"))
            assert (await call.read()).token_ids
            await stack.gateway.stop(0)  # the stream ends with the server, then the pool closes every channel
            assert server.worker.aborts == server.worker.started
            assert not stack.gateway.gateway._aborts
            call.cancel()
        gc.collect()
        await asyncio.sleep(0)
        assert errors == []

    run(scenario())
