"""Reference linear layers: the exact arithmetic each format's GEMM kernel performs.

Integer formats quantize the input per token to int8, multiply int8 x int8 -> int32 exactly,
and apply scales (and the per-channel zero term) in an fp32 epilogue whose result is rounded
to fp16, as the kernels write fp16.
"""

from __future__ import annotations

import functools
import time

import torch

from shared.formats.weights import (
    Fp16Weight,
    PackedWeight,
    W4ChannelWeight,
    W4G128ProgressiveWeight,
    W4G128Weight,
    W8Weight,
)
from shared.quant.activations import per_token_codes


class Int8Gemm:
    """x8 (M, K) int8 @ w8 (N, K)^T int8 -> (M, N) int32, exact, with the weight prepared once.

    Backends, all exact, so they differ only in speed:
      "cuda": torch's int8 GEMM on the GPU.
      "int8": torch's int8 GEMM on the CPU; fast where the CPU has VNNI (an AVX-512 VNNI host:
              32 ms against fp32's 104 ms at 4096x3072x512), and inexact where it has not.
      "fp32": fp32 GEMMs over K in chunks, each exact because every partial sum, in any order, is an
              integer of magnitude at most 2^24: bounded by 128 * (a weight row's sum of |w8| over
              the chunk). One chunk when the weight allows it (4-bit codes always do up to
              K = 8738; trained int8 weights mostly do), else chunks of EXACT_FP32_K, where even
              128 * 128 * K is 2^24, summed in int32. On CPUs without VNNI torch's int8 GEMM is
              5-10x slower than fp64 and fp32 twice as fast again (an AVX2 host: 806 / 54 / 24 ms
              at 2048x512x1536).
    On a CPU, measured_cpu_backend() picks "int8" only where it is exact and faster.
    """

    EXACT_FP32_K = 1024

    def __init__(self, w8: torch.Tensor, cpu_backend: str | None = None):
        if w8.device.type == "cuda":
            self.backend = "cuda"
        else:
            self.backend = cpu_backend or measured_cpu_backend()
            if self.backend not in CPU_BACKENDS:
                raise ValueError(f"unknown CPU int8 GEMM backend {self.backend!r}; one of {CPU_BACKENDS}")
        # The fp32 backend keeps only its fp32 slices: the int8 copy beside them would be dead weight.
        self.w8 = None if self.backend == "fp32" else w8  # (N, K) int8
        self._chunks = self._fp32_chunks(w8) if self.backend == "fp32" else []

    @classmethod
    def _fp32_chunks(cls, w8: torch.Tensor) -> list[torch.Tensor]:
        """(N, K_c) fp32 slices of w8 over K: 4 bytes a weight, for the fp32 backend's speed."""
        # int16 first: abs(-128) does not fit int8
        largest_row_l1 = int(w8.to(torch.int16).abs().sum(dim=1, dtype=torch.int64).max()) if w8.numel() else 0
        step = w8.shape[1] if 128 * largest_row_l1 <= 2**24 else cls.EXACT_FP32_K
        return [w8[:, i : i + step].float() for i in range(0, w8.shape[1], step)]

    def __call__(self, x8: torch.Tensor) -> torch.Tensor:
        """(M, N) int32."""
        if self.backend == "cuda":
            return _int_mm_cuda(x8, self.w8)
        if self.backend == "int8":
            return torch._int_mm(x8.contiguous(), self.w8.t())
        if len(self._chunks) == 1:
            return self.as_float(x8).to(torch.int32)
        acc, start = None, 0
        for w in self._chunks:
            part = (x8[:, start : start + w.shape[1]].float() @ w.t()).to(torch.int32)  # (M, N) exact
            acc = part if acc is None else acc + part
            start += w.shape[1]
        return acc

    def as_float(self, codes: torch.Tensor) -> torch.Tensor:
        """codes (M, K) int8, or fp32 holding the int8 values (shared.quant.activations.per_token_codes)
        -> (M, N) fp32, a new tensor: the int32 result converted to fp32, as the kernels' epilogue
        does; with one K chunk the fp32 GEMM gives it directly (every value an exact integer below 2^24)."""
        if self.backend != "fp32":
            return self(codes.to(torch.int8)).float()
        if len(self._chunks) == 1:
            return codes.float() @ self._chunks[0].t()
        return self(codes).float()


CPU_BACKENDS = ("int8", "fp32")


@functools.cache
def measured_cpu_backend() -> str:
    """The exact CPU backend of Int8Gemm that is faster on this machine, chosen once per process
    (about 0.1 s). "int8" must first prove itself exact: without VNNI, torch's CPU int8 GEMM goes
    through 16-bit pair sums that saturate (seen with oneDNN limited to AVX2: off by 8.2M on rows
    of 127s), so there it is never used, however fast."""
    if not _cpu_int8_gemm_is_exact():
        return "fp32"
    gen = torch.Generator().manual_seed(0)  # its own: measuring must not move the caller's torch RNG
    x8 = torch.randint(-127, 128, (1024, 512), dtype=torch.int8, generator=gen)
    w8 = torch.randint(-127, 128, (1024, 512), dtype=torch.int8, generator=gen)
    wf = w8.float()

    def best_of_three(gemm) -> float:
        gemm()  # warm-up: first-call allocation and dispatch
        times = []
        for _ in range(3):
            start = time.perf_counter()
            gemm()
            times.append(time.perf_counter() - start)
        return min(times)

    int8_s = best_of_three(lambda: torch._int_mm(x8, w8.t()))
    fp32_s = best_of_three(lambda: x8.float() @ wf.t())
    return "int8" if int8_s * 1.2 < fp32_s else "fp32"


