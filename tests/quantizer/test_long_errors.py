"""A job whose error is longer than the registry records (10,000 characters) must still end FAILED:
were its failure refused, the job would stay RUNNING, heartbeating, holding its binding for ever."""

from __future__ import annotations

from services.quantizer.pipeline import Pipeline
from shared.rpc.qserve.v1 import quantizer_pb2

Q = quantizer_pb2


def test_a_job_failing_with_a_very_long_error_ends_failed(bucket_store, start_quantizer, registry_url, small_model,
                                                          request_for, monkeypatch):
    def torch_lists_every_mismatch(self):  # e.g. load_state_dict's "Error(s) in loading state_dict"
        raise RuntimeError("size mismatch for model.layers.0.mlp.up_proj.weight: [1024, 256] vs [256, 1024]\n" * 400)

    monkeypatch.setattr(Pipeline, "_load", torch_lists_every_mismatch)
    quantizer = start_quantizer(bucket_store, registry_url, heartbeat_s=0.2)
    job = quantizer.stub.Publish(request_for(small_model))
    updates = list(quantizer.stub.WatchJob(Q.WatchJobRequest(job_id=job.job_id), timeout=8))

    final = updates[-1].job
    assert final.state == Q.JOB_STATE_FAILED
    assert final.error.startswith("start failed: RuntimeError: size mismatch for model.layers.0.")  # before any stage
    assert len(final.error) <= 10_000 and final.error.endswith("(error shortened)")


def test_an_error_quoting_a_nul_character_can_be_recorded():
    """PostgreSQL refuses text holding NUL: a job whose error quoted one from its request could never be
    recorded as failed (it stayed RUNNING, retried on every heartbeat). The character is written escaped."""
    from services.quantizer.jobs import _shorten

    assert _shorten("bad name 'a\x00b'") == "bad name 'a\\x00b'"
