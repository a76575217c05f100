"""W4A8 GEMM and activation-quant kernels against torch's GEMMs on Llama-2-7B shapes (GPU only).

    python3 bench/kernels.py --out bench/results/h200/kernels.json

For every (N, K) and M: each variant is first checked against the reference linear on fresh random
inputs with a NaN-poisoned output, then timed with triton.testing.do_bench (median; do_bench
clears the L2 before every timed call, so weights and activations come from HBM each time, as in
a real forward). Baselines in the same run: cuBLAS fp16 (torch.matmul), torch._int_mm (int8,
M > 16), torch._scaled_mm (fp8 e4m3, per-token x per-channel scales) and
torch._weight_int4pack_mm (W4A16 g128, bf16). The JSON holds the raw times, TOP/s, GB/s, ratios,
the issue's checks and the best variant per (N, K, M), the seed of a kernel policy table.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)]  # qkv, o, gate_up, down
MS = [1, 16, 64, 256, 1024, 4096]
# (kind, M range, minimum ratio of cuBLAS fp16 time over the best W4A8 time), from issue 3
TARGETS_FP16 = [((1, 16), 3.0), ((64, 64), 2.5), ((256, 256), 1.5), ((4096, 4096), 1.5)]
TARGET_INT4PACK = ((1, 16), 1.5)


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


class Bench:
    def __init__(self, args):
        import torch
        import triton

        self.torch, self.triton = torch, triton
        self.args = args
        self.dev = torch.device("cuda")
        props = torch.cuda.get_device_properties(self.dev)
        self.result = {
            "command": " ".join(["python3"] + sys.argv),
            "machine": {
                "gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
                "triton": triton.__version__, "cuda": torch.version.cuda, "platform": platform.platform(),
            },
            "timing": "triton.testing.do_bench median, warmup %d ms, rep %d ms, L2 cleared before each call"
            % (args.warmup, args.rep),
            "act_quant": [], "gemm": [], "baseline_notes": {}, "checks": [], "best_variant": {},
        }

    def time_ms(self, fn) -> float:
        from triton.testing import do_bench

        return do_bench(fn, warmup=self.args.warmup, rep=self.args.rep, return_mode="median")

    def note(self, key: str, text: str) -> None:
        if key not in self.result["baseline_notes"]:
            self.result["baseline_notes"][key] = text
            print(f"  note {key}: {text}", flush=True)

    # ---------------------------------------------------------------- activation quant
    def act_quant(self) -> None:
        import torch
        import torch.nn.functional as F

        from services.worker.kernels.act_quant import quantize, rmsnorm_quant, silu_mul_quant
        from shared.model.llama import rms_norm
        from shared.quant.activations import quantize_per_token

        for m in (1, 16, 256, 4096):
            x = torch.randn(m, 4096, device=self.dev, dtype=torch.float16) * 3
            w = 1 + 0.1 * torch.randn(4096, device=self.dev)
            gu = torch.randn(m, 2 * 11008, device=self.dev, dtype=torch.float16) * 3
            g, u = gu.float().chunk(2, dim=-1)
            cases = [
                ("rmsnorm_quant", lambda: rmsnorm_quant(x, w, 1e-6), rms_norm(x, w, 1e-6), 2 * m * 4096 + m * 4096),
                ("silu_mul_quant", lambda: silu_mul_quant(gu), F.silu(g) * u, 2 * m * 2 * 11008 + m * 11008),
                ("quantize", lambda: quantize(x), x.float(), 2 * m * 4096 + m * 4096),
            ]
            for name, fn, ref_in, nbytes in cases:
                row = {"op": name, "M": m}
                try:
                    x8, scale, rowsum = fn()
                    r8, rs = quantize_per_token(ref_in)
                    row["scale_max_rel_err"] = ((scale - rs[:, 0]).abs() / rs[:, 0]).max().item()
                    row["code_max_diff"] = (x8.int() - r8.int()).abs().max().item()
                    row["rowsum_exact"] = bool(torch.equal(rowsum, x8.int().sum(1)))
                    row["correct"] = row["scale_max_rel_err"] < 1e-6 and row["code_max_diff"] <= 1 and row["rowsum_exact"]
                    t = self.time_ms(fn)
                    row.update(us=t * 1e3, gbps=nbytes / t / 1e6)
                except Exception as e:  # a failing kernel is a result, not the end of the run
                    row["error"] = f"{type(e).__name__}: {e}"[:500]
                self.result["act_quant"].append(row)
                print(f"  {name:15s} M={m:5d} {row.get('us', float('nan')):8.2f} us  correct={row.get('correct')}"
                      f" {row.get('error', '')}", flush=True)

    # ---------------------------------------------------------------- GEMMs
    def baselines(self, n: int, k: int, w16, w8, w_fp8, w_scale8, int4):
        """name -> (make(x, x16, x8) -> callable or None, byte kind)."""
        torch = self.torch

        def fp16(x, x16, x8):
            return lambda: torch.matmul(x16, w16.t())

        def int_mm(x, x16, x8):
            if x8.shape[0] <= 16:
                self.note("torch._int_mm", "cuBLAS int8 GEMM needs M > 16; not timed there")
                return None
            return lambda: torch._int_mm(x8, w8.t())

        def scaled_mm(x, x16, x8):
            amax = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-8)
            sa = (amax / 448).float()
            xf8 = (x / sa).to(torch.float8_e4m3fn)
            for dtype in (torch.float16, torch.bfloat16):
                try:
                    torch._scaled_mm(xf8, w_fp8.t(), scale_a=sa, scale_b=w_scale8, out_dtype=dtype)
                    self.note("torch._scaled_mm", f"row-wise scales, out_dtype={dtype}")
                    return lambda: torch._scaled_mm(xf8, w_fp8.t(), scale_a=sa, scale_b=w_scale8, out_dtype=dtype)
                except Exception as e:
                    self.note(f"torch._scaled_mm {dtype}", f"{type(e).__name__}: {e}"[:300])
            return None

        def int4pack(x, x16, x8):
            if int4 is None:
                return None
            packed, sz = int4
            xb = x.to(torch.bfloat16)
            return lambda: torch._weight_int4pack_mm(xb, packed, 128, sz)

        return {"cublas_fp16": (fp16, "fp16"), "torch_int_mm": (int_mm, "int8"),
                "torch_scaled_mm_fp8": (scaled_mm, "fp8"), "torch_int4pack_mm": (int4pack, "int4pack")}

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

    def shape(self, n: int, k: int) -> None:
        import torch

        from services.worker.kernels import w4a8_gemm as gemm
        from shared.model.linear import reference_linear
        from shared.quant.activations import quantize_per_token
        from shared.quant.weights import quantize_w4_channel, quantize_w4_g128_progressive

        w = torch.randn(n, k, device=self.dev) * 0.02
        weights = {"w4g128p": quantize_w4_g128_progressive(w), "w4chn": quantize_w4_channel(w)}
        refs = {kind: reference_linear(p) for kind, p in weights.items()}
        w16 = w.half()
        w8 = weights["w4g128p"].int8_weight()
        w_scale8 = (w.abs().amax(dim=1) / 448).clamp_min(1e-12)[None, :].float()  # (1, N)
        w_fp8 = (w / w_scale8.t()).to(torch.float8_e4m3fn)
        base = self.baselines(n, k, w16, w8, w_fp8, w_scale8, self.make_int4pack(n, k))
        del w
        pattern = re.compile(self.args.variants) if self.args.variants else None
        for m in self.args.ms:
            x = torch.randn(m, k, device=self.dev)
            x[:, torch.randint(0, k, (8,), device=self.dev)] *= 10  # a few outlier channels
            x8, sx = quantize_per_token(x)
            sx = sx[:, 0].contiguous()
            rowsum = x8.sum(dim=1, dtype=torch.int32)
            x16 = x.half()
            row = {"N": n, "K": k, "M": m, "flop": 2 * m * n * k, "impl": {}}
            for kind, p in weights.items():
                ref = refs[kind](x)
                for v in gemm.variants_for(kind):
                    if pattern and not pattern.search(v.name):
                        continue
                    ok, reason = v.can_implement(m, n, k, kind)
                    if not ok:
                        continue
                    row["impl"][v.name] = self.run_variant(gemm, v, x8, sx, p, rowsum if kind == "w4chn" else None,
                                                           ref, gemm_bytes(kind, m, n, k), row["flop"])
            for name, (make, byte_kind) in base.items():
                entry = {}
                try:
                    fn = make(x, x16, x8)
                    if fn is None:
                        continue
                    fn()
                    t = self.time_ms(fn)
                    entry = {"us": t * 1e3, "tops": row["flop"] / t / 1e9,
                             "gbps": gemm_bytes(byte_kind, m, n, k) / t / 1e6}
                except Exception as e:
                    entry = {"error": f"{type(e).__name__}: {e}"[:300]}
                row["impl"][name] = entry
            self.summarize(row)
            self.result["gemm"].append(row)
            self.write()

    def run_variant(self, gemm, v, x8, sx, weight, rowsum, ref, nbytes: int, flop: int) -> dict:
        torch = self.torch
        entry = {"split_k": gemm.split_factor(v, x8.shape[0], ref.shape[1], x8.shape[1], x8.device)}
        try:
            out = torch.full(ref.shape, float("nan"), dtype=torch.float16, device=self.dev)
            gemm.w4a8_gemm(x8, sx, weight, rowsum=rowsum, variant=v.name, out=out)
            torch.cuda.synchronize()
            err = (out.float() - ref).abs()
            entry["all_written"] = bool(torch.isfinite(out).all())
            entry["exact"] = bool(torch.equal(out.float(), ref))
            entry["max_rel_err"] = (err.max() / ref.abs().max()).item()
            entry["correct"] = entry["all_written"] and entry["max_rel_err"] <= 1e-3
            t = self.time_ms(lambda: gemm.w4a8_gemm(x8, sx, weight, rowsum=rowsum, variant=v.name, out=out))
            entry.update(us=t * 1e3, tops=flop / t / 1e9, gbps=nbytes / t / 1e6)
            m, groups = x8.shape[0], x8.shape[1] // 128
            if v.split_k and m <= self.args.sweep_max_m:
                # The split factor is a heuristic; record what the others would have given.
                entry["split_sweep_us"] = {}
                for split in (1, 2, 3, 4, 6, 8, 12, 16):
                    if split <= groups and split != entry["split_k"]:
                        gemm.w4a8_gemm(x8, sx, weight, rowsum=rowsum, variant=v.name, split_k=split, out=out)
                        entry["split_sweep_us"][split] = 1e3 * self.time_ms(
                            lambda: gemm.w4a8_gemm(x8, sx, weight, rowsum=rowsum, variant=v.name, split_k=split, out=out))
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {e}"[:800]
            traceback.print_exc(limit=1)
        return entry

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
            for (lo, hi), target in TARGETS_FP16:
                if lo <= m <= hi and "cublas_fp16" in ratios:
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
    p.add_argument("--rep", type=int, default=25, help="do_bench repetition, ms")
    p.add_argument("--skip-act-quant", action="store_true")
    p.add_argument("--sweep-max-m", type=int, default=64, help="time every split-K factor up to this M")
    args = p.parse_args()
    args.ms = [int(m) for m in args.ms.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]

    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA GPU")
    torch.manual_seed(0)
    bench = Bench(args)
    print(json.dumps(bench.result["machine"]), flush=True)
    start = time.time()
    if not args.skip_act_quant:
        bench.act_quant()
    for n, k in shapes:
        bench.shape(n, k)
    bench.result["seconds"] = time.time() - start
    bench.write()
    met = sum(c["met"] for c in bench.result["checks"])
    print(f"checks met: {met}/{len(bench.result['checks'])}")
    for c in bench.result["checks"]:
        print(f"  {'MET ' if c['met'] else 'MISS'} {c['name']}: {c['value']:.2f} (>= {c['target']})")
    print(f"total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
