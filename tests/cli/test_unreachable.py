"""qctl tells "cannot reach the gateway" (nothing there, a name that does not resolve) from the gateway's own
UNAVAILABLE answer (e.g. no healthy worker)."""

from __future__ import annotations

import grpc
import pytest

from qctl.errors import _unreachable


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize("details", [
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Failed to connect to remote host",
    "DNS resolution failed for nonsense:50051: C-ares status is not ARES_SUCCESS",
    "errors resolving nonsense.invalid:50051: [UNAVAILABLE: ...]",  # was taken for the gateway's own answer
])
def test_a_transport_failure_is_unreachable(details):
    assert _unreachable(_Failed(grpc.StatusCode.UNAVAILABLE, details))


def test_the_gateways_own_unavailable_answer_is_not():
    assert not _unreachable(_Failed(grpc.StatusCode.UNAVAILABLE, "no healthy worker serves deployment 'chat'"))


def test_a_services_own_unavailable_that_mentions_a_connection_is_not():
    # A gateway whose registry database is down passes psycopg's text on: the gateway answered.
    assert not _unreachable(_Failed(grpc.StatusCode.UNAVAILABLE, 'connection failed: connection to server at '
                                    '"127.0.0.1", port 5432 failed: Connection refused\n\tIs the server running'))
    # A deadline is not "unreachable" either: the call may have reached the service (qctl.errors says so).
    assert not _unreachable(_Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
