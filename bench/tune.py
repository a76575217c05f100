"""Offline profiler of the W4A8 GEMM variants: writes the kernel policy table of the present GPU.

    python3 bench/tune.py --model /models/Llama-2-7b-hf --out bench/results/h200/policy.json --target sm90
    python3 bench/tune.py --shapes 12288x4096,4096x4096,22016x4096,4096x11008 --out policy.json

For every format (weight kind), (N, K) of the model and M of the grid, every variant that
can_implement it is timed and the fastest correct one wins. Before timing, each (variant, N, K) is
checked once against the reference linear of shared/model/linear.py on a few M (--check-m) with a
NaN-poisoned output: bit-exact for the int32 paths, rtol 1e-3 for the `.f16` (fp16 MMA) ones; a
variant that fails (or raises) is never timed for that shape. Timing is bench/kernels.py's: ROTATE
calls on distinct weight and activation sets captured in one CUDA graph, do_bench's median over its
replays with the L2 cleared before each, divided by ROTATE. --prune R stops timing a variant at the
larger Ms once it ran R times slower than the winner at some M while its M tile is no taller than the
winner's (larger M only favours taller tiles; 0: time everything).

The per-M winners become the table's rows (shared/formats/kernel_policy.py): consecutive Ms with the
same winner merge into one [max_M, variant] row, and the largest M's row is unbounded ([null, v]).
The table, with a "source" entry (the command line, GPU, torch / Triton versions, the M grid), is
checked with the worker's own parser and written to --out and/or, with --target, to
shared/formats/kernel_policies/<target>.json, the table the quantizer puts into every artifact for
that GPU target (the worker looks the variant up in it: nothing is tuned while serving). --raw
writes every check and time. --merge keeps a target file's entries for shapes not tuned here.

On the CPU (TRITON_INTERPRET=1) it runs the same path with wall-clock timing, for tests; main()
takes a timer and a GEMM function to inject (tests/kernels/test_tune.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.kernels import FLUSHES, check_output, gemm_calls, time_calls, w4a8_act_set, w4a8_weight_set, warm_gpu, x_sums  # noqa: E402
from bench.policy_table import POLICY_DIR, write_policy  # noqa: E402

FORMATS = ("w4a8kv4-g128", "w4a8kv4-chn")
M_GRID = sorted({2**i for i in range(14)} | {3, 24, 48, 96, 192, 384})  # 1 .. 8192
CHECK_MS = (1, 17, 100, 1000)
ROTATE = 4

# timer(fns, case) -> ms per call; case: {"kind", "N", "K", "M", "variant"}
Timer = Callable[[list, dict], float]


def model_shapes(folder: Path) -> list[tuple[str, int, int]]:
    """The fused W4A8 linears of a Llama checkpoint as (names, N, K), one entry per distinct (N, K):
    qkv (q + 2 kv, hidden), o (hidden, heads * head_dim), gate_up (2 ffn, hidden), down (hidden, ffn)."""
    from shared.formats.artifact import BLOCK_LINEARS
    from shared.model.config import LlamaConfig

    c = LlamaConfig.from_folder(folder)
    h, f = c.hidden_size, c.intermediate_size
    by_name = {"qkv": (c.q_size + 2 * c.kv_size, h), "o": (h, c.q_size), "gate_up": (2 * f, h), "down": (h, f)}
    assert set(by_name) == set(BLOCK_LINEARS), f"the block's linears changed: {BLOCK_LINEARS}"
    shapes: dict[tuple[int, int], list[str]] = {}
    for name in BLOCK_LINEARS:
        shapes.setdefault(by_name[name], []).append(name)
    return [("+".join(names), n, k) for (n, k), names in shapes.items()]


def parse_shapes(text: str) -> list[tuple[str, int, int]]:
    out = []
    for item in text.split(","):
        try:
            n, k = (int(v) for v in item.strip().lower().split("x"))
        except ValueError:
            raise SystemExit(f"--shapes: {item!r} is not NxK (e.g. 12288x4096)") from None
        out.append((f"{n}x{k}", n, k))
    return out


def merge_rows(winners: dict[int, str], unbounded_ok: Callable[[str], bool] = lambda name: True,
               fallback: str | None = None) -> list[list]:
    """{M: winner} -> [[max_M, variant], ..., [None, variant]]: consecutive Ms with the same winner
    share one row (its max_M the largest of them); the last row has no bound. If the largest M's
    winner may not run every larger M (unbounded_ok false, e.g. a variant with a max_M), its row
    keeps its bound and [None, fallback] follows."""
    rows: list[list] = []
    for m in sorted(winners):
        if rows and rows[-1][1] == winners[m]:
            rows[-1][0] = m
        else:
            rows.append([m, winners[m]])
    if not rows:
        return rows
    if unbounded_ok(rows[-1][1]) or rows[-1][1] == fallback:
        rows[-1][0] = None
    else:
        rows.append([None, fallback])
    return rows


def gpu_timer(warmup: int, rep: int, flush: str = "read") -> Timer:
    return lambda fns, case: time_calls(fns, warmup, rep, flush)


def wall_timer(reps: int = 3) -> Timer:
    """The CPU (interpreter) stand-in: median wall time of reps rounds of the calls, per call."""

    def timer(fns, case):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for fn in fns:
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / len(fns))
        return sorted(times)[len(times) // 2]

    return timer


@dataclass
class Progress:
    """Counts timings done against the planned total; prints a line with the elapsed time and an ETA."""

    total: int
    done: int = 0
    start: float = field(default_factory=time.time)

    def line(self, text: str) -> None:
        elapsed = time.time() - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        print(f"[{self.done:4d}/{self.total} timings, {elapsed:5.0f} s, ETA {eta:4.0f} s] {text}", flush=True)


class Tuner:
    def __init__(self, *, device, ms: list[int], check_ms: list[int], timer: Timer, gemm_fn=None,
                 variants: list[str] | None = None, rotate: int = ROTATE, prune: float = 0.0):
        from services.worker.kernels import w4a8_gemm as gemm

        self.gemm = gemm
        self.gemm_fn = gemm_fn or gemm.w4a8_gemm
        self.device, self.ms, self.check_ms = device, sorted(set(ms)), sorted(set(check_ms))
        self.timer, self.rotate, self.prune = timer, rotate, prune
        self.variants = [gemm.get_variant(name) for name in variants] if variants else list(gemm.VARIANTS)
        self.raw: dict = {"checks": [], "times": [], "errors": []}

    def candidates(self, kind: str, n: int, k: int) -> list:
        return [v for v in self.variants if v.kind == kind and any(v.can_implement(m, n, k, kind)[0] for m in self.ms)]

    def planned(self, kind: str, n: int, k: int) -> int:
        return sum(v.can_implement(m, n, k, kind)[0] for v in self.candidates(kind, n, k) for m in self.ms)

    def check(self, kind: str, n: int, k: int, ws: list, candidates: list) -> list:
        """Each candidate once against the reference on the check Ms it can run (or, with none of
        those, the smallest grid M it can): the variants that passed everywhere."""
        import torch

        from shared.model.linear import reference_linear

        ref_linear = reference_linear(ws[0][kind])
        plan = {v.name: [m for m in self.check_ms if v.can_implement(m, n, k, kind)[0]]
                or [min(m for m in self.ms if v.can_implement(m, n, k, kind)[0])] for v in candidates}
        failed: set[str] = set()
        for m in sorted({m for ms in plan.values() for m in ms}):
            a = w4a8_act_set(m, k, self.device)
            ref = ref_linear(a["x"])
            for v in candidates:
                if m not in plan[v.name] or v.name in failed:
                    continue
                entry = {"kind": kind, "N": n, "K": k, "M": m, "variant": v.name}
                try:
                    out = torch.full((m, n), float("nan"), dtype=torch.float16, device=self.device)
                    self.gemm_fn(a["x8"], a["sx"], ws[0][kind], **x_sums(a), variant=v.name, out=out)
                    entry.update(check_output(out, ref, v.dot_fp16))
                except Exception as e:  # a variant that does not run is a wrong one
                    entry.update(correct=False, error=f"{type(e).__name__}: {e}"[:500])
                self.raw["checks"].append(entry)
                if not entry["correct"]:
                    failed.add(v.name)
                    print(f"  WRONG {v.name} {kind} {n}x{k} M={m}: "
                          + (entry.get("error") or f"max_rel_err {entry['max_rel_err']:.3g}, rows {entry.get('wrong_rows')}"),
                          flush=True)
        return [v for v in candidates if v.name not in failed]

    def shape(self, kind: str, n: int, k: int, progress: Progress) -> dict[int, str]:
        """{M: the fastest correct variant} for one (kind, N, K)."""
        ws = [{kind: w4a8_weight_set(n, k, self.device)[kind]} for _ in range(self.rotate)]
        candidates = self.candidates(kind, n, k)
        correct = self.check(kind, n, k, ws, candidates)
        print(f"{kind} {n}x{k}: {len(correct)}/{len(candidates)} variants correct", flush=True)
        progress.total -= sum(v.can_implement(m, n, k, kind)[0] for v in candidates if v not in correct
                              for m in self.ms)
        winners: dict[int, str] = {}
        pruned: set[str] = set()
        for m in self.ms:
            runnable = [v for v in correct if v.can_implement(m, n, k, kind)[0]]
            acts = [w4a8_act_set(m, k, self.device) for _ in range(self.rotate)]
            times: dict[str, float] = {}
            for v in runnable:
                case = {"kind": kind, "N": n, "K": k, "M": m, "variant": v.name}
                if v.name in pruned:
                    self.raw["times"].append({**case, "pruned": True})
                    progress.done += 1
                    continue
                try:
                    times[v.name] = self.timer(gemm_calls(self.gemm_fn, v.name, kind, ws, acts), case)
                    self.raw["times"].append({**case, "us": times[v.name] * 1e3})
                except Exception as e:
                    self.raw["errors"].append({**case, "error": f"{type(e).__name__}: {e}"[:500]})
                    print(f"  ERROR {v.name} {kind} {n}x{k} M={m}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                progress.done += 1
            del acts
            if not times:
                print(f"  {kind} {n}x{k} M={m}: no correct variant ran; the table leaves this M to the next row",
                      flush=True)
                continue
            winners[m] = min(times, key=times.get)
            if self.prune:
                # Larger M favours larger M tiles: a variant R times slower than the winner whose
                # tile is no taller than the winner's will not catch up at the Ms still to come.
                best = self.gemm.get_variant(winners[m])
                pruned |= {name for name, t in times.items() if t > self.prune * times[best.name]
                           and self.gemm.get_variant(name).block_m <= best.block_m}
            progress.line(f"{kind} {n}x{k} M={m:5d}: {winners[m]} {times[winners[m]] * 1e3:.1f} us"
                          f" ({len(times)} timed)")
        return winners

    def rows(self, kind: str, n: int, k: int, winners: dict[int, str]) -> list[list]:
        top = max(winners) if winners else max(self.ms)
        fallback = self.gemm.default_variant_name(top + 1, kind)
        if winners and top < M_GRID[-1]:
            # A grid short of the Ms a server runs (--m 1,2,4) made its top M's small-tile winner run every prefill
            # M too (2.6x slower than the default at M = 4096): past the grid, no row, so each M gets the worker's
            # default for that M (logged once per shape).
            rows = merge_rows(winners)
            rows[-1][0] = top
            return rows
        return merge_rows(winners, lambda name: self.gemm.get_variant(name).max_m is None, fallback)


def machine(device) -> dict:
    import torch
    import triton

    if device.type == "cuda":
        from bench.machine import gpu_machine

        return gpu_machine(device)
    return {"gpu": None, "device": "cpu (Triton interpreter)", "torch": torch.__version__,
            "triton": triton.__version__, "platform": platform.platform()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from shared.formats.manifest import GPU_TARGETS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="a Hugging Face Llama checkpoint folder (its config.json)")
    src.add_argument("--shapes", help="N x K list, e.g. 12288x4096,4096x4096")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma list of {FORMATS}")
    p.add_argument("--m", default=",".join(map(str, M_GRID)), help="the M grid (comma list)")
    p.add_argument("--check-m", default=",".join(map(str, CHECK_MS)), help="Ms of the correctness check")
    p.add_argument("--variants", default="", help="comma list of variant names to consider (default: all)")
    p.add_argument("--out", type=Path, help="the policy table JSON to write")
    p.add_argument("--target", choices=[t for t in GPU_TARGETS if t != "cpu"],
                   help="also write shared/formats/kernel_policies/<target>.json")
    p.add_argument("--merge", action="store_true", help="keep the target file's entries for shapes not tuned here")
    p.add_argument("--any-device", action="store_true",
                   help="write --target from a run on another device (the Triton interpreter in tests): a table for "
                        "a GPU must be timed on that GPU")
    p.add_argument("--raw", type=Path, help="write every check and time to this JSON")
    p.add_argument("--warmup", type=int, default=5, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=20, help="do_bench repetition, ms")
    p.add_argument("--flush", choices=FLUSHES, default="read", help="how the L2 is cleared before a replay (bench.kernels.time_calls)")
    p.add_argument("--rotate", type=int, default=None, help=f"weight/activation sets per graph ({ROTATE}; 1 on CPU)")
    p.add_argument("--prune", type=float, default=4.0,
                   help="stop timing a variant once it is this many times slower than the winner with an M tile no"
                   " taller than the winner's (0: never)")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu (Triton interpreter)")
    args = p.parse_args(argv)
    if not args.out and not args.target:
        p.error("give --out FILE and/or --target TARGET")
    return args


def main(argv: list[str] | None = None, *, timer: Timer | None = None, gemm_fn=None) -> dict:
    """Runs the tuner; returns the written table. timer / gemm_fn replace the timing and the GEMM call
    (tests)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    import torch

    from shared.formats.kernel_policy import parse_policy
    from shared.formats.spec import format_spec

    command = shlex.join(["python3", "bench/tune.py", *argv])
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.target and not args.any_device:
        here = (f"sm{''.join(map(str, torch.cuda.get_device_capability(device)))}" if device.type == "cuda"
                else device.type)
        if here != args.target:  # CPU wall-clock timings written as the sm90 table the quantizer ships
            raise SystemExit(f"--target {args.target}: this run is on {here}; a GPU's table is timed on that GPU "
                             f"(--out FILE writes a table anywhere)")
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels' module is imported
    kinds = [format_spec(f.strip()).weight_kind for f in args.formats.split(",")]
    shapes = model_shapes(args.model) if args.model else parse_shapes(args.shapes)
    ms = [int(m) for m in args.m.split(",")]
    if timer is None:
        timer = gpu_timer(args.warmup, args.rep, args.flush) if device.type == "cuda" else wall_timer()
    torch.manual_seed(0)
    tuner = Tuner(device=device, ms=ms, check_ms=[int(m) for m in args.check_m.split(",")], timer=timer,
                  gemm_fn=gemm_fn, variants=[v.strip() for v in args.variants.split(",") if v.strip()],
                  rotate=args.rotate or (ROTATE if device.type == "cuda" else 1), prune=args.prune)
    info = machine(device)
    print(f"tuning {len(shapes)} shapes x {len(kinds)} formats x {len(tuner.ms)} Ms on {info.get('gpu') or device}: "
          + ", ".join(f"{n}x{k}" + (f" ({name})" if args.model else "") for name, n, k in shapes), flush=True)
    progress = Progress(sum(tuner.planned(kind, n, k) for kind in kinds for _, n, k in shapes))
    if device.type == "cuda":
        warm_gpu(device)
    gemm: dict = {}
    unsolved: list[tuple[str, str]] = []  # (kind, shape) with no correct variant: the default, also when merged
    for kind in kinds:
        for _, n, k in shapes:
            winners = tuner.shape(kind, n, k, progress)
            if not winners:
                print(f"{kind} {n}x{k}: no correct variant at any M; left out of the table (the default applies)")
                unsolved.append((kind, f"{n}x{k}"))
                continue
            gemm.setdefault(kind, {})[f"{n}x{k}"] = tuner.rows(kind, n, k, winners)
            tuner.raw.setdefault("winners", {}).setdefault(kind, {})[f"{n}x{k}"] = {str(m): v for m, v in winners.items()}
    seconds = time.time() - progress.start
    source = {"tool": "bench/tune.py", "command": command, **{key: info.get(key) for key in ("gpu", "torch", "triton", "cuda")},
              "m_grid": tuner.ms, "check_m": tuner.check_ms, "shapes": [[name, n, k] for name, n, k in shapes],
              "timing": f"median (warmup {args.warmup} ms, rep {args.rep} ms, L2 cleared by a 256 MB {args.flush}) of a CUDA graph of"
              f" {tuner.rotate} calls on distinct inputs, per call" if device.type == "cuda" else "CPU wall clock",
              "seconds": round(seconds, 1), "date": time.strftime("%Y-%m-%d")}
    table = {"gemm": gemm, "source": source}
    parse_policy(table)
    if args.out:
        write_policy(table, args.out)
    if args.target:
        target = POLICY_DIR / f"{args.target}.json"
        written = table
        if args.merge and target.is_file():
            old = json.loads(target.read_text())
            merged = {kind: dict(shapes_) for kind, shapes_ in old.get("gemm", {}).items()}
            for kind, shapes_ in gemm.items():
                merged.setdefault(kind, {}).update(shapes_)
            for kind, shape in unsolved:  # its old rows name a variant this run found wrong
                merged.get(kind, {}).pop(shape, None)
            written = {"gemm": merged, "source": {**source, "merged_into": old.get("source")}}
        write_policy(written, target)
    if args.raw:
        args.raw.parent.mkdir(parents=True, exist_ok=True)
        args.raw.write_text(json.dumps({"source": source, "machine": info, **tuner.raw}, indent=1) + "\n")
        print(f"wrote {args.raw}")
    print(f"{progress.done} timings in {seconds:.0f} s; {len(tuner.raw['errors'])} errors,"
          f" {sum(not c['correct'] for c in tuner.raw['checks'])} failed checks")
    print(f"command: {command}", flush=True)
    return table


if __name__ == "__main__":
    main()
