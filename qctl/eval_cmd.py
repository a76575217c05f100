"""`qctl eval`: perplexity of a checkpoint, or of an artifact made from it, over a whole text file."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import Progress

from qctl.devices import resolve_device
from qctl.errors import user_errors
from shared.model.config import LlamaConfig

DEFAULT_SEQ_LEN = 512  # eval's window when --seq-len is not given (or the model's context, if shorter)


@user_errors
def evaluate(
    model: Path = typer.Option(..., "--model", help="the source checkpoint folder (its tokenizer is used)"),
    artifact: Path = typer.Option(None, "--artifact", help="an artifact folder made from --model [default: the fp model]"),
    data: Path = typer.Option(..., "--data", help="text file, tokenized whole, no special tokens"),
    seq_len: int = typer.Option(None, help="window length; windows do not overlap "
                                "[default: 512, or the model's max_position_embeddings if shorter]"),
    max_windows: int = typer.Option(0, help="score only the first N windows (0: all)"),
    batch_size: int = typer.Option(8, help="windows per forward"),
    device: str = typer.Option("auto", help="cpu, cuda, or auto"),
    as_json: bool = typer.Option(False, "--json", help='print {"ppl": ..., "tokens": ...} only'),
):
    """Perplexity over the whole file in non-overlapping windows."""
    # Imported here, not at the top: they import torch, which only this command's run needs.
    from shared.formats.artifact import ArtifactReader
    from shared.model.checkpoint import HfCheckpoint
    from shared.model.load import artifact_model, fp_model
    from shared.model.perplexity import perplexity, windows_of
    from shared.model.text_file import read_text_file
    from shared.model.tokenizer import Tokenizer, check_token_ids

    if batch_size < 1:  # before the (long) model load; perplexity() checks it too
        raise ValueError(f"batch size must be at least 1, got {batch_size}")
    dev = resolve_device(device)
    _, text = read_text_file(data, "data file")
    config = LlamaConfig.from_folder(model)
    tokenizer = Tokenizer(model)
    seq_len = config.window(seq_len, DEFAULT_SEQ_LEN, "--seq-len", "an eval")
    if artifact is not None:
        reader = ArtifactReader(artifact)
        if LlamaConfig.from_dict(reader.manifest.model_config) != config:
            raise ValueError(f"artifact {artifact} was not made from {model}: their model configurations differ")
        # The same configuration is not the same model (a fine-tune, another version): scored with the wrong
        # checkpoint's tokenizer, the number would be compared with that checkpoint's fp16 perplexity.
        version = HfCheckpoint(model).content_hash()
        if reader.manifest.model_version != version:
            raise ValueError(f"artifact {artifact} was not made from {model}: it was made from model version "
                             f"{reader.manifest.model_version[:12]}, and {model} is version {version[:12]} (same "
                             f"configuration, other weights)")
        # Nor is the same weights with another tokenizer (content_hash covers config.json and the weights): the
        # worker serves with the artifact's, so that is the one whose ids the number must be of.
        if reader.tokenizer_dir.is_dir() and \
                Tokenizer(reader.tokenizer_dir).vocabulary_digest() != tokenizer.vocabulary_digest():
            raise ValueError(f"artifact {artifact} carries another tokenizer than {model} (their id -> token tables "
                             f"differ): its workers would read other token ids than this eval scores")
        net = artifact_model(reader, dev)
    else:
        net = fp_model(HfCheckpoint(model), dev)
    windows = windows_of(tokenizer.encode(text), seq_len)
    check_token_ids(windows, config.vocab_size, f"the data file {data}")
    if max_windows > 0:
        windows = windows[:max_windows]
    with Progress(console=Console(stderr=True), transient=True, disable=as_json) as bar:
        task = bar.add_task("eval", total=windows.shape[0])
        result = perplexity(net.forward, windows, batch_size, dev, lambda done, total: bar.update(task, completed=done))
    if as_json:
        print(json.dumps({"ppl": result.ppl, "tokens": result.tokens, "windows": result.windows}))
    else:
        print(f"perplexity {result.ppl:.4f} over {result.tokens} tokens ({result.windows} windows of {seq_len})")
