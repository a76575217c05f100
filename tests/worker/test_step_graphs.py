"""StepGraphs' bookkeeping on the CPU, with toy pieces: buckets, padding, attention on the real rows,
re-capture when the W4A8 workspace moves (the runner's end-to-end test is in test_triton_runner.py)."""

from __future__ import annotations

import pytest
import torch

from services.worker.engine.step_graphs import StepBuffers, StepGraphs
from services.worker.engine.step_inputs import StepTensors
from services.worker.kernels import w4a8_gemm
from tests.worker.conftest import EagerPiece

LAYERS = 2
CPU = torch.device("cpu")


class _Model:
    """Pieces that write what they saw into the buffers, and an attention that records its rows."""

    def __init__(self):
        self.seen = []  # (piece k, slots, positions) at each piece run
        self.attended = []  # (layer, rows) at each attention

    def piece(self, k: int, st: StepTensors, buf: StepBuffers, rotate_keys: bool) -> None:
        assert rotate_keys  # a captured piece serves steps with prefill rows
        self.seen.append((k, st.slots.tolist(), st.positions.tolist()))
        buf.x[:, 0] = st.tokens.half() + k

    def attend(self, layer: int, st: StepTensors, buf: StepBuffers) -> None:
        self.attended.append((layer, buf.x.shape[0]))


def _step(tokens: list[int]) -> StepTensors:
    t = len(tokens)
    return StepTensors(tokens=torch.tensor(tokens), positions=torch.arange(3, 3 + t, dtype=torch.int32),
                       slots=torch.arange(10, 10 + t), num_prefill=t, cu_seqlens=torch.tensor([0, t], dtype=torch.int32),
                       max_seqlen=t, block_tables=None, context_lens=None, max_context=0, logit_rows=None)


@pytest.fixture
def graphs(monkeypatch):
    monkeypatch.setattr(w4a8_gemm, "WORKSPACE", w4a8_gemm._Workspace())  # this test's own
    model = _Model()
    buffers = StepBuffers.empty(8, hidden=4, heads=2, kv_heads=1, head_dim=16, device=CPU)
    return model, StepGraphs(model.piece, model.attend, LAYERS, buffers, (8, 4), CPU, capture_piece=EagerPiece)


def test_a_step_replays_its_bucket_padded_with_attention_on_its_own_rows(graphs):
    model, g = graphs
    rows = g.run(_step([5, 6, 7]))
    assert g.bucket_for(3) == 4 and sorted(g.graphs) == [4] and len(g.graphs[4]) == LAYERS + 1
    assert rows.x.shape[0] == 3 and rows.x[:, 0].tolist() == [5 + LAYERS, 6 + LAYERS, 7 + LAYERS]
    # The capture ran each piece with no cache writes; the replay saw the step's rows and one padding row.
    replayed = model.seen[-(LAYERS + 1):]
    assert all(slots == [10, 11, 12, -1] and positions == [3, 4, 5, 0] for _, slots, positions in replayed)
    assert model.attended == [(0, 3), (1, 3)]
    # A bigger step's rows do not leak into a smaller one's padding.
    g.run(_step([1, 2, 3, 4, 5, 6, 7]))
    g.run(_step([9]))
    assert model.seen[-1][1:] == ([10, -1, -1, -1], [3, 0, 0, 0])
    with pytest.raises(ValueError, match="above the largest step graph"):
        g.run(_step(list(range(9))))


def test_pieces_are_captured_again_when_the_workspace_moves(graphs):
    model, g = graphs
    g.run(_step([1, 2]))
    first = g.graphs[4]
    g.run(_step([1, 2]))
    assert g.graphs[4] is first  # replayed, not captured again
    w4a8_gemm.WORKSPACE.get(CPU, 1 << 10)  # a bigger split-K workspace: the captures point at freed memory
    assert g.workspace_moved()
    g.run(_step([1, 2]))
    assert g.graphs[4] is not first and not g.workspace_moved()


def test_buffers_must_hold_the_largest_bucket():
    buffers = StepBuffers.empty(4, hidden=4, heads=2, kv_heads=1, head_dim=16, device=CPU)
    with pytest.raises(ValueError, match="cannot hold the 8-token bucket"):
        StepGraphs(lambda *a: None, lambda *a: None, LAYERS, buffers, (4, 8), CPU, capture_piece=EagerPiece)


def test_large_steps_replay_a_graph_only_when_its_bucket_pads_them_little():
    """Small steps wait on the host, so a graph wins at any padding; large ones are GPU-bound, and
    7,176 tokens padded to the 8,192 bucket cost their prompt phase 8% on an H100 (session 40)."""
    from services.worker.engine.step_graphs import LAUNCH_BOUND_TOKENS, replays_graph

    assert replays_graph(17, 32) and replays_graph(LAUNCH_BOUND_TOKENS - 255, LAUNCH_BOUND_TOKENS)
    assert replays_graph(2049, 2304) and replays_graph(4096, 4096)
    assert not replays_graph(7176, 8192) and not replays_graph(4097, 5120)
    assert replays_graph(8000, 8192) and replays_graph(5000, 5120)
    assert not replays_graph(9000, None)
