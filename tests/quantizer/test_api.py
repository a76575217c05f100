"""The rpc contract: status codes that say what to do, health, reflection, the queue limit."""

from __future__ import annotations

import contextlib
import hashlib
import json
import signal
import socket
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from shared.rpc import probe
from shared.rpc.qserve.v1 import common_pb2, quantizer_pb2
from tests.quantizer.conftest import free_port, quantizer_process

Q = quantizer_pb2
INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND


@pytest.fixture
def quantizer(bucket_store, start_quantizer, registry_url):
    return start_quantizer(bucket_store, registry_url)


def _error(call, *args) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        call(*args)
    return raised.value


def _gpt2(folder):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    return folder


@pytest.mark.parametrize(
    ("fields", "code", "says"),
    [
        ({"format": "w3a8"}, INVALID, "format 'w3a8' is not supported; accepted: w4a8kv4-g128, w4a8kv4-chn, w8a8, "
                                      "w4a16-g128, fp16"),
        ({"gpu_target": "sm100"}, INVALID, "gpu_target 'sm100' is not supported; accepted: cpu, sm80, sm89, sm90"),
        ({"model_name": "Llama 2"}, INVALID, "model_name 'Llama 2' is not accepted: use 1-64 characters of [a-z0-9._-]"),
        ({"model_name": ""}, INVALID, "model_name '' is not accepted"),
        ({"source": ""}, INVALID, "source is required"),
        ({"source": "/no/such/checkpoint"}, NOT_FOUND, "source checkpoint folder '/no/such/checkpoint' does not exist"),
        ({"source": "s3://Bad_Bucket/x"}, INVALID, "S3 bucket name 'Bad_Bucket' is not valid"),
        ({"version_label": "v 1"}, INVALID, "version_label 'v 1' is not accepted"),
        ({"max_relative_perplexity_increase": -0.01}, INVALID, "max_relative_perplexity_increase -0.01 is not accepted"),
        ({"eval": Q.EvalData(data="/no/eval.txt")}, NOT_FOUND, "eval.data file '/no/eval.txt' does not exist"),
        ({"eval": Q.EvalData()}, INVALID, "eval.data is required"),
        # pathlib raises for a name too long to look up (the client got UNKNOWN)
        ({"source": "/" + "d" * 300}, INVALID, "cannot be looked up on the quantizer's host: File name too long"),
        ({"eval": Q.EvalData(data="/" + "e" * 300)}, INVALID, "eval.data file '/eeee"),
        ({"calibration": Q.Calibration(data="/" + "c" * 300)}, INVALID, "cannot be looked up"),
        ({"calibration": Q.Calibration(data="/no/calib.txt")}, NOT_FOUND, "calibration.data file '/no/calib.txt'"),
        ({"calibration": Q.Calibration(seq_len=1)}, INVALID, "calibration.seq_len=1 is out of range"),
        ({"eval": Q.EvalData(data="/no/eval.txt", sha256="abc")}, INVALID, "eval.sha256 'abc' is not a sha256"),
        ({"calibration": Q.Calibration(sha256="a" * 64)}, INVALID, "calibration.sha256 pins a file: give "
                                                                   "calibration.data too"),
        ({"format": "fp16", "qoq": Q.QoQOptions(rotation=True)}, INVALID,
         "QoQ steps rotation were enabled for format 'fp16'"),
    ],
)
def test_publish_refuses_bad_input_naming_it(quantizer, small_model, request_for, fields, code, says):
    request = request_for(small_model)
    for name, value in fields.items():
        if isinstance(value, (Q.EvalData, Q.Calibration, Q.QoQOptions)):
            getattr(request, name).CopyFrom(value)
        else:
            setattr(request, name, value)
    error = _error(quantizer.stub.Publish, request)
    assert error.code() == code
    assert says in error.details()


def test_a_non_llama_checkpoint_is_refused_at_publish(quantizer, request_for, tmp_path):
    error = _error(quantizer.stub.Publish, request_for(_gpt2(tmp_path / "gpt2")))
    assert error.code() == INVALID
    assert "model_type='gpt2'" in error.details() and "is not a Llama-family checkpoint" in error.details()


