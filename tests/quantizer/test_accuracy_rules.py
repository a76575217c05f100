"""The accuracy gate's rule and the fp16 perplexity cache's key (accuracy audit)."""

from __future__ import annotations

import math

import pytest
import torch

from services.quantizer.config import over_budget
from services.quantizer.evaluate import EvalWindows, Fp16PerplexityCache


@pytest.mark.parametrize("fp16, quantized", [(5.0, math.nan), (5.0, math.inf), (math.nan, 5.0), (math.inf, 5.0)])
def test_a_perplexity_that_is_not_a_number_is_never_within_the_budget(fp16, quantized):
    """A quantization that overflows (scales x10) measured NaN, and NaN compared as within any budget: the job
    said "+nan%, within the budget" and uploaded, stopped only by the registry refusing the number."""
    assert over_budget(fp16, quantized, budget=10.0)


def test_finite_perplexities_are_judged_by_the_ratio():
    assert not over_budget(5.0, 5.2, budget=0.05)
    assert over_budget(5.0, 5.3, budget=0.05)


def test_the_fp16_cache_keys_on_the_tokens_not_only_the_text():
    """A checkpoint with the same weights (the same model_version) and another tokenizer got the first one's fp16
    perplexity, measured on other tokens, and was judged against it (+148.8% where its own was +4.4%)."""
    tokens = torch.arange(24, dtype=torch.int64).reshape(3, 8)
    same_text = dict(name="eval", sha256="a" * 64, seq_len=8)
    first = EvalWindows(tokens=tokens, **same_text)
    other_tokenizer = EvalWindows(tokens=tokens + 1, **same_text)
    assert Fp16PerplexityCache.key("v", first) != Fp16PerplexityCache.key("v", other_tokenizer)
    assert Fp16PerplexityCache.key("v", first) == Fp16PerplexityCache.key("v", EvalWindows(tokens=tokens.clone(),
                                                                                         **same_text))
    assert Fp16PerplexityCache.key("v", first) != Fp16PerplexityCache.key("w", first)
    fewer = EvalWindows(tokens=tokens[:2], **same_text)
    assert Fp16PerplexityCache.key("v", first) != Fp16PerplexityCache.key("v", fewer)


def test_an_artifact_reusing_a_twins_files_does_not_take_the_twins_windows_for_its_numbers():
    """Published again on 8 windows, an artifact reusing an identical one's stored files (published on 4) read
    that one's manifest after a restart: its own 8-window perplexities came labelled as of 4 windows."""
    from datetime import datetime, timezone
    from types import SimpleNamespace

    from services.quantizer.views import ArtifactDetails, ArtifactView, EvaluationView
    from shared.registry import ArtifactState

    version = SimpleNamespace(model=SimpleNamespace(name="tiny"), content_hash="c" * 64, label="")
    row = SimpleNamespace(id="b" * 32, model_version=version, format="w4a8kv4-g128", gpu="cpu",
                          state=ArtifactState.READY, failure_reason=None, object_prefix="tiny/a/", eval_data="eval",
                          ppl_fp16=5.774, ppl_quant=5.856, created_at=datetime.now(timezone.utc),
                          vocabulary_digest="")
    twins = ArtifactDetails(100, EvaluationView("eval", 7.158, 7.302, seq_len=512, windows=4))
    unknown = ArtifactView.from_row(row, twins).evaluation
    assert (unknown.ppl_fp16, unknown.ppl_quantized, unknown.seq_len, unknown.windows) == (5.774, 5.856, 0, 0)
    own = ArtifactDetails(100, EvaluationView("eval", 5.774, 5.856, seq_len=512, windows=8, budget=0.05))
    known = ArtifactView.from_row(row, own).evaluation
    assert (known.seq_len, known.windows, known.budget) == (512, 8, 0.05)
