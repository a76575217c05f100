"""From an artifact reference (a local folder, or an artifact id in the object store) to a verified
ArtifactReader bound to this worker, and from the reader to a model runner for the device.

Refusals happen here, before anything is served: an artifact for another GPU target or of a
format the runner cannot run (ArtifactMismatch, FAILED_PRECONDITION, naming both sides), and a
missing, partial or corrupt one (every file's size and sha256 are checked against the manifest).
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from services.worker.engine.artifact_cache import (ARTIFACT_ID_RE, DAMAGED, aside_path, download_into_cache, download_turn,
                                                   hold)
from services.worker.errors import (ArtifactCorrupt, ArtifactMismatch, ArtifactNotFound, ArtifactNotReady, ArtifactRefused,
                                   ArtifactUnavailable, RunnerUnavailable)
from shared.formats.artifact import ArtifactError, ArtifactReader, sha256_file
from shared.formats.manifest import MANIFEST_NAME
from shared.formats.spec import FORMATS
from shared.model.config import CheckpointError
from shared.storage import (InsufficientSpace, InvalidKey, LocalDiskError, ObjectNotFound, StorageConfig,
                            StorageError, VerificationFailed, open_store)

log = logging.getLogger(__name__)

TRITON_RUNNER_MODULE = "services.worker.engine.triton_runner"


@dataclass(slots=True)
class LoadedArtifact:
    reader: ArtifactReader
    folder: Path
    # The id this worker serves (Info, gateway registration). It differs from the manifest's id only
    # for an artifact the registry points at the objects of an identical READY twin.
    artifact_id: str
    object_prefix: str = ""  # where it came from in the store; empty for a local folder
    version_label: str = ""  # from the registry when one was given
    registry_state: str = ""  # the registry's state name (e.g. "READY") when one was given
    # Open while the worker lives: marks the cached copy as in use, so no other worker deletes it to make room
    # (artifact_cache.py). None for a local folder.
    cache_hold: int | None = None

    @property
    def size_bytes(self) -> int:
        return sum(f.size for f in self.reader.manifest.files)


@dataclass(slots=True, frozen=True)
class RegistryRecord:
    object_prefix: str
    version_label: str
    state: str
    manifest_sha256: str | None  # the registry's digest of manifest.json (the manifest is not in its own file list)


def worker_gpu_target(device: torch.device) -> tuple[str, str]:
    """(gpu_target, gpu_name) of the device: ("cpu", "cpu") or e.g. ("sm90", "NVIDIA H200")."""
    if device.type != "cuda":
        return "cpu", "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}", torch.cuda.get_device_name(device)


def runner_class(device: torch.device) -> type:
    """TritonRunner on a CUDA device (imported only then: it needs triton and a GPU), else ReferenceRunner."""
    if device.type == "cuda":
        try:
            module = importlib.import_module(TRITON_RUNNER_MODULE)
        except ModuleNotFoundError as exc:
            if exc.name != TRITON_RUNNER_MODULE:
                raise
            raise RunnerUnavailable(
                f"device {device} needs the GPU runner ({TRITON_RUNNER_MODULE}), which this build lacks; "
                "use --device cpu for the torch reference backend"
            ) from None
        return module.TritonRunner
    from services.worker.engine.reference_runner import ReferenceRunner

    return ReferenceRunner


def load_runner(
    reader: ArtifactReader,
    device: torch.device | str,
    block_size: int,
    *,
    max_batch_tokens: int | None = None,
    max_model_len: int | None = None,
    max_decode_batch: int | None = None,
):
    """The ModelRunner (services/worker/engine/runner.py) for the device, weights loaded.

    max_batch_tokens and max_model_len size the GPU runner's workspace, max_decode_batch (the
    engine's most running sequences) its decode graphs; the reference runner allocates per step,
    and max_model_len bounds the attention it accounts for.
    """
    device = torch.device(device)
    cls = runner_class(device)
    if device.type != "cuda":
        return cls(reader, device, block_size, max_model_len=max_model_len)
    settings_cls = importlib.import_module(TRITON_RUNNER_MODULE).TritonRunnerSettings
    options = {"block_size": block_size, "max_model_len": max_model_len, "max_decode_batch": max_decode_batch}
    if max_batch_tokens is not None:
        options["max_batch_tokens"] = max_batch_tokens
    try:
        return cls(reader, device, block_size, settings_cls(**options))
    except (ArtifactError, CheckpointError) as exc:  # ValueErrors too, but the files' fault, not the GPU's
        raise ArtifactCorrupt(f"artifact {reader.manifest.artifact_id} cannot be loaded: {exc}") from exc
    except ValueError as exc:  # the runner names the format it cannot run and those it can
        m = reader.manifest
        raise ArtifactMismatch(f"artifact {m.artifact_id} (format {m.format!r}) is refused by the GPU runner: {exc}") from exc


def runner_formats(device: torch.device) -> tuple[str, ...]:
    """Formats the device's runner runs; a runner that does not list them is asked at load time."""
    return tuple(getattr(runner_class(device), "SUPPORTED_FORMATS", FORMATS))


