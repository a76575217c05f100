"""A health probe for containers and scripts: `python -m shared.rpc.probe HOST:PORT [SERVICE]`.

Asks the standard gRPC health service of one of our servers and exits 0 when it answers SERVING,
1 otherwise (printing why), so docker-compose health checks need no extra binary in the image.
A server that serves TLS is asked over TLS: `--tls-ca FILE` (with `--tls-client-cert FILE
--tls-client-key FILE` where it requires a client certificate, `--tls-server-name NAME` where the
certificate does not name the address dialled).
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.config import ServiceArgumentParser, add_tls_client_arguments
from shared.rpc.tls import ClientTls, TlsError, channel, load_client_tls, mismatch_hint


def check(address: str, service: str = "", timeout_s: float = 3.0, tls: ClientTls | None = None) -> tuple[bool, str]:
    with channel(address, tls) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            hint = mismatch_hint(exc.details() or "", tls is not None)
            return False, f"{address}: {exc.code().name}: {exc.details()}{hint}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address} {service or '(server)'}: {status}"


def _parser() -> argparse.ArgumentParser:
    p = ServiceArgumentParser(prog="python -m shared.rpc.probe",
                              description="Exit 0 when the server's health service answers SERVING, 1 otherwise.")
    p.add_argument("address", metavar="HOST:PORT")
    p.add_argument("service", nargs="?", default="", help="a service name [default: the server as a whole]")
    add_tls_client_arguments(p, "servers")
    # A container's health check dials 127.0.0.1, while the service's certificate names the host that
    # other containers reach it by.
    p.add_argument("--tls-server-name", default=None, metavar="NAME",
                   help="the name to check the server's certificate against [default: the host of HOST:PORT]")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        tls = load_client_tls(args.tls_ca, args.tls_client_cert, args.tls_client_key,
                              server_name=args.tls_server_name)
    except TlsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.tls_server_name and tls is None:
        print("error: --tls-server-name needs --tls-ca: a name is checked only over TLS", file=sys.stderr)
        return 2
    ok, message = check(args.address, args.service, tls=tls)
    print(message, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
