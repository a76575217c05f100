"""SASS instruction counts of our Triton kernels, compiled for sm_90 on a machine without a GPU.

    python3 bench/sass_count.py attention --block-n 32 --maxnreg 128 --qk-int16
    python3 bench/sass_count.py attention --group 4 --block-n 16 --qk-int16 --split
    python3 bench/sass_count.py act_quant --op silu --block 16384 --warps 16
    python3 bench/sass_count.py act_quant --op rmsnorm --block 4096 --warps 8 --add
    python3 bench/sass_count.py kv_write --group 2 --block-h 8 --warps 4
    python3 bench/sass_count.py --loop-min 20 kv_write --key-feedback --group 1 --block-h 16 --warps 2
    python3 bench/sass_count.py --loop-min 50 gemm g128.n64m64.sk.swar
    python3 bench/sass_count.py --loop-min 20 gemm g128.i8.n256m128 [--dequant]

Triton compiles the kernel for an H100/H200 target (ptxas ships with the triton wheel), the
integer arguments specialized as divisible by 16 the way real launches are; nvdisasm (also in
the wheel) gives the SASS. It prints registers, stack (spills) and, for each loop of 300+
instructions, its length and instruction mix: for the decode attention that is the cost of one
tile, the figure that tracked the H200's times in sessions 8 and 9 (an issue-bound kernel whose
loop did not get shorter did not get faster). The Triton here may not be the GPU image's (3.6):
compare variants compiled by the same one, and confirm on the GPU (bench/attention.py).

It also prints how long Triton took to compile the kernel (what a worker's cold start-up pays for each form of
it); MLIR_ENABLE_TIMING=1 in the environment breaks that down by compiler pass (the decode attention kernels spend
over 90% of it in TritonGPUCoalesce, services/worker/kernel_warm_up.py).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LOOP_MIN = 300  # shorter backward branches are reductions and tails, not the main loop


def _tools() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compile_sass(fn, pointer_types: dict[str, str], constexprs: dict, floats=(), num_warps=4, num_stages=1,
                 maxnreg=None, fp_fusion=True, gluon=False) -> dict:
    """-> {"regs", "stack", "sass", "ptx", "layouts"} of fn compiled for sm_90 (pointer_types: arg -> "*fp16"
    etc.; layouts: the distinct register layouts of its Triton GPU IR). gluon: fn is a Gluon kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if gluon:
        try:
            from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
        except ImportError:  # Triton 3.6: ASTSource tells a Gluon function by itself
            pass
    names = fn.arg_names
    if "num_warps" in names:  # a Gluon kernel's own parameter
        constexprs = {**constexprs, "num_warps": num_warps}
    signature = {n: "constexpr" if n in constexprs else pointer_types.get(n, "fp32" if n in floats else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in constexprs and n not in floats and not signature[n].startswith("tensordesc")}
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(n),): v for n, v in constexprs.items()}, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": fp_fusion,
               **({"maxnreg": maxnreg} if maxnreg else {})}
    started = time.perf_counter()
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    compile_s = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = _run(_tools() / "cuobjdump", "-res-usage", cubin)
        sass = _run(_tools() / "nvdisasm", "-c", cubin)
    regs, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    layouts = sorted(set(re.findall(r"#ttg\.blocked<\{[^}]*\}>", compiled.asm["ttgir"])))
    return {"regs": regs, "stack": stack, "sass": sass, "ptx": compiled.asm["ptx"], "layouts": layouts,
            "compile_s": compile_s}


def _run(tool: Path, *args) -> str:
    return subprocess.run([str(tool), *map(str, args)], capture_output=True, text=True, check=True).stdout


def loops(sass: str) -> list[list[str]]:
    """Instruction lists of the backward-branch loops of a disassembly (label .. branch)."""
    instructions: list[str] = []
    labels: dict[str, int] = {}
    for line in sass.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        ins = re.search(r"/\*[0-9a-f]{4,}\*/\s*(.*?);", line)
        if ins:
            instructions.append(re.sub(r"^@!?U?P[T\d]+\s+", "", ins.group(1)).strip())
    found = []
    for i, ins in enumerate(instructions):
        target = re.search(r"(\.L_x_\d+)", ins) if ins.startswith("BRA") else None
        if target and labels.get(target.group(1), i + 1) <= i:
            found.append(instructions[labels[target.group(1)] : i + 1])
    return found


