"""Quantize a Hugging Face Llama checkpoint into an artifact folder, streaming block by block.

Peak memory is one block's fp32 weights, the embedding and LM head, and the calibration
activations: a 7B checkpoint never needs its whole fp32 size in memory.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from shared import __version__
from shared.disk_space import RoomCheck, shortage
from shared.formats.artifact import (
    EMBED_FILE,
    HEAD_FILE,
    TOKENIZER_DIR,
    ArtifactError,
    ArtifactWriter,
    block_file,
    block_tensors,
    estimated_artifact_bytes,
)
from shared.formats.kernel_policy import POLICY_KINDS, shipped_policy
from shared.formats.manifest import GPU_TARGETS, Manifest
from shared.formats.probe import PROBE_FILE
from shared.formats.spec import FormatSpec, format_spec
from shared.formats.weights import GROUP_SIZE, Fp16Weight
from shared.model.checkpoint import HfCheckpoint
from shared.model.config import CheckpointError, LlamaConfig
from shared.model.load import reference_probe
from shared.model.rope import cos_sin, inverse_frequencies
from shared.model.tokenizer import TOKENIZER_FILES, Tokenizer, check_token_ids
from shared.quant.block import WorkBlock
from shared.quant.calibration import DEFAULT_SAMPLES, DEFAULT_SEQ_LEN, load_calibration
from shared.quant.options import QoQOptions
from shared.quant.qoq import quantize_block
from shared.quant.rotation import rotation_matrix

Progress = Callable[[str, int, int], None]  # (stage, done, total)


@dataclass(slots=True, frozen=True)
class QuantizeSettings:
    model_dir: Path
    out_dir: Path
    format: str
    gpu_target: str = "cpu"
    options: QoQOptions = field(default_factory=QoQOptions)
    calib_path: Path | None = None  # None: the built-in default calibration text
    calib_samples: int = DEFAULT_SAMPLES
    calib_seq_len: int | None = None  # None: DEFAULT_SEQ_LEN, or the model's context if that is shorter
    model_name: str | None = None  # default: the checkpoint folder's name
    device: str = "cpu"
    # The free-space check before any work: a SharedSpace's when other jobs write to the same disk.
    room: RoomCheck = shortage
    # Refuse a checkpoint without a tokenizer before any work (qctl quantize: a worker refuses such an artifact; fp16
    # and RTN read no calibration text, so nothing else would). Tests and benches make token-id-only artifacts.
    needs_tokenizer: bool = False

    def __post_init__(self):
        format_spec(self.format)  # raises on an unknown format
        if self.gpu_target not in GPU_TARGETS:
            raise ValueError(f"unknown GPU target {self.gpu_target!r}; expected one of: {', '.join(GPU_TARGETS)}")


def check_group_divisibility(config: LlamaConfig, spec: FormatSpec) -> None:
    if not spec.needs_groups:
        return
    sizes = {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
             "num_attention_heads*head_dim": config.q_size}
    for name, size in sizes.items():
        if size % GROUP_SIZE:
            raise CheckpointError(
                f"{name}={size} is not a multiple of the group size {GROUP_SIZE} that format {spec.name} needs; "
                "use w8a8 or fp16 for this model"
            )


def artifact_bytes(model_dir: str | Path, config: LlamaConfig, spec: FormatSpec, options: QoQOptions) -> int:
    """About what quantize_checkpoint writes for this checkpoint, a little over (estimated_artifact_bytes)."""
    key_feedback = spec.kv_bits == 4 and options.key_feedback
    return estimated_artifact_bytes(
        spec, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_layers=config.num_layers, q_size=config.q_size,
        kv_size=config.kv_size, key_feedback_floats=config.num_kv_heads * config.head_dim ** 2 if key_feedback else 0,
        other_files=sum(p.stat().st_size for p in (Path(model_dir) / n for n in TOKENIZER_FILES) if p.is_file()))


def check_room_for_artifact(out_dir: str | Path, model_dir: str | Path, config: LlamaConfig, spec: FormatSpec,
                            options: QoQOptions, room: RoomCheck = shortage) -> None:
    """Refuses, before any work, an artifact the output folder's disk cannot hold (ArtifactError naming both
    figures): the writing would otherwise fail on ENOSPC after the whole quantization."""
    needed = artifact_bytes(model_dir, config, spec, options)
    short = room(out_dir, needed, f"the {spec.name} artifact in {out_dir}")
    if short is not None:
        raise ArtifactError(short)


def needs_calibration(spec: FormatSpec, options: QoQOptions) -> bool:
    if spec.weight_kind == "fp16":
        return False
    kv_data = spec.kv_bits == 4 and (options.kv_range_search or options.key_feedback)
    return (options.smooth_attention or kv_data or options.smoothing or options.reorder or options.clipping or options.gptq
            or options.compensate_inputs)


@torch.no_grad()
def quantize_checkpoint(settings: QuantizeSettings, progress: Progress | None = None) -> Manifest:
    report = progress or (lambda stage, done, total: None)
    spec = format_spec(settings.format)
    device = torch.device(settings.device)
    report("load", 0, 1)
    ckpt = HfCheckpoint(settings.model_dir)
    config = ckpt.config
    check_group_divisibility(config, spec)
    options = settings.options if spec.weight_kind != "fp16" else QoQOptions.rtn()
    check_room_for_artifact(settings.out_dir, settings.model_dir, config, spec, options, settings.room)
    if settings.needs_tokenizer:
        Tokenizer(settings.model_dir)  # a CheckpointError naming the folder when it has none
    tokens, calibration = None, None
    if needs_calibration(spec, options):
        # Before the (long, for a 7B model) content hash, so a bad calibration file fails fast.
        seq_len = config.window(settings.calib_seq_len or None, DEFAULT_SEQ_LEN, "--calib-seq-len", "a calibration")
        tokens, calibration = load_calibration(
            settings.calib_path, Tokenizer(settings.model_dir), settings.calib_samples, seq_len
        )
        check_token_ids(tokens, config.vocab_size, f"the calibration text {calibration.data_name}")
    model_version = ckpt.content_hash()
    report("load", 1, 1)

    # What makes two artifacts the same (an existing --out is replaced only by the same one): the
    # calibration data too, since other data gives other weights.
    identity = {"model_version": model_version, "format": spec.name, "gpu_target": settings.gpu_target,
                "options": options.to_dict(), "calibration": calibration.to_dict() if calibration else None}
    with ArtifactWriter(settings.out_dir, identity) as writer:
        rotation = rotation_matrix(config.hidden_size, options.seed).float().to(device) if options.rotation else None
        value_rotation = (
            rotation_matrix(config.head_dim, options.seed + 1).float().to(device) if options.rotate_values else None
        )
        embed = ckpt.embed_tokens().to(device=device, dtype=torch.float32)  # (V, H)
        if rotation is not None:
            embed = embed @ rotation
        writer.write_tensors(EMBED_FILE, {"embed": embed.half()})

        x, cos, sin, token_idx = None, None, None, None
        if tokens is not None:
            x = embed[tokens.to(device)]  # (N, T, H) fp32
            positions = torch.arange(tokens.shape[1], device=device)
            cos, sin = cos_sin(positions, inverse_frequencies(config.rope, config.head_dim))
            g = torch.Generator().manual_seed(options.seed)
            token_idx = torch.randperm(tokens.numel(), generator=g)[: options.search_tokens].sort().values.to(device)
        del embed

        for i in range(config.num_layers):
            work = WorkBlock.from_fp(ckpt.block(i), device)
            qb, x = quantize_block(config, work, x, cos, sin, spec, options, rotation, token_idx, value_rotation)
            writer.write_tensors(block_file(i), block_tensors(qb.norms, qb.linears, qb.kv_range, qb.key_feedback))
            del work, qb
            report("quantize", i + 1, config.num_layers)

        report("pack", 0, 1)
        final_norm = ckpt.final_norm().to(device=device, dtype=torch.float32)
        lm_head = ckpt.lm_head().to(device=device, dtype=torch.float32)
        if rotation is not None:
            lm_head = (lm_head * final_norm[None, :]) @ rotation
            final_norm = torch.ones_like(final_norm)
        head = {"final_norm": final_norm.half(), **Fp16Weight(lm_head.half()).tensors("lm_head")}
        writer.write_tensors(HEAD_FILE, head)
        for name in TOKENIZER_FILES:
            src = Path(settings.model_dir) / name
            if src.is_file():
                writer.copy_file(src, f"{TOKENIZER_DIR}/{name}")
        manifest = Manifest(
            artifact_id=uuid.uuid4().hex,
            model_name=settings.model_name or Path(settings.model_dir).resolve().name,
            model_version=model_version,
            format=spec.name,
            gpu_target=settings.gpu_target,
            quantizer_version=__version__,
            model_config=config.to_dict(),
            options=options.to_dict(),
            calibration=calibration.to_dict() if calibration else None,
            created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            # The GEMM variants measured fastest on this GPU target travel with the artifact.
            kernel_policy=shipped_policy(settings.gpu_target) if spec.weight_kind in POLICY_KINDS else None,
        )
        # The reference logits of the probe, from the weights as written: what a worker checks its kernels against.
        writer.write_tensors(PROBE_FILE, reference_probe(writer.staged_reader(manifest), device).tensors())
        writer.finish(manifest)
        report("pack", 1, 1)
    return manifest
