"""PublishSpec: a Publish request checked and with its defaults filled in (from_pb / to_pb)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.quantizer.config import QuantizerConfig
from services.quantizer.errors import InvalidRequest, MissingInput
from shared.formats.manifest import GPU_TARGETS
from shared.formats.spec import FORMATS, format_spec
from shared.model.config import CheckpointError, LlamaConfig
from shared.quant.calibration import DEFAULT_SAMPLES, DEFAULT_SEQ_LEN
from shared.quant.options import QoQOptions
from shared.quant.quantize_model import check_group_divisibility
from shared.rpc.qserve.v1 import quantizer_pb2
from shared.storage import InvalidConfig, StorageConfig

MODEL_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
VERSION_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
QOQ_STEPS = ("smooth_attention", "rotation", "smoothing", "reorder", "clipping", "gptq", "rotate_values",
             "kv_range_search", "compensate_inputs", "key_feedback")  # the proto's switches
DEFAULT_EVAL_SEQ_LEN = 512
MAX_SEQ_LEN = 32768
MAX_CALIB_SAMPLES = 4096
MAX_EVAL_NAME = 256  # the registry records the eval data name with the artifact (1 to 256 characters)


@dataclass(slots=True, frozen=True)
class PublishSpec:
    source: str  # local folder or s3://bucket/prefix
    model_name: str
    version_label: str  # '' = none given
    format: str
    gpu_target: str
    calib_data: str  # local path or s3:// URI; '' = the built-in calibration text
    calib_samples: int
    # None: not asked, and the model's context not known yet (an s3:// source): quantize_checkpoint applies
    # LlamaConfig.window's rule once the job has read config.json
    calib_seq_len: int | None
    qoq: dict[str, bool]  # the proto's switches as given (unset ones absent)
    budget: float  # largest accepted perplexity_quantized / perplexity_fp16 - 1
    eval_data: str  # local path or s3:// URI
    eval_name: str
    eval_seq_len: int | None  # None: as calib_seq_len (the pipeline applies the rule once config.json is read)
    eval_max_windows: int  # 0 = every window of the text
    calib_sha256: str = ""  # the content the request pinned (lowercase hex); '' = not pinned
    eval_sha256: str = ""

    @property
    def options(self) -> QoQOptions:
        """The QoQ recipe with the request's switches applied (unset = the recipe's default)."""
        return QoQOptions(**self.qoq)

    @classmethod
    def from_pb(cls, req: quantizer_pb2.PublishRequest, config: QuantizerConfig) -> PublishSpec:
        """Raises InvalidRequest (INVALID_ARGUMENT) or MissingInput (NOT_FOUND), naming the bad value."""
        if req.format not in FORMATS:
            raise InvalidRequest(f"format {req.format!r} is not supported; accepted: {', '.join(FORMATS)}")
        if req.gpu_target not in GPU_TARGETS:
            raise InvalidRequest(f"gpu_target {req.gpu_target!r} is not supported; accepted: {', '.join(GPU_TARGETS)}")
        if not MODEL_NAME.fullmatch(req.model_name):
            raise InvalidRequest(
                f"model_name {req.model_name!r} is not accepted: use 1-64 characters of [a-z0-9._-], "
                "starting with a letter or digit"
            )
        if req.version_label and not VERSION_LABEL.fullmatch(req.version_label):
            raise InvalidRequest(
                f"version_label {req.version_label!r} is not accepted: use 1-128 characters of letters, digits, "
                "'.', '_' and '-', starting with a letter or digit (or leave it empty)"
            )
        qoq = {step: getattr(req.qoq, step) for step in QOQ_STEPS if req.qoq.HasField(step)}
        if req.format == "fp16" and any(qoq.values()):
            on = ", ".join(step for step, value in qoq.items() if value)
            raise InvalidRequest(f"QoQ steps {on} were enabled for format 'fp16', which quantizes nothing; unset them")
        budget = config.default_budget
        if req.HasField("max_relative_perplexity_increase"):
            budget = req.max_relative_perplexity_increase
            if not math.isfinite(budget) or budget < 0:
                raise InvalidRequest(
                    f"max_relative_perplexity_increase {budget!r} is not accepted: use a finite number >= 0 "
                    "(0.05 = quantized perplexity at most 5% above fp16)"
                )
        source, model_config = _check_source(req.source, req.format, config)
        calib_data = req.calibration.data or config.default_calib_data or ""
        calib_sha256 = _pinned("calibration.sha256", req.calibration.sha256)
        if calib_sha256 and not calib_data:
            raise InvalidRequest("calibration.sha256 pins a file: give calibration.data too (the built-in "
                                 "calibration text is not pinned)")
        if calib_data:
            _check_text_file("calibration.data", calib_data, config)
        eval_data = req.eval.data or config.default_eval_data or ""
        if not eval_data:
            raise InvalidRequest(
                "eval.data is required: every artifact is evaluated (give a text file path or s3:// URI, "
                "or start the quantizer with --eval-data)"
            )
        eval_sha256 = _pinned("eval.sha256", req.eval.sha256)
        _check_text_file("eval.data", eval_data, config)
        eval_name = req.eval.name or _stem(eval_data)
        if not eval_name.strip() or len(eval_name) > MAX_EVAL_NAME or "\x00" in eval_name:
            raise InvalidRequest(
                f"eval.name {eval_name!r} is not accepted: use a non-blank name of at most {MAX_EVAL_NAME} "
                "characters, without NUL (or leave it empty for the eval file's name)"
            )
        return cls(
            source=source,
            model_name=req.model_name,
            version_label=req.version_label,
            format=req.format,
            gpu_target=req.gpu_target,
            calib_data=calib_data,
            calib_samples=_count("calibration.num_samples", req.calibration.num_samples, DEFAULT_SAMPLES,
                                 1, MAX_CALIB_SAMPLES),
            calib_seq_len=_window("calibration.seq_len", req.calibration.seq_len, DEFAULT_SEQ_LEN, "a calibration",
                                  model_config),
            qoq=qoq,
            budget=float(budget),
            eval_data=eval_data,
            eval_name=eval_name,
            eval_seq_len=_window("eval.seq_len", req.eval.seq_len, DEFAULT_EVAL_SEQ_LEN, "an eval", model_config),
            eval_max_windows=req.eval.max_windows,
            calib_sha256=calib_sha256,
            eval_sha256=eval_sha256,
        )

    def to_pb(self) -> quantizer_pb2.PublishRequest:
        return quantizer_pb2.PublishRequest(
            source=self.source,
            model_name=self.model_name,
            version_label=self.version_label,
            format=self.format,
            gpu_target=self.gpu_target,
            calibration=quantizer_pb2.Calibration(
                data=self.calib_data, num_samples=self.calib_samples, seq_len=self.calib_seq_len or 0,
                sha256=self.calib_sha256,
            ),
            qoq=quantizer_pb2.QoQOptions(**self.qoq),
            max_relative_perplexity_increase=self.budget,
            eval=quantizer_pb2.EvalData(
                data=self.eval_data, name=self.eval_name, seq_len=self.eval_seq_len or 0, max_windows=self.eval_max_windows,
                sha256=self.eval_sha256,
            ),
        )


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def _check_source(source: str, format: str, config: QuantizerConfig) -> tuple[str, LlamaConfig | None]:
    """The source, and its model configuration when it is a local folder (None for s3://: read by the job)."""
    if not source:
        raise InvalidRequest("source is required: a checkpoint folder or an s3://bucket/prefix URI")
    if is_s3(source):
        _check_s3_uri("source", source, config)
        return source, None  # read when the job runs: its errors end the job FAILED
    folder = _local_path("source", source, config)
    if not _looked_up("source checkpoint folder", source, folder.is_dir):
        raise MissingInput(f"source checkpoint folder {source!r} does not exist (on the quantizer's host)")
    try:
        model_config = LlamaConfig.from_folder(folder)
        check_group_divisibility(model_config, format_spec(format))
    except CheckpointError as exc:
        raise InvalidRequest(f"source {source!r}: {exc}") from exc
    except (ValueError, TypeError, ArithmeticError, OSError) as exc:
        # LlamaConfig checks that the keys it needs are there, not their types or ranges: a value of the
        # wrong type (a string, a null) or a zero head count fails inside its arithmetic, and the client
        # would get UNKNOWN naming neither the source nor its config.json.
        raise InvalidRequest(
            f"source {source!r}: its config.json cannot be used as a Llama configuration "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    return str(folder.resolve()), model_config


def _check_text_file(what: str, uri: str, config: QuantizerConfig) -> None:
    if is_s3(uri):
        bucket_and_key = uri[len("s3://"):].split("?", 1)[0]
        if "/" not in bucket_and_key.strip("/") or bucket_and_key.endswith("/"):
            raise InvalidRequest(f"{what} {uri!r} names no object: use s3://bucket/path/file.txt")
        _check_s3_uri(what, uri, config)
    else:
        own = uri in (config.default_calib_data, config.default_eval_data)  # the operator's (--eval-data)
        path = Path(uri).expanduser() if own else _local_path(what, uri, config)
        if not _looked_up(f"{what} file", uri, path.is_file):
            raise MissingInput(f"{what} file {uri!r} does not exist (on the quantizer's host)")


# The kernel's pseudo-files: /proc/self/environ holds the quantizer's own secrets (its S3 keys, its tokens).
NEVER_READ = (Path("/proc"), Path("/sys"), Path("/dev"))


def _local_path(what: str, uri: str, config: QuantizerConfig) -> Path:
    """A request's local path, refused (before it is looked up: whether it exists is news too) where a publish
    must not read: the kernel's pseudo-files, and anything outside --local-root when that is set."""
    path = Path(uri).expanduser()
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError):  # a symlink loop, a name too long: _looked_up says why
        return path
    if any(resolved.is_relative_to(root) for root in NEVER_READ):
        raise InvalidRequest(f"{what} {uri!r} is a system file, not model data")
    if config.local_roots and not any(resolved.is_relative_to(root) for root in config.local_roots):
        raise InvalidRequest(f"{what} {uri!r} is outside the folders this quantizer reads requests' files from "
                             f"(--local-root: {', '.join(str(root) for root in config.local_roots)})")
    return path


def _looked_up(what: str, path: str, check: Callable[[], bool]) -> bool:
    """check() (Path.is_dir, is_file), with the paths it cannot look up (a name too long, a folder it may not
    enter) refused naming why: pathlib raises OSError for those, and the client got UNKNOWN."""
    try:
        return check()
    except OSError as exc:
        shown = repr(path[:200]) + ("..." if len(path) > 200 else "")
        raise InvalidRequest(f"{what} {shown} cannot be looked up on the quantizer's host: "
                             f"{exc.strerror or exc}") from None


def _check_s3_uri(what: str, uri: str, config: QuantizerConfig) -> None:
    try:
        StorageConfig.from_url(uri, base=config.store if config.store.kind == "s3" else None)
    except InvalidConfig as exc:
        raise InvalidRequest(f"{what} {uri!r} is not a usable S3 URI: {exc}") from exc


def _window(what: str, asked: int, default: int, what_for: str, model: LlamaConfig | None) -> int | None:
    """A window of tokens (0 = not asked), by LlamaConfig.window's rule as `qctl quantize` and `qctl eval` apply
    it: not asked, the default or the model's context if that is shorter; asked past the context, refused (no
    trained or served positions there). Filling in the default before the context is known (512 for a model of
    256 positions) refused it as if the caller had asked for it. None: not asked, and no context known yet."""
    asked = _count(what, asked, 0, 2, MAX_SEQ_LEN, f"{default}, or the model's context if shorter")
    if model is None:
        return asked or None
    try:
        return model.window(asked or None, default, what, what_for)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def _count(what: str, value: int, default: int, low: int, high: int, default_text: str | None = None) -> int:
    if value == 0:
        return default
    if not low <= value <= high:
        raise InvalidRequest(f"{what}={value} is out of range: use {low} to {high}, or 0 for the default "
                             f"({default_text or default})")
    return value


def _pinned(what: str, digest: str) -> str:
    """A pinned sha256, lowercased ('' = not pinned); INVALID_ARGUMENT for anything but 64 hex digits."""
    digest = digest.strip().lower()
    if digest and not SHA256_HEX.fullmatch(digest):
        raise InvalidRequest(f"{what} {digest[:80]!r} is not a sha256: give 64 hex digits (`sha256sum FILE`), or "
                             f"leave it empty")
    return digest


def _stem(uri: str) -> str:
    name = uri.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
    return name.rsplit(".", 1)[0] if "." in name else name
