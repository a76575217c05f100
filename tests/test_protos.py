"""The qserve.v1 gRPC API as its users see it: the services and rpcs exist with the right shapes,
messages round-trip, oneofs and optional fields behave, and the generated stubs stream over a real
loopback channel."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from shared.rpc.qserve.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    quantizer_pb2,
    quantizer_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

# service -> {rpc: (request type, response type, server streaming)}
API = {
    (quantizer_pb2, "Quantizer"): {
        "Publish": ("PublishRequest", "Job", False),
        "WatchJob": ("WatchJobRequest", "JobProgress", True),
        "GetJob": ("GetJobRequest", "Job", False),
        "GetArtifact": ("GetArtifactRequest", "ArtifactInfo", False),
        "ListArtifacts": ("ListArtifactsRequest", "ListArtifactsResponse", False),
        "ListModels": ("ListModelsRequest", "ListModelsResponse", False),
        "ListJobs": ("ListJobsRequest", "ListJobsResponse", False),
        "CancelJob": ("CancelJobRequest", "Job", False),
    },
    (worker_pb2, "Worker"): {
        "Generate": ("GenerateRequest", "GenerateResponse", True),
        "Abort": ("AbortRequest", "AbortResponse", False),
        "Info": ("InfoRequest", "WorkerInfo", False),
    },
    (gateway_pb2, "Gateway"): {
        "Generate": ("GatewayGenerateRequest", "GatewayGenerateResponse", True),
    },
    (gateway_pb2, "Admin"): {
        "RegisterWorker": ("RegisterWorkerRequest", "RegisterWorkerResponse", False),
        "Heartbeat": ("HeartbeatRequest", "HeartbeatResponse", False),
        "DeregisterWorker": ("DeregisterWorkerRequest", "DeregisterWorkerResponse", False),
        "CreateDeployment": ("CreateDeploymentRequest", "Deployment", False),
        "GetDeployment": ("GetDeploymentRequest", "Deployment", False),
        "ListDeployments": ("ListDeploymentsRequest", "ListDeploymentsResponse", False),
        "StartRollout": ("StartRolloutRequest", "Deployment", False),
        "PromoteRollout": ("PromoteRolloutRequest", "Deployment", False),
        "AbortRollout": ("AbortRolloutRequest", "Deployment", False),
        "RolloutStatus": ("RolloutStatusRequest", "RolloutStatusResponse", False),
        "SetFallback": ("SetFallbackRequest", "Deployment", False),
        "ListWorkers": ("ListWorkersRequest", "ListWorkersResponse", False),
        "ListEvents": ("ListEventsRequest", "ListEventsResponse", False),
    },
}


@pytest.mark.parametrize("module, service", list(API), ids=[s for _, s in API])
def test_service_has_exactly_the_documented_rpcs(module, service):
    desc = module.DESCRIPTOR.services_by_name[service]
    assert desc.full_name == f"qserve.v1.{service}"
    expected = API[(module, service)]
    assert set(desc.methods_by_name) == set(expected)
    for name, (request, response, server_streaming) in expected.items():
        method = desc.methods_by_name[name]
        assert method.input_type.full_name == f"qserve.v1.{request}", name
        assert method.output_type.full_name == f"qserve.v1.{response}", name
        assert method.server_streaming is server_streaming, name
        assert method.client_streaming is False, name


def test_every_file_is_in_the_versioned_package():
    for module in (common_pb2, quantizer_pb2, worker_pb2, gateway_pb2):
        assert module.DESCRIPTOR.package == "qserve.v1"


def test_text_generate_request_round_trips():
    req = worker_pb2.GenerateRequest(
        request_id="r-1",
        text="def main():",
        sampling=common_pb2.SamplingParams(
            temperature=0.7, top_k=40, top_p=0.9, seed=1234, max_new_tokens=64,
            stop_token_ids=[2], stop=["\n\n"],
        ),
    )
    back = worker_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert back == req
    assert back.WhichOneof("prompt") == "text"
    assert back.text == "def main():"
    assert back.sampling.seed == 1234
    assert list(back.sampling.stop) == ["\n\n"]


@pytest.mark.parametrize("message", [worker_pb2.GenerateRequest, gateway_pb2.GatewayGenerateRequest])
def test_prompt_is_text_or_token_ids_never_both(message):
    req = message()
    assert req.WhichOneof("prompt") is None
    req.text = "hello"
    assert req.WhichOneof("prompt") == "text"
    req.token_ids.ids.extend([1, 15043, 29871])
    assert req.WhichOneof("prompt") == "token_ids"
    assert req.text == ""  # setting token_ids cleared the text
    back = message.FromString(req.SerializeToString())
    assert back.WhichOneof("prompt") == "token_ids"
    assert list(back.token_ids.ids) == [1, 15043, 29871]


def test_unset_sampling_means_greedy_and_seed_presence_is_kept():
    sampling = common_pb2.SamplingParams()
    assert sampling.temperature == 0.0  # greedy
    assert not sampling.HasField("seed")
    sampling.seed = 0  # seed 0 is a real seed, distinct from "no seed"
    back = common_pb2.SamplingParams.FromString(sampling.SerializeToString())
    assert back.HasField("seed") and back.seed == 0


def test_accuracy_budget_and_qoq_steps_distinguish_unset_from_false_or_zero():
    req = quantizer_pb2.PublishRequest(source="/ckpt", model_name="tiny", format="w4a8kv4-g128", gpu_target="cpu")
    assert not req.HasField("max_relative_perplexity_increase")  # the 5% default applies
    assert not req.qoq.HasField("rotation")  # unset = step on
    req.max_relative_perplexity_increase = 0.0
    req.qoq.rotation = False
    back = quantizer_pb2.PublishRequest.FromString(req.SerializeToString())
    assert back.HasField("max_relative_perplexity_increase")
    assert back.qoq.HasField("rotation") and back.qoq.rotation is False
    assert not back.qoq.HasField("clipping")


def test_enums_have_the_documented_values():
    assert {n for n in common_pb2.FinishReason.keys()} == {
        "FINISH_REASON_UNSPECIFIED", "FINISH_REASON_LENGTH", "FINISH_REASON_EOS",
        "FINISH_REASON_STOP", "FINISH_REASON_ABORT",
    }
    assert set(common_pb2.ArtifactState.keys()) == {
        "ARTIFACT_STATE_UNSPECIFIED", "ARTIFACT_STATE_PENDING", "ARTIFACT_STATE_READY", "ARTIFACT_STATE_FAILED",
    }
    assert set(quantizer_pb2.JobState.keys()) == {
        "JOB_STATE_UNSPECIFIED", "JOB_STATE_QUEUED", "JOB_STATE_RUNNING", "JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED",
        "JOB_STATE_CANCELLED",
    }
    # stages are numbered in pipeline order
    stages = [quantizer_pb2.JobStage.Value(f"JOB_STAGE_{s}") for s in
              ("LOAD", "CALIBRATE", "QUANTIZE", "PACK", "EVAL", "UPLOAD", "REGISTER")]
    assert stages == sorted(stages) and stages[0] == 1


def test_final_message_carries_finish_with_counts_and_timings():
    mid = worker_pb2.GenerateResponse(request_id="r", token_ids=[5, 6], text="ab")
    assert not mid.HasField("finish")
    final = worker_pb2.GenerateResponse(request_id="r")
    final.finish.reason = common_pb2.FINISH_REASON_EOS
    final.finish.prompt_tokens = 3
    final.finish.generated_tokens = 2
    final.finish.timings.time_to_first_token.FromMilliseconds(12)
    back = worker_pb2.GenerateResponse.FromString(final.SerializeToString())
    assert back.HasField("finish")
    assert back.finish.reason == common_pb2.FINISH_REASON_EOS
    assert back.finish.timings.time_to_first_token.ToMilliseconds() == 12


def test_artifact_info_and_job_carry_registry_fields():
    info = common_pb2.ArtifactInfo(
        artifact_id="a1", model_name="tiny", model_version="sha256:abc", version_label="rc1",
        format="w4a8kv4-g128", gpu_target="sm90", state=common_pb2.ARTIFACT_STATE_READY,
        object_key_prefix="tiny/sha256:abc/w4a8kv4-g128/sm90/a1/",
        evaluation=common_pb2.Evaluation(data_name="pystdlib-eval", perplexity_fp16=5.01, perplexity_quantized=5.12),
    )
    info.created_at.FromSeconds(1_700_000_000)
    job = quantizer_pb2.Job(job_id="j1", state=quantizer_pb2.JOB_STATE_SUCCEEDED,
                            stage=quantizer_pb2.JOB_STAGE_REGISTER, block_index=6, block_count=6, artifact=info)
    back = quantizer_pb2.Job.FromString(job.SerializeToString())
    assert back.artifact.evaluation.perplexity_quantized == pytest.approx(5.12)
    assert back.artifact.created_at.ToSeconds() == 1_700_000_000
    assert not back.HasField("estimated_remaining")  # unknown ETA is distinguishable from zero
    # the worker reports the same artifact record it loaded
    worker = worker_pb2.WorkerInfo(artifact=info, kv_blocks_total=10, kv_blocks_free=7, kv_blocks_used=3)
    assert worker_pb2.WorkerInfo.FromString(worker.SerializeToString()).artifact == info


class _EchoWorker(worker_pb2_grpc.WorkerServicer):
    """Streams the prompt's token ids back one by one, then a final message."""

    def Generate(self, request, context):
        for tok in request.token_ids.ids:
            yield worker_pb2.GenerateResponse(request_id=request.request_id, token_ids=[tok], text=f"<{tok}>")
        final = worker_pb2.GenerateResponse(request_id=request.request_id)
        final.finish.reason = common_pb2.FINISH_REASON_LENGTH
        final.finish.generated_tokens = len(request.token_ids.ids)
        yield final

    def Abort(self, request, context):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")


