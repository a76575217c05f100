"""Artifact refusal before serving: another GPU target or format (FAILED_PRECONDITION naming both),
corrupt or partial files; and loading an artifact id from the object store."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import grpc
import pytest

from services.worker.config import WorkerConfig
from services.worker.engine.artifact_cache import LOCKS_DIR
from services.worker.engine.loading import open_artifact
from services.worker.errors import ArtifactCorrupt, ArtifactMismatch, ArtifactNotFound, ArtifactRefused, ArtifactUnavailable
from services.worker.server import BackgroundWorker, main
from shared.formats.artifact import ArtifactReader
from shared.storage import LocalStore, ObjectInfo, StorageConfig, StorageError


@pytest.fixture
def artifact_copy(artifacts, tmp_path) -> Path:
    return Path(shutil.copytree(artifacts["w4a8kv4-g128"], tmp_path / "artifact"))


def _set_manifest(folder: Path, **fields) -> None:
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.update(fields)
    path.write_text(json.dumps(manifest))


def test_another_gpu_target_is_failed_precondition_naming_both(artifact_copy, capsys):
    _set_manifest(artifact_copy, gpu_target="sm90")
    with pytest.raises(ArtifactMismatch) as err:
        open_artifact(str(artifact_copy), gpu_target="cpu")
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "'sm90'" in str(err.value) and "'cpu'" in str(err.value)
    # The command line says the same and exits 2 without serving.
    assert main(["--artifact", str(artifact_copy), "--port", "0", "--metrics-port", "-1"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("error (FAILED_PRECONDITION):") and "'sm90'" in line and "'cpu'" in line


def test_another_format_is_failed_precondition_naming_both(artifacts):
    with pytest.raises(ArtifactMismatch) as err:
        BackgroundWorker(WorkerConfig(artifact=str(artifacts["w4a8kv4-g128"]), format="fp16", port=0,
                                      metrics_port=None, kv_blocks=8))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "'w4a8kv4-g128'" in str(err.value) and "'fp16'" in str(err.value)
    with pytest.raises(ArtifactMismatch) as err:  # a runner that does not run the format
        open_artifact(str(artifacts["w4a8kv4-g128"]), gpu_target="cpu", formats=("fp16", "w8a8"))
    assert "'w4a8kv4-g128'" in str(err.value) and "fp16, w8a8" in str(err.value)


def test_a_corrupted_file_is_refused(artifact_copy):
    path = artifact_copy / "weights" / "block_000.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactCorrupt) as err:
        open_artifact(str(artifact_copy), gpu_target="cpu")
    assert "weights/block_000.safetensors" in str(err.value) and "sha256" in str(err.value)


def test_a_partial_artifact_is_refused(artifact_copy):
    (artifact_copy / "weights" / "head.safetensors").unlink()
    with pytest.raises(ArtifactCorrupt) as err:
        open_artifact(str(artifact_copy), gpu_target="cpu")
    assert "weights/head.safetensors is missing" in str(err.value)
    (artifact_copy / "manifest.json").unlink()
    with pytest.raises(ArtifactCorrupt, match="manifest.json"):
        open_artifact(str(artifact_copy), gpu_target="cpu")


def test_neither_a_folder_nor_an_id(tmp_path):
    with pytest.raises(ArtifactNotFound, match="neither a local artifact folder nor an artifact id"):
        open_artifact(str(tmp_path / "nope"), gpu_target="cpu")


def _in_store(artifacts, tmp_path):
    """(manifest, object prefix, store config, empty cache folder) of the g128 artifact published to a local store."""
    manifest = ArtifactReader(artifacts["w4a8kv4-g128"], verify=False).manifest
    store_root = tmp_path / "store"
    prefix = f"{manifest.model_name}/{manifest.model_version}/{manifest.format}/cpu/{manifest.artifact_id}/"
    LocalStore(store_root, create=True).publish_folder(artifacts["w4a8kv4-g128"], prefix)
    return manifest, prefix, StorageConfig(kind="local", root=store_root), tmp_path / "cache"


def _damage(cache, artifact_id):
    block = cache / artifact_id / "weights" / "block_001.safetensors"
    block.write_bytes(b"x" + block.read_bytes()[1:])


def test_an_artifact_id_is_fetched_from_the_store_and_cached(artifacts, tmp_path):
    manifest, prefix, store, cache = _in_store(artifacts, tmp_path)
    loaded = open_artifact(manifest.artifact_id, gpu_target="cpu", store=store, cache_dir=cache)
    assert loaded.object_prefix == prefix and loaded.folder == cache / manifest.artifact_id
    assert loaded.reader.manifest.artifact_id == manifest.artifact_id
    # A damaged cached copy is fetched again rather than served.
    _damage(cache, manifest.artifact_id)
    again = open_artifact(manifest.artifact_id, gpu_target="cpu", store=store, cache_dir=cache)
    again.reader.verify()
    with pytest.raises(ArtifactNotFound, match="not in the store"):
        open_artifact("0" * 32, gpu_target="cpu", store=store, cache_dir=cache)


def test_a_cache_disk_too_small_for_the_artifact_is_refused_as_such(artifacts, tmp_path, monkeypatch):
    """Not DATA_LOSS ("could not be downloaded intact"): nothing is wrong with the artifact, the cache's disk is
    full; the refusal names the cache folder and both sizes, and leaves nothing in it."""
    manifest, _, store, cache = _in_store(artifacts, tmp_path)
    monkeypatch.setattr("shared.disk_space.free_bytes", lambda path: 1000)
    with pytest.raises(ArtifactRefused, match=rf"cannot be fetched into --cache-dir {cache}: not enough disk space ") as info:
        open_artifact(manifest.artifact_id, gpu_target="cpu", store=store, cache_dir=cache)
    assert type(info.value) is ArtifactRefused and info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert not (cache / manifest.artifact_id).exists()


def test_a_cache_disk_that_fills_mid_download_is_refused_as_such(artifacts, tmp_path, monkeypatch):
    """The room check passed, then the disk filled (another process wrote meanwhile): reported as "the object
    store is unavailable" (UNAVAILABLE), it named neither the cache nor its disk. Nothing is left in the cache."""
    import errno

    manifest, _, store, cache = _in_store(artifacts, tmp_path)
    real_get_file = LocalStore.get_file

    def disk_full_at_the_second_file(self, key, local_path, calls=[]):
        calls.append(key)
        if len(calls) == 2:
            full = OSError(errno.ENOSPC, "No space left on device")
            raise StorageError(f"cannot copy {key}: {full}") from full  # as LocalStore words it
        return real_get_file(self, key, local_path)

    monkeypatch.setattr(LocalStore, "get_file", disk_full_at_the_second_file)
    with pytest.raises(ArtifactRefused, match=rf"cannot be fetched into --cache-dir {cache}: the disk of .* cannot "
                                              rf"take the download: .*No space left on device") as info:
        open_artifact(manifest.artifact_id, gpu_target="cpu", store=store, cache_dir=cache)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert not (cache / manifest.artifact_id).exists()
    assert not [p for p in cache.iterdir() if p.name != LOCKS_DIR]


