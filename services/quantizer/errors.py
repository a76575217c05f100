"""Errors of the quantizer service. The servicer maps each to the gRPC status the proto promises."""


class QuantizerError(Exception):
    """Base class of the errors below."""


class InvalidRequest(QuantizerError, ValueError):
    """A request field is missing or malformed (INVALID_ARGUMENT); the message names it."""


class MissingInput(QuantizerError):
    """A named source checkpoint, calibration or eval file does not exist (NOT_FOUND)."""


class QueueFull(QuantizerError):
    """Every worker is busy and the queue is full (RESOURCE_EXHAUSTED)."""


class JobCancelled(QuantizerError):
    """The quantizer is stopping; the job ends FAILED with this reason."""


class AccuracyBudgetExceeded(QuantizerError):
    """The quantized perplexity is above what the accuracy budget allows."""