def check_binding(reader: ArtifactReader, gpu_target: str, formats: tuple[str, ...], expected_format: str | None) -> None:
    """Raises ArtifactMismatch unless the artifact's GPU target and format are this worker's."""
    m = reader.manifest
    if m.gpu_target != gpu_target:
        raise ArtifactMismatch(
            f"artifact {m.artifact_id} is built for GPU target {m.gpu_target!r}, but this worker's target is "
            f"{gpu_target!r}; serve an artifact quantized for {gpu_target!r}"
        )
    if expected_format is not None and m.format != expected_format:
        raise ArtifactMismatch(
            f"artifact {m.artifact_id} has format {m.format!r}, but this worker is configured for format "
            f"{expected_format!r}"
        )
    if m.format not in formats:
        raise ArtifactMismatch(
            f"artifact {m.artifact_id} has format {m.format!r}, which this worker's runner does not run; "
            f"it runs: {', '.join(formats)}"
        )


def open_artifact(
    ref: str,
    *,
    gpu_target: str,
    formats: tuple[str, ...] = tuple(FORMATS),
    expected_format: str | None = None,
    store: StorageConfig | None = None,
    registry_url: str | None = None,
    cache_dir: Path | None = None,
) -> LoadedArtifact:
    """A verified artifact bound to this worker. `ref` is a local artifact folder or an artifact id
    (downloaded from `store` into `cache_dir`; its prefix from the registry, or found in the store)."""
    if Path(ref).is_dir():
        reader = _read(Path(ref), gpu_target, formats, expected_format)
        return LoadedArtifact(reader, Path(ref), reader.manifest.artifact_id)
    if not ARTIFACT_ID_RE.match(ref):
        raise ArtifactNotFound(
            f"artifact {ref!r} is neither a local artifact folder nor an artifact id (32 hex characters)"
        )
    if store is None:
        raise ArtifactNotFound(f"artifact id {ref!r} given without --store to fetch it from")
    if cache_dir is None:
        raise ArtifactNotFound(f"artifact id {ref!r} given without a cache folder to download it into")
    held = hold(Path(cache_dir), ref)  # before the folder is read: from now on no eviction deletes it
    try:
        loaded = _fetch(ref, gpu_target, formats, expected_format, store, registry_url, Path(cache_dir))
    except BaseException:
        if held is not None:
            os.close(held)
        raise
    loaded.cache_hold = held
    return loaded


def _fetch(ref: str, gpu_target: str, formats: tuple[str, ...], expected_format: str | None, store: StorageConfig,
           registry_url: str | None, cache_dir: Path) -> LoadedArtifact:
    """The cached copy of artifact `ref`, verified; downloaded first when there is none (or it is damaged).
    The store is contacted only for a download: a worker restarting while the store is down serves its
    complete cached copy."""
    record = _registry_lookup(ref, registry_url) if registry_url else None
    folder = cache_dir / ref
    cached = _cached_copy(folder, ref, gpu_target, formats, expected_format, record)
    if cached is not None:
        return cached
    prefix = _download(ref, store, record, folder, cache_dir)
    reader = _read_fetched(folder, ref, record, gpu_target, formats, expected_format)
    return _loaded(reader, folder, ref, prefix or _object_prefix(reader, ref, record), record)


