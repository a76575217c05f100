"""The quantizer's log lines: one line per event, whatever a Publish request carried."""

from __future__ import annotations

import logging

from shared.rpc.qserve.v1 import quantizer_pb2


def test_a_publish_is_one_log_line_whatever_its_source_uri_holds(bucket_store, start_quantizer, registry_url,
                                                                 request_for, caplog):
    """urlsplit drops newlines, so an s3:// source with one passes validation: written raw, it would
    split the job's log line in two, the second one forged by the caller."""
    quantizer = start_quantizer(bucket_store, registry_url)
    source = f"s3://{bucket_store.bucket}/ckpt\n2030-01-01 00:00:00 INFO services.quantizer: job x succeeded"
    with caplog.at_level(logging.INFO, logger="services.quantizer"):
        job = quantizer.stub.Publish(request_for(source))
        quantizer.follow(job.job_id, timeout_s=60)  # fails (nothing there); its lines are logged by then
    publish = [r.getMessage() for r in caplog.records if "publish" in r.getMessage()]
    assert publish, [r.getMessage() for r in caplog.records]
    for record in caplog.records:
        assert "\n" not in record.getMessage(), record.getMessage()
    assert quantizer_pb2.JOB_STATE_FAILED == quantizer.stub.GetJob(quantizer_pb2.GetJobRequest(job_id=job.job_id)).state
