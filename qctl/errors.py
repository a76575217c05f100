"""Turns the errors a user can cause into one clear line and exit code 2, never a traceback."""

from __future__ import annotations

import functools
import sys

import typer

from shared.formats.artifact import ArtifactError
from shared.formats.manifest import ManifestError
from shared.formats.weights import FormatError
from shared.model.config import CheckpointError
from shared.quant.calibration import CalibrationError

USER_ERRORS = (CheckpointError, CalibrationError, ArtifactError, ManifestError, FormatError, FileNotFoundError, ValueError)


def user_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as e:
            print(f"error: {e}", file=sys.stderr)
            raise typer.Exit(code=2) from None

    return wrapper
