"""The artifact folder: file names, tensor names, an atomic writer and a verifying reader.

    manifest.json                      shared.formats.manifest.Manifest
    weights/embed.safetensors          embed (V, H) fp16
    weights/block_{i:03d}.safetensors  attn_norm, mlp_norm (H,) fp16; qkv.*, o.*, gate_up.*, down.*
                                       (one PackedWeight each, in the format's weight kind);
                                       KV4 formats: kv_range (2,) fp32, the K and V range ratios
                                       of shared.formats.kv4 (absent: 1, 1); key_feedback
                                       (kv_heads, D, D) fp32, the keys' error-feedback factor
                                       of shared.formats.kv4 (absent: keys rounded to nearest)
    weights/head.safetensors           final_norm (H,) fp16; lm_head.weight (V, H) fp16
    probe.safetensors                  token ids and their reference logits (shared.formats.probe)
    tokenizer/                         the source checkpoint's tokenizer files
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from shared.file_modes import FILE_MODE
from shared.formats.kv4 import FULL_KV_RANGE, check_key_feedback, range_margin
from shared.formats.manifest import MANIFEST_NAME, FileEntry, Manifest, ManifestError
from shared.formats.probe import PROBE_FILE, Probe, probe_bytes
from shared.formats.spec import FormatSpec, format_spec
from shared.formats.weights import WEIGHT_KINDS, FormatError, Fp16Weight, PackedWeight

EMBED_FILE = "weights/embed.safetensors"
HEAD_FILE = "weights/head.safetensors"
TOKENIZER_DIR = "tokenizer"
BLOCK_LINEARS = ("qkv", "o", "gate_up", "down")
KV_RANGE = "kv_range"
KEY_FEEDBACK = "key_feedback"


def block_file(i: int) -> str:
    return f"weights/block_{i:03d}.safetensors"


class ArtifactError(ValueError):
    """An artifact folder that is missing files, corrupt, or not the artifact that was expected."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()