def _cpu_int8_gemm_is_exact() -> bool:
    """torch._int_mm against int64 on the extremes the formats reach (activations in [-127, 127],
    weights in [-128, 127]) and on random codes, at sizes its blocked kernels actually take."""
    gen = torch.Generator().manual_seed(0)
    x8 = torch.randint(-127, 128, (64, 512), dtype=torch.int8, generator=gen)
    w8 = torch.randint(-128, 128, (48, 512), dtype=torch.int8, generator=gen)
    x8[0], x8[1], x8[2, ::2], x8[2, 1::2] = 127, -127, 127, -127
    w8[0], w8[1], w8[2], w8[3, ::2], w8[3, 1::2] = 127, -128, -127, 127, -128
    expect = x8.long() @ w8.long().t()
    return torch.equal(torch._int_mm(x8, w8.t()).long(), expect)


def _int_mm_cuda(x8: torch.Tensor, w8: torch.Tensor) -> torch.Tensor:
    m = x8.shape[0]
    if m <= 16:
        # cuBLAS int8 GEMM needs M > 16; pad with zero rows (they contribute nothing).
        padded = torch.zeros(17, x8.shape[1], dtype=torch.int8, device=x8.device)
        padded[:m] = x8
        return torch._int_mm(padded, w8.t())[:m]
    return torch._int_mm(x8.contiguous(), w8.t())


def int8_matmul(x8: torch.Tensor, w8: torch.Tensor, cpu_backend: str | None = None) -> torch.Tensor:
    """x8 (M, K) int8 @ w8 (N, K)^T int8 -> (M, N) int32, exact (a one-off Int8Gemm)."""
    return Int8Gemm(w8, cpu_backend)(x8)


def _round_fp16_(y: torch.Tensor) -> torch.Tensor:
    """fp32 y rounded to fp16 values, as the kernels write fp16; in place, on the epilogue's own (M, N)
    tensor, so no further fp32 tensor is made per layer."""
    return y.copy_(y.to(torch.float16))


class ReferenceLinear:
    """y = x W^T for x (..., K) fp32 -> (..., N) fp32."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        return self.forward_2d(x.reshape(-1, x.shape[-1])).reshape(*lead, -1)

    def forward_2d(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class FpLinear(ReferenceLinear):
    def __init__(self, weight: torch.Tensor, dtype: torch.dtype = torch.float32):
        self.weight = weight.to(dtype)  # (N, K)

    def forward_2d(self, x):
        return (x.to(self.weight.dtype) @ self.weight.t()).float()


class W4A16Linear(ReferenceLinear):
    """Weight-only: dequantized to fp16 once, fp activations."""

    def __init__(self, packed: W4G128Weight, dtype: torch.dtype = torch.float32):
        self.weight = packed.dequantize().half().to(dtype)  # (N, K)

    def forward_2d(self, x):
        return _round_fp16_((x.to(self.weight.dtype) @ self.weight.t()).float())


class W8A8Linear(ReferenceLinear):
    def __init__(self, packed: W8Weight):
        self.gemm = Int8Gemm(packed.qweight)  # (N, K) int8
        self.scale = packed.scale.float()  # (N,)

    def forward_2d(self, x):
        codes, sx = per_token_codes(x)
        acc = self.gemm.as_float(codes)  # (M, N) the int32 sums, as fp32
        return _round_fp16_(acc.mul_(sx).mul_(self.scale))


class W4A8G128Linear(ReferenceLinear):
    """Progressive groups: the level-2 dequantization gives int8 weights, then one int8 GEMM."""

    def __init__(self, packed: W4G128ProgressiveWeight):
        self.gemm = Int8Gemm(packed.int8_weight())  # (N, K) int8
        self.s1 = packed.s1.float()  # (N,)

    def forward_2d(self, x):
        codes, sx = per_token_codes(x)
        acc = self.gemm.as_float(codes)  # (M, N) the int32 sums, as fp32
        return _round_fp16_(acc.mul_(sx).mul_(self.s1))


class W4A8ChannelLinear(ReferenceLinear):
    """Per-channel uint4: int8 GEMM on the raw codes, zero * rowsum(x8) subtracted in the epilogue."""

    def __init__(self, packed: W4ChannelWeight):
        self.gemm = Int8Gemm(packed.codes().to(torch.int8))  # (N, K) codes in [0, 15]
        self.scale = packed.scale.float()
        self.zero = packed.zero.float()

    def forward_2d(self, x):
        codes, sx = per_token_codes(x)
        acc = self.gemm.as_float(codes)  # (M, N) the int32 sums, as fp32
        row_sum = codes.sum(dim=-1, keepdim=True)  # (M, 1), exact in fp32 for K < 2^17
        return _round_fp16_(acc.sub_(row_sum * self.zero).mul_(sx).mul_(self.scale))


def reference_linear(packed: PackedWeight, dtype: torch.dtype = torch.float32) -> ReferenceLinear:
    if isinstance(packed, Fp16Weight):
        return FpLinear(packed.weight, dtype)
    if isinstance(packed, W4G128Weight):
        return W4A16Linear(packed, dtype)
    if isinstance(packed, W8Weight):
        return W8A8Linear(packed)
    if isinstance(packed, W4G128ProgressiveWeight):
        return W4A8G128Linear(packed)
    if isinstance(packed, W4ChannelWeight):
        return W4A8ChannelLinear(packed)
    raise TypeError(f"no reference linear for {type(packed).__name__}")
