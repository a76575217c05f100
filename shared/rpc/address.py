"""host:port, one rule for every setting and request that names a gRPC address: a host name or IPv4 address
(no whitespace, ':', '/' or brackets), or an IPv6 address in brackets, then a port of 1-65535 (0 too where a
listen address lets the system pick one). gRPC takes more (dns:///..., unix:, unbracketed IPv6), and reads
some of it otherwise than meant: a port past 65535 is taken modulo 65536."""

from __future__ import annotations

import ipaddress
import re

_HOST_PORT = re.compile(r"(?P<host>[^\s:/\[\]]+|\[[0-9A-Fa-f:.]+\]):(?P<port>\d{1,5})")


def split_host_port(text: str, *, port_zero: bool = False) -> tuple[str, int] | None:
    """(host, port) of `text`; None unless it is host:port by the rule above (port 0 only with port_zero)."""
    match = _HOST_PORT.fullmatch(text)
    if match is None:
        return None
    port = int(match["port"])
    if not (0 if port_zero else 1) <= port <= 65535:
        return None
    return match["host"], port


def is_host_port(text: str, *, port_zero: bool = False) -> bool:
    return split_host_port(text, port_zero=port_zero) is not None


def is_loopback(listen: str) -> bool:
    """Whether host:port names a loopback host (127.0.0.0/8, ::1, localhost): only this machine can call it."""
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name, or 0.0.0.0-style wildcards are addresses: not loopback
        return False

