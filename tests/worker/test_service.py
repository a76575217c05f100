"""The Worker rpc contract on loopback: cancellation and Abort free blocks, status codes for bad
requests, admission limits, Info, health, metrics, and the graceful drain."""

from __future__ import annotations

import hashlib
import logging

import socket
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.formats.artifact import TOKENIZER_DIR, ArtifactReader
from shared.model.tokenizer import Tokenizer
from shared.rpc.qserve.v1 import common_pb2, worker_pb2
from shared.rpc.refusal import DRAINING, REFUSAL_KEY
from tests.worker.conftest import generate, stub

PROMPT = [17, 300, 42, 9, 1200, 77]


def _request(ids=PROMPT, request_id="", **sampling) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(request_id=request_id, token_ids=common_pb2.TokenIds(ids=ids),
                                      sampling=common_pb2.SamplingParams(**sampling))


def _wait_for(predicate, timeout_s=10.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def worker(artifacts):
    from services.worker.config import WorkerConfig
    from services.worker.server import BackgroundWorker

    w = BackgroundWorker(WorkerConfig(artifact=str(artifacts["fp16"]), port=0, metrics_port=0, kv_blocks=64,
                                      block_size=4, max_running_sequences=1, max_waiting_requests=1,
                                      max_context_tokens=256, max_batch_tokens=32))
    yield w
    w.stop(grace_s=0)


@pytest.fixture(scope="module")
def client(worker):
    channel, s = stub(worker)
    yield s
    channel.close()


def _info(client) -> worker_pb2.WorkerInfo:
    return client.Info(worker_pb2.InfoRequest(), timeout=10)


def _idle(client) -> bool:
    info = _info(client)
    return info.kv_blocks_used == 0 and info.running_requests == 0 and info.waiting_requests == 0


def test_cancelling_the_stream_aborts_the_request_and_frees_its_blocks(client):
    call = client.Generate(_request(ignore_eos=True), timeout=60)  # unlimited: runs until cancelled
    stream = iter(call)
    first, second = next(stream), next(stream)
    assert first.token_ids and second.token_ids
    assert _info(client).kv_blocks_used > 0
    call.cancel()
    _wait_for(lambda: _idle(client), 5.0, "the cancelled request's blocks to be freed")


def test_abort_ends_the_stream_with_reason_abort(client):
    call = client.Generate(_request(request_id="to-abort", ignore_eos=True), timeout=60)
    stream = iter(call)
    next(stream)
    assert client.Abort(worker_pb2.AbortRequest(request_id="to-abort"), timeout=10).found
    assert _info(client).kv_blocks_used == 0  # freed before Abort answered
    last = list(stream)[-1]
    assert last.finish.reason == common_pb2.FINISH_REASON_ABORT and last.request_id == "to-abort"
    assert not client.Abort(worker_pb2.AbortRequest(request_id="to-abort"), timeout=10).found


@pytest.mark.parametrize(
    "request_pb, words",
    [
        (worker_pb2.GenerateRequest(), ["no prompt"]),
        (worker_pb2.GenerateRequest(text=""), ["prompt text is empty"]),
        (_request(ids=[]), ["prompt token_ids are empty"]),
        (_request(ids=[1, 4096]), ["4096", "0..4095"]),
        (_request(ids=list(range(256))), ["256 tokens", "at most 255"]),
        (_request(temperature=-0.5), ["temperature=-0.5", ">= 0"]),
        (_request(top_p=1.5), ["top_p=1.5", "(0, 1]"]),
        (_request(stop_token_ids=[5000]), ["stop token id 5000", "0..4095"]),
        (_request(stop=["ok", ""]), ["stop string ''"]),
        (_request(stop_token_ids=list(range(300))), ["300 stop token ids", "at most 256"]),
    ],
)
def test_bad_requests_are_invalid_argument_naming_the_value(client, request_pb, words):
    with pytest.raises(grpc.RpcError) as err:
        list(client.Generate(request_pb, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for word in words:
        assert word in err.value.details(), err.value.details()


def test_empty_abort_id_is_invalid(client):
    with pytest.raises(grpc.RpcError) as err:
        client.Abort(worker_pb2.AbortRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_duplicate_request_id_and_full_queue(client):
    running = client.Generate(_request(request_id="dup", ignore_eos=True), timeout=60)
    next(iter(running))
    with pytest.raises(grpc.RpcError) as err:
        list(client.Generate(_request(request_id="dup"), timeout=10))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and "'dup'" in err.value.details()
    # One running sequence at most, one waiting request at most: the third is refused.
    waiting = client.Generate(_request(request_id="second", max_new_tokens=2), timeout=60)
    _wait_for(lambda: _info(client).waiting_requests == 1, what="the second request to wait")
    with pytest.raises(grpc.RpcError) as err:
        list(client.Generate(_request(request_id="third", max_new_tokens=2), timeout=10))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "1 requests" in err.value.details()
    running.cancel()
    assert [m.finish.reason for m in waiting if m.HasField("finish")] == [common_pb2.FINISH_REASON_LENGTH]
    _wait_for(lambda: _idle(client), what="an idle worker")


def test_text_prompt_and_finish_fields(client, worker):
    tokenizer = worker.server.served.tokenizer
    messages = list(client.Generate(
        worker_pb2.GenerateRequest(text="def main(", sampling=common_pb2.SamplingParams(max_new_tokens=5,
                                                                                        ignore_eos=True)),
        timeout=60))
    finish = messages[-1].finish
    assert finish.reason == common_pb2.FINISH_REASON_LENGTH
    assert finish.prompt_tokens == len(tokenizer.encode("def main(")) and finish.generated_tokens == 5
    t = finish.timings
    ttft, total = t.time_to_first_token.ToTimedelta(), t.total.ToTimedelta()
    assert t.queue.ToTimedelta() <= ttft <= total and t.time_per_output_token.ToTimedelta().total_seconds() > 0
    assert len({m.request_id for m in messages}) == 1 and messages[0].request_id  # assigned by the worker


def test_info_describes_the_artifact_and_capacity(client, artifacts):
    info = _info(client)
    manifest = ArtifactReader(artifacts["fp16"], verify=False).manifest
    assert info.artifact.artifact_id == manifest.artifact_id and info.artifact.model_version == manifest.model_version
    assert (info.format, info.gpu_target, info.gpu_name) == ("fp16", "cpu", "cpu")
    assert info.artifact.size_bytes == sum(f.size for f in manifest.files)
    assert info.artifact.vocabulary_digest == Tokenizer(Path(artifacts["fp16"]) / TOKENIZER_DIR).vocabulary_digest()
    manifest_bytes = (Path(artifacts["fp16"]) / "manifest.json").read_bytes()
    assert info.artifact.manifest_sha256 == hashlib.sha256(manifest_bytes).hexdigest()  # the gateway checks it
    assert (info.kv_blocks_total, info.kv_block_size, info.max_context_tokens) == (64, 4, 256)
    assert (info.max_running_sequences, info.max_waiting_requests) == (1, 1)
    assert info.kv_blocks_free + info.kv_blocks_used == info.kv_blocks_total and not info.draining
    assert info.HasField("probe_error") and 0 <= info.probe_error < 0.01  # the fp16 artifact on the CPU reference


def test_health_is_serving(worker):
    with grpc.insecure_channel(worker.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "qserve.v1.Worker"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING


def test_metrics_endpoint(client, worker):
    generate(client, PROMPT, max_new_tokens=3, ignore_eos=True)
    url = f"http://127.0.0.1:{worker.server.metrics_port}/metrics"
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    for name in ("qserve_worker_time_to_first_token_seconds_count", "qserve_worker_time_per_output_token_seconds_count",
                 "qserve_worker_queue_time_seconds_count", "qserve_worker_running_requests",
                 "qserve_worker_waiting_requests", "qserve_worker_kv_usage_ratio", "qserve_worker_kv_blocks_free"):
        assert name in body, name
    finished = [line for line in body.splitlines() if line.startswith('qserve_worker_requests_total{reason="length"}')]
    assert finished and float(finished[0].split()[-1]) >= 1
    assert "qserve_worker_kv_blocks_free 64.0" in body


def test_drain_finishes_in_flight_work_and_refuses_new(start_worker):
    w = start_worker("fp16")
    channel, client = stub(w)
    call = client.Generate(_request(max_new_tokens=6, ignore_eos=True), timeout=60)
    stream = iter(call)
    next(stream)
    drained = threading.Thread(target=w.call, args=(w.server.drain(30.0),))
    drained.start()
    _wait_for(lambda: _info(client).draining, what="draining")
    with pytest.raises(grpc.RpcError) as err:
        list(client.Generate(_request(max_new_tokens=2), timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
    # marked as a routine refusal, which the gateway does not count as a failure (shared.rpc.refusal)
    assert (REFUSAL_KEY, DRAINING) in tuple(err.value.trailing_metadata())
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    last = list(stream)[-1]
    assert last.finish.reason == common_pb2.FINISH_REASON_LENGTH and last.finish.generated_tokens == 6
    drained.join(30)
    assert not drained.is_alive()
    channel.close()


def test_drain_aborts_what_outlives_the_grace(start_worker):
    w = start_worker("fp16")
    channel, client = stub(w)
    stream = iter(client.Generate(_request(ignore_eos=True), timeout=60))
    next(stream)
    started = time.monotonic()
    w.stop(grace_s=0.3)
    assert time.monotonic() - started < 10
    assert list(stream)[-1].finish.reason == common_pb2.FINISH_REASON_ABORT
    channel.close()


def test_a_seed_reproduces_sampled_tokens(client):
    params = dict(temperature=0.8, top_k=40, top_p=0.9, max_new_tokens=8, ignore_eos=True)
    first = [t for m in generate(client, PROMPT, seed=7, **params) for t in m.token_ids]
    again = [t for m in generate(client, PROMPT, seed=7, **params) for t in m.token_ids]
    other = [t for m in generate(client, PROMPT, seed=8, **params) for t in m.token_ids]
    assert first == again and len(first) == 8
    assert other != first


def test_stop_string_across_tokens_and_stop_token_ids(client, worker):
    tokenizer = worker.server.served.tokenizer
    prompt = tokenizer.encode("import os\nimport sys\n\n\ndef main(")
    full = [t for m in generate(client, prompt, max_new_tokens=12, ignore_eos=True) for t in m.token_ids]
    ends = [len(tokenizer.decode(full[: i + 1])) for i in range(len(full))]  # text length after token i
    text = tokenizer.decode(full)
    # A stop string made of the last character of one token and the first of the next.
    i = next(i for i in range(1, len(full) - 1) if ends[i] - ends[i - 1] >= 1 and ends[i + 1] - ends[i] >= 1)
    stop = text[ends[i] - 1 : ends[i] + 1]
    at = text.find(stop)
    last_token = next(j for j in range(len(full)) if ends[j] >= at + len(stop))
    messages = generate(client, prompt, max_new_tokens=12, ignore_eos=True, stop=[stop])
    assert messages[-1].finish.reason == common_pb2.FINISH_REASON_STOP
    assert "".join(m.text for m in messages) == text[:at]
    assert [t for m in messages for t in m.token_ids] == full[: last_token + 1]
    # A stop token id: generation ends right after it, its id included.
    messages = generate(client, prompt, max_new_tokens=12, ignore_eos=True, stop_token_ids=[full[3]])
    got = [t for m in messages for t in m.token_ids]
    assert got == full[: full.index(full[3]) + 1]
    assert messages[-1].finish.reason == common_pb2.FINISH_REASON_STOP


def test_a_cancelled_stream_is_counted_in_the_metrics(client, worker):
    """The finish of a request whose caller cancelled never reaches the (closed) stream: it must
    still be counted (finished requests by reason abort, generated tokens), as an Abort rpc's is."""
    registry = worker.server._metrics.registry

    def aborted():
        return registry.get_sample_value("qserve_worker_requests_total", {"reason": "abort"}) or 0.0

    before = aborted()
    generated_before = registry.get_sample_value("qserve_worker_generated_tokens_total") or 0.0
    call = client.Generate(_request(ignore_eos=True), timeout=60)
    stream = iter(call)
    next(stream), next(stream)
    call.cancel()
    _wait_for(lambda: _idle(client), 5.0, "the cancelled request's blocks to be freed")
    _wait_for(lambda: aborted() == before + 1, 5.0, "the cancelled request to be counted")
    assert registry.get_sample_value("qserve_worker_generated_tokens_total") >= generated_before + 2


def test_a_request_ended_by_an_engine_error_is_counted_in_the_metrics(client, worker):
    """A step that raises ends its requests INTERNAL; they are counted as finished with reason error."""
    registry = worker.server._metrics.registry
    engine = worker.server.served.engine
    before = registry.get_sample_value("qserve_worker_requests_total", {"reason": "error"}) or 0.0
    step = engine.runner.step

    def failing_once(batch):
        engine.runner.step = step
        raise RuntimeError("device lost")

    engine.runner.step = failing_once
    try:
        with pytest.raises(grpc.RpcError) as raised:
            list(client.Generate(_request(max_new_tokens=4), timeout=60))
    finally:
        engine.runner.step = step
    assert raised.value.code() == grpc.StatusCode.INTERNAL
    assert registry.get_sample_value("qserve_worker_requests_total", {"reason": "error"}) == before + 1
    _wait_for(lambda: _idle(client), 5.0, "the failed request's blocks to be freed")


@pytest.mark.parametrize("setting", ["port", "metrics_port"])
def test_a_port_in_use_is_a_config_error_naming_the_setting(artifacts, setting):
    from services.worker.config import ConfigError, WorkerConfig
    from services.worker.server import BackgroundWorker

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = {"port": 0, "metrics_port": 0, setting: port}
        config = WorkerConfig(artifact=str(artifacts["fp16"]), host="127.0.0.1", kv_blocks=16, block_size=4, **ports)
        with pytest.raises(ConfigError, match=f"{port}.*--{'metrics-port' if setting == 'metrics_port' else 'host / --port'}"):
            BackgroundWorker(config)



def test_a_worker_open_beyond_loopback_without_client_certificates_warns(start_worker, caplog):
    """Its port takes no token: a client reaching it skips the gateway's API keys and limits. Said at start-up
    (security audit), as the quantizer says it of a port open without tokens."""
    with caplog.at_level(logging.WARNING, logger="services.worker.server"):
        start_worker("fp16", host="0.0.0.0")
    assert any("without --tls-client-ca" in record.getMessage() for record in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="services.worker.server"):
        start_worker("fp16")  # loopback, the default
    assert not any("without --tls-client-ca" in record.getMessage() for record in caplog.records)