@pytest.fixture
def worker_channel():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    worker_pb2_grpc.add_WorkerServicer_to_server(_EchoWorker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel
    server.stop(grace=None)


def test_generated_stubs_stream_over_loopback(worker_channel):
    stub = worker_pb2_grpc.WorkerStub(worker_channel)
    req = worker_pb2.GenerateRequest(request_id="r-9", token_ids=common_pb2.TokenIds(ids=[7, 8, 9]))
    msgs = list(stub.Generate(req, timeout=10))
    assert "".join(m.text for m in msgs) == "<7><8><9>"
    assert [t for m in msgs for t in m.token_ids] == [7, 8, 9]
    assert [m.HasField("finish") for m in msgs] == [False, False, False, True]
    assert msgs[-1].finish.generated_tokens == 3
    with pytest.raises(grpc.RpcError) as err:
        stub.Abort(worker_pb2.AbortRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_stub_classes_exist_for_every_service():
    for stub in (quantizer_pb2_grpc.QuantizerStub, worker_pb2_grpc.WorkerStub,
                 gateway_pb2_grpc.GatewayStub, gateway_pb2_grpc.AdminStub):
        assert callable(stub)
    for add in (quantizer_pb2_grpc.add_QuantizerServicer_to_server, worker_pb2_grpc.add_WorkerServicer_to_server,
                gateway_pb2_grpc.add_GatewayServicer_to_server, gateway_pb2_grpc.add_AdminServicer_to_server):
        assert callable(add)
