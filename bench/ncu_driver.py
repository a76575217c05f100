"""Launch one kernel a few times at a benchmark shape, for Nsight Compute to profile (GPU only).

    ncu --clock-control none --kernel-name regex:_kv4_decode --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section Occupancy \
        python3 bench/ncu_driver.py attention --batch 64 --ctx 1536

    python3 bench/ncu_driver.py gemm --fmt chn --shape 12288x4096 --m 256 --variant chn.n128m128

The first launches compile (skip them with --launch-skip); --dump DIR writes each compiled
Triton kernel's PTX, cubin and register counts there (disassemble with `cuobjdump -sass`).
Correctness is not checked here: bench/attention.py and bench/kernels.py do that.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.attention import paged_batch  # noqa: E402
from bench.kernels import w4a8_act_set, w4a8_weight_set  # noqa: E402
from bench.machine import compiled_kernels  # noqa: E402

LAUNCHES = 4


def attention_calls(args, torch, dev):
    from services.worker.kernels.paged_attention import DecodeConfig, paged_decode_attention

    gen = torch.Generator(device=dev).manual_seed(0)
    kc, vc, tables, lens = paged_batch(torch, dev, gen, args.batch, args.kv_heads, args.ctx, args.head_dim, kv4=True)
    q = torch.randn(args.batch, args.heads, args.head_dim, device=dev, generator=gen).half()
    cfg = DecodeConfig(**json.loads(args.config)) if args.config else None
    return lambda: paged_decode_attention(q, kc, vc, tables, lens, max_context_len=args.ctx, config=cfg)


def gemm_calls(args, torch, dev):
    from bench.kernels import x_sums
    from services.worker.kernels.w4a8_gemm import w4a8_gemm

    n, k = (int(v) for v in args.shape.split("x"))
    kind = "w4chn" if args.fmt == "chn" else "w4g128p"
    w = w4a8_weight_set(n, k, dev)[kind]
    a = w4a8_act_set(args.m, k, dev)
    return lambda: w4a8_gemm(a["x8"], a["sx"], w, **x_sums(a), variant=args.variant)


def dump_kernels(out: Path) -> None:
    """PTX, cubin and resource counts of every kernel Triton compiled in this process."""
    from services.worker.kernels import paged_attention, w4a8_gemm

    out.mkdir(parents=True, exist_ok=True)
    fns = [getattr(mod, name) for mod in (paged_attention, w4a8_gemm) for name in dir(mod)
           if name.startswith("_") and name.endswith("_kernel")]
    resources = []
    for fn in fns:
        for i, (_, kern) in enumerate(compiled_kernels(fn)):
            stem = f"{fn.__name__}_{i}"
            (out / f"{stem}.ptx").write_text(kern.asm["ptx"])
            (out / f"{stem}.cubin").write_bytes(kern.asm["cubin"])
            resources.append({"kernel": stem, "n_regs": kern.n_regs, "n_spills": kern.n_spills,
                              "shared": getattr(kern.metadata, "shared", None)})
    (out / "resources.json").write_text(json.dumps(resources, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=("attention", "gemm"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=32)
    parser.add_argument("--ctx", type=int, default=1536)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--config", default=None, help='DecodeConfig fields as JSON, e.g. {"block_n": 32}')
    parser.add_argument("--fmt", choices=("chn", "g128"), default="chn")
    parser.add_argument("--shape", default="12288x4096", help="GEMM N x K")
    parser.add_argument("--m", type=int, default=256)
    parser.add_argument("--variant", default=None)
    parser.add_argument("--dump", type=Path, default=None)
    args = parser.parse_args()

    import torch

    dev = torch.device("cuda")
    call = (attention_calls if args.kernel == "attention" else gemm_calls)(args, torch, dev)
    for _ in range(LAUNCHES):
        call()
    torch.cuda.synchronize()
    if args.dump:
        dump_kernels(args.dump)


if __name__ == "__main__":
    main()
