"""One publish, stage by stage: load -> calibrate/quantize/pack -> eval -> accuracy gate -> manifest ->
upload -> register. Runs on a worker thread; reports through a Reporter (see jobs.py)."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from sqlalchemy.orm import Session

from services.quantizer.adoption import check_adoptable
from services.quantizer.allocation import Binding, Claim, claim_binding
from services.quantizer.config import QuantizerConfig, over_budget
from services.quantizer.errors import AccuracyBudgetExceeded, InputChanged, JobCancelled
from services.quantizer.evaluate import (
    EvalWindows,
    Fp16PerplexityCache,
    artifact_perplexity,
    checkpoint_perplexity,
    eval_windows,
)
from services.quantizer.leftovers import delete_leftover_objects
from services.quantizer.publish_spec import DEFAULT_EVAL_SEQ_LEN, PublishSpec
from services.quantizer.sources import local_file, local_folder
from services.quantizer.views import ArtifactDetails, EvaluationView, Stage
from shared.disk_space import SharedSpace
from shared.formats.artifact import TOKENIZER_DIR, sha256_file
from shared.formats.manifest import MANIFEST_NAME, Evaluation, Manifest
from shared.formats.spec import format_spec
from shared.model.checkpoint import HfCheckpoint
from shared.model.config import LlamaConfig
from shared.model.tokenizer import Tokenizer
from shared.quant.quantize_model import QuantizeSettings, check_group_divisibility, quantize_checkpoint
from shared.registry import (
    ArtifactState,
    JobState,
    Registry,
    find_ready_by_digest,
    get_artifact,
    get_job,
    mark_artifact_failed,
    mark_artifact_ready,
)
from shared.storage import ObjectStore, PublishInProgress, TransferProgress

log = logging.getLogger(__name__)
# Under the quantizer's work_dir: the disk claims of the jobs writing there (shared.disk_space.SharedSpace),
# of this quantizer and any other sharing the folder.
DISK_CLAIMS_DIR = "disk-claims"
# How long a job waits for the claim on its artifact's prefix: long enough for a claim its writer left (killed)
# to go stale and be taken over (claims.CLAIM_STALE_AFTER_S, 45 s).
CLEAR_WAIT_S = 75.0
CLEAR_POLL_S = 2.0


class Reporter(Protocol):
    def progress(self, stage: Stage, block_index: int = 0, block_count: int = 0, *,
                 message: str = "", remaining_s: float | None = None) -> None:
        """Records the job's progress; raises JobCancelled when the quantizer is stopping."""

    def check(self) -> None:
        """Raises JobCancelled when the quantizer is stopping."""


