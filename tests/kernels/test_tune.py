"""bench/tune.py, the offline GEMM profiler, on the CPU (Triton interpreter) with an injected timer.

The correctness checks run the real kernels on a tiny shape (N 256, K 384); the timer is a stand-in
that makes known variants win at known Ms, so the table it writes is known in advance. A GEMM
function that corrupts one variant's output stands for a variant that computes wrong results: it is
made the fastest everywhere and must never be chosen.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import tune  # noqa: E402
from services.worker.engine.kernel_policy import GemmPolicy  # noqa: E402
from services.worker.kernels import w4a8_gemm as gemm  # noqa: E402
from shared.formats.kernel_policy import parse_policy  # noqa: E402

N, K, MS = 256, 384, (1, 3, 17)
FAULTY = "chn.n64m16.sk.f16"  # max_M 16: also the variant that cannot run every M
VARIANTS = ["g128.n64m16.sk", "g128.n128m64.sk", "chn.n64m16.sk", "chn.n128m16.sk", FAULTY]
# ms per call by (variant, M); the faulty variant would win everywhere
TIMES = {
    "g128.n64m16.sk": {1: 1.0, 3: 1.0, 17: 5.0},
    "g128.n128m64.sk": {1: 2.0, 3: 2.0, 17: 2.0},
    "chn.n64m16.sk": {1: 1.0, 3: 3.0, 17: 3.0},
    "chn.n128m16.sk": {1: 2.0, 3: 2.0, 17: 2.0},
    FAULTY: {1: 1e-3, 3: 1e-3, 17: 1e-3},
}
EXPECTED = {  # the grid stops at 17: Ms above it get the worker's default for each M (no row)
    "w4g128p": [[3, "g128.n64m16.sk"], [17, "g128.n128m64.sk"]],
    "w4chn": [[1, "chn.n64m16.sk"], [17, "chn.n128m16.sk"]],
}


def faulty_gemm(x8, sx, weight, rowsum=None, variant=None, *, group_sums=None, split_k=None, out=None):
    y = gemm.w4a8_gemm(x8, sx, weight, rowsum=rowsum, variant=variant, group_sums=group_sums, split_k=split_k, out=out)
    if variant == FAULTY:
        y[0, 0] += 1.0 + y.abs().max()  # one wrong element, far outside the `.f16` tolerance
    return y


class FakeTimer:
    def __init__(self):
        self.cases: list[dict] = []

    def __call__(self, fns, case):
        assert fns and all(callable(f) for f in fns)
        self.cases.append(case)
        return TIMES[case["variant"]][case["M"]]


def _argv(tmp_path: Path, *extra: str) -> list[str]:
    return ["--shapes", f"{N}x{K}", "--m", ",".join(map(str, MS)), "--check-m", "1,17",
            "--variants", ",".join(VARIANTS), "--device", "cpu", "--prune", "0", *extra]


def test_tune_writes_the_table_of_the_fastest_correct_variants(tmp_path, capsys):
    timer = FakeTimer()
    out, raw = tmp_path / "policy.json", tmp_path / "raw.json"
    table = tune.main(_argv(tmp_path, "--out", str(out), "--raw", str(raw)), timer=timer, gemm_fn=faulty_gemm)

    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(table))
    parsed = parse_policy(written)
    GemmPolicy.from_manifest(written)  # every name a variant of its kind, as the worker loads it
    assert set(parsed) == {("w4g128p", N, K), ("w4chn", N, K)}
    assert written["gemm"]["w4g128p"][f"{N}x{K}"] == EXPECTED["w4g128p"]
    assert written["gemm"]["w4chn"][f"{N}x{K}"] == EXPECTED["w4chn"]

    # The faulty variant failed its check and was never timed, hence never chosen.
    assert FAULTY not in {c["variant"] for c in timer.cases}
    assert FAULTY not in json.dumps(written["gemm"])
    checks = json.loads(raw.read_text())["checks"]
    assert [c["correct"] for c in checks if c["variant"] == FAULTY] == [False]
    assert all(c["correct"] for c in checks if c["variant"] != FAULTY)
    # Every other (variant, M) it can run was timed once.
    timed = sorted((c["variant"], c["M"]) for c in timer.cases)
    assert timed == sorted((v, m) for v in VARIANTS if v != FAULTY for m in MS)

    src = written["source"]
    assert src["command"].startswith("python3 bench/tune.py --shapes 256x384")
    assert src["m_grid"] == list(MS) and src["triton"]
    assert src["command"] in capsys.readouterr().out


def test_tune_target_merges_with_the_shipped_table(tmp_path, monkeypatch):
    monkeypatch.setattr(tune, "POLICY_DIR", tmp_path)
    other = {"gemm": {"w4chn": {"4096x4096": [[None, "chn.n128m128"]]}}, "source": {"gpu": "earlier"}}
    (tmp_path / "sm90.json").write_text(json.dumps(other))
    tune.main(_argv(tmp_path, "--formats", "w4a8kv4-chn", "--target", "sm90", "--merge", "--any-device"),
              timer=FakeTimer(), gemm_fn=faulty_gemm)
    written = json.loads((tmp_path / "sm90.json").read_text())
    assert written["gemm"]["w4chn"] == {"4096x4096": [[None, "chn.n128m128"]], f"{N}x{K}": EXPECTED["w4chn"]}
    assert written["source"]["merged_into"] == {"gpu": "earlier"}
    parse_policy(written)


def test_a_target_table_is_timed_on_its_gpu(tmp_path, monkeypatch):
    """CPU wall-clock timings were written as the sm90 table the quantizer ships."""
    monkeypatch.setattr(tune, "POLICY_DIR", tmp_path)
    with pytest.raises(SystemExit, match="--target sm90: this run is on cpu"):
        tune.main(_argv(tmp_path, "--formats", "w4a8kv4-chn", "--target", "sm90"), timer=FakeTimer(),
                  gemm_fn=faulty_gemm)
    assert not (tmp_path / "sm90.json").exists()


def test_a_merged_shape_with_no_correct_variant_now_gets_the_default(tmp_path, monkeypatch):
    """"left out of the table (the default applies)", while --merge kept the old rows naming a variant the run had
    just found wrong."""
    monkeypatch.setattr(tune, "POLICY_DIR", tmp_path)
    old = {"gemm": {"w4chn": {f"{N}x{K}": [[None, FAULTY]], "4096x4096": [[None, "chn.n128m128"]]}}}
    (tmp_path / "sm90.json").write_text(json.dumps(old))
    tune.main(_argv(tmp_path, "--formats", "w4a8kv4-chn", "--variants", FAULTY, "--target", "sm90", "--merge",
                    "--any-device"), timer=FakeTimer(), gemm_fn=faulty_gemm)
    assert json.loads((tmp_path / "sm90.json").read_text())["gemm"]["w4chn"] == {"4096x4096": [[None, "chn.n128m128"]]}


def test_a_short_grid_leaves_the_ms_past_it_to_the_default():
    """--m 1,2,4: the decode-sized winner at M = 4 ran every prefill M (2.6x slower at 4096 on an H100)."""
    tuner = tune.Tuner(device=None, ms=[1, 2, 4], check_ms=[1], timer=FakeTimer(), gemm_fn=None, variants=[],
                       rotate=1, prune=0)
    rows = tuner.rows("w4chn", 4096, 4096, {1: "chn.n128m16.sk", 2: "chn.n128m16.sk", 4: "chn.n128m16.sk"})
    assert rows == [[4, "chn.n128m16.sk"]]
    policy = GemmPolicy.from_manifest({"gemm": {"w4chn": {"4096x4096": rows}}})
    assert policy.variant("w4chn", 4096, 4096, 4) == "chn.n128m16.sk"
    assert policy.variant("w4chn", 4096, 4096, 4096) == gemm.default_variant_name(4096, "w4chn")
    full = tuner.rows("w4chn", 4096, 4096, {1: "chn.n128m16.sk", tune.M_GRID[-1]: "chn.n128m16.sk"})
    assert full == [[None, "chn.n128m16.sk"]]


def test_merge_rows():
    assert tune.merge_rows({1: "a", 2: "a", 4: "b", 8: "a", 16: "a"}) == [[2, "a"], [4, "b"], [None, "a"]]
    assert tune.merge_rows({1: "a"}) == [[None, "a"]]
    assert tune.merge_rows({}) == []
    # A last winner that may not run every larger M keeps its bound; the fallback takes the rest.
    assert tune.merge_rows({1: "a", 16: "f16"}, lambda v: v != "f16", "d") == [[1, "a"], [16, "f16"], [None, "d"]]
    assert tune.merge_rows({1: "a", 16: "d"}, lambda v: False, "d") == [[1, "a"], [None, "d"]]  # the default: one row


@pytest.mark.parametrize("hf, expected", [
    # Llama-2-7B
    ({"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32},
     [("qkv", 12288, 4096), ("o", 4096, 4096), ("gate_up", 22016, 4096), ("down", 4096, 11008)]),
    # Llama-3-8B (grouped-query attention)
    ({"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8},
     [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]),
    # qkv and gate_up of one shape: tuned once, named by both
    ({"hidden_size": 512, "intermediate_size": 768, "num_attention_heads": 8, "num_key_value_heads": 8},
     [("qkv+gate_up", 1536, 512), ("o", 512, 512), ("down", 512, 768)]),
])
def test_model_shapes(tmp_path, hf, expected):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
              "vocab_size": 32000, **hf}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert tune.model_shapes(tmp_path) == expected
