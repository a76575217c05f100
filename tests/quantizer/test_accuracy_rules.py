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
