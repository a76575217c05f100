"""manifest.json: what an artifact is, what made it, how accurate it is, and its files' digests."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shared.formats.spec import FORMATS

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
GPU_TARGETS = ("cpu", "sm80", "sm89", "sm90")
ARTIFACT_ID_RE = re.compile(r"^[0-9a-f]{32}$")  # uuid4 hex, as the quantizer and the registry assign
# Strings a worker reports (Info, gateway registration) and builds object keys from: another JSON type there
# failed only once it was serving.
_IDENTITY_FIELDS = ("model_name", "model_version", "quantizer_version", "created_at")


class ManifestError(ValueError):
    """A manifest that is missing, malformed or of another schema version."""


@dataclass(slots=True, frozen=True)
class FileEntry:
    path: str  # relative to the artifact folder, '/'-separated
    sha256: str
    size: int


@dataclass(slots=True, frozen=True)
class Evaluation:
    data_name: str
    data_sha256: str
    seq_len: int
    windows: int
    ppl_fp16: float
    ppl_quantized: float

    @property
    def ratio(self) -> float:
        return self.ppl_quantized / self.ppl_fp16


@dataclass(slots=True)
class Manifest:
    artifact_id: str
    model_name: str
    model_version: str  # sha256 of the source checkpoint's config and weights
    format: str  # a key of shared.formats.spec.FORMATS
    gpu_target: str  # one of GPU_TARGETS
    quantizer_version: str
    model_config: dict  # shared.model.config.LlamaConfig.to_dict()
    options: dict  # shared.quant.options.QoQOptions.to_dict()
    calibration: dict | None  # shared.quant.calibration.CalibrationRecord.to_dict(); None for fp16
    created_at: str  # ISO 8601, UTC
    evaluation: Evaluation | None = None
    files: list[FileEntry] = field(default_factory=list)
    kernel_policy: dict | None = None  # per-GPU kernel choice table (bench/tune.py); None on cpu
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ManifestError(f"unknown format {self.format!r}; expected one of {', '.join(FORMATS)}")
        if self.gpu_target not in GPU_TARGETS:
            raise ManifestError(f"unknown GPU target {self.gpu_target!r}; expected one of {', '.join(GPU_TARGETS)}")

    def binding(self) -> tuple[str, str, str]:
        """What a worker checks: (model version, format, GPU target)."""
        return (self.model_version, self.format, self.gpu_target)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ManifestError(f"manifest is not valid JSON: {e}") from e
        if not isinstance(d, dict):
            raise ManifestError(f"manifest must be a JSON object, got {type(d).__name__}")
        version = d.get("schema_version")
        if type(version) is not int or version != SCHEMA_VERSION:  # not true, which equals 1
            raise ManifestError(f"manifest schema_version {version!r} is not supported (this build reads {SCHEMA_VERSION})")
        try:
            d["files"] = [FileEntry(**f) for f in d.get("files", [])]
            d["evaluation"] = Evaluation(**d["evaluation"]) if d.get("evaluation") else None
            manifest = cls(**d)
        except TypeError as e:
            raise ManifestError(f"manifest has missing or unknown fields: {e}") from e
        if not isinstance(manifest.model_config, dict):
            raise ManifestError(f"manifest model_config must be an object, got {type(manifest.model_config).__name__}")
        if not (isinstance(manifest.artifact_id, str) and ARTIFACT_ID_RE.fullmatch(manifest.artifact_id)):
            raise ManifestError(f"manifest artifact_id {manifest.artifact_id!r} is not an artifact id "
                                "(32 lowercase hex characters)")
        for name in _IDENTITY_FIELDS:
            if not isinstance(getattr(manifest, name), str):
                raise ManifestError(f"manifest {name} {getattr(manifest, name)!r} must be a string")
        for f in manifest.files:
            if not (isinstance(f.path, str) and isinstance(f.sha256, str) and type(f.size) is int and f.size >= 0):
                raise ManifestError(f"manifest file entry {f!r} needs a path, a sha256 string and a size in bytes")
        return manifest

    def write(self, folder: Path) -> Path:
        path = Path(folder) / MANIFEST_NAME
        path.write_text(self.to_json())
        return path

    @classmethod
    def read(cls, folder: Path) -> "Manifest":
        return cls.read_with_digest(folder)[0]

    @classmethod
    def read_with_digest(cls, folder: Path) -> tuple["Manifest", str]:
        """The manifest and the sha256 of its file's bytes, as read once (the registry records that digest)."""
        path = Path(folder) / MANIFEST_NAME
        if not path.is_file():
            raise ManifestError(f"{folder} has no {MANIFEST_NAME}: not an artifact folder")
        data = path.read_bytes()
        try:
            text = data.decode()
        except UnicodeDecodeError as exc:  # else the codec's words alone, naming no file
            raise ManifestError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}): not an artifact's "
                                f"manifest") from None
        return cls.from_json(text), hashlib.sha256(data).hexdigest()
