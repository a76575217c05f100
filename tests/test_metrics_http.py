"""The Prometheus /metrics HTTP server of every service (shared/rpc/serving.serve_metrics)."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from shared.rpc.serving import serve_metrics


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 on this host")
def test_a_bracketed_ipv6_host_as_grpc_takes_it_serves_metrics():
    """--listen [::]:PORT (the gateway) and --host [::] (the worker) are gRPC's form; the HTTP server could not
    resolve "[::]", and the service refused to start ("Name or service not known")."""
    registry = CollectorRegistry()
    Counter("qserve_test_events", "events", registry=registry).inc()
    server = serve_metrics(registry, "[::]", 0, "--metrics-port", RuntimeError)
    try:
        port = server.server_address[1]
        body = urllib.request.urlopen(f"http://[::1]:{port}/metrics", timeout=5).read().decode()
        assert "qserve_test_events_total 1.0" in body
    finally:
        server.shutdown()
        server.server_close()
