"""A health probe for containers and scripts: `python -m shared.rpc.probe HOST:PORT [SERVICE]`.

Asks the standard gRPC health service of one of our servers and exits 0 when it answers SERVING,
1 otherwise (printing why), so docker-compose health checks need no extra binary in the image.
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout_s: float = 3.0) -> tuple[bool, str]:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            return False, f"{address}: {exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address} {service or '(server)'}: {status}"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2:
        print("usage: python -m shared.rpc.probe HOST:PORT [SERVICE]", file=sys.stderr)
        return 2
    ok, message = check(*args)
    print(message, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
