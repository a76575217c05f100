"""Accuracy on the trained fixture: the figures users judge us by (a few minutes on 2 CPU cores).

The full table, with the ablation and the issue's targets, is bench/results/accuracy.json
(bench/accuracy.py). Here the fixture's fp16 perplexity must reproduce the published 5.012 on the
whole file, and QoQ must keep its measured accuracy: a regression in any QoQ step shows up as a
failure here. The quantized models are evaluated on every other window (108 of the 215), against
fp16 on the same windows: half the evaluation time, and the ratios moved by at most 0.02 of the
gap (session 17, this suite's settings: g128 QoQ 1.0197 x fp16 on those windows against 1.0188 on
all, 0.413 of the gap to RTN closed against 0.432; per-channel 1.0229 / 1.0232, 0.536 / 0.520).
"""

import math
import time

import pytest

from shared.formats.artifact import ArtifactReader
from shared.model.checkpoint import HfCheckpoint
from shared.model.load import artifact_model, fp_model
from shared.model.perplexity import perplexity, windows_of
from shared.model.tokenizer import Tokenizer
from shared.quant.options import QoQOptions
from shared.quant.quantize_model import QuantizeSettings, quantize_checkpoint
from tests.time_limits import assert_within

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def windows(tiny_llama, eval_text):
    return windows_of(Tokenizer(tiny_llama).encode(eval_text.read_text()), 512)


@pytest.fixture(scope="module")
def fp16_halves(tiny_llama, windows):
    """fp16 perplexity on the even windows and on the odd ones."""
    forward = fp_model(HfCheckpoint(tiny_llama)).forward
    return perplexity(forward, windows[::2]), perplexity(forward, windows[1::2])


@pytest.fixture(scope="module")
def fp16_ppl(fp16_halves):
    """fp16 perplexity on the even windows: what the quantized models are compared with."""
    return fp16_halves[0].ppl


def _quantized_ppl(tiny_llama, calib_text, windows, out, fmt, options):
    start = time.time()
    quantize_checkpoint(QuantizeSettings(tiny_llama, out, fmt, options=options, calib_path=calib_text))
    seconds = time.time() - start
    return perplexity(artifact_model(ArtifactReader(out)).forward, windows[::2]).ppl, seconds


def test_fp16_reproduces_the_published_perplexity(windows, fp16_halves):
    assert windows.shape == (215, 512)
    even, odd = fp16_halves
    # every window scores seq_len - 1 tokens, so the whole file's mean NLL weighs each half by its windows
    whole = math.exp((math.log(even.ppl) * even.windows + math.log(odd.ppl) * odd.windows) / windows.shape[0])
    assert abs(whole - 5.012) <= 0.01


def test_qoq_g128_keeps_accuracy_and_quantizes_in_under_two_minutes(tiny_llama, calib_text, windows, fp16_ppl, tmp_path):
    qoq, seconds = _quantized_ppl(tiny_llama, calib_text, windows, tmp_path / "qoq", "w4a8kv4-g128", QoQOptions())
    rtn, _ = _quantized_ppl(tiny_llama, calib_text, windows, tmp_path / "rtn", "w4a8kv4-g128", QoQOptions.rtn())
    assert_within(seconds, 120, "quantizing the fixture (QoQ g128)")
    # bench/results/accuracy.json (whole file): RTN 1.033, QoQ 1.0192 (the 1.02, met), 0.42
    # of the gap closed (half not met); on the even windows 1.0197 and 0.41. 1.021 leaves room for
    # the ~0.005 ppl that hosts' float math moves it.
    assert qoq / fp16_ppl <= 1.021
    assert (rtn - qoq) / (rtn - fp16_ppl) >= 0.35


def test_qoq_per_channel_keeps_accuracy(tiny_llama, calib_text, windows, fp16_ppl, tmp_path):
    qoq, _ = _quantized_ppl(tiny_llama, calib_text, windows, tmp_path / "qoq", "w4a8kv4-chn", QoQOptions())
    rtn, _ = _quantized_ppl(tiny_llama, calib_text, windows, tmp_path / "rtn", "w4a8kv4-chn", QoQOptions.rtn())
    # The 1.03 x fp16, met on every host measured. Its half of the gap to RTN sits inside the
    # spread of hosts' float math and of the rotation's seed: accuracy.json (Intel Xeon) 1.0232 and
    # 0.52 closed, 0.54 on the even windows; an AMD EPYC host (session 18, whole file / even windows)
    # 1.0251 and 0.48 / 0.49 with the default seed, 0.52 / 0.52 and 0.52 / 0.52 with seeds 1 and 2.
    # So the floor here is 0.45: a regression of any QoQ step costs more than that spread.
    assert qoq / fp16_ppl <= 1.03
    assert (rtn - qoq) / (rtn - fp16_ppl) >= 0.45
