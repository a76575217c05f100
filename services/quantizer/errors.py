"""Errors of the quantizer service. The servicer maps each to the gRPC status the proto promises."""


class QuantizerError(Exception):
    """Base class of the errors below."""


class InvalidRequest(QuantizerError, ValueError):
    """A request field is missing or malformed (INVALID_ARGUMENT); the message names it."""


class MissingInput(QuantizerError):
    """A named source checkpoint, calibration or eval file does not exist (NOT_FOUND)."""


class QueueFull(QuantizerError):
    """Every worker is busy and the queue is full (RESOURCE_EXHAUSTED)."""


class InputChanged(QuantizerError):
    """A calibration or eval file whose content is not the sha256 the request pinned: the job fails."""


class JobCancelled(QuantizerError):
    """The job must stop at this step: the quantizer is stopping (the job ends FAILED with this reason) or
    an operator cancelled it (CancelJob: it ends CANCELLED)."""


class JobEnded(QuantizerError):
    """CancelJob of a job that has already ended (FAILED_PRECONDITION); the message names its state."""


class AccuracyBudgetExceeded(QuantizerError):
    """The quantized perplexity is above what the accuracy budget allows."""


class BindingMismatch(QuantizerError):
    """The binding is already published by an artifact made with settings this request explicitly asks otherwise:
    a binding holds one artifact, so the job fails rather than hand back the other settings' artifact."""


class Unauthenticated(QuantizerError):
    """Tokens are configured and the call carries none, or one this quantizer does not know (UNAUTHENTICATED)."""


class Forbidden(QuantizerError):
    """The caller's token has a scope that does not allow this rpc (PERMISSION_DENIED)."""
