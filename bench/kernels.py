"""W4A8 GEMM and activation-quant kernels against torch's GEMMs on Llama-2-7B shapes (GPU only).

    python3 bench/kernels.py --out bench/results/h200/kernels.json

First every variant is checked bit-exact on an awkward shape for several M and split-K factors.
Then for every (N, K) and M: each variant is checked against the reference linear on fresh random
inputs with a NaN-poisoned output (bit-exact; `.f16` variants within rtol 1e-3), then timed: ROTATE calls on distinct weight and activation sets
are captured in one CUDA graph, timed over its replays as triton.testing.do_bench does (median; the
L2 cleared before each replay, by default by reading 256 MB: see time_calls) and the time per call
is replay / ROTATE. So every call reads cold data from
HBM and no host launch overhead is counted, as in a graph-captured forward. Baselines, same way: cuBLAS fp16 (torch.matmul), torch._int_mm (int8,
M > 16), torch._scaled_mm (fp8 e4m3, per-token x per-channel scales) and
torch._weight_int4pack_mm (W4A16 g128, bf16). The JSON holds the raw times, TOP/s, GB/s, ratios,
the issue's checks and the best variant per (N, K, M), the seed of a kernel policy table.
bench/tune.py measures a model's whole (N, K, M) grid and writes the policy table itself; it
imports this module's timing and checking helpers (time_calls, check_output, ...).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import compiled_kernels, gpu_machine  # noqa: E402

SHAPES = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)]  # qkv, o, gate_up, down
MS = [1, 16, 64, 256, 1024, 4096]
ROTATE = 4
# (kind, M range, minimum ratio of cuBLAS fp16 time over the best W4A8 time), from issue 3
TARGETS_FP16 = [((1, 16), 3.0), ((64, 64), 2.5), ((256, 256), 1.5), ((4096, 4096), 1.5)]
TARGET_INT4PACK = ((1, 16), 1.5)


def fp16_target(m: int) -> float | None:
    """The issue's minimum cuBLAS-fp16-over-W4A8 time ratio at M, or None where it sets none."""
    return next((target for (lo, hi), target in TARGETS_FP16 if lo <= m <= hi), None)


def gemm_bytes(kind: str, m: int, n: int, k: int) -> int:
    """Fewest bytes a GEMM moves: weights (with scales) + activations (with scales) + fp16 output."""
    out = 2 * m * n
    if kind == "w4g128p":
        return n * k // 2 + 2 * n * (k // 128) + 2 * n + m * k + 4 * m + out
    if kind == "w4chn":
        return n * k // 2 + 4 * n + m * k + 8 * m + out
    if kind == "fp16":
        return 2 * n * k + 2 * m * k + out
    if kind == "int8":
        return n * k + m * k + 4 * m * n
    if kind == "fp8":
        return n * k + m * k + 4 * (m + n) + out
    if kind == "int4pack":
        return n * k // 2 + 4 * n * (k // 128) + 2 * m * k + out
    raise ValueError(kind)


FLUSHES = ("write", "read")


def time_calls(fns, warmup: int, rep: int, flush: str = "read") -> float:
    """Median ms per call of fns (one per input set) run back to back in a CUDA graph, over the
    graph's replays (warmup / rep in ms), the L2 cleared before each, divided by len(fns).

    flush "write" is triton.testing.do_bench's own clear: it zeroes 256 MB, so the L2 is full of
    dirty lines and the first ~60 MB a timed replay reads each evict one, a DRAM write-back per
    line read. "read" reads 256 MB instead: the replay finds the L2 full of clean lines of other
    data, as a kernel in a forward pass finds it (the previous layers' weights), and its reads are
    reads only. The write clear costs a kernel that reads a few MB (decode GEMMs) proportionally
    more than cuBLAS fp16, which reads four times the bytes. "read" is the default since session 25
    (bench/results/h200/gemv_sweep_*.json: both clears in one session)."""
    import torch
    from triton.testing import do_bench

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    if flush == "write":
        return do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median") / len(fns)
    if flush != "read":
        raise ValueError(f"flush must be one of {FLUSHES}, not {flush!r}")
    return _median_ms_read_flush(graph.replay, warmup, rep) / len(fns)


_FLUSH_BUFFER = []


