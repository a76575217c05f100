"""What qctl's options accept, defined once: format names (the shared.formats registry's), and the ranges of
the protos' integer fields (a value past them would make protobuf raise while the request is built, a
traceback, instead of typer's one-line "not in the range" error), service addresses and bearer tokens."""

from enum import Enum

import typer

from shared.formats.spec import FORMATS
from shared.rpc.address import is_host_port

FormatName = Enum("FormatName", {name: name for name in FORMATS}, type=str)
# What `qctl up` rolls out over the fp16 baseline it publishes anyway (fp16 would be a rollout onto itself).
QuantizedFormatName = Enum("QuantizedFormatName", {name: name for name in FORMATS if name != "fp16"}, type=str)

UINT32_MAX = 2**32 - 1  # counts, token ids, top_k, max_new_tokens
UINT64_MAX = 2**64 - 1  # the sampling seed

def service_address(value: str) -> str:
    """--gateway / --quantizer: refused unless host:port with a port of 1-65535. gRPC took port 100995 modulo
    65536 (35459) and sent the admin token to whatever listened there."""
    if value is not None and not is_host_port(value):
        raise typer.BadParameter(f"{value!r} is not host:port with a port from 1 to 65535")
    return value


def bearer_token(value: str | None) -> str | None:
    """A token as given less surrounding whitespace (QCTL_TOKEN="$(cat token.txt)" keeps a file's '\\r'); one with
    other control characters is refused here, naming the option: gRPC refused it as "Invalid metadata",
    reported as the gateway's error."""
    if value is None:
        return None
    value = value.strip()
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value) or not value.isascii():
        raise typer.BadParameter("the token holds control or non-ASCII characters (check the file or variable it came from)")
    return value