def test_the_runner_is_chosen_by_device(artifacts, monkeypatch):
    import sys

    import torch

    from services.worker.engine.loading import TRITON_RUNNER_MODULE, load_runner, runner_class
    from services.worker.engine.reference_runner import ReferenceRunner
    from services.worker.errors import RunnerUnavailable

    reader = ArtifactReader(artifacts["fp16"], verify=False)
    runner = load_runner(reader, "cpu", 8)
    assert isinstance(runner, ReferenceRunner) and runner.block_size == 8 and runner.format == "fp16"
    # A build without the GPU runner says so instead of failing on an import deep inside.
    monkeypatch.setitem(sys.modules, TRITON_RUNNER_MODULE, None)
    with pytest.raises(RunnerUnavailable, match="--device cpu"):
        runner_class(torch.device("cuda"))


def _publish_pending(artifacts, tmp_path, fmt: str):
    """A registry with one reserved (PENDING) artifact of `fmt` whose files are in a local store.
    Returns (registry, url, artifact_id, object_prefix, published folder)."""
    from shared.registry import create_registry, register_model_version, reserve_artifact

    source = ArtifactReader(artifacts[fmt], verify=False).manifest
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    registry = create_registry(url)
    with registry.transaction() as session:
        version = register_model_version(session, "tiny", source.model_version, label="rc1")
        row = reserve_artifact(session, version, fmt, "cpu").artifact
        artifact_id, prefix = row.id, row.object_prefix
    folder = Path(shutil.copytree(artifacts[fmt], tmp_path / "published"))
    _set_manifest(folder, artifact_id=artifact_id)
    LocalStore(tmp_path / "store", create=True).publish_folder(folder, prefix)
    return registry, url, artifact_id, prefix, folder


