"""Greedy tokens streamed over gRPC equal the reference forward's, for 8 concurrent requests of
different lengths arriving at different times; preemption and resumption change nothing."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.worker.conftest import check_greedy, generate, stub

# (prompt length, new tokens, arrival delay in seconds): prompts longer than max_batch_tokens=32
# are prefilled in chunks, and late arrivals join a batch that is already decoding.
REQUESTS = [(5, 8, 0.0), (40, 6, 0.0), (17, 10, 0.05), (3, 7, 0.1), (33, 5, 0.1), (9, 9, 0.2), (26, 6, 0.3), (12, 8, 0.4)]


def _prompts(n_requests, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 4096, (length,), generator=g).tolist() for length, _, _ in n_requests]


def _run_concurrently(worker_stub, prompts, requests):
    results = [None] * len(requests)

    def one(i):
        time.sleep(requests[i][2])
        results[i] = generate(worker_stub, prompts[i], max_new_tokens=requests[i][1], ignore_eos=True)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


# Overlapped steps (the GPU default: each step launched before the previous one's tokens are read
# back) must give the same tokens; on the CPU they are off by default, so they are asked for here.
@pytest.mark.parametrize("fmt, overlap", [("fp16", False), ("w4a8kv4-g128", False), ("w4a8kv4-g128", True)])
def test_concurrent_greedy_equals_reference_forward(fmt, overlap, start_worker, reference_models, artifacts):
    worker = start_worker(fmt, overlap_steps=overlap)
    channel, worker_stub = stub(worker)
    prompts = _prompts(REQUESTS)
    results = _run_concurrently(worker_stub, prompts, REQUESTS)
    channel.close()
    model = reference_models[fmt]
    tokenizer = worker.server.served.tokenizer
    for (length, new, _), prompt, messages in zip(REQUESTS, prompts, results):
        tokens = [t for m in messages for t in m.token_ids]
        finish = messages[-1].finish
        assert finish.reason == 1 and finish.prompt_tokens == length and finish.generated_tokens == new
        assert all(not m.HasField("finish") for m in messages[:-1])
        assert "".join(m.text for m in messages) == tokenizer.decode(tokens)
        check_greedy(model, prompt, tokens)
    stats = worker.server.served.engine.stats()
    assert stats.kv_blocks_used == 0 and stats.running == 0 and stats.waiting == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_gives_the_tokens_of_an_uninterrupted_run(overlap, start_worker, reference_models):
    # 12 blocks of 4 tokens = 48 slots; a sequence of 9-12 + 14 tokens ends on 6 or 7 blocks, so any three
    # of these four decoding together need at least 18: some must be preempted (blocks taken back) and
    # recomputed. Four requests at once, not three with one arriving later: on a loaded host the
    # late one once arrived after the first two had finished, and nothing was preempted.
    worker = start_worker("w4a8kv4-g128", kv_blocks=12, block_size=4, max_batch_tokens=16, overlap_steps=overlap)
    channel, worker_stub = stub(worker)
    requests = [(10, 14, 0.0), (11, 14, 0.0), (9, 14, 0.0), (12, 14, 0.0)]
    prompts = _prompts(requests, seed=1)
    results = _run_concurrently(worker_stub, prompts, requests)
    channel.close()
    stats = worker.server.served.engine.stats()
    assert stats.preemptions > 0, "the tiny cache was expected to force a preemption"
    assert stats.kv_blocks_used == 0
    for (_, new, _), prompt, messages in zip(requests, prompts, results):
        tokens = [t for m in messages for t in m.token_ids]
        assert messages[-1].finish.generated_tokens == new
        check_greedy(reference_models["w4a8kv4-g128"], prompt, tokens)

    # The same requests one at a time on a worker whose cache never runs out: the same tokens.
    roomy = start_worker("w4a8kv4-g128", kv_blocks=64, block_size=4, max_batch_tokens=16)
    channel, roomy_stub = stub(roomy)
    for (_, new, _), prompt, messages in zip(requests, prompts, results):
        alone = generate(roomy_stub, prompt, max_new_tokens=new, ignore_eos=True)
        assert [t for m in alone for t in m.token_ids] == [t for m in messages for t in m.token_ids]
    channel.close()
    assert roomy.server.served.engine.stats().preemptions == 0