def test_a_group_format_refuses_sizes_it_cannot_group(quantizer, request_for, tmp_path):
    from tests.conftest import write_random_llama

    odd = write_random_llama(tmp_path / "odd", hidden=192, ffn=384, heads=3, kv_heads=1)
    error = _error(quantizer.stub.Publish, request_for(odd))
    assert error.code() == INVALID and "hidden_size=192 is not a multiple of the group size 128" in error.details()


def test_unknown_ids_are_not_found(quantizer):
    for call, request in (
        (quantizer.stub.GetJob, Q.GetJobRequest(job_id="nope")),
        (quantizer.stub.GetArtifact, Q.GetArtifactRequest(artifact_id="nope")),
        (lambda r: list(quantizer.stub.WatchJob(r)), Q.WatchJobRequest(job_id="nope")),
    ):
        error = _error(call, request)
        assert error.code() == NOT_FOUND and "'nope'" in error.details()


def test_watching_a_job_while_the_registry_is_down_is_unavailable(quantizer, monkeypatch):
    from sqlalchemy.exc import OperationalError

    def down(job_id):
        raise OperationalError("SELECT quant_jobs", {}, ConnectionRefusedError("registry down"))

    monkeypatch.setattr(quantizer.server.running.runner, "view", down)
    error = _error(lambda r: list(quantizer.stub.WatchJob(r)), Q.WatchJobRequest(job_id="a" * 32))
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error  # was UNKNOWN


def test_list_filters_check_their_values(quantizer):
    error = _error(quantizer.stub.ListArtifacts, Q.ListArtifactsRequest(format="int3"))
    assert error.code() == INVALID and "accepted: w4a8kv4-g128" in error.details()
    error = _error(quantizer.stub.ListArtifacts, Q.ListArtifactsRequest(gpu_target="tpu"))
    assert error.code() == INVALID and "accepted: cpu, sm80" in error.details()
    for call, request in ((quantizer.stub.ListArtifacts, Q.ListArtifactsRequest(model_name="m\x00")),
                          (quantizer.stub.ListArtifacts, Q.ListArtifactsRequest(model_version="a\x00")),
                          (quantizer.stub.ListModels, Q.ListModelsRequest(model_name="m\x00"))):
        error = _error(call, request)  # as on PostgreSQL, which cannot compare text holding NUL
        assert error.code() == INVALID and "holds a NUL character" in error.details()
    assert not quantizer.stub.ListModels(Q.ListModelsRequest(model_name="unknown")).models
    assert not quantizer.stub.ListArtifacts(Q.ListArtifactsRequest(state=common_pb2.ARTIFACT_STATE_READY)).artifacts
    error = _error(quantizer.stub.ListArtifacts, Q.ListArtifactsRequest(state=99))  # a newer client's state
    assert error.code() == INVALID and "state 99 is not an artifact state to filter by" in error.details()


def test_health_and_reflection(quantizer):
    health = health_pb2_grpc.HealthStub(quantizer.channel)
    for service in ("", "qserve.v1.Quantizer"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(quantizer.channel)
    answers = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for answer in answers for s in answer.list_services_response.service}
    assert {"qserve.v1.Quantizer", "grpc.health.v1.Health"} <= names


def test_the_container_health_probe_reads_the_health_service(quantizer, capsys):
    assert probe.main([quantizer.address]) == 0
    assert probe.main([quantizer.address, "qserve.v1.Quantizer"]) == 0
    assert probe.main([quantizer.address, "qserve.v1.NoSuchService"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_a_full_queue_is_resource_exhausted_and_the_jobs_run(bucket_store, start_quantizer, registry_url, small_model,
                                                             request_for):
    quantizer = start_quantizer(bucket_store, registry_url, workers=1, max_queued=1)
    accepted = [quantizer.stub.Publish(request_for(small_model)), quantizer.stub.Publish(request_for(small_model))]
    error = _error(quantizer.stub.Publish, request_for(small_model))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry later" in error.details()
    finals = [quantizer.follow(job.job_id)[-1].job for job in accepted]
    assert [job.state for job in finals] == [Q.JOB_STATE_SUCCEEDED] * 2
    assert finals[0].artifact.artifact_id == finals[1].artifact.artifact_id


def test_watching_a_finished_job_gives_its_final_snapshot(quantizer, small_model, request_for):
    job, _ = quantizer.publish(request_for(small_model))
    again = quantizer.follow(job.job_id)
    assert len(again) == 1 and again[0].job.state == Q.JOB_STATE_SUCCEEDED


def test_the_server_process_serves_health_and_stops_on_sigterm(tmp_path, registry_url):
    port = free_port()
    process = quantizer_process("--registry-url", registry_url, "--store", tmp_path / "objects", "--create-bucket",
                              "--work-dir", tmp_path / "work", "--listen", f"127.0.0.1:{port}")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="qserve.v1.Quantizer"))
            assert check.status == health_pb2.HealthCheckResponse.SERVING
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()
    assert "serving on port" in process.stdout.read()