def test_an_artifact_id_through_the_registry_including_reused_objects(artifacts, tmp_path):
    from shared.formats.artifact import sha256_file
    from shared.registry import mark_artifact_ready, register_model_version, reserve_artifact

    registry, url, first_id, first_prefix, folder = _publish_pending(artifacts, tmp_path, "w4a8kv4-g128")
    manifest_sha = sha256_file(folder / "manifest.json")
    with registry.transaction() as session:
        mark_artifact_ready(session, first_id, manifest_sha256=manifest_sha, content_digest="d" * 64)
        # Another binding with identical content points at the first one's objects instead of a new upload.
        other_version = register_model_version(session, "tiny", "f" * 64, label="rc2")
        twin_id = reserve_artifact(session, other_version, "w4a8kv4-g128", "cpu").artifact.id
        mark_artifact_ready(session, twin_id, manifest_sha256=manifest_sha, content_digest="d" * 64,
                            reuse_prefix_of=first_id)
    registry.close()
    store = StorageConfig(kind="local", root=tmp_path / "store")
    loaded = open_artifact(first_id, gpu_target="cpu", store=store, registry_url=url, cache_dir=tmp_path / "cache")
    assert (loaded.artifact_id, loaded.object_prefix, loaded.version_label, loaded.registry_state) == (
        first_id, first_prefix, "rc1", "READY")
    twin = open_artifact(twin_id, gpu_target="cpu", store=store, registry_url=url, cache_dir=tmp_path / "cache")
    assert (twin.artifact_id, twin.reader.manifest.artifact_id, twin.object_prefix) == (twin_id, first_id, first_prefix)
    # Without the registry, the fetched files must be the artifact asked for.
    with pytest.raises(ArtifactNotFound, match="--registry-url"):
        open_artifact(twin_id, gpu_target="cpu", store=store, cache_dir=tmp_path / "cache2")


@pytest.mark.parametrize("state", ["PENDING", "FAILED"])
def test_an_artifact_the_registry_has_not_marked_ready_is_refused(artifacts, tmp_path, state):
    """A half-published or failed artifact never serves, even when its objects are in the store."""
    from services.worker.errors import ArtifactNotReady
    from shared.registry import mark_artifact_failed

    registry, url, artifact_id, _, _ = _publish_pending(artifacts, tmp_path, "fp16")
    if state == "FAILED":
        with registry.transaction() as session:
            mark_artifact_failed(session, artifact_id, "accuracy gate: ppl ratio 1.31")
    registry.close()
    store = StorageConfig(kind="local", root=tmp_path / "store")
    with pytest.raises(ArtifactNotReady, match=f"{state} in the registry, not READY") as refused:
        open_artifact(artifact_id, gpu_target="cpu", store=store, registry_url=url, cache_dir=tmp_path / "cache")
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert not (tmp_path / "cache" / artifact_id).exists()  # refused before anything was downloaded


@pytest.mark.parametrize("capture", [True, False])
def test_the_worker_captures_graphs_once_the_cache_exists_unless_told_not_to(artifacts, monkeypatch, capture):
    """Graphs point at the KV cache: the start-up capture comes after the engine allocated it, and
    --no-capture-graphs leaves every graph to its first use."""
    from services.worker import serving
    from services.worker.config import WorkerConfig

    captured = []
    real_load_runner = serving.load_runner

    def runner_with_graphs(*args, **kwargs):
        runner = real_load_runner(*args, **kwargs)
        runner.capture_graphs = lambda progress=None: captured.append(len(runner.k_cache))  # layers with a cache
        return runner

    monkeypatch.setattr(serving, "load_runner", runner_with_graphs)
    config = WorkerConfig(artifact=str(artifacts["fp16"]), kv_blocks=8, block_size=4, capture_graphs=capture)
    served = serving.load_served_model(config)
    assert captured == ([served.engine.runner.config.num_layers] if capture else [])
    assert WorkerConfig.from_args(["--artifact", "x", "--no-capture-graphs"]).capture_graphs is False