def _cached_copy(folder: Path, ref: str, gpu_target: str, formats: tuple[str, ...], expected_format: str | None,
                 record: RegistryRecord | None) -> LoadedArtifact | None:
    """The complete, verified cached copy of `ref`; None when there is none, or it was damaged (then discarded)."""
    # Held open while the cached copy is read: what is discarded must be the copy found damaged
    # (an open folder's inode number cannot be reused by another worker's fresh copy).
    pin = _open_folder(folder)
    if pin is None:
        return None
    try:
        reader = _read_fetched(folder, ref, record, gpu_target, formats, expected_format)
        return _loaded(reader, folder, ref, _object_prefix(reader, ref, record), record)
    except ArtifactCorrupt as exc:
        log.warning("cached copy of %s is unusable (%s); downloading it again", ref, exc)
        _discard_damaged(folder, os.fstat(pin))
        return None
    finally:
        os.close(pin)


def _download(ref: str, store: StorageConfig, record: RegistryRecord | None, folder: Path,
              cache_dir: Path) -> str | None:
    """Downloads `ref` into `folder`; returns its prefix in the store, None when another worker's copy landed
    there first (the store is then not contacted). Only bytes not matching their sha256 or size are
    ArtifactCorrupt: a store that cannot be reached says nothing about the artifact (ArtifactUnavailable)."""
    if folder.exists():  # another worker put a complete, verified copy there meanwhile
        return None
    try:
        with download_turn(cache_dir, ref) as alone:  # one download at a time per cache (artifact_cache)
            if folder.exists():
                return None
            object_store = open_store(store)
            prefix = record.object_prefix if record else _find_prefix(object_store, ref)
            log.info("downloading artifact %s from %s", ref, object_store.uri(prefix))
            try:
                download_into_cache(object_store, prefix, folder, ref, alone)
            except StorageError:
                # Another worker's download may have landed between the check and ours (one of an older
                # build, without the download lock; the store renames only complete, verified copies
                # into place): it is read and verified by the caller.
                if not folder.exists():
                    raise
            return prefix
    except ObjectNotFound as exc:
        raise ArtifactNotFound(f"artifact {ref}: {exc}") from exc
    except (InsufficientSpace, LocalDiskError) as exc:  # the cache's disk, not the artifact nor the store
        raise ArtifactRefused(f"artifact {ref} cannot be fetched into --cache-dir {cache_dir}: {exc}") from exc
    except VerificationFailed as exc:
        raise ArtifactCorrupt(f"artifact {ref} could not be downloaded intact: {exc}") from exc
    except InvalidKey as exc:  # the store answered; the artifact's objects are malformed: no later start succeeds
        raise ArtifactCorrupt(f"artifact {ref} is malformed in the store: {exc}") from exc
    except StorageError as exc:
        raise ArtifactUnavailable(
            f"artifact {ref} cannot be fetched: the object store is unavailable and no complete copy is cached "
            f"in {cache_dir}: {exc}"
        ) from exc


def _object_prefix(reader: ArtifactReader, ref: str, record: RegistryRecord | None) -> str:
    """Where the artifact is in the store, without asking the store: the registry's record, else the
    quantizer's layout (shared.registry.artifacts.object_prefix) from its manifest, whose id is `ref`."""
    if record is not None:
        return record.object_prefix
    from shared.registry.artifacts import object_prefix  # the one layout, the registry's

    m = reader.manifest
    return object_prefix(m.model_name, m.model_version, m.format, m.gpu_target, ref)


def _open_folder(folder: Path) -> int | None:
    """A file descriptor of the folder, None when there is none (or another worker just moved it)."""
    try:
        return os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except (FileNotFoundError, NotADirectoryError):
        return None


def _discard_damaged(folder: Path, damaged: os.stat_result) -> None:
    """Removes the damaged cached copy `damaged` (the stat of `folder`, held open, when it was read).
    Workers sharing the cache folder may find the same damaged copy: it is first renamed aside to a
    name of this worker's own (atomic), so a copy that is already gone is left alone, and a fresh
    copy another worker put there meanwhile (and may be loading) is put back rather than deleted."""
    aside = aside_path(folder, DAMAGED)
    try:
        os.rename(folder, aside)
    except FileNotFoundError:
        return  # another worker moved it aside first
    moved = aside.stat()
    if (moved.st_dev, moved.st_ino) != (damaged.st_dev, damaged.st_ino):
        try:
            os.rename(aside, folder)  # not the damaged copy: another worker's fresh one
            return
        except OSError:
            pass  # yet another complete copy is there now; this one is redundant
    shutil.rmtree(aside, ignore_errors=True)