class ArtifactWriter:
    """Writes into a hidden staging folder beside `out_dir`; `finish` moves it into place.

    A crash or error leaves `out_dir` as it was. `identity` (model version, format, GPU target,
    options, calibration) decides whether an existing artifact in `out_dir` may be replaced: the same
    artifact re-made is fine, a different one is refused, and so is one beside files of the user's.
    One writer at a time per `out_dir` (an flock on `.<name>.lock` beside it): holding it, the staging
    folders a killed run left beside `out_dir` (hidden, as large as the artifact) are removed.
    """

    def __init__(self, out_dir: str | Path, identity: dict):
        # Resolved: `.` (renamed by its path, '.' itself cannot be) and a symlink (the folder it names is replaced).
        self.out_dir = Path(out_dir).expanduser().resolve()
        self.identity = identity
        self._check_destination()
        self._lock = _lock_output(self.out_dir)
        try:
            _remove_leftovers(self.out_dir)
            self.staging = self.out_dir.parent / f".{self.out_dir.name}.partial-{uuid.uuid4().hex[:8]}"
            self.staging.mkdir(parents=True)
        except BaseException:
            self._lock.close()
            raise

    def _check_destination(self) -> None:
        if not self.out_dir.exists():
            return
        if not self.out_dir.is_dir():
            raise ArtifactError(f"output path {self.out_dir} exists and is not a folder")
        if os.path.ismount(self.out_dir):
            raise ArtifactError(
                f"output folder {self.out_dir} is a mount point: the artifact is written beside it and moved into "
                f"place, which a mount point cannot be; give a folder inside it (e.g. {self.out_dir / 'artifact'})"
            )
        if not any(self.out_dir.iterdir()):
            return
        try:
            existing = Manifest.read(self.out_dir)
        except ManifestError:
            raise ArtifactError(
                f"output folder {self.out_dir} is not empty and holds no artifact; choose an empty or new folder"
            ) from None
        theirs = {k: getattr(existing, k) for k in self.identity}
        if theirs != self.identity:
            diff = ", ".join(f"{k}={theirs[k]!r} (new: {self.identity[k]!r})" for k in self.identity if theirs[k] != self.identity[k])
            raise ArtifactError(f"output folder {self.out_dir} already holds a different artifact: {diff}")
        # The folder is replaced whole: files that are not the artifact's (notes, results) would go with it.
        listed = {f.path for f in existing.files} | {MANIFEST_NAME}
        others = sorted(rel for p in self.out_dir.rglob("*")
                        if not p.is_dir() and (rel := p.relative_to(self.out_dir).as_posix()) not in listed)
        if others:
            shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
            raise ArtifactError(f"output folder {self.out_dir} holds files that are not its artifact's ({shown}): "
                                f"re-making the artifact replaces the folder; move them or choose another folder")

    def write_tensors(self, relpath: str, tensors: dict[str, torch.Tensor]) -> None:
        """Refuses a floating tensor holding inf or NaN (ArtifactError): a bf16 checkpoint's value beyond fp16's
        range became inf in fp16, and the artifact, written without a word, answered NaN."""
        for name, tensor in tensors.items():
            if tensor.is_floating_point() and not (finite := torch.isfinite(tensor)).all():
                raise ArtifactError(
                    f"{relpath}: tensor {name!r} holds {int((~finite).sum())} value(s) that are inf or NaN: the "
                    f"checkpoint has a weight that is not finite, or beyond fp16's range (+-65504) after its "
                    f"quantization steps; the artifact would answer NaN")
        path = self.staging / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))
        except SafetensorError as exc:  # a full disk among others: not an OSError, it was a traceback
            raise OSError(f"cannot write {path}: {exc}") from None
        path.chmod(FILE_MODE)  # not safetensors' 0600: see shared/file_modes.py

    def copy_file(self, src: Path, relpath: str) -> None:
        dst = self.staging / relpath
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)

    def staged_reader(self, manifest: Manifest) -> "ArtifactReader":
        """A reader of what is written so far (not verified): for computing from the written weights (the probe)
        before finish. The manifest written here for it is replaced by finish's."""
        manifest.write(self.staging)
        return ArtifactReader(self.staging, verify=False)

    def finish(self, manifest: Manifest) -> Path:
        manifest.files = [
            FileEntry(p.relative_to(self.staging).as_posix(), sha256_file(p), p.stat().st_size)
            for p in sorted(self.staging.rglob("*"))
            if p.is_file() and p != self.staging / MANIFEST_NAME  # staged_reader's, replaced below
        ]
        manifest.write(self.staging)
        old = None
        if self.out_dir.exists():
            old = self.out_dir.parent / f".{self.out_dir.name}.old-{uuid.uuid4().hex[:8]}"
            self.out_dir.rename(old)
        self.staging.rename(self.out_dir)
        if old is not None:
            shutil.rmtree(old)
        return self.out_dir

    def abort(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)

    def __enter__(self) -> "ArtifactWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.staging.exists():
            self.abort()
        self._lock.close()


def _lock_output(out_dir: Path):
    """The open `.<name>.lock` beside out_dir, flocked (the kernel drops it however the process ends); an
    ArtifactError when another writer holds it."""
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a file where the folder goes: said as its deeper ancestors' case is
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(out_dir.parent)) from None
    lock = open(out_dir.parent / f".{out_dir.name}.lock", "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise ArtifactError(f"another run is writing an artifact to {out_dir}; wait for it or choose another "
                            f"folder") from None
    return lock


def _remove_leftovers(out_dir: Path) -> None:
    """The staging and replaced folders (.<name>.partial-*, .<name>.old-*) a run killed while writing out_dir
    left beside it: under the lock no other run is writing them."""
    for pattern in (f".{out_dir.name}.partial-*", f".{out_dir.name}.old-*"):
        for leftover in out_dir.parent.glob(pattern):
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)