def test_a_long_graph_capture_at_start_up_logs_its_progress(monkeypatch, caplog):
    """A GPU worker's first start compiles every kernel while capturing its graphs (minutes): the log
    says so before it starts and how far it is while it runs, not only when it is over."""
    import logging

    from services.worker import serving

    class SlowCapture:
        def capture_graphs(self, progress=None):
            for done in range(1, 4):
                progress(done, 3)

    monkeypatch.setattr(serving, "GRAPH_PROGRESS_LOG_S", 0.0)
    with caplog.at_level(logging.INFO, logger=serving.__name__):
        serving._capture_graphs(SlowCapture())
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("compiling kernels and capturing CUDA graphs")
    assert [line.split(" (")[0] for line in lines[1:-1]] == ["captured 1 of 3 CUDA graphs", "captured 2 of 3 CUDA graphs"]
    assert lines[-1].startswith("kernels compiled and CUDA graphs captured in")


def _cached_store(artifacts, tmp_path):
    """(artifact id, store config, cache folder) with a damaged cached copy of the artifact."""
    manifest, _prefix, store, cache = _in_store(artifacts, tmp_path)
    open_artifact(manifest.artifact_id, gpu_target="cpu", store=store, cache_dir=cache)
    _damage(cache, manifest.artifact_id)
    return manifest.artifact_id, store, cache


def test_a_damaged_cache_another_worker_already_removed_is_downloaded_again(artifacts, tmp_path, monkeypatch):
    """Two workers sharing the cache find the same damaged copy; the other one removes it first."""
    from services.worker.engine import loading

    artifact_id, store, cache = _cached_store(artifacts, tmp_path)
    real_read = loading._read

    def read(folder, *args):
        try:
            return real_read(folder, *args)
        except ArtifactCorrupt:
            shutil.rmtree(folder)  # the other worker's clean-up, between our read and ours
            raise

    monkeypatch.setattr(loading, "_read", read)
    loaded = open_artifact(artifact_id, gpu_target="cpu", store=store, cache_dir=cache)
    loaded.reader.verify()
    assert [p.name for p in cache.iterdir() if p.name != LOCKS_DIR] == [artifact_id]


def test_a_damaged_cache_does_not_delete_the_fresh_copy_another_worker_loads(artifacts, tmp_path, monkeypatch):
    """Two workers find the same damaged copy; the other one replaces it with a fresh download (and
    loads it) before this one gets to discard it: that fresh copy is used, not deleted."""
    from services.worker.engine import loading

    artifact_id, store, cache = _cached_store(artifacts, tmp_path)
    real_read, real_download = loading._read, LocalStore.download_folder
    downloads, other = [], []

    def read(folder, *args):
        try:
            return real_read(folder, *args)
        except ArtifactCorrupt:
            if not other:  # the other worker does it all in between
                monkeypatch.setattr(loading, "_read", real_read)
                other.append(open_artifact(artifact_id, gpu_target="cpu", store=store, cache_dir=cache))
                monkeypatch.setattr(loading, "_read", read)
            raise

    def download(self, prefix, local_dir, **kw):
        downloads.append(local_dir)
        return real_download(self, prefix, local_dir, **kw)

    monkeypatch.setattr(loading, "_read", read)
    monkeypatch.setattr(LocalStore, "download_folder", download)
    loaded = open_artifact(artifact_id, gpu_target="cpu", store=store, cache_dir=cache)
    assert len(other) == 1 and len(downloads) == 1  # only the other worker downloaded
    fresh = other[0].folder.stat().st_ino
    assert loaded.folder.stat().st_ino == fresh  # the other worker's copy, still there
    other[0].reader.verify()
    loaded.reader.verify()
    assert [p.name for p in cache.iterdir() if p.name != LOCKS_DIR] == [artifact_id]


def _store_down(monkeypatch) -> None:
    """An object store outage (S3/MinIO unreachable): every listing fails."""
    def down(self, prefix=""):
        raise StorageError(f"cannot reach S3 endpoint for listing of {self.uri(prefix)}: Could not connect")

    monkeypatch.setattr(LocalStore, "list", down)