def attention(a):
    import triton

    from services.worker.kernels import paged_attention as pa

    pointers = {n: "*fp16" for n in ("q_ptr", "out_ptr")}
    pointers |= {n: "*i32" for n in ("k_ptr", "v_ptr", "block_tables_ptr", "context_lens_ptr")}
    pointers |= {n: "*fp32" for n in ("part_m_ptr", "part_l_ptr", "part_o_ptr")}
    if a.head_rows:  # heads as the score MMA's rows (paged_attention_head_rows.py)
        consts = dict(HEAD_DIM=a.head_dim, BLOCK_SIZE=16, SPLIT=a.split, FAST=True, GROUP=a.group,
                      PREFETCH=not a.no_prefetch)
        from services.worker.kernels import paged_attention_head_rows as hr

        sass = compile_sass(hr._kv4_decode_head_rows_kernel, pointers, consts, floats=("qk_scale",), num_warps=1,
                            maxnreg=a.maxnreg)
        return sass, 32
    if a.mma:  # scores on the int8 tensor cores (paged_attention_mma.py): one warp, 32-token tiles
        consts = dict(HEAD_DIM=a.head_dim, BLOCK_SIZE=16, SPLIT=a.split, PREFETCH=not a.no_prefetch, FAST=True,
                      GROUP=a.group, PAGE_AHEAD=a.page_ahead, PV_MMA=a.pv_mma)
        sass = compile_sass(pa._kv4_decode_mma_kernel, pointers, consts, floats=("qk_scale",), num_warps=1, maxnreg=a.maxnreg)
        return sass, 32
    consts = dict(GROUP=a.group, BLOCK_G=triton.next_power_of_2(a.group), HEAD_DIM=a.head_dim, BLOCK_SIZE=16,
                  BLOCK_N=a.block_n, SPLIT=a.split, PREFETCH=not a.no_prefetch, QK_INT=a.qk_int16, FAST=True,
                  PAGE_AHEAD=a.page_ahead)
    sass = compile_sass(pa._kv4_decode_fma_kernel, pointers, consts, floats=("qk_scale",), num_warps=a.warps, maxnreg=a.maxnreg)
    return sass, a.block_n


def act_quant(a):
    from services.worker.kernels import act_quant as aq

    pointers = {"in_ptr": "*fp16", "w_ptr": "*fp16", "x8_ptr": "*i8", "scale_ptr": "*fp32", "rowsum_ptr": "*i32",
                "group_sums_ptr": "*i32", "add_ptr": "*fp16"}
    consts = dict(OP={"quantize": 0, "rmsnorm": 1, "silu": 2}[a.op], BLOCK=a.block, ONE_PASS=not a.chunked,
                  ADD=a.add)
    return compile_sass(aq._act_quant_kernel, pointers, consts, floats=("eps",), num_warps=a.warps), None


def kv_write(a):
    import triton

    from services.worker.kernels import kv4_cache as kc

    pointers = {n: "*fp16" for n in ("key_ptr", "value_ptr", "query_ptr", "query_out_ptr")}
    pointers |= {"positions_ptr": "*i32", "slots_ptr": "*i64", "rope_ptr": "*fp32", "k_cache_ptr": "*u8", "v_cache_ptr": "*u8",
                 "key_feedback_ptr": "*fp32"}
    consts = dict(HEAD_DIM=a.head_dim, BLOCK_SIZE=16, GROUP=a.group, BLOCK_G=triton.next_power_of_2(a.group), BLOCK_H=a.block_h,
                  QUANTIZE=True, ROTATE_QUERY=True, K_SHRINK=False, V_SHRINK=True, KEY_FEEDBACK=a.key_feedback)
    # As write_kv4_cache launches it: no FMA contraction (the reference rounds every product).
    return compile_sass(kc._rope_cache_write_kernel, pointers, consts, floats=("k_margin", "v_margin"), num_warps=a.warps,
                        fp_fusion=False), None


