"""build_host_step: a mixed step's rows (grouped prefill / continuing chunks / decode, so attention
slices them) and its logit rows (batch order, which the sampler and the engine rely on)."""

import numpy as np

from services.worker.engine.runner import SequenceChunk, StepBatch
from services.worker.engine.step_inputs import build_host_step


def test_rows_are_grouped_by_attention_path_and_logits_stay_in_batch_order():
    batch = StepBatch(chunks=[
        SequenceChunk(seq_id=1, token_ids=[11], start_position=5, block_table=[0, 1], want_logits=True),  # decode
        SequenceChunk(seq_id=2, token_ids=[21, 22, 23], start_position=0, block_table=[2], want_logits=True),
        SequenceChunk(seq_id=3, token_ids=[31, 32], start_position=4, block_table=[3, 4], want_logits=False),
        SequenceChunk(seq_id=4, token_ids=[41, 42], start_position=0, block_table=[5], want_logits=True),
    ])
    host = build_host_step(batch, block_size=4, max_blocks=4, max_model_len=64)
    # prefill chunks (2, 4), then the chunk continuing a cached prefix (3), then the decode token (1)
    assert host.tokens.tolist() == [21, 22, 23, 41, 42, 31, 32, 11]
    assert host.num_prefill == 5 and host.cu_seqlens.tolist() == [0, 3, 5] and host.max_seqlen == 3
    assert host.positions.tolist() == [0, 1, 2, 0, 1, 4, 5, 5]
    assert host.slots.tolist() == [8, 9, 10, 20, 21, 16, 17, 5]  # block * 4 + offset
    assert host.num_chunked == 2 and host.chunk_cu.tolist() == [0, 2] and host.chunk_starts.tolist() == [4]
    assert host.chunk_tables[:, :2].tolist() == [[3, 4]] and host.max_chunk == 2
    assert host.context_lens.tolist() == [6] and host.max_context == 6
    assert host.block_tables[:, :2].tolist() == [[0, 1]]
    # logits of chunks 1, 2 and 4 in that order: the decode's row 7, then rows 2 and 4
    assert host.logit_rows.tolist() == [7, 2, 4]
    assert np.all(host.block_tables[:, 2:] == 0) and np.all(host.chunk_tables[:, 2:] == 0)