def test_a_complete_cached_copy_is_served_while_the_store_is_down(artifacts, tmp_path, monkeypatch):
    """A worker restarting during a store outage serves its verified cached copy, reporting the same prefix."""
    manifest, prefix, store, cache = _in_store(artifacts, tmp_path)
    os.close(open_artifact(manifest.artifact_id, gpu_target="cpu", store=store, cache_dir=cache).cache_hold)
    _store_down(monkeypatch)
    loaded = open_artifact(manifest.artifact_id, gpu_target="cpu", store=store, cache_dir=cache)
    assert loaded.folder == cache / manifest.artifact_id and loaded.object_prefix == prefix


def test_a_store_outage_without_a_cached_copy_is_unavailable_not_data_loss(artifacts, tmp_path, monkeypatch):
    manifest, _prefix, store, cache = _in_store(artifacts, tmp_path)
    _store_down(monkeypatch)
    with pytest.raises(ArtifactUnavailable, match=f"artifact {manifest.artifact_id} cannot be fetched: the object "
                                                  "store is unavailable") as err:
        open_artifact(manifest.artifact_id, gpu_target="cpu", store=store, cache_dir=cache)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_download_not_matching_its_sha256_is_data_loss(artifacts, tmp_path, monkeypatch):
    manifest, _prefix, store, cache = _in_store(artifacts, tmp_path)
    real_get = LocalStore.get_file

    def altered_in_transit(self, key, local_path):
        got = real_get(self, key, local_path)
        return ObjectInfo(got.key, got.size, "0" * 64)

    monkeypatch.setattr(LocalStore, "get_file", altered_in_transit)
    with pytest.raises(ArtifactCorrupt, match=f"artifact {manifest.artifact_id} could not be downloaded intact") as err:
        open_artifact(manifest.artifact_id, gpu_target="cpu", store=store, cache_dir=cache)
    assert err.value.code == grpc.StatusCode.DATA_LOSS


def test_a_cached_copy_whose_manifest_differs_from_the_registrys_is_fetched_again(artifacts, tmp_path, caplog):
    """Its manifest still parses (here its GPU target was changed): the binding check refused it (ArtifactMismatch)
    before the registry's digest of manifest.json was compared, so the damaged copy was never discarded and every
    restart was refused until someone deleted it by hand."""
    import logging

    from services.worker.engine import loading
    from shared.formats.artifact import sha256_file
    from shared.registry import mark_artifact_ready

    registry, url, artifact_id, _prefix, folder = _publish_pending(artifacts, tmp_path, "fp16")
    with registry.transaction() as session:
        mark_artifact_ready(session, artifact_id, manifest_sha256=sha256_file(folder / "manifest.json"),
                            content_digest="d" * 64)
    registry.close()
    store, cache = StorageConfig(kind="local", root=tmp_path / "store"), tmp_path / "cache"
    os.close(open_artifact(artifact_id, gpu_target="cpu", store=store, registry_url=url, cache_dir=cache).cache_hold)
    _set_manifest(cache / artifact_id, gpu_target="sm90")
    with caplog.at_level(logging.WARNING, logger=loading.__name__):
        loaded = open_artifact(artifact_id, gpu_target="cpu", store=store, registry_url=url, cache_dir=cache)
    assert loaded.reader.manifest.gpu_target == "cpu"
    assert sha256_file(loaded.folder / "manifest.json") == sha256_file(folder / "manifest.json")
    assert any("manifest.json does not match the registry's sha256" in r.getMessage() for r in caplog.records)
    os.close(loaded.cache_hold)


def test_an_object_key_no_store_accepts_is_data_loss_not_unavailable(artifacts, tmp_path):
    """The store answered, and the artifact's objects are malformed (here a backslash in a key): reported as the
    store being unavailable (UNAVAILABLE: "a later start may succeed"), the start was retried forever."""
    manifest, prefix, store, cache = _in_store(artifacts, tmp_path)
    (store.root / prefix / "tokenizer" / "a\\b.json").write_text("{}")
    with pytest.raises(ArtifactCorrupt, match=f"artifact {manifest.artifact_id} is malformed in the store: object "
                                              "key 'tokenizer/a") as err:
        open_artifact(manifest.artifact_id, gpu_target="cpu", store=store, cache_dir=cache)
    assert err.value.code == grpc.StatusCode.DATA_LOSS
    assert not (cache / manifest.artifact_id).exists()