def gemm(a):
    """A W4A8 tensor-core variant by name (w4a8_gemm.VARIANTS), as a split-K launch compiles it.

    The unit strides are passed as the constant 1, as Triton specializes them at launch: compiled
    with them as plain (16-divisible) integers, the tile loads degrade to byte loads."""
    from services.worker.kernels import w4a8_gemm as wg

    v = wg.get_variant(a.variant)
    if v.gemv:
        raise SystemExit(f"{v.name} is a dp4a variant: use the gemv subcommand")
    if v.int8_path:
        return int8_path(v, a.dequant)
    common = dict(BLOCK_M=v.block_m, BLOCK_N=v.block_n, GROUP_M=v.group_m, DOT_FP16=v.dot_fp16, USE_SPLIT=v.split_k,
                  FAST_UNPACK=True, PDL=0, stride_xk=1, stride_qk=1, stride_on=1)
    pointers = {"x_ptr": "*i8", "sx_ptr": "*fp32", "qw_ptr": "*u8", "out_ptr": "*fp16", "ws_ptr": "*i32"}
    if v.kind == wg.G128:
        pointers |= {"s2_ptr": "*u8", "zero_ptr": "*u8", "s1_ptr": "*fp16", "group_sums_ptr": "*i32"}
        consts = common | dict(ZERO_AFTER_DOT=v.zero_after_dot, SWAR=v.swar, stride_sg=1,
                               HAS_GROUP_SUMS=v.zero_after_dot and a.group_sums)
        kernel = wg._w4a8_g128_kernel
    else:
        pointers |= {"rowsum_ptr": "*i32", "scale_ptr": "*fp16", "zero_ptr": "*fp16"}
        consts = common | dict(HAS_ROWSUM=True)
        kernel = wg._w4a8_channel_kernel
    return compile_sass(kernel, pointers, consts, num_warps=v.num_warps, num_stages=v.num_stages, maxnreg=v.maxnreg), None


def int8_path(v, dequant: bool):
    """The int8 path of a .i8 variant (w4a8_int8_path.py): its int8 GEMM, or with --dequant its first pass."""
    from services.worker.kernels import w4a8_int8_path as ip

    if dequant:
        pointers = {"qw_ptr": "*u8", "s2_ptr": "*u8", "zero_ptr": "*u8", "w8_ptr": "*i8"}
        consts = dict(BLOCK_N=ip.DEQUANT_BLOCK_N, GROUPS=ip.DEQUANT_GROUPS, FAST_UNPACK=True, PDL=0, stride_sg=1)
        return compile_sass(ip._g128_to_int8_kernel, pointers, consts, num_warps=4), None
    consts = dict(BLOCK_M=v.block_m, BLOCK_N=v.block_n, BLOCK_K=ip.INT8_BLOCK_K, GROUP_M=v.group_m, PDL=0, stride_on=1)
    pointers = {"sx_ptr": "*fp32", "s1_ptr": "*fp16", "out_ptr": "*fp16",
                "x_desc": f"tensordesc<i8[{v.block_m}, {ip.INT8_BLOCK_K}]>",
                "w_desc": f"tensordesc<i8[{v.block_n}, {ip.INT8_BLOCK_K}]>"}
    return compile_sass(ip._int8_gemm_kernel, pointers, consts, num_warps=v.num_warps, num_stages=v.num_stages), None


