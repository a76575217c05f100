"""Registry errors. Each message names the bad value and what would be accepted."""


class RegistryError(Exception):
    """Base class for every error the registry raises on purpose."""


class NotFound(RegistryError):
    """A row that the caller named does not exist (maps to gRPC NOT_FOUND)."""


class Conflict(RegistryError):
    """The request clashes with a row that already exists (maps to gRPC ALREADY_EXISTS)."""


class InvalidState(RegistryError):
    """The row exists but is in a state that does not allow the change (gRPC FAILED_PRECONDITION)."""


class InvalidValue(RegistryError, ValueError):
    """An argument is malformed or out of range (maps to gRPC INVALID_ARGUMENT)."""
