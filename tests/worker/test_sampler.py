"""The sampler: greedy, temperature with top-k / top-p, and seeds that reproduce whatever the batch."""

import torch

from services.worker.engine.sampler import NON_FINITE, filter_logits, finite_rows, ids_for_host, new_generator, sample
from services.worker.engine.sequence import SamplingOptions

PROBS = torch.tensor([0.05, 0.5, 0.15, 0.3])  # token 1 most likely, then 3, 2, 0


def _draws(opt: SamplingOptions, logits: torch.Tensor, n: int) -> list[int]:
    g = new_generator(opt, torch.device("cpu"))
    return [int(sample(logits[None], [opt], [g])[0]) for _ in range(n)]


def test_greedy_rows_take_the_argmax_and_ignore_the_rest():
    logits = torch.randn(3, 50)
    opts = [SamplingOptions(), SamplingOptions(top_k=3, seed=1), SamplingOptions()]
    got = sample(logits, opts, [None, None, None])
    assert got.dtype == torch.int64 and got.device == logits.device  # ids stay where the logits are
    assert got.tolist() == logits.argmax(dim=-1).tolist()


def test_top_k_keeps_the_k_most_likely():
    opt = SamplingOptions(temperature=1.0, top_k=2, seed=0)
    assert set(_draws(opt, PROBS.log(), 200)) == {1, 3}


def test_top_p_keeps_the_smallest_set_reaching_p():
    kept = torch.isfinite(filter_logits(PROBS.log(), 1.0, 0, 0.8)).nonzero().flatten().tolist()
    assert kept == [1, 3]  # 0.5 + 0.3 reaches 0.8: token 2 is not needed
    kept = torch.isfinite(filter_logits(PROBS.log(), 1.0, 0, 0.81)).nonzero().flatten().tolist()
    assert kept == [1, 2, 3]
    kept = torch.isfinite(filter_logits(PROBS.log(), 1.0, 0, 0.01)).nonzero().flatten().tolist()
    assert kept == [1]  # the most likely token always stays
    opt = SamplingOptions(temperature=1.0, top_p=0.8, seed=3)
    assert set(_draws(opt, PROBS.log(), 200)) == {1, 3}


def test_temperature_sharpens_and_flattens():
    low = _draws(SamplingOptions(temperature=0.05, seed=0), PROBS.log(), 100)
    high = _draws(SamplingOptions(temperature=5.0, seed=0), PROBS.log(), 400)
    assert set(low) == {1}
    assert set(high) == {0, 1, 2, 3}


def test_a_seed_reproduces_the_same_tokens_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 4096)  # 6 steps of one request
    opt = SamplingOptions(temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    alone_g = new_generator(opt, torch.device("cpu"))
    alone = [int(sample(logits[i : i + 1], [opt], [alone_g])[0]) for i in range(6)]
    # Same request batched with two sampled strangers that draw from their own generators.
    other = SamplingOptions(temperature=1.0, seed=99)
    g, g1, g2 = (new_generator(o, torch.device("cpu")) for o in (opt, other, other))
    batched = []
    for i in range(6):
        rows = torch.stack([torch.randn(4096), logits[i], torch.randn(4096)])
        batched.append(int(sample(rows, [other, opt, other], [g1, g, g2])[1]))
    assert batched == alone
    unseeded = {tuple(_draws(SamplingOptions(temperature=1.0), torch.zeros(4096), 4)) for _ in range(3)}
    assert len(unseeded) > 1  # no seed: fresh randomness per request


def test_seeds_differing_only_in_their_high_bits_draw_different_tokens():
    """The proto's seed is 64 bits; the CPU generator keeps only the low 32 of its own seed."""
    logits = torch.zeros(4096)
    for a, b in ((1, 2**32 + 1), (0, 2**63), (12345, 12345 + 7 * 2**40)):
        draws = [_draws(SamplingOptions(temperature=1.0, seed=s), logits, 8) for s in (a, b)]
        assert draws[0] != draws[1], (a, b)
    assert _draws(SamplingOptions(temperature=1.0, seed=2**64 - 1), logits, 8) == \
        _draws(SamplingOptions(temperature=1.0, seed=2**64 - 1), logits, 8)


def test_a_tiny_temperature_samples_the_argmax_instead_of_failing_the_step():
    """A valid (finite, > 0) but tiny fp32 temperature overflows logits / temperature to inf; the
    softmax then gives NaN and multinomial raises, which failed the whole step (every request
    batched with it). It must behave as the limit it approaches: the most likely token."""
    logits = torch.tensor([[1.0, 5.0, 3.0, -2.0]])
    for temperature in (1e-38, 1e-45, 1e-20):
        opt = SamplingOptions(temperature=temperature, top_k=3, top_p=0.9, seed=0)
        assert _draws(opt, logits[0], 3) == [1, 1, 1]


def test_a_non_finite_row_is_marked_for_the_host_and_sampling_it_does_not_raise():
    logits = torch.randn(3, 50)
    logits[1, 7], logits[2, 0] = float("nan"), float("inf")
    opts = [SamplingOptions(temperature=1.0, seed=0)] * 3
    finite = finite_rows(logits)
    ids = sample(logits, opts, [new_generator(o, torch.device("cpu")) for o in opts], finite)
    assert finite.tolist() == [True, False, False]
    assert ((0 <= ids) & (ids < 50)).all()  # valid token ids on the device: the next step embeds them
    host = ids_for_host(ids, finite).tolist()
    assert host[0] == int(ids[0]) and host[1:] == [NON_FINITE, NON_FINITE]