@dataclass(slots=True)
class Services:
    config: QuantizerConfig
    registry: Registry
    store: ObjectStore
    fp16_cache: Fp16PerplexityCache


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def content_digest(manifest: Manifest) -> str:
    """Identifies the bytes a worker loads for this binding: the files (not the manifest, which names the
    artifact and its evaluation), the binding and the kernel policy table."""
    body = {
        "model_version": manifest.model_version, "format": manifest.format, "gpu_target": manifest.gpu_target,
        "kernel_policy": manifest.kernel_policy,
        "files": [[f.path, f.sha256, f.size] for f in sorted(manifest.files, key=lambda f: f.path)],
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class Pipeline:
    def __init__(self, services: Services, spec: PublishSpec, job_id: str, reporter: Reporter, work_dir: Path):
        self.services = services
        self.spec = spec
        self.job_id = job_id
        self.reporter = reporter
        self.work_dir = work_dir
        # What this job downloads and writes under work_dir, claimed against the other jobs sharing the disk.
        self.space = SharedSpace(services.config.work_dir / DISK_CLAIMS_DIR, work_dir)
        self.device = resolve_device(services.config.device)
        self.claim: Claim | None = None
        self.evaluation: EvaluationView | None = None
        self.details: ArtifactDetails | None = None  # set once evaluated; the size once uploaded
        self._abandoned = False  # quantization failed: a side thread measuring fp16 stops

    @property
    def owned_artifact(self) -> str | None:
        """The artifact this job builds (None before allocation, or when it adopted a READY one)."""
        return self.claim.artifact_id if self.claim is not None and self.claim.owned else None

    def run(self, finish: Callable[[Session, str], None]) -> str:
        """Publishes; `finish(session, artifact_id)` runs in the transaction that marks the artifact READY."""
        registry = self.services.registry
        folder, checkpoint, model_version, windows = self._load()
        self.claim = claim_binding(
            registry, self.job_id,
            Binding(self.spec.model_name, model_version, self.spec.version_label, self.spec.format, self.spec.gpu_target),
            actor=self.services.config.owner, check=self.reporter.check,
            waiting=lambda holder: self.reporter.progress(
                Stage.LOAD, message=f"job {holder} is publishing the same binding: waiting for it"),
        )
        if not self.claim.owned:
            self.reporter.progress(Stage.REGISTER, message=f"the binding is already published as artifact "
                                                            f"{self.claim.artifact_id}")
            manifest = Manifest.from_json(
                self.services.store.get_bytes(self.claim.object_prefix + MANIFEST_NAME).decode())
            check_adoptable(self.spec, self.claim.artifact_id, manifest)
            with registry.transaction() as session:
                finish(session, self.claim.artifact_id)
            return self.claim.artifact_id
        artifact_dir, ppl_fp16 = self._quantize_and_fp16_eval(folder, checkpoint, model_version, windows)
        ppl_quantized = self._quantized_perplexity(artifact_dir, windows, ppl_fp16)
        self._gate(ppl_fp16, ppl_quantized, windows)
        manifest = self._write_manifest(artifact_dir, windows, ppl_fp16, ppl_quantized)
        digest = content_digest(manifest)
        reuse_of, manifest_sha256 = self._upload(artifact_dir, digest)
        self._register(finish, digest, manifest_sha256, reuse_of, artifact_dir)
        return self.claim.artifact_id

    def fail(self, session: Session, reason: str) -> None:
        """Marks the artifact this job builds FAILED (keeping its perplexities when it was evaluated)."""
        artifact_id = self.owned_artifact
        if artifact_id is None or not self._holds_claim(session):
            return
        if get_artifact(session, artifact_id, for_update=True).state != ArtifactState.PENDING:
            return
        artifact = mark_artifact_failed(session, artifact_id, reason, actor=self.services.config.owner)
        if self.evaluation is not None:
            artifact.ppl_fp16, artifact.ppl_quant = self.evaluation.ppl_fp16, self.evaluation.ppl_quantized
            artifact.eval_data = self.evaluation.data_name

    # ---- stages ----

    def _load(self) -> tuple[Path, HfCheckpoint, str, EvalWindows]:
        self.reporter.progress(Stage.LOAD, message=f"reading {self.spec.source}")
        # A 70B source takes minutes to download: its progress, every 10 s (and a cancel between files).
        downloaded = TransferProgress(lambda done: self.reporter.progress(Stage.LOAD, message=f"downloaded {done}"))
        folder = local_folder(self.spec.source, self.work_dir / "source", self.services.config.store, downloaded,
                              self.space.shortage)
        if downloaded.files:
            self.reporter.progress(Stage.LOAD, message=f"downloaded {self.spec.source}: {downloaded.summary()}")
        checkpoint = HfCheckpoint(folder)  # config.json, a Llama-family model, every tensor present
        check_group_divisibility(checkpoint.config, format_spec(self.spec.format))
        windows = self._eval_windows(folder, checkpoint.config)  # a bad eval text fails now, not after quantizing
        model_version = checkpoint.content_hash()
        self.reporter.progress(Stage.LOAD, message=f"model version {model_version[:12]}")
        return folder, checkpoint, model_version, windows

    def _quantize(self, folder: Path, num_layers: int) -> Path:
        spec = self.spec
        calib = local_file(spec.calib_data, self.work_dir / "calib", self.services.config.store) if spec.calib_data else None
        if calib is not None:
            _check_pinned(calib, spec.calib_sha256, "calibration.data", spec.calib_data)
        out = self.work_dir / "artifact"
        # When the blocks start: the calibration text and the checkpoint's content hash (minutes for a 70B model)
        # come first, and counted as block time they made the first estimates far too long.
        blocks_started = time.monotonic()

        def progress(stage: str, done: int, total: int) -> None:
            nonlocal blocks_started
            if stage == "load" and done == 0:
                self.reporter.progress(Stage.CALIBRATE, message="reading the calibration text")
            elif stage == "load":
                blocks_started = time.monotonic()
                self.reporter.progress(Stage.QUANTIZE, 1, num_layers)
            elif stage == "quantize" and done < total:
                remaining = (time.monotonic() - blocks_started) / done * (total - done)
                self.reporter.progress(Stage.QUANTIZE, done + 1, total, remaining_s=remaining,
                                       message=f"block {done}/{total} done")
            elif stage == "pack" and done == 0:
                self.reporter.progress(Stage.PACK, message=f"block {num_layers}/{num_layers} done; writing the artifact")

        manifest = quantize_checkpoint(
            QuantizeSettings(
                model_dir=folder, out_dir=out, format=spec.format, gpu_target=spec.gpu_target, options=spec.options,
                calib_path=calib, calib_samples=spec.calib_samples, calib_seq_len=spec.calib_seq_len,
                model_name=spec.model_name, device=self.device, room=self.space.shortage,
            ),
            progress,
        )
        used = (manifest.calibration or {}).get("samples")
        if used is not None and used < spec.calib_samples:  # a short text: fewer windows, said nowhere else
            self.reporter.progress(Stage.PACK, message=f"calibrated on {used} windows, not the {spec.calib_samples} "
                                                       f"asked: the calibration text holds no more")
        return out

    def _eval_windows(self, folder: Path, config: LlamaConfig) -> EvalWindows:
        spec = self.spec
        # An s3:// source's window is settled here, once its config.json is read (publish_spec: a local source's
        # was at Publish): the default or the context if shorter, an asked one refused past the context.
        seq_len = config.window(spec.eval_seq_len, DEFAULT_EVAL_SEQ_LEN, "eval.seq_len", "an eval")
        text = local_file(spec.eval_data, self.work_dir / "eval", self.services.config.store)
        _check_pinned(text, spec.eval_sha256, "eval.data", spec.eval_data)
        return eval_windows(text, spec.eval_name, folder, seq_len, spec.eval_max_windows)

    def _quantize_and_fp16_eval(self, folder: Path, checkpoint: HfCheckpoint, model_version: str,
                                windows: EvalWindows) -> tuple[Path, float]:
        """The fp16 perplexity needs only the checkpoint: with config.overlap_eval it is measured on a
        second thread while quantizing, which keeps a second core busy through the quantizer's serial
        stretches. Otherwise it is measured after (or read from the cache)."""
        cache = self.services.fp16_cache
        key = cache.key(model_version, windows)
        ppl_fp16 = cache.get(key)
        if ppl_fp16 is not None or not self.services.config.overlap_eval:
            artifact_dir = self._quantize(folder, checkpoint.config.num_layers)
            if ppl_fp16 is not None:
                self.reporter.progress(Stage.EVAL, message=f"fp16 perplexity {ppl_fp16:.4f} (cached)")
            else:
                ppl_fp16 = checkpoint_perplexity(checkpoint, windows, self.device,
                                                 self._window_progress("fp16", windows))
                cache.put(key, ppl_fp16)
            return artifact_dir, ppl_fp16

        def alongside(done: int, total: int) -> None:  # silent: the job's stage is the quantizer's
            self.reporter.check()
            if self._abandoned:
                raise JobCancelled("quantization failed: the fp16 perplexity is not needed")

        with ThreadPoolExecutor(1, thread_name_prefix="fp16-eval") as side:
            future = side.submit(checkpoint_perplexity, checkpoint, windows, self.device, alongside)
            try:
                artifact_dir = self._quantize(folder, checkpoint.config.num_layers)
            except BaseException:
                self._abandoned = True
                raise
            if not future.done():
                self.reporter.progress(Stage.EVAL, message=f"fp16 perplexity on {windows.name}: finishing "
                                                            f"{windows.count} windows of {windows.seq_len} tokens")
            ppl_fp16 = future.result()
        cache.put(key, ppl_fp16)
        self.reporter.progress(Stage.EVAL, message=f"fp16 perplexity {ppl_fp16:.4f} (measured while quantizing)")
        return artifact_dir, ppl_fp16

    def _quantized_perplexity(self, artifact_dir: Path, windows: EvalWindows, ppl_fp16: float) -> float:
        if self.spec.format == "fp16":  # the artifact is the checkpoint's own weights
            return ppl_fp16
        return artifact_perplexity(artifact_dir, windows, self.device, self._window_progress(self.spec.format, windows))

    def _window_progress(self, what: str, windows: EvalWindows) -> Callable[[int, int], None]:
        started = time.monotonic()
        self.reporter.progress(Stage.EVAL, message=f"{what} perplexity on {windows.name}: "
                                                    f"{windows.count} windows of {windows.seq_len} tokens")

        def progress(done: int, total: int) -> None:
            remaining = (time.monotonic() - started) / done * (total - done)
            self.reporter.progress(Stage.EVAL, message=f"{what}: {done}/{total} windows", remaining_s=remaining)

        return progress

    def _gate(self, ppl_fp16: float, ppl_quantized: float, windows: EvalWindows) -> None:
        budget = self.spec.budget
        self.evaluation = EvaluationView(windows.name, ppl_fp16, ppl_quantized, windows.seq_len, windows.count, budget)
        self.details = ArtifactDetails(0, self.evaluation)
        increase = ppl_quantized / ppl_fp16 - 1
        numbers = (f"quantized perplexity {ppl_quantized:.4f} vs fp16 {ppl_fp16:.4f} on {windows.name} "
                   f"({windows.count} windows of {windows.seq_len} tokens): {increase:+.2%}")
        if not (math.isfinite(ppl_fp16) and math.isfinite(ppl_quantized)):
            raise AccuracyBudgetExceeded(f"accuracy budget exceeded: {numbers}: a perplexity that is not a finite "
                                         f"number (a model that overflows to inf or NaN) is within no budget")
        if over_budget(ppl_fp16, ppl_quantized, budget):
            raise AccuracyBudgetExceeded(
                f"accuracy budget exceeded: {numbers}, above the budget of {budget:.2%} "
                f"(max_relative_perplexity_increase={budget:g})"
            )
        self.reporter.progress(Stage.EVAL, message=f"{numbers}, within the budget of {budget:.2%}")

    def _write_manifest(self, artifact_dir: Path, windows: EvalWindows, ppl_fp16: float, ppl_quantized: float) -> Manifest:
        # The manifest is not in its own file list, so rewriting it keeps every listed sha256 valid.
        manifest = Manifest.read(artifact_dir)
        manifest.artifact_id = self.claim.artifact_id
        manifest.model_name = self.spec.model_name
        manifest.evaluation = Evaluation(windows.name, windows.sha256, windows.seq_len, windows.count,
                                         ppl_fp16, ppl_quantized)
        manifest.write(artifact_dir)
        return manifest

    def _upload(self, artifact_dir: Path, digest: str) -> tuple[str | None, str]:
        """-> (id of the READY artifact whose identical objects are reused, or None; manifest sha256)."""
        store, prefix = self.services.store, self.claim.object_prefix
        self.reporter.progress(Stage.UPLOAD, message=f"publishing to {store.uri(prefix)}")
        # An earlier attempt of this (never READY) artifact died mid-publish. Cleared also when a twin's
        # objects are reused: a worker without a registry finds an artifact id by the manifest under it.
        self._clear_prefix(store, prefix)
        with self.services.registry.sessions() as session:
            twin = find_ready_by_digest(session, digest)
        if twin is not None:
            self.reporter.progress(Stage.UPLOAD, message=f"identical content is stored as artifact {twin.id}: "
                                                          f"reusing {twin.object_prefix}")
            return twin.id, twin.manifest_sha256
        objects = store.publish_folder(
            artifact_dir, prefix,
            progress=lambda info: self.reporter.progress(
                Stage.UPLOAD, message=f"uploaded {info.key.split('/', 2)[-1]} ({info.size} bytes)"),
        )
        self.details = ArtifactDetails(sum(o.size for o in objects), self.evaluation)
        return None, sha256_file(artifact_dir / MANIFEST_NAME)

    def _clear_prefix(self, store: ObjectStore, prefix: str) -> None:
        """Clears the prefix under its claim (shared/storage/claims.py). A claim still held is waited for, up to
        CLEAR_WAIT_S: one left by a quantizer killed mid-publish and restarted at once (it fails its own jobs at
        start, so a retry can come seconds later) is taken over once stale. Past the wait (an orphaned job, cut
        off from the registry but alive, still publishing there: its files and ours would mix) the job fails."""
        deadline = time.monotonic() + CLEAR_WAIT_S
        while True:
            try:
                store.clear_prefix(prefix)  # even empty: a publish killed while uploading left its claim alone
                return
            except PublishInProgress as exc:
                if time.monotonic() >= deadline:
                    raise
                self.reporter.progress(Stage.UPLOAD, message=f"waiting for the artifact's prefix: {exc}")
                time.sleep(CLEAR_POLL_S)

    def _register(self, finish: Callable[[Session, str], None], digest: str, manifest_sha256: str,
                  reuse_of: str | None, artifact_dir: Path) -> None:
        artifact_id = self.claim.artifact_id
        try:
            # Inside the try: a stop (JobCancelled) or a registry error at this report must not leave the
            # uploaded objects, manifest included, behind an artifact that ends FAILED.
            self.reporter.progress(Stage.REGISTER)
            vocabulary = Tokenizer(artifact_dir / TOKENIZER_DIR).vocabulary_digest()  # checked across a deployment's arms
            with self.services.registry.transaction() as session:
                mark_artifact_ready(
                    session, artifact_id, manifest_sha256=manifest_sha256, content_digest=digest,
                    actor=self.services.config.owner, ppl_fp16=self.evaluation.ppl_fp16,
                    ppl_quant=self.evaluation.ppl_quantized, eval_data=self.evaluation.data_name,
                    reuse_prefix_of=reuse_of, vocabulary_digest=vocabulary,
                )
                finish(session, artifact_id)
        except Exception:
            # Never leave objects behind an artifact that is not READY, but never delete those of one that is:
            # the commit may have gone through before its error (a connection lost after COMMIT was sent).
            if reuse_of is None and self._may_delete_objects(artifact_id):
                try:
                    self.services.store.delete_prefix(self.claim.object_prefix)
                except Exception as exc:  # the original error matters more; purge later
                    log.warning("could not delete %s after a failed register: %s", self.claim.object_prefix, exc)
            elif reuse_of is None:
                # Failed as an orphan while it published (cut off from the registry, not dead): the sweep that
                # failed it deleted what was there then, and this publish went on to write a whole artifact.
                delete_leftover_objects(self.services, artifact_id, f"job {self.job_id}, failed as an orphan while "
                                        "it published,")
            raise
        if reuse_of is not None:
            size = sum(f.size for f in Manifest.read(artifact_dir).files)
            self.details = ArtifactDetails(size, self.evaluation)

    def _holds_claim(self, session: Session) -> bool:
        """Whether this job still holds its claim: a job failed meanwhile as an orphan (its quantizer was
        cut off from the registry for longer than orphan_after_s) has lost it, and another job may be
        retrying the same artifact, writing to the same prefix, right now."""
        return get_job(session, self.job_id).state in (JobState.QUEUED, JobState.RUNNING)

    def _may_delete_objects(self, artifact_id: str) -> bool:
        """Whether a failed register may delete the objects it uploaded: not when the artifact is READY
        despite the error (a connection lost after COMMIT was sent), nor when this job no longer holds it,
        nor when the registry cannot be read. Keeping objects is safe: a retry of the binding replaces
        them before publishing."""
        try:
            with self.services.registry.sessions() as session:
                return get_artifact(session, artifact_id).state != ArtifactState.READY and self._holds_claim(session)
        except Exception as exc:
            log.warning("could not read the state of artifact %s after a failed register: %s", artifact_id, exc)
            return False


def _check_pinned(path: Path, pinned: str, what: str, uri: str) -> None:
    """Raises InputChanged when the request pinned the file's sha256 and the file read is not that content:
    an artifact calibrated or evaluated on other text than the caller reviewed must not be published."""
    if not pinned:
        return
    digest = sha256_file(path)
    if digest != pinned:
        raise InputChanged(f"{what} {uri} has sha256 {digest}, not the {pinned} the request pinned: the file "
                           f"changed since; check it, then publish again with its new sha256 (or none)")