class ArtifactReader:
    """Opens an artifact folder; with verify=True every file's size and sha256 must match the manifest."""

    def __init__(self, folder: str | Path, verify: bool = True):
        self.folder = Path(folder)
        try:
            # The digest of the bytes parsed: what a worker reports as loaded (WorkerInfo), beside the registry's.
            self.manifest, self.manifest_sha256 = Manifest.read_with_digest(self.folder)
        except ManifestError as e:
            raise ArtifactError(str(e)) from e
        self.spec: FormatSpec = format_spec(self.manifest.format)
        if verify:
            self.verify()

    def verify(self) -> None:
        self._check_file_list()
        for entry in self.manifest.files:
            path = self.folder / entry.path
            if not path.is_file():
                raise ArtifactError(f"artifact {self.folder} is incomplete: {entry.path} is missing")
            if path.stat().st_size != entry.size:
                raise ArtifactError(
                    f"artifact {self.folder} is corrupt: {entry.path} has {path.stat().st_size} bytes, manifest says {entry.size}"
                )
            if sha256_file(path) != entry.sha256:
                raise ArtifactError(f"artifact {self.folder} is corrupt: sha256 of {entry.path} does not match the manifest")

    def _check_file_list(self) -> None:
        """The manifest's file list must cover exactly the folder's files (every byte a worker reads
        has a sha256 to check), stay inside the folder, and name the weights of every layer of its
        model_config and no others."""
        listed: set[str] = set()
        for entry in self.manifest.files:
            path = entry.path
            parts = path.split("/") if isinstance(path, str) else [""]
            if (not isinstance(path, str) or path.startswith("/") or "\\" in path
                    or any(seg in ("", ".", "..") for seg in parts)):
                raise ArtifactError(f"artifact {self.folder}: manifest file path {path!r} is not a relative path inside the folder")
            if path == MANIFEST_NAME or path in listed:
                raise ArtifactError(f"artifact {self.folder}: manifest lists {path!r} twice or lists itself")
            listed.add(path)
        num_layers = self.manifest.model_config.get("num_layers")
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ArtifactError(f"artifact {self.folder}: model_config.num_layers {num_layers!r} is not a positive integer")
        # Each layer has a file of its own besides the embeddings' and the head's: a count past what is listed
        # cannot be right, and the set of names below would take memory in proportion to it (10**12: all the host's).
        if num_layers + 2 > len(listed):
            raise ArtifactError(
                f"artifact {self.folder} is corrupt: model_config.num_layers={num_layers}, but the manifest lists "
                f"only {len(listed)} files"
            )
        weights = {EMBED_FILE, HEAD_FILE} | {block_file(i) for i in range(num_layers)}
        missing = sorted(weights - listed)
        if missing:
            raise ArtifactError(
                f"artifact {self.folder} is corrupt: the manifest has no sha256 for {', '.join(missing)} "
                f"(model_config.num_layers={num_layers})"
            )
        extra = sorted(p for p in listed - weights if p.startswith("weights/"))
        if extra:
            raise ArtifactError(
                f"artifact {self.folder} is corrupt: {', '.join(extra)} do not belong to a model of "
                f"{num_layers} layers (model_config.num_layers)"
            )
        on_disk = {
            p.relative_to(self.folder).as_posix() for p in self.folder.rglob("*") if p.is_file() or p.is_symlink()
        } - {MANIFEST_NAME}
        unlisted = sorted(on_disk - listed)
        if unlisted:
            raise ArtifactError(
                f"artifact {self.folder} is corrupt: {', '.join(unlisted)} not in the manifest's file list "
                "(no sha256 to check it against)"
            )

    def probe(self) -> Probe | None:
        """The probe the quantizer wrote (shared.formats.probe); None for an artifact made before probes."""
        if not (self.folder / PROBE_FILE).is_file():
            return None
        try:
            return Probe.read(self.folder / PROBE_FILE)
        except ValueError as exc:
            raise ArtifactError(f"artifact {self.folder}: unreadable {PROBE_FILE}: {exc}") from exc

    def _load(self, relpath: str) -> dict[str, torch.Tensor]:
        path = self.folder / relpath
        if not path.is_file():
            raise ArtifactError(f"artifact {self.folder} lacks {relpath}")
        try:
            return load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise self._unreadable(relpath, e) from e

    def _unreadable(self, relpath: str, e: Exception) -> ArtifactError:
        # A file listed with its own sha256 can still be no safetensors file at all (truncated then re-signed, a
        # header claiming more bytes than the file has): the artifact's fault, refused as such.
        return ArtifactError(f"artifact {self.folder}: {relpath} is not a readable safetensors file: {e}")

    def _shape(self, relpath: str, name: str, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
        if tuple(got) != tuple(expected):
            raise ArtifactError(
                f"artifact {self.folder}: {relpath}: {name} is {tuple(got)}, but the manifest's model_config "
                f"needs {tuple(expected)}"
            )

    def _config(self, *names: str) -> tuple[int, ...]:
        config = self.manifest.model_config
        try:
            return tuple(int(config[n]) for n in names)
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactError(f"artifact {self.folder}: model_config lacks a usable {e}") from None

    def _tensor(self, relpath: str, t: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        """An fp tensor of the file (an embedding, a norm): one of integers was served, its values read as
        numbers, as long as the probe's error stayed under its limit."""
        try:
            tensor = t[name]
        except KeyError:
            raise ArtifactError(f"artifact {self.folder}: {relpath} lacks tensor {name!r}") from None
        if not tensor.is_floating_point():
            raise ArtifactError(f"artifact {self.folder}: {relpath}: {name} is {tensor.dtype}, not floating point")
        return tensor

    def embed(self) -> torch.Tensor:
        vocab, hidden = self._config("vocab_size", "hidden_size")
        embed = self._tensor(EMBED_FILE, self._load(EMBED_FILE), "embed")
        self._shape(EMBED_FILE, "embed", embed.shape, (vocab, hidden))
        return embed

    def head(self) -> tuple[torch.Tensor, Fp16Weight]:
        vocab, hidden = self._config("vocab_size", "hidden_size")
        t = self._load(HEAD_FILE)
        final_norm = self._tensor(HEAD_FILE, t, "final_norm")
        try:
            lm_head = Fp16Weight.from_tensors("lm_head", t)
        except FormatError as e:
            raise ArtifactError(f"artifact {self.folder}: {HEAD_FILE}: {e}") from None
        self._shape(HEAD_FILE, "final_norm", final_norm.shape, (hidden,))
        self._shape(HEAD_FILE, "lm_head.weight", lm_head.weight.shape, (vocab, hidden))
        return final_norm, lm_head

    def block(self, i: int) -> tuple[dict[str, torch.Tensor], dict[str, PackedWeight]]:
        """-> norms {attn_norm, mlp_norm}, linears {qkv, o, gate_up, down}, their shapes checked
        against the manifest's model_config."""
        hidden, inter, heads, kv_heads, head_dim, layers = self._config(
            "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "num_layers")
        relpath = block_file(i)
        if not 0 <= i < layers:
            raise ArtifactError(f"artifact {self.folder}: block {i} is outside the model's {layers} layers")
        t = self._load(relpath)
        kind = WEIGHT_KINDS[self.spec.weight_kind]
        norms = {name: self._tensor(relpath, t, name) for name in ("attn_norm", "mlp_norm")}
        try:
            linears = {name: kind.from_tensors(name, t) for name in BLOCK_LINEARS}
        except FormatError as e:
            raise ArtifactError(f"artifact {self.folder}: {relpath}: {e}") from None
        q, kv = heads * head_dim, kv_heads * head_dim
        expected = {"qkv": (q + 2 * kv, hidden), "o": (hidden, q), "gate_up": (2 * inter, hidden), "down": (hidden, inter)}
        for name, norm in norms.items():
            self._shape(relpath, name, norm.shape, (hidden,))
        for name, w in linears.items():
            self._shape(relpath, f"{name} (out, in features)", (w.out_features, w.in_features), expected[name])
        return norms, linears

    def _optional_block_tensor(self, i: int, name: str, check) -> torch.Tensor | None:
        """Block i's tensor `name` after check(tensor) (a ValueError becomes an ArtifactError), or
        None where the file lacks it (artifacts written before it existed, or without the option)."""
        path = self.folder / block_file(i)
        if not path.is_file():
            raise ArtifactError(f"artifact {self.folder} lacks {block_file(i)}")
        try:
            with safe_open(str(path), framework="pt") as f:
                if name not in f.keys():
                    return None
                t = f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise self._unreadable(block_file(i), e) from e
        try:
            check(t)
        except ValueError as e:
            raise ArtifactError(f"artifact {self.folder}: {block_file(i)}: {e}") from None
        return t

    def block_kv_range(self, i: int) -> tuple[float, float]:
        """Block i's KV4 range ratios (K, V); artifacts written before they existed read as (1, 1)."""
        def check(t):
            if t.shape != (2,):
                raise ValueError(f"{KV_RANGE} must hold the K and V ratios, got shape {tuple(t.shape)}")
            for ratio in t.tolist():
                range_margin(ratio)  # the format's own check of a ratio

        t = self._optional_block_tensor(i, KV_RANGE, check)
        return FULL_KV_RANGE if t is None else tuple(t.tolist())

    def block_key_feedback(self, i: int) -> torch.Tensor | None:
        """Block i's key error-feedback factor R (kv_heads, D, D) fp32, checked against the model's
        KV heads and head size, or None (keys rounded to nearest)."""
        config = self.manifest.model_config
        return self._optional_block_tensor(
            i, KEY_FEEDBACK, lambda t: check_key_feedback(t, config["num_kv_heads"], config["head_dim"]))

    @property
    def tokenizer_dir(self) -> Path:
        return self.folder / TOKENIZER_DIR


def block_tensors(
    norms: dict[str, torch.Tensor], linears: dict[str, PackedWeight], kv_range: tuple[float, float] = FULL_KV_RANGE,
    key_feedback: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    out = {k: v.to(torch.float16) for k, v in norms.items()}
    for name, packed in linears.items():
        out.update(packed.tensors(name))
    # Both kept out of files that do not need them: older readers load those as before.
    if kv_range != FULL_KV_RANGE:
        out[KV_RANGE] = torch.tensor(kv_range, dtype=torch.float32)
    if key_feedback is not None:
        out[KEY_FEEDBACK] = key_feedback.to(torch.float32).contiguous()
    return out


# A safetensors file's header (names, dtypes, shapes, offsets) and the manifest: generous, so that an artifact that
# fits is never refused on its estimate's account while one far too large still is.
_HEADER_BYTES = 1 << 20


def estimated_artifact_bytes(spec: FormatSpec, *, vocab_size: int, hidden_size: int, intermediate_size: int,
                             num_layers: int, q_size: int, kv_size: int, key_feedback_floats: int = 0,
                             other_files: int = 0) -> int:
    """The size of the artifact quantize_checkpoint writes for this shape and format (the fused linears of
    BLOCK_LINEARS in the format's weight kind, fp16 norms, embeddings and LM head, the probe), a little over: checked
    against the free disk space before any work. key_feedback_floats: fp32 values of a block's key-feedback
    factor (0 without it); other_files: bytes copied as they are (the tokenizer's)."""
    kind = WEIGHT_KINDS[spec.weight_kind]
    h, i = hidden_size, intermediate_size
    linears = ((q_size + 2 * kv_size, h), (h, q_size), (2 * i, h), (h, i))  # qkv, o, gate_up, down
    block = sum(kind.stored_bytes(n, k) for n, k in linears) + 2 * 2 * h + 4 * key_feedback_floats
    tables = 2 * 2 * vocab_size * h + 2 * h  # embeddings, LM head (its own copy when tied), final norm
    return num_layers * block + tables + probe_bytes(vocab_size) + other_files + (num_layers + 4) * _HEADER_BYTES


__all__ = [
    "ArtifactError",
    "ArtifactReader",
    "ArtifactWriter",
    "BLOCK_LINEARS",
    "EMBED_FILE",
    "HEAD_FILE",
    "MANIFEST_NAME",
    "TOKENIZER_DIR",
    "block_file",
    "block_tensors",
    "estimated_artifact_bytes",
    "sha256_file",
]
