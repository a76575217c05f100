"""build_host_step: a mixed step's rows (prefill chunks first, so attention slices them) and its
logit rows (batch order, which the sampler and the engine rely on)."""

import numpy as np

from services.worker.engine.runner import SequenceChunk, StepBatch
from services.worker.engine.step_inputs import build_host_step


def test_prefill_rows_come_first_and_logits_stay_in_batch_order():
    batch = StepBatch(chunks=[
        SequenceChunk(seq_id=1, token_ids=[11], start_position=5, block_table=[0, 1], want_logits=True),  # decode
        SequenceChunk(seq_id=2, token_ids=[21, 22, 23], start_position=0, block_table=[2], want_logits=True),
        SequenceChunk(seq_id=3, token_ids=[31, 32], start_position=4, block_table=[3, 4], want_logits=False),
        SequenceChunk(seq_id=4, token_ids=[41, 42], start_position=0, block_table=[5], want_logits=True),
    ])
    host = build_host_step(batch, block_size=4, max_blocks=4, max_model_len=64)
    assert host.tokens.tolist() == [21, 22, 23, 41, 42, 11, 31, 32]
    assert host.num_prefill == 5 and host.cu_seqlens.tolist() == [0, 3, 5] and host.max_seqlen == 3
    assert host.positions.tolist() == [0, 1, 2, 0, 1, 5, 4, 5]
    assert host.slots.tolist() == [8, 9, 10, 20, 21, 5, 16, 17]  # block * 4 + offset
    assert host.context_lens.tolist() == [6, 5, 6] and host.max_context == 6
    assert host.block_tables[:, :2].tolist() == [[0, 1], [3, 4], [3, 4]]
    # logits of chunks 1, 2 and 4 in that order: the decode's row 5, then rows 2 and 4
    assert host.logit_rows.tolist() == [5, 2, 4]
    assert np.all(host.block_tables[:, 2:] == 0)