def _loaded(reader: ArtifactReader, folder: Path, ref: str, prefix: str, record: RegistryRecord | None) -> LoadedArtifact:
    if record is None:
        return LoadedArtifact(reader, folder, ref, prefix)
    return LoadedArtifact(reader, folder, ref, prefix, record.version_label, record.state)


def _read_fetched(folder: Path, ref: str, record: RegistryRecord | None, gpu_target: str, formats: tuple[str, ...],
                  expected_format: str | None) -> ArtifactReader:
    """_read of a fetched or cached copy of `ref`, which must be the artifact asked for. The registry's digest of
    manifest.json is checked first: a manifest altered in the cache is a damaged copy (ArtifactCorrupt: discarded
    and fetched again), not a mismatch to refuse on every start, and nothing it claims is acted on."""
    if record is not None and record.manifest_sha256 is not None:
        try:
            digest = sha256_file(folder / MANIFEST_NAME)
        except OSError as exc:
            raise ArtifactCorrupt(f"artifact {ref}: manifest.json cannot be read: {exc}") from exc
        if digest != record.manifest_sha256:
            raise ArtifactCorrupt(f"artifact {ref}: manifest.json does not match the registry's sha256")
    reader = _read(folder, gpu_target, formats, expected_format)
    _check_identity(reader, ref, record)
    return reader


def _check_identity(reader: ArtifactReader, ref: str, record: RegistryRecord | None) -> None:
    """The files must be the artifact asked for: its own manifest, or (with a registry record) the
    manifest the registry recorded (_read_fetched checked its digest), which may be an identical twin's."""
    if record is not None and record.manifest_sha256 is not None:
        if reader.manifest.artifact_id != ref:
            log.info("artifact %s shares the stored objects of identical artifact %s", ref, reader.manifest.artifact_id)
        return
    if reader.manifest.artifact_id != ref:
        raise ArtifactCorrupt(f"the files fetched for artifact {ref} are artifact {reader.manifest.artifact_id}")


def _read(folder: Path, gpu_target: str, formats: tuple[str, ...], expected_format: str | None) -> ArtifactReader:
    try:
        reader = ArtifactReader(folder, verify=False)
    except (ArtifactError, ValueError) as exc:
        raise ArtifactCorrupt(f"artifact folder {folder} cannot be read: {exc}") from exc
    check_binding(reader, gpu_target, formats, expected_format)  # cheap, so before hashing every file
    try:
        reader.verify()
    except ArtifactError as exc:
        raise ArtifactCorrupt(str(exc)) from exc
    return reader


def _find_prefix(store, artifact_id: str) -> str:
    """The artifact's folder in the store (`<model>/<version>/<format>/<gpu>/<id>/`), from a listing."""
    for info in store.list(""):
        parts = info.key.split("/")
        if len(parts) >= 2 and parts[-1] == MANIFEST_NAME and parts[-2] == artifact_id:
            return info.key[: -len(MANIFEST_NAME)]
    raise ArtifactNotFound(
        f"artifact {artifact_id} is not in the store {store.uri()}; an artifact that reuses another's "
        "objects is found only through the registry (--registry-url)"
    )


def _registry_lookup(artifact_id: str, registry_url: str) -> RegistryRecord:
    from shared.registry import ArtifactState, NotFound, create_registry, get_artifact

    registry = create_registry(registry_url, migrate_to_head=False)
    try:
        with registry.sessions() as session:  # reads only: on SQLite it takes no lock (Registry.sessions)
            row = get_artifact(session, artifact_id)
            if row.state is not ArtifactState.READY:
                # PENDING: still being published (its objects may be partial); FAILED: the quantizer
                # gave up on it. Neither may ever serve traffic.
                raise ArtifactNotReady(
                    f"artifact {artifact_id} is {row.state.name} in the registry, not READY: "
                    + ("its publication failed" if row.state is ArtifactState.FAILED else "it is still being published")
                )
            return RegistryRecord(row.object_prefix, row.model_version.label, row.state.name, row.manifest_sha256)
    except NotFound as exc:
        raise ArtifactNotFound(str(exc)) from exc
    finally:
        registry.close()