def _median_ms_read_flush(fn, warmup: int, rep: int) -> float:
    """do_bench's loop (an estimate from 5 runs sets the counts; events around each timed run),
    with a 256 MB read before every run in place of its 256 MB zeroing."""
    import statistics

    import torch

    if not _FLUSH_BUFFER:
        _FLUSH_BUFFER.append(torch.ones(64 << 20, dtype=torch.int32, device="cuda"))
    buf = _FLUSH_BUFFER[0]

    def flush():
        torch.sum(buf, dtype=torch.int32)

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = start.elapsed_time(end) / 5
    for _ in range(max(1, int(warmup / estimate))):
        fn()
    n = max(1, int(rep / estimate))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        flush()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def warm_gpu(dev) -> None:
    """Half a second of matrix products so clocks are up before the first timing."""
    import torch

    a = torch.randn(8192, 8192, device=dev, dtype=torch.float16)
    end = time.time() + 0.5
    while time.time() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def w4a8_weight_set(n: int, k: int, dev) -> dict:
    """A random (N, K) weight w (fp32, std 0.02) and its two W4A8 packings, by weight kind."""
    import torch

    from shared.quant.weights import quantize_w4_channel, quantize_w4_g128_progressive

    w = torch.randn(n, k, device=dev) * 0.02
    return {"w": w, "w4g128p": quantize_w4_g128_progressive(w), "w4chn": quantize_w4_channel(w)}


