"""W4A8 GEMM kernels (Triton interpreter) against the reference linears of shared/model/linear.py.

The int8 paths must equal the reference bit for bit: both take the same exact int32 sums through
the same fp32 epilogue. The fp16-MMA path accumulates integer-valued products in fp32, which is
exact at these sizes; it is held to rtol 1e-3 as the function it promises.
"""

from __future__ import annotations

import pytest
import torch

from services.worker.kernels import w4a8_gemm as gemm
from shared.formats.weights import GROUP_SIZE, W4G128ProgressiveWeight, pack_codes
from shared.model.linear import reference_linear
from shared.quant.activations import quantize_per_token
from shared.quant.weights import progressive_safe_code_range, quantize_w4_channel, quantize_w4_g128_progressive

# (M, N, K): M around the tile edges, N not a multiple of any tile, K = 128 x odd.
SHAPES = [(1, 67, 384), (3, 200, 640), (127, 200, 384), (128, 67, 640), (129, 200, 384)]


def _activations(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, torch.randint(0, k, (3,), generator=g)] *= 20  # outlier channels: codes span [-127, 127]
    return x


def _full_range_g128(n: int, k: int, seed: int) -> W4G128ProgressiveWeight:
    """Random s2, zero and codes anywhere in the safe range: int8 weights reach both ends of int8."""
    g = torch.Generator().manual_seed(seed)
    s2 = torch.randint(1, 17, (n, k // GROUP_SIZE), generator=g, dtype=torch.uint8)
    zero = torch.randint(0, 16, (n, k // GROUP_SIZE), generator=g, dtype=torch.uint8)
    lo, hi = progressive_safe_code_range(s2, zero)
    u = torch.rand(n, k // GROUP_SIZE, GROUP_SIZE, generator=g)
    q = (lo[..., None] + torch.floor(u * (hi - lo + 1)[..., None])).clamp(max=15).flatten(1).to(torch.uint8)
    s1 = (torch.rand(n, generator=g) * 1e-3 + 1e-4).half()
    return W4G128ProgressiveWeight(qweight=pack_codes(q), s1=s1, s2=s2, zero=zero)


def _weight(kind: str, n: int, k: int, seed: int):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    return quantize_w4_g128_progressive(w) if kind == "w4g128p" else quantize_w4_channel(w)


def _slice_tested(v: gemm.GemmVariant) -> bool:
    """The variants the K-slice and group-sums tests run: the x-shared M = 1 loops differ from each
    other only in rows per program and warps (the same code), so one per kind stands for the rest
    there; the interpreter runs their programs one by one (the n4 ones took 20 s a test)."""
    if v.x_shared:
        return v.name.endswith(".n16m1g16.xs")
    return True


def _rows(v: gemm.GemmVariant, cap: int) -> int:
    """Tokens a test runs a variant at: up to cap, its max_m, and 2 for the x-shared loops (one
    program per token: 2 covers the per-token offsets, more only multiplies interpreter time)."""
    return min(cap, 2 if v.x_shared else (v.max_m or cap))


def _assert_matches(y: torch.Tensor, ref: torch.Tensor, variant: gemm.GemmVariant) -> None:
    assert y.dtype == torch.float16 and y.shape == ref.shape
    assert torch.isfinite(y).all()
    if variant.dot_fp16:
        torch.testing.assert_close(y.float(), ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item())
    else:
        assert torch.equal(y.float(), ref), f"max diff {(y.float() - ref).abs().max().item()}"


@pytest.mark.parametrize("variant", gemm.VARIANTS, ids=lambda v: v.name)
def test_variant_matches_reference_linear(variant: gemm.GemmVariant):
    ran = 0
    for i, (m, n, k) in enumerate(SHAPES):
        if not variant.can_implement(m, n, k, variant.kind)[0] or (m > 1 and not _slice_tested(variant)):
            continue
        weight = _weight(variant.kind, n, k, seed=i)
        x = _activations(m, k, seed=100 + i)
        x8, sx = quantize_per_token(x)
        y = gemm.w4a8_gemm(x8, sx[:, 0], weight, variant=variant.name)
        _assert_matches(y, reference_linear(weight)(x), variant)
        ran += 1
    assert ran >= (1 if variant.max_m == 1 or not _slice_tested(variant) else 2)  # M = 1 also in the split-K test


@pytest.mark.parametrize("variant", [v for v in gemm.VARIANTS if (v.split_k or v.gemv) and _slice_tested(v)],
                         ids=lambda v: v.name)
def test_split_k_slices_sum_exactly(variant: gemm.GemmVariant):
    _assert_splits_sum_exactly(variant, (1, 2, 3, 5), seed=7)


def _assert_splits_sum_exactly(variant: gemm.GemmVariant, splits: tuple[int, ...], seed: int) -> None:
    # K = 640 is 5 groups: 2 slices of (3, 2) groups, 3 of (2, 2, 1), 5 of one each.
    m, n, k = _rows(variant, 5), 67, 640
    weight = _weight(variant.kind, n, k, seed=seed)
    x = _activations(m, k, seed=seed + 1)
    x8, sx = quantize_per_token(x)
    ref = reference_linear(weight)(x)
    for split in splits:
        y = gemm.w4a8_gemm(x8, sx, weight, variant=variant.name, split_k=split)
        _assert_matches(y, ref, variant)


@pytest.mark.parametrize("name", ["chn.n64m16.sk", "g128.n64m16.sk.zp", "chn.gemv.n8m4g4"])
def test_split_epilogue_sums_whole_and_partial_slice_tiles_exactly(name: str):
    """The epilogue reads the slices as one power-of-two tile: splits that fill it (2) and that leave
    masked rows (3, 5)."""
    _assert_splits_sum_exactly(gemm.get_variant(name), (2, 3, 5), seed=11)


def test_split_factor_rules(monkeypatch):
    monkeypatch.setattr(gemm, "_num_sms", lambda device: 132)
    cpu = torch.device("cpu")
    # About 3 programs per SM: 32 x 4 tiles of 128 x 64 at M = 256, N = 4096.
    assert gemm.split_factor(gemm.get_variant("chn.n128m64.sk"), 256, 4096, 11008, cpu) == 3
    capped = gemm.get_variant("chn.n128m128.sk.r128")  # two CTAs per SM: at most one wave of 264
    assert gemm.split_factor(capped, 256, 4096, 11008, cpu) == 4  # 64 tiles -> 256 programs
    assert gemm.split_factor(capped, 256, 12288, 4096, cpu) == 1  # 192 tiles already fill most of it
    assert gemm.split_factor(capped, 16, 4096, 1024, cpu) == 2  # 32 tiles would take 8; 8 groups allow 2
    assert gemm.split_factor(gemm.get_variant("chn.n128m128.r128"), 16, 4096, 4096, cpu) == 1  # not a split variant


@pytest.mark.parametrize("variant", [v for v in gemm.VARIANTS if v.kind == "w4g128p"], ids=lambda v: v.name)
def test_g128_full_int8_weight_range(variant: gemm.GemmVariant):
    m, n, k = _rows(variant, 9), 67, 384
    weight = _full_range_g128(n, k, seed=3)
    w8 = weight.int8_weight()
    assert w8.min() == -128 and w8.max() == 126  # 127 is no product of a code and a scale <= 16
    x = _activations(m, k, seed=4)
    x8, sx = quantize_per_token(x)
    y = gemm.w4a8_gemm(x8, sx, weight, variant=variant.name, split_k=2 if variant.split_k or variant.gemv else None)
    _assert_matches(y, reference_linear(weight)(x), variant)


@pytest.mark.parametrize("name", ["chn.n64m16.sk", "chn.n64m16.sk.f16", "chn.n128m128", "chn.gemv.n8m4g4", "chn.gemv.n8m1g16",
                                  "chn.gemv.n16m1g16.xs"])
def test_channel_rowsum_given_or_computed(name: str):
    from services.worker.kernels.act_quant import quantize

    variant = gemm.get_variant(name)
    m, n, k = _rows(variant, 3), 200, 640
    weight = _weight("w4chn", n, k, seed=5)
    x = _activations(m, k, seed=6)
    x8, sx, rowsum, _ = quantize(x)
    ref = reference_linear(weight)(x)
    for rs in (rowsum, None):
        _assert_matches(gemm.w4a8_gemm(x8, sx, weight, rowsum=rs, variant=name, split_k=2), ref, variant)


@pytest.mark.parametrize("variant", [v for v in gemm.VARIANTS if v.kind == "w4g128p"
                                     and (v.gemv or v.zero_after_dot) and _slice_tested(v)],
                         ids=lambda v: v.name)
def test_g128_group_sums_given_or_computed(variant: gemm.GemmVariant):
    """The variants that take x8's group sums (the M = 1 dp4a loop, the .zp kernels) use them for the
    zero term when given (full int8 weight range, a K slice per program or several); the others
    (the other dp4a loops) check and ignore them. Same exact result either way."""
    m, n, k = _rows(variant, 3), 67, 640
    for rows in sorted({1, m}):
        weight = _full_range_g128(n, k, seed=9)
        x = _activations(rows, k, seed=10 + rows)
        x8, sx = quantize_per_token(x)
        group_sums = x8.view(rows, k // GROUP_SIZE, GROUP_SIZE).sum(-1, dtype=torch.int32)
        ref = reference_linear(weight)(x)
        splits = (1, 2, 5) if variant.split_k or variant.gemv else (None,)
        for split in splits:
            for sums in (group_sums, None):
                y = gemm.w4a8_gemm(x8, sx, weight, variant=variant.name, group_sums=sums, split_k=split)
                _assert_matches(y, ref, variant)
        with pytest.raises(ValueError, match="group_sums"):
            gemm.w4a8_gemm(x8, sx, weight, variant=variant.name, group_sums=group_sums[:, 1:])


def test_which_variants_take_group_sums():
    takes = {v.name for v in gemm.VARIANTS if v.takes_group_sums}
    assert takes == {v.name for v in gemm.VARIANTS if v.kind == "w4g128p" and (v.zero_after_dot or (v.gemv and v.block_m == 1))}
    assert "g128.gemv.n8m4g4" not in takes and "g128.n128m16.sk.zp" in takes


def test_every_output_is_written_into_a_given_buffer():
    m, n, k = 3, 67, 384
    weight = _weight("w4g128p", n, k, seed=9)
    x8, sx = quantize_per_token(_activations(m, k, seed=10))
    out = torch.full((m, n), float("nan"), dtype=torch.float16)
    y = gemm.w4a8_gemm(x8, sx, weight, variant="g128.n64m16.sk", out=out)
    assert y.data_ptr() == out.data_ptr() and torch.isfinite(out).all()


def test_default_variant_is_logged_once(caplog):
    m, n, k = 2, 67, 384
    weight = _weight("w4chn", n, k, seed=11)
    x = _activations(m, k, seed=12)
    x8, sx = quantize_per_token(x)
    gemm._logged_defaults.clear()
    with caplog.at_level("INFO", logger=gemm.__name__):
        y = gemm.w4a8_gemm(x8, sx, weight)
        gemm.w4a8_gemm(x8, sx, weight)
    assert torch.equal(y.float(), reference_linear(weight)(x))
    assert [r.getMessage() for r in caplog.records].count(
        f"w4a8_gemm: no variant given for w4chn M=2, using {gemm.default_variant_name(2, 'w4chn')}") == 1


def test_can_implement_reasons():
    v = gemm.get_variant("g128.n64m16.sk.f16")
    assert v.can_implement(16, 4096, 4096, "w4g128p") == (True, "ok")
    ok, reason = v.can_implement(1, 4096, 200, "w4g128p")
    assert not ok and "K=200" in reason and "128" in reason
    ok, reason = v.can_implement(17, 4096, 4096, "w4g128p")
    assert not ok and "M=17" in reason
    ok, reason = v.can_implement(1, 4096, 4096, "w4chn")
    assert not ok and "w4chn" in reason
    ok, reason = gemm.get_variant("chn.n128m128").can_implement(1, 64, gemm.MAX_K + 128, "w4chn")
    assert not ok and "overflow" in reason
    for variant in gemm.VARIANTS:
        ok, reason = variant.can_implement(1, 64, 384, variant.kind)
        assert ok, reason
    ok, reason = gemm.get_variant("chn.gemv.n8m1g16").can_implement(2, 64, 384, "w4chn")
    assert not ok and "M=2" in reason


def test_bad_requests_name_the_problem():
    m, n, k = 2, 67, 384
    weight = _weight("w4g128p", n, k, seed=13)
    x8, sx = quantize_per_token(_activations(m, k, seed=14))
    with pytest.raises(ValueError, match="unknown W4A8 GEMM variant 'nope'"):
        gemm.w4a8_gemm(x8, sx, weight, variant="nope")
    with pytest.raises(ValueError, match="reads w4chn weights, not w4g128p.*g128.n64m16.sk: ok"):
        gemm.w4a8_gemm(x8, sx, weight, variant="chn.n64m16.sk")
    with pytest.raises(TypeError, match="W8Weight"):
        from shared.quant.weights import quantize_w8

        gemm.w4a8_gemm(x8, sx, quantize_w8(torch.randn(n, k)))
    with pytest.raises(ValueError, match="K=256"):
        gemm.w4a8_gemm(x8[:, :256], sx, weight, variant="g128.n64m16.sk")


def test_no_variant_takes_a_problem_past_int32_offsets():
    """The kernels index with int32 offsets: a problem whose M x N or M x K reaches 2^31 is refused by name."""
    for variant in gemm.VARIANTS:
        ok, why = variant.can_implement(2**17, 2**14, 4096, variant.kind)  # M x N = 2^31
        assert not ok and "2^31" in why, (variant.name, why)


def test_workspace_is_one_buffer_per_device_whatever_the_spelling(monkeypatch):
    # A runner built with "cuda" and a GEMM launched on tensors of "cuda:0" once kept two
    # workspaces; the decode graphs watched the one the GEMMs never used, and replayed over a
    # freed buffer after the other grew.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert gemm.canonical_device("cuda") == torch.device("cuda", 0) == gemm.canonical_device(torch.device("cuda:0"))
    assert gemm.canonical_device("cpu") == torch.device("cpu")
    ws = gemm._Workspace()
    small = ws.get("cpu", 8)
    assert ws.get(torch.device("cpu"), 4) is small and ws.pointer("cpu") == small.data_ptr()
    grown = ws.get("cpu", 64)
    assert grown.numel() == 64 and ws.pointer(torch.device("cpu")) == grown.data_ptr() != small.data_ptr()
    assert ws.pointer("meta") is None


def test_int8_path_dequantizes_every_weight_and_uses_the_workspace():
    """The int8 path's first pass writes exactly the weight's int8 values (N = 67: a partial block of
    rows; full int8 range) over whatever the scratch held; the GEMM reads them from WORKSPACE, whose
    size workspace_elements reports; it takes no split."""
    from services.worker.kernels.w4a8_int8_path import dequantize_g128_to_int8

    n, k = 67, 384
    weight = _full_range_g128(n, k, seed=15)
    # K = 384 is 3 groups: 2 or 4 a program leave groups past K, masked.
    for block_n, groups in ((64, 1), (32, 2), (16, 4)):
        scratch = torch.full((n * k + 100,), 77, dtype=torch.int8)
        assert torch.equal(dequantize_g128_to_int8(weight, scratch, block_n=block_n, groups=groups),
                           weight.int8_weight()), (block_n, groups)
        assert (scratch[n * k:] == 77).all()  # nothing written past N * K
    variant = gemm.get_variant("g128.i8.n128m128")
    assert gemm.workspace_elements(variant, 300, n, k, torch.device("cpu")) == (n * k + 3) // 4
    x8, sx = quantize_per_token(_activations(5, k, seed=16))
    gemm.w4a8_gemm(x8, sx, weight, variant=variant.name)
    assert torch.equal(gemm.WORKSPACE.get("cpu", 1).view(torch.int8)[: n * k].view(n, k), weight.int8_weight())
    with pytest.raises(ValueError, match="does not split K"):
        gemm.w4a8_gemm(x8, sx, weight, variant=variant.name, split_k=2)


def test_int8_path_walks_every_tile_and_takes_any_x8_rows():
    """The int8 path's persistent TMA GEMM: a program walks several tiles (4 programs on the CPU for
    3 x 3 tiles of 128 x 128, partial at both edges), and an x8 whose rows do not start 16 bytes
    apart (a column slice) is copied to what TMA takes; bit-equal to the reference."""
    n, k, m = 300, 384, 259
    weight = _full_range_g128(n, k, seed=17)
    wide = quantize_per_token(_activations(m, k + 8, seed=18))[0]
    x8 = wide[:, 8:]  # rows k + 8 bytes apart: not a multiple of 16
    sx = torch.rand(m, dtype=torch.float32) / 64 + 1e-3
    ref = (x8.float() @ weight.int8_weight().float().T * sx[:, None] * weight.s1.float()[None, :]).half()
    y = gemm.w4a8_gemm(x8, sx, weight, variant="g128.i8.n128m128")
    assert torch.equal(y, ref), f"max diff {(y.float() - ref.float()).abs().max().item()}"


def test_int8_path_takes_one_row_at_any_stride():
    """One row whose stride is not 16 bytes (a column slice of a wider buffer) was handed to the TMA descriptor
    as it was: 'strides must be 16-byte aligned' (an AssertionError), aligned base or not."""
    n, k = 64, 128
    weight = _full_range_g128(n, k, seed=19)
    wide = quantize_per_token(_activations(1, k + 8, seed=20))[0]
    sx = torch.rand(1, dtype=torch.float32) / 64 + 1e-3
    for x8 in (wide[:, 8:], wide[:, :k]):  # an 8-byte offset, and an aligned base with a 136-byte stride
        ref = (x8.float() @ weight.int8_weight().float().T * sx[:, None] * weight.s1.float()[None, :]).half()
        assert torch.equal(gemm.w4a8_gemm(x8, sx, weight, variant="g128.i8.n128m128"), ref)


def test_int8_path_asks_for_pdl_at_every_m(monkeypatch):
    """The pass and the int8 GEMM ask for the PDL launch of a 256-row launch (the rule's last PDL size)
    whatever M is: above 256 rows the rule turns PDL off for other kernels, and this pair is 0-4%
    faster with it (bench/results/h100/int8_pdl_ab.json)."""
    from services.worker.kernels import launch_overlap, w4a8_int8_path

    asked = []
    real = w4a8_int8_path.launch_kwargs
    monkeypatch.setattr(w4a8_int8_path, "launch_kwargs", lambda device, rows: asked.append(rows) or real(device, rows))
    n, k = 40, 256
    weight = _full_range_g128(n, k, seed=19)
    for m in (3, 300):
        x8, sx = quantize_per_token(_activations(m, k, seed=20))
        y = gemm.w4a8_gemm(x8, sx[:, 0], weight, variant="g128.i8.n128m128")
        ref = (x8.float() @ weight.int8_weight().float().T * sx.float() * weight.s1.float()[None, :]).half()
        assert torch.equal(y, ref)
    assert asked == [3, launch_overlap.PDL_MAX_ROWS]
