"""What qctl's options accept, defined once: format names (the shared.formats registry's), and the ranges of
the protos' integer fields (a value past them would make protobuf raise while the request is built, a
traceback, instead of typer's one-line "not in the range" error)."""

from enum import Enum

from shared.formats.spec import FORMATS

FormatName = Enum("FormatName", {name: name for name in FORMATS}, type=str)
# What `qctl up` rolls out over the fp16 baseline it publishes anyway (fp16 would be a rollout onto itself).
QuantizedFormatName = Enum("QuantizedFormatName", {name: name for name in FORMATS if name != "fp16"}, type=str)

UINT32_MAX = 2**32 - 1  # counts, token ids, top_k, max_new_tokens
UINT64_MAX = 2**64 - 1  # the sampling seed