def w4a8_act_set(m: int, k: int, dev) -> dict:
    """Random activations x (M, K) fp32 with a few outlier channels, and their per-token int8 codes
    x8, scales sx (M,), row sums (M,) and 128-group sums (M, K / 128) int32: the W4A8 GEMM's inputs,
    as the activation-quant kernels give them."""
    import torch

    from shared.quant.activations import quantize_per_token

    x = torch.randn(m, k, device=dev)
    x[:, torch.randint(0, k, (8,), device=dev)] *= 10  # a few outlier channels
    x8, sx = quantize_per_token(x)
    return {"x": x, "x8": x8, "sx": sx[:, 0].contiguous(), "rowsum": x8.sum(dim=1, dtype=torch.int32),
            "group_sums": x8.view(m, k // 128, 128).sum(dim=2, dtype=torch.int32)}


def x_sums(a: dict) -> dict:
    """Both activation sums of w4a8_act_set as w4a8_gemm keywords, as the engine passes them:
    w4a8_gemm reads the ones its weight kind and variant use."""
    return {"rowsum": a["rowsum"], "group_sums": a["group_sums"]}


def gemm_calls(gemm_fn, variant: str, kind: str, ws: list, acts: list, split=None) -> list:
    """One call of w4a8_gemm (or a stand-in of its signature) per (weight set, activation set),
    each into its own output: the list time_calls replays."""
    import torch

    m, n = acts[0]["x8"].shape[0], ws[0][kind].qweight.shape[0]
    outs = [torch.empty((m, n), dtype=torch.float16, device=acts[0]["x8"].device) for _ in ws]
    return [lambda w=w, a=a, o=o: gemm_fn(
        a["x8"], a["sx"], w[kind], **x_sums(a), variant=variant, split_k=split, out=o)
        for w, a, o in zip(ws, acts, outs)]


def check_output(out, ref, dot_fp16: bool) -> dict:
    """A variant's output (NaN-poisoned before the call) against the reference linear's: the int32
    paths must equal it bit for bit, the fp16-MMA (`.f16`) ones within rtol 1e-3 of its largest value."""
    import torch

    err = (out.float() - ref).abs()
    entry = {"all_written": bool(torch.isfinite(out).all()), "exact": bool(torch.equal(out.float(), ref)),
             "max_rel_err": (err.max() / ref.abs().max().clamp_min(1e-30)).item()}
    entry["correct"] = entry["all_written"] and (entry["max_rel_err"] <= 1e-3 if dot_fp16 else entry["exact"])
    if not entry["exact"]:
        entry["wrong_rows"] = (out.float() != ref).any(dim=1).nonzero()[:, 0].tolist()[:16]
    return entry


class Bench:
    def __init__(self, args):
        import torch
        import triton

        self.torch, self.triton = torch, triton
        self.args = args
        self.dev = torch.device("cuda")
        self.result = {
            "command": " ".join(["python3"] + sys.argv),
            "machine": gpu_machine(self.dev),
            "timing": "per call: median (warmup %d ms, rep %d ms, L2 cleared before each replay by a 256 MB %s,"
            " see time_calls) of a CUDA graph of %d calls on distinct weight/activation sets, divided by %d"
            % (args.warmup, args.rep, args.flush, ROTATE, ROTATE),
            "act_quant": [], "gemm": [], "baseline_notes": {}, "checks": [], "best_variant": {},
        }

    def time_calls(self, fns) -> float:
        return time_calls(fns, self.args.warmup, self.args.rep, self.args.flush)

    def warm_gpu(self) -> None:
        warm_gpu(self.dev)

    def note(self, key: str, text: str) -> None:
        if key not in self.result["baseline_notes"]:
            self.result["baseline_notes"][key] = text
            print(f"  note {key}: {text}", flush=True)

    # ---------------------------------------------------------------- activation quant
    def act_quant(self) -> None:
        import torch
        import torch.nn.functional as F

        from services.worker.kernels import act_quant
        from services.worker.kernels.act_quant import quantize, rmsnorm_quant, silu_mul_quant
        from shared.model.llama import rms_norm
        from shared.quant.activations import quantize_per_token

        w = 1 + 0.1 * torch.randn(4096, device=self.dev)
        for m in (1, 16, 256, 4096):
            xs = [torch.randn(m, 4096, device=self.dev, dtype=torch.float16) * 3 for _ in range(ROTATE)]
            gus = [torch.randn(m, 2 * 11008, device=self.dev, dtype=torch.float16) * 3 for _ in range(ROTATE)]
            g, u = gus[0].float().chunk(2, dim=-1)
            cases = [
                ("rmsnorm_quant", [lambda x=x: rmsnorm_quant(x, w, 1e-6) for x in xs], rms_norm(xs[0], w, 1e-6),
                 3 * m * 4096),
                ("silu_mul_quant", [lambda gu=gu: silu_mul_quant(gu) for gu in gus], F.silu(g) * u, 5 * m * 11008),
                ("quantize", [lambda x=x: quantize(x) for x in xs], xs[0].float(), 3 * m * 4096),
            ]
            for name, fns, ref_in, nbytes in cases:
                row = {"op": name, "M": m}
                try:
                    x8, scale, rowsum, _ = fns[0]()
                    r8, rs = quantize_per_token(ref_in)
                    row["scale_max_rel_err"] = ((scale - rs[:, 0]).abs() / rs[:, 0]).max().item()
                    row["code_max_diff"] = (x8.int() - r8.int()).abs().max().item()
                    row["rowsum_exact"] = bool(torch.equal(rowsum, x8.int().sum(1)))
                    row["correct"] = row["scale_max_rel_err"] < 1e-6 and row["code_max_diff"] <= 1 and row["rowsum_exact"]
                    t = self.time_calls(fns)
                    row.update(us=t * 1e3, gbps=nbytes / t / 1e6)
                    # the same op forced down the chunked path, in the same run: what one pass saves
                    one_pass_max, act_quant.ONE_PASS_MAX = act_quant.ONE_PASS_MAX, 0
                    try:
                        row["us_chunked_path"] = self.time_calls(fns) * 1e3
                    finally:
                        act_quant.ONE_PASS_MAX = one_pass_max
                except Exception as e:  # a failing kernel is a result, not the end of the run
                    row["error"] = f"{type(e).__name__}: {e}"[:500]
                self.result["act_quant"].append(row)
                print(f"  {name:15s} M={m:5d} {row.get('us', float('nan')):8.2f} us {row.get('gbps', 0):7.0f} GB/s"
                      f" (chunked path {row.get('us_chunked_path', float('nan')):8.2f} us)"
                      f" correct={row.get('correct')} {row.get('error', '')}", flush=True)
        rows = self.result["act_quant"]
        self.result["checks"].append({
            "name": "act_quant kernels match the reference (scale, codes within 1, exact row sums)",
            "value": sum(bool(r.get("correct")) for r in rows), "target": len(rows), "op": ">=",
            "met": all(r.get("correct") for r in rows)})

    # ---------------------------------------------------------------- correctness sweep
    def correctness_sweep(self) -> None:
        """Every variant, bit-exact, on N and K that are no tile multiple, for several M and splits."""
        import torch

        from services.worker.kernels import w4a8_gemm as gemm
        from shared.model.linear import reference_linear
        from shared.quant.activations import quantize_per_token
        from shared.quant.weights import quantize_w4_channel, quantize_w4_g128_progressive

        n, k = self.args.sweep_shape
        w = torch.randn(n, k, device=self.dev)
        weights = {"w4g128p": quantize_w4_g128_progressive(w), "w4chn": quantize_w4_channel(w)}
        failures = []
        pattern = re.compile(self.args.variants) if self.args.variants else None
        for m in (1, 2, 16, 17, 100):
            x = torch.randn(m, k, device=self.dev)
            x[:, :4] *= 10
            x8, sx = quantize_per_token(x)
            sums = {"rowsum": x8.sum(dim=1, dtype=torch.int32),
                    "group_sums": x8.view(m, k // 128, 128).sum(dim=2, dtype=torch.int32)}
            for kind, p in weights.items():
                ref = reference_linear(p)(x)
                for v in gemm.variants_for(kind):
                    if (pattern and not pattern.search(v.name)) or not v.can_implement(m, n, k, kind)[0]:
                        continue
                    for split in ((None, 1, 3, k // 128) if v.split_k else (None,)):
                        given = "rowsum" if kind == "w4chn" else "group_sums"
                        for given_sums in ({given: sums[given]}, {}):
                            case = f"{v.name} M={m} split={split} {given}={bool(given_sums)}"
                            try:
                                out = torch.full((m, n), float("nan"), dtype=torch.float16, device=self.dev)
                                gemm.w4a8_gemm(x8, sx, p, **given_sums, variant=v.name, split_k=split, out=out)
                                bad = (out.float() != ref)
                                if bad.any():
                                    rows = bad.any(dim=1).nonzero()[:, 0].tolist()
                                    failures.append(f"{case}: {bad.float().mean().item():.3f} wrong, rows {rows[:8]}")
                            except Exception as e:
                                failures.append(f"{case}: {type(e).__name__}: {str(e)[-300:]}")
        self.result["correctness_sweep"] = {"N": n, "K": k, "M": [1, 2, 16, 17, 100], "failures": failures}
        print(f"correctness sweep: {len(failures)} failures", flush=True)
        for f in failures[:40]:
            print("  FAIL", f, flush=True)

    # ---------------------------------------------------------------- GEMMs
    def make_int4pack(self, n: int, k: int):
        torch = self.torch
        try:
            codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=self.dev)
            packed = torch.ops.aten._convert_weight_to_int4pack(codes, 8)
            sz = torch.randn(k // 128, n, 2, device=self.dev).to(torch.bfloat16)
            torch._weight_int4pack_mm(torch.randn(1, k, device=self.dev, dtype=torch.bfloat16), packed, 128, sz)
            return packed, sz
        except Exception as e:
            self.note("torch._weight_int4pack_mm", f"unavailable: {type(e).__name__}: {e}"[:300])
            return None

    def weight_set(self, n: int, k: int) -> dict:
        import torch

        s = w4a8_weight_set(n, k, self.dev)
        w = s.pop("w")
        w_scale8 = (w.abs().amax(dim=1) / 448).clamp_min(1e-12)[None, :].float()  # (1, N)
        return {
            **s, "fp16": w.half(), "int8": s["w4g128p"].int8_weight(),
            "fp8": (w / w_scale8.t()).to(torch.float8_e4m3fn), "fp8_scale": w_scale8, "int4pack": self.make_int4pack(n, k),
        }

    def act_set(self, m: int, k: int) -> dict:
        import torch

        a = w4a8_act_set(m, k, self.dev)
        x = a["x"]
        sa = (x.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 448).float()
        return {**a, "x16": x.half(), "xbf16": x.to(torch.bfloat16), "xf8": (x / sa).to(torch.float8_e4m3fn), "sa": sa}

    def baseline_fn(self, name: str, w: dict, a: dict):
        torch = self.torch
        m = a["x"].shape[0]
        if name == "cublas_fp16":
            return lambda: torch.matmul(a["x16"], w["fp16"].t())
        if name == "torch_int_mm":
            if m <= 16:
                self.note("torch._int_mm", "cuBLAS int8 GEMM needs M > 16; not timed there")
                return None
            return lambda: torch._int_mm(a["x8"], w["int8"].t())
        if name == "torch_scaled_mm_fp8":
            for dtype in (torch.float16, torch.bfloat16):
                def fn(dtype=dtype):
                    return torch._scaled_mm(a["xf8"], w["fp8"].t(), scale_a=a["sa"], scale_b=w["fp8_scale"], out_dtype=dtype)
                try:
                    fn()
                    self.note("torch._scaled_mm", f"fp8 e4m3, row-wise scales (M,1) x (1,N), out_dtype={dtype}")
                    return fn
                except Exception as e:
                    self.note(f"torch._scaled_mm {dtype}", f"{type(e).__name__}: {e}"[:300])
            return None
        if name == "torch_int4pack_mm":
            if w["int4pack"] is None:
                return None
            packed, sz = w["int4pack"]
            return lambda: torch._weight_int4pack_mm(a["xbf16"], packed, 128, sz)
        raise ValueError(name)

    def shape(self, n: int, k: int) -> None:
        import torch

        from services.worker.kernels import w4a8_gemm as gemm
        from shared.model.linear import reference_linear

        ws = [self.weight_set(n, k) for _ in range(ROTATE)]
        refs = {kind: reference_linear(ws[0][kind]) for kind in ("w4g128p", "w4chn")}
        pattern = re.compile(self.args.variants) if self.args.variants else None
        byte_kinds = {"cublas_fp16": "fp16", "torch_int_mm": "int8", "torch_scaled_mm_fp8": "fp8",
                      "torch_int4pack_mm": "int4pack"}
        for m in self.args.ms:
            acts = [self.act_set(m, k) for _ in range(ROTATE)]
            row = {"N": n, "K": k, "M": m, "flop": 2 * m * n * k, "impl": {}}
            for kind in ("w4g128p", "w4chn"):
                ref = refs[kind](acts[0]["x"])
                for v in gemm.variants_for(kind):
                    if (pattern and not pattern.search(v.name)) or not v.can_implement(m, n, k, kind)[0]:
                        continue
                    row["impl"][v.name] = self.run_variant(gemm, v, kind, ws, acts, ref,
                                                           gemm_bytes(kind, m, n, k), row["flop"])
                del ref
            for name, byte_kind in byte_kinds.items():
                entry = {}
                try:
                    fns = [self.baseline_fn(name, w, a) for w, a in zip(ws, acts)]
                    if fns[0] is None:
                        continue
                    t = self.time_calls(fns)
                    entry = {"us": t * 1e3, "tops": row["flop"] / t / 1e9,
                             "gbps": gemm_bytes(byte_kind, m, n, k) / t / 1e6}
                except Exception as e:
                    entry = {"error": f"{type(e).__name__}: {e}"[:300]}
                row["impl"][name] = entry
            self.summarize(row)
            self.result["gemm"].append(row)
            self.write()
            del acts
            torch.cuda.empty_cache()

    def run_variant(self, gemm, v, kind: str, ws: list, acts: list, ref, nbytes: int, flop: int) -> dict:
        torch = self.torch
        m, k = acts[0]["x8"].shape
        n = ref.shape[1]
        entry = {"split_k": gemm.split_factor(v, m, n, k, self.dev)}

        def calls(split=None):
            return gemm_calls(gemm.w4a8_gemm, v.name, kind, ws, acts, split)

        try:
            out = torch.full((m, n), float("nan"), dtype=torch.float16, device=self.dev)
            a = acts[0]
            gemm.w4a8_gemm(a["x8"], a["sx"], ws[0][kind], **x_sums(a), variant=v.name, out=out)
            torch.cuda.synchronize()
            entry.update(check_output(out, ref, v.dot_fp16))
            del out
            t = self.time_calls(calls())
            entry.update(us=t * 1e3, tops=flop / t / 1e9, gbps=nbytes / t / 1e6)
            if v.split_k and m <= self.args.sweep_max_m:
                # The split factor is a heuristic; record what the others would have given.
                entry["split_sweep_us"] = {}
                for split in (1, 2, 4, 8, 16):
                    if split <= k // 128 and split != entry["split_k"]:
                        entry["split_sweep_us"][split] = 1e3 * self.time_calls(calls(split))
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {e}"[:800]
            traceback.print_exc(limit=1)
        return entry

    def kernel_resources(self) -> None:
        """Registers, spills and shared memory of every compiled kernel (Triton's JIT cache)."""
        from services.worker.kernels import act_quant, w4a8_gemm

        rows = []
        for fn in (w4a8_gemm._w4a8_g128_kernel, w4a8_gemm._w4a8_channel_kernel, act_quant._act_quant_kernel):
            try:
                for key, kern in compiled_kernels(fn):
                    md = kern.metadata
                    rows.append({"kernel": fn.__name__, "key": str(key)[-400:], "n_regs": kern.n_regs,
                                 "n_spills": kern.n_spills, "shared": getattr(md, "shared", None),
                                 "num_warps": getattr(md, "num_warps", None),
                                 "num_stages": getattr(md, "num_stages", None)})
            except Exception as e:
                rows.append({"kernel": fn.__name__, "error": f"{type(e).__name__}: {e}"[:300]})
        self.result["kernel_resources"] = rows

    def summarize(self, row: dict) -> None:
        impl = row["impl"]
        n, k, m = row["N"], row["K"], row["M"]
        row["best"], row["ratios"] = {}, {}
        for kind, prefix in (("w4g128p", "g128."), ("w4chn", "chn.")):
            timed = {name: e["us"] for name, e in impl.items()
                     if name.startswith(prefix) and e.get("correct") and "us" in e}
            if not timed:
                continue
            best = min(timed, key=timed.get)
            row["best"][kind] = best
            self.result["best_variant"].setdefault(kind, {}).setdefault(f"{n}x{k}", {})[str(m)] = best
            row["ratios"][kind] = {b: impl[b]["us"] / timed[best] for b in
                                   ("cublas_fp16", "torch_int_mm", "torch_scaled_mm_fp8", "torch_int4pack_mm")
                                   if "us" in impl.get(b, {})}
            ratios = row["ratios"][kind]
            target = fp16_target(m)
            if target is not None and "cublas_fp16" in ratios:
                self.check(f"{kind} {n}x{k} M={m} best W4A8 vs cuBLAS fp16", ratios["cublas_fp16"], target)
            (lo, hi), target = TARGET_INT4PACK
            if lo <= m <= hi and "torch_int4pack_mm" in ratios:
                self.check(f"{kind} {n}x{k} M={m} best W4A8 vs torch._weight_int4pack_mm",
                           ratios["torch_int4pack_mm"], target)
        line = " ".join(f"{name}={e['us']:.1f}" for name, e in impl.items() if "us" in e and not name.startswith(("g128", "chn")))
        best = " ".join(f"{kind}:{name}={impl[name]['us']:.1f} ({row['ratios'][kind].get('cublas_fp16', 0):.2f}x fp16)"
                        for kind, name in row["best"].items())
        bad = [name for name, e in impl.items() if name.startswith(("g128", "chn")) and not e.get("correct")]
        print(f"N={n:5d} K={k:5d} M={m:5d} | {best} | {line} us" + (f" | NOT OK: {bad}" if bad else ""), flush=True)

    def check(self, name: str, value: float, target: float) -> None:
        self.result["checks"].append({"name": name, "value": round(value, 3), "target": target, "op": ">=",
                                      "met": bool(value >= target)})

    def write(self) -> None:
        self.args.out.parent.mkdir(parents=True, exist_ok=True)
        self.args.out.write_text(json.dumps(self.result, indent=1) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="N x K list, e.g. 4096x4096")
    p.add_argument("--ms", default=",".join(map(str, MS)))
    p.add_argument("--variants", default="", help="regular expression on variant names")
    p.add_argument("--warmup", type=int, default=5, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=20, help="do_bench repetition, ms")
    p.add_argument("--flush", choices=FLUSHES, default="read", help="how the L2 is cleared before a replay (time_calls)")
    p.add_argument("--skip-act-quant", action="store_true")
    p.add_argument("--only-act-quant", action="store_true", help="the activation-quant kernels alone (no GEMMs)")
    p.add_argument("--sweep-max-m", type=int, default=64, help="time every split-K factor up to this M")
    p.add_argument("--sweep-shape", default="1008x1152", help="N x K of the correctness sweep (no tile multiples)")
    args = p.parse_args()
    args.ms = [int(m) for m in args.ms.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    args.sweep_shape = tuple(int(v) for v in args.sweep_shape.split("x"))

    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA GPU")
    torch.manual_seed(0)
    bench = Bench(args)
    print(json.dumps(bench.result["machine"]), flush=True)
    start = time.time()
    bench.warm_gpu()
    if args.only_act_quant:
        bench.act_quant()
        bench.result["seconds"] = time.time() - start
        bench.write()
        return
    bench.correctness_sweep()
    if not args.skip_act_quant:
        bench.act_quant()
    for n, k in shapes:
        bench.shape(n, k)
    bench.kernel_resources()
    bench.result["seconds"] = time.time() - start
    bench.write()
    met = sum(c["met"] for c in bench.result["checks"])
    print(f"checks met: {met}/{len(bench.result['checks'])}")
    for c in bench.result["checks"]:
        print(f"  {'MET ' if c['met'] else 'MISS'} {c['name']}: {c['value']:.2f} (>= {c['target']})")
    print(f"total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
