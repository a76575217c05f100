"""`qctl demo`: quantize a model, check its accuracy against fp16 and generate a few tokens, offline.

Given no --model it makes a small random-weight Llama (and says so): the path is real, the text
is noise. Point --model at a trained checkpoint for meaningful perplexity and text.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import typer
from rich.console import Console

from qctl.choices import FormatName
from qctl.errors import user_errors


@user_errors
def demo(
    model: Path = typer.Option(None, "--model", help="checkpoint folder [default: make a small random demo model]"),
    workdir: Path = typer.Option(Path(".qserve-demo"), help="where the demo model and artifact are written"),
    format: FormatName = typer.Option("w4a8kv4-g128", "--format", help="artifact format"),
    prompt: str = typer.Option("def fibonacci(n):", help="prompt for the generated sample"),
    new_tokens: int = typer.Option(24, help="tokens to generate"),
):
    """Quantize -> verify -> evaluate -> generate, on the CPU reference backend."""
    # Imported here, not at the top: they import torch, which only this command's run needs.
    import torch

    from shared.formats.artifact import ArtifactReader
    from shared.model.checkpoint import HfCheckpoint
    from shared.model.load import artifact_model, fp_model
    from shared.model.perplexity import perplexity, windows_of
    from shared.model.tokenizer import Tokenizer
    from shared.quant.calibration import default_calibration_text
    from shared.quant.quantize_model import QuantizeSettings, quantize_checkpoint

    console = Console(stderr=True)
    if model is None:
        model = demo_model(workdir / "demo-model", console)
    out = workdir / f"artifact-{format.value}"
    console.print(f"quantizing {model} -> {out} ({format.value})")
    settings = QuantizeSettings(model_dir=model, out_dir=out, format=format.value, calib_samples=8, calib_seq_len=256)
    quantize_checkpoint(settings, lambda stage, done, total: console.print(f"  {stage} {done}/{total}") if stage == "quantize" else None)
    reader = ArtifactReader(out)  # verifies every file's sha256 against the manifest
    quantized, reference = artifact_model(reader), fp_model(HfCheckpoint(model))
    tokenizer = Tokenizer(model)
    _, text = default_calibration_text(max_bytes=400_000)
    windows = windows_of(tokenizer.encode(text[-60_000:]), 256)[:8]
    ppl_fp, ppl_q = perplexity(reference.forward, windows).ppl, perplexity(quantized.forward, windows).ppl
    console.print(f"perplexity fp16 {ppl_fp:.3f}  {format.value} {ppl_q:.3f}  ratio {ppl_q / ppl_fp:.4f}")
    ids = tokenizer.encode(prompt)
    for _ in range(new_tokens):
        logits = quantized.forward(torch.tensor([ids]))
        ids.append(int(logits[0, -1].argmax()))
    print(tokenizer.decode(ids))


def demo_model(folder: Path, console: Console, note: str = "") -> Path:
    """The small random-weight Llama at folder (`qctl demo`'s and `qctl up`'s without --model), written when it
    is not there. One that an older qctl left half written (stopped while writing it in place; it is written
    into a temporary folder now) is deleted and written again: that folder is qctl's own, under its --workdir."""
    from shared.model.demo import demo_checkpoint_complete, write_demo_checkpoint  # here, not at the top: torch

    if demo_checkpoint_complete(folder):
        return folder
    if folder.exists():
        console.print(f"{folder} is incomplete (a run was stopped while writing it): deleting it")
        shutil.rmtree(folder)
    console.print(f"no --model given: writing a small random-weight Llama to {folder} (no download){note}")
    return write_demo_checkpoint(folder, "tiny")
