"""Every weight layout survives safetensors and means what its class says."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.formats.weights import WEIGHT_KINDS, FormatError, W4G128ProgressiveWeight
from shared.quant.weights import WEIGHT_QUANTIZERS


@pytest.mark.parametrize("kind", sorted(WEIGHT_QUANTIZERS))
def test_round_trip_through_safetensors(kind, tmp_path):
    w = torch.randn(67, 256)  # odd N
    packed = WEIGHT_QUANTIZERS[kind][0](w)
    path = tmp_path / "w.safetensors"
    save_file(packed.tensors("layer"), str(path))
    loaded = WEIGHT_KINDS[kind].from_tensors("layer", load_file(str(path)))
    assert torch.equal(loaded.dequantize(), packed.dequantize())
    rel = (loaded.dequantize() - w).norm() / w.norm()
    assert rel < {"fp16": 1e-3, "w8": 0.01}.get(kind, 0.12), f"{kind}: relative error {rel:.4f}"


def test_missing_tensor_names_the_key():
    packed = WEIGHT_QUANTIZERS["w4chn"][0](torch.randn(8, 128))
    tensors = packed.tensors("down")
    del tensors["down.zero"]
    with pytest.raises(FormatError, match="down.zero"):
        WEIGHT_KINDS["w4chn"].from_tensors("down", tensors)


def test_wrong_dtype_is_refused_with_shapes_named():
    packed = WEIGHT_QUANTIZERS["w4g128p"][0](torch.randn(8, 128))
    with pytest.raises(FormatError, match="s2: expected"):
        W4G128ProgressiveWeight(qweight=packed.qweight, s1=packed.s1, s2=packed.s2.float(), zero=packed.zero)


def test_clip_ratio_shrinks_the_range():
    w = torch.randn(4, 128)
    w[:, 0] = 20.0  # an outlier per row
    full = WEIGHT_QUANTIZERS["w4chn"][0](w)
    clipped = WEIGHT_QUANTIZERS["w4chn"][0](w, torch.full((4,), 0.5))
    assert (clipped.scale.float() < full.scale.float()).all()


@pytest.mark.parametrize("kind", ["w4g128p", "w4chn", "w4g128"])
def test_a_4bit_weight_whose_k_is_not_a_multiple_of_the_group_is_refused(kind):
    """K = 192: one group of 128 and 64 columns that no group scale covers; the kernels would read
    past the codes. Refused when built (from an artifact's tensors), not at the first GEMM."""
    n, k = 4, 192
    cls = WEIGHT_KINDS[kind]
    tensors = {
        "w4g128p": dict(qweight=torch.zeros(n, k // 2, dtype=torch.uint8), s1=torch.ones(n, dtype=torch.float16),
                        s2=torch.ones(n, 1, dtype=torch.uint8), zero=torch.zeros(n, 1, dtype=torch.uint8)),
        "w4chn": dict(qweight=torch.zeros(n, k // 2, dtype=torch.uint8), scale=torch.ones(n, dtype=torch.float16),
                      zero=torch.zeros(n, dtype=torch.float16)),
        "w4g128": dict(qweight=torch.zeros(n, k // 2, dtype=torch.uint8), scale=torch.ones(n, 1, dtype=torch.float16),
                       zero=torch.zeros(n, 1, dtype=torch.uint8)),
    }[kind]
    with pytest.raises(FormatError, match="multiple of"):
        cls(**tensors)


@pytest.mark.parametrize("rank", [1, 3])
@pytest.mark.parametrize("kind", ["w8", "w4g128p", "w4chn", "w4g128"])
def test_a_qweight_of_another_rank_is_a_format_error(kind, rank):
    """Unpacking its shape was a bare ValueError ("not enough values to unpack"): not the FormatError an artifact
    reader turns into a refusal, so a worker died with a traceback on such an artifact."""
    tensors = WEIGHT_QUANTIZERS[kind][0](torch.randn(8, 128)).tensors("down")
    qweight = tensors["down.qweight"]
    tensors["down.qweight"] = qweight.flatten() if rank == 1 else qweight[None]
    with pytest.raises(FormatError, match=r"qweight: expected a 2-D tensor"):
        WEIGHT_KINDS[kind].from_tensors("down", tensors)
