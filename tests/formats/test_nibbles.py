import pytest
import torch

from shared.formats.nibbles import WEIGHT_PACK_CHUNK, pack_halves, unpack_halves


def test_round_trip_and_documented_layout():
    q = torch.randint(0, 16, (3, 256), dtype=torch.uint8)
    packed = pack_halves(q, WEIGHT_PACK_CHUNK)
    assert packed.shape == (3, 128) and packed.dtype == torch.uint8
    assert torch.equal(unpack_halves(packed, WEIGHT_PACK_CHUNK), q)
    # byte j of chunk c: low nibble = value 128c + j, high nibble = value 128c + 64 + j
    assert packed[1, 64 + 2].item() == q[1, 128 + 2].item() | (q[1, 128 + 64 + 2].item() << 4)


def test_rejects_lengths_that_are_not_whole_chunks():
    with pytest.raises(ValueError, match="multiple of the pack chunk 128"):
        pack_halves(torch.zeros(2, 192, dtype=torch.uint8), WEIGHT_PACK_CHUNK)


def test_rejects_non_uint8_codes():
    with pytest.raises(TypeError):
        pack_halves(torch.zeros(2, 128, dtype=torch.int32), WEIGHT_PACK_CHUNK)