def gemv(a):
    from services.worker.kernels import w4a8_gemv as gv

    pointers = {"x_ptr": "*i32", "sx_ptr": "*fp32", "rowsum_ptr": "*i32", "qw_ptr": "*i32", "s2_ptr": "*u8",
                "zero_ptr": "*u8", "col_scale_ptr": "*fp16", "out_ptr": "*fp16", "ws_ptr": "*i32"}
    if not a.g128:
        pointers |= {"s2_ptr": "*fp16", "zero_ptr": "*fp16"}
    consts = dict(G128=a.g128, HAS_ROWSUM=not a.g128 or a.group_sums, BLOCK_N=a.block_n, BLOCK_M=a.block_m,
                  GROUPS_PER_STEP=a.groups_per_step, USE_SPLIT=False, FAST=True, PDL=0, X_SHARED=a.x_shared)
    return compile_sass(gv._w4a8_gemv_kernel, pointers, consts, num_warps=a.warps, maxnreg=a.maxnreg), None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loop-min", type=int, default=LOOP_MIN, help="shortest loop to report (instructions)")
    p.add_argument("--ops", type=int, default=12, help="opcodes listed per loop, most frequent first")
    sub = p.add_subparsers(dest="kernel", required=True)
    att = sub.add_parser("attention", help="the KV4 decode 'fma' kernel (or with --mma the 'mma' one)")
    att.add_argument("--group", type=int, default=1)
    att.add_argument("--head-dim", type=int, default=128)
    att.add_argument("--block-n", type=int, default=32)
    att.add_argument("--warps", type=int, default=1)
    att.add_argument("--maxnreg", type=int)
    att.add_argument("--qk-int16", action="store_true")
    att.add_argument("--split", action="store_true", help="the partitioned variant (partials + reduction)")
    att.add_argument("--no-prefetch", action="store_true")
    att.add_argument("--mma", action="store_true", help="the 'mma' kernel (int8 tensor-core scores, head_dim 128)")
    att.add_argument("--page-ahead", action="store_true", help="block-table entries a tile ahead of the words")
    att.add_argument("--pv-mma", action="store_true", help="with --mma: the value sums on the fp16 tensor cores")
    att.add_argument("--head-rows", action="store_true", help="the head-rows kernel (heads as the score MMA's rows)")
    aq = sub.add_parser("act_quant", help="rmsnorm / silu / plain per-token int8 quantization")
    aq.add_argument("--op", choices=("quantize", "rmsnorm", "silu"), default="silu")
    aq.add_argument("--block", type=int, default=16384)
    aq.add_argument("--chunked", action="store_true")
    aq.add_argument("--add", action="store_true", help="rmsnorm with the residual add fused (add=y)")
    aq.add_argument("--warps", type=int, default=16)
    kv = sub.add_parser("kv_write", help="RoPE + KV4 cache write")
    kv.add_argument("--group", type=int, default=2,
                    help="query heads per KV head as the runner passes them (q + k in prefill: 2)")
    kv.add_argument("--head-dim", type=int, default=128)
    kv.add_argument("--block-h", type=int, default=8)
    kv.add_argument("--warps", type=int, default=4)
    kv.add_argument("--key-feedback", action="store_true", help="keys by error-feedback rounding (shared.formats.kv4)")
    gm = sub.add_parser("gemm", help="a W4A8 tensor-core variant of w4a8_gemm.py, by name")
    gm.add_argument("variant", help="e.g. chn.n128m16.sk or g128.n64m64.sk.swar")
    gm.add_argument("--group-sums", action="store_true", help="g128 .zp: x8's group sums from the act-quant kernel")
    gm.add_argument("--dequant", action="store_true", help=".i8 variants: the dequantization pass instead of the GEMM")
    gv = sub.add_parser("gemv", help="the W4A8 dp4a kernel for M <= 4 (w4a8_gemv.py)")
    gv.add_argument("--g128", action="store_true", help="per-group weights (default per-channel)")
    gv.add_argument("--group-sums", action="store_true", help="g128: the zero term from the act-quant group sums")
    gv.add_argument("--block-n", type=int, default=16)
    gv.add_argument("--block-m", type=int, default=1)
    gv.add_argument("--groups-per-step", type=int, default=8)
    gv.add_argument("--warps", type=int, default=4)
    gv.add_argument("--maxnreg", type=int)
    gv.add_argument("--x-shared", action="store_true", help="M = 1: x held once for all rows (_row_sums_x_shared)")
    a = p.parse_args()
    # A fresh Triton cache: a kernel compiled before would load from disk, and the compile time printed be nothing.
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="sass_count_")
    result, tile_tokens = {"attention": attention, "act_quant": act_quant, "kv_write": kv_write,
                           "gemm": gemm, "gemv": gemv}[a.kernel](a)
    total = len(re.findall(r"/\*[0-9a-f]{4,}\*/", result["sass"]))
    print(f"{a.kernel}: {result['regs']} registers, {result['stack']} bytes of stack, {total} instructions, "
          f"compiled in {result['compile_s']:.1f} s")
    for layout in result["layouts"]:
        print(f"  layout {layout}")
    for body in (b for b in loops(result["sass"]) if len(b) >= a.loop_min):
        per = f" ({len(body) * 32 / tile_tokens:.0f} per 32 tokens)" if tile_tokens else ""
        mix = collections.Counter(ins.split()[0] for ins in body).most_common(a.ops)
        print(f"  loop of {len(body)} instructions{per}: " + " ".join(f"{op} {n}" for op, n in mix))


if __name__ == "__main__":
    main()