def test_the_server_process_names_a_missing_bucket(moto, tmp_path, registry_url):
    process = quantizer_process("--registry-url", registry_url, "--store", "s3://no-such-bucket",
                              "--store-endpoint", moto.endpoint, "--work-dir", tmp_path / "work")
    assert process.wait(timeout=60) == 2
    assert "error: bucket 'no-such-bucket' does not exist at endpoint" in process.stdout.read()


@pytest.mark.parametrize("holder", ["socket", "grpc"])
def test_the_server_process_names_a_port_in_use(tmp_path, registry_url, holder):
    """Also when a gRPC server holds it (another instance of a service): gRPC's default SO_REUSEPORT let the second
    bind the port too, and the kernel split the connections between the two."""
    with contextlib.ExitStack() as held:
        if holder == "socket":
            taken = held.enter_context(socket.socket())
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
        else:
            other = grpc.server(futures.ThreadPoolExecutor(1))  # gRPC's defaults, as a service of an older build
            port = other.add_insecure_port("127.0.0.1:0")
            other.start()
            held.callback(other.stop, None)
        process = quantizer_process("--registry-url", registry_url, "--store", tmp_path / "objects", "--create-bucket",
                                    "--work-dir", tmp_path / "work", "--listen", f"127.0.0.1:{port}")
        assert process.wait(timeout=60) == 2
    output = process.stdout.read()
    assert "Traceback" not in output and f"error: cannot listen on 127.0.0.1:{port} (--listen)" in output, output


@pytest.mark.parametrize("name", ["x" * 257, "   ", "eval\x00small"])  # NUL: PostgreSQL cannot store it
def test_an_eval_name_the_registry_cannot_record_is_refused_at_publish(quantizer, small_model, request_for, name):
    # The registry records the eval data name (1 to 256 characters, not blank) when the artifact turns READY:
    # a name it refuses must fail Publish at once, not the job after quantizing, evaluating and uploading.
    request = request_for(small_model)
    request.eval.name = name
    error = _error(quantizer.stub.Publish, request)
    assert error.code() == INVALID
    assert "eval.name" in error.details()


def test_a_calibration_or_eval_file_that_changed_since_it_was_pinned_fails_the_job(quantizer, small_model,
                                                                                   request_for, small_texts):
    """A replaced S3 object (here a local file) was used as read: an artifact calibrated or evaluated on text
    other than the caller reviewed. The pinned digests that match publish as before."""
    calib, evaluation = small_texts
    calib_sha, eval_sha = (hashlib.sha256(path.read_bytes()).hexdigest() for path in (calib, evaluation))
    stale = "0" * 64
    for pins, what in (((calib_sha, stale), "eval.data"), ((stale, eval_sha), "calibration.data")):
        request = request_for(small_model)
        request.calibration.sha256, request.eval.sha256 = pins
        job, _ = quantizer.publish(request)
        assert job.state == Q.JOB_STATE_FAILED, job
        assert f"{what} " in job.error and f"not the {stale} the request pinned" in job.error, job.error
        assert job.artifact.state != common_pb2.ARTIFACT_STATE_READY
    request = request_for(small_model)
    request.calibration.sha256, request.eval.sha256 = calib_sha.upper(), eval_sha  # hex in either case
    job, _ = quantizer.publish(request)
    assert job.state == Q.JOB_STATE_SUCCEEDED, job.error
    assert job.request.calibration.sha256 == calib_sha and job.request.eval.sha256 == eval_sha
