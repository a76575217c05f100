"""`qctl quantize`: checkpoint folder -> artifact folder, with a progress bar per block."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from qctl.choices import FormatName
from qctl.devices import resolve_device, resolve_gpu_target
from qctl.errors import user_errors
from shared.formats.spec import format_spec
from shared.quant.options import DEFAULT_SAMPLES, DEFAULT_SEQ_LEN, QoQOptions


@user_errors
def quantize(
    model: Path = typer.Option(..., "--model", help="Hugging Face Llama checkpoint folder (safetensors)"),
    format: FormatName = typer.Option(..., "--format", help="artifact format"),
    out: Path = typer.Option(..., "--out", help="artifact folder to write (replaced only if it holds the same artifact)"),
    calib: Path = typer.Option(None, "--calib", help="calibration text file [default: the Python standard library sources]"),
    calib_samples: int = typer.Option(DEFAULT_SAMPLES, help="calibration windows"),
    calib_seq_len: int = typer.Option(None, help=f"tokens per calibration window [default: {DEFAULT_SEQ_LEN}, or the "
                                                 "model's context if shorter]"),
    gpu_target: str = typer.Option("auto", help="GPU the artifact is bound to: cpu, sm80, sm89, sm90, or auto"),
    device: str = typer.Option("auto", help="torch device that runs the quantization: cpu, cuda, or auto"),
    name: str = typer.Option(None, help="model name recorded in the manifest [default: the folder name]"),
    rtn: bool = typer.Option(False, "--rtn", help="plain round-to-nearest: switch every QoQ step off"),
    rotation: bool = typer.Option(True, "--rotation/--no-rotation", help="Hadamard rotation of block inputs"),
    rotate_values: bool = typer.Option(True, "--rotate-values/--no-rotate-values", help="per-head rotation of V"),
    smooth_attention: bool = typer.Option(True, "--smooth-attention/--no-smooth-attention", help="SmoothAttention on K"),
    kv_range_search: bool = typer.Option(True, "--kv-range-search/--no-kv-range-search",
                                         help="per-layer KV4 range ratio of V, searched"),
    smoothing: bool = typer.Option(True, "--smoothing/--no-smoothing", help="smoothing of o_proj/down_proj inputs"),
    reorder: bool = typer.Option(True, "--reorder/--no-reorder", help="activation-aware channel reordering"),
    clipping: bool = typer.Option(True, "--clipping/--no-clipping", help="weight clip-ratio search"),
    gptq: bool = typer.Option(True, "--gptq/--no-gptq", help="error-compensated rounding"),
    compensate_inputs: bool = typer.Option(
        QoQOptions().compensate_inputs, "--compensate-inputs/--no-compensate-inputs",
        help="fit each linear to its fp output from the quantized block's inputs (int8, KV4) before rounding"),
    key_feedback: bool = typer.Option(False, "--key-feedback/--no-key-feedback",
                                      help="KV4 keys rounded with error feedback against each layer's query statistics"),
    seed: int = typer.Option(0, help="seed of the rotations and the token subsample"),
):
    """Quantize a checkpoint into an artifact folder (manifest.json + safetensors)."""
    # Imported here, not at the top: they import torch, which only this command's run needs.
    from shared.quant.calibration import CalibrationError
    from shared.quant.quantize_model import QuantizeSettings, needs_calibration, quantize_checkpoint

    if rtn:
        options = QoQOptions.rtn()
    else:
        options = QoQOptions(
            rotation=rotation, rotate_values=rotate_values, smooth_attention=smooth_attention, kv_range_search=kv_range_search,
            smoothing=smoothing, reorder=reorder, clipping=clipping, gptq=gptq,
            compensate_inputs=compensate_inputs, key_feedback=key_feedback, seed=seed,
        )
    settings = QuantizeSettings(
        model_dir=model, out_dir=out, format=format.value, gpu_target=resolve_gpu_target(gpu_target),
        options=options, calib_path=calib, calib_samples=calib_samples, calib_seq_len=calib_seq_len,
        model_name=name, device=resolve_device(device), needs_tokenizer=True,
    )
    console = Console(stderr=True)
    if calib is not None and not needs_calibration(format_spec(settings.format), settings.options):
        if not calib.is_file():
            raise CalibrationError(f"calibration file {calib} does not exist")
        console.print(f"note: --calib {calib} is not used: {settings.format} with these options needs no calibration",
                      soft_wrap=True)
    columns = (TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        tasks: dict[str, int] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        manifest = quantize_checkpoint(settings, progress)
    console.print(
        f"wrote {out} ({manifest.format}, {manifest.gpu_target}, artifact {manifest.artifact_id}, "
        f"model version {manifest.model_version[:12]})"
    )
