"""Shared test fixtures: paths of the read-only fixtures in ../shared and small random checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Triton kernels run in Triton's interpreter in the tests (CI has no GPU). `triton.jit` reads the
# variable when a kernel module is imported, and tests of other folders (formats, worker) import
# kernel modules too, so it is set here, before any test module is collected.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import sqlalchemy as sa  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

# Under pytest-xdist (scripts/test.sh runs the fast tests on QSERVE_TEST_WORKERS processes) each
# worker's torch gets its share of the cores, not all of them: oversubscribed OpenMP threads spin.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO.parent / "shared"
TINY_LLAMA = FIXTURES / "models" / "tiny-llama-pystdlib"
EVAL_TEXT = FIXTURES / "data" / "pystdlib-eval.txt"
CALIB_TEXT = FIXTURES / "data" / "pystdlib-calib.txt"


POSTGRES_URL = os.environ.get("QSERVE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@contextmanager
def fresh_postgres_schema(prefix: str) -> Iterator[str]:
    """A URL of the test PostgreSQL whose search_path is a new schema, dropped afterwards.

    An unreachable server fails the test under CI (CI=true) and skips it elsewhere.
    """
    schema = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3})
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    except sa.exc.OperationalError as exc:
        admin.dispose()
        message = f"PostgreSQL at {POSTGRES_URL} is unreachable ({exc.orig}); set QSERVE_TEST_POSTGRES_URL or start it"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    try:
        yield f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def _require(path: Path) -> Path:
    if not path.exists():
        pytest.fail(f"test fixture {path} is missing (the repo expects ../shared beside it)")
    return path


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    return _require(TINY_LLAMA)


@pytest.fixture(scope="session")
def eval_text() -> Path:
    return _require(EVAL_TEXT)


@pytest.fixture(scope="session")
def calib_text() -> Path:
    return _require(CALIB_TEXT)


def write_random_llama(
    folder: Path,
    *,
    hidden: int = 256,
    ffn: int = 384,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 4096,
    tie: bool = False,
    rope_scaling: dict | None = None,
    seed: int = 0,
    tokenizer_from: Path | None = TINY_LLAMA,
) -> Path:
    """A random-weight Llama checkpoint in Hugging Face layout (config.json + model.safetensors)."""
    g = torch.Generator().manual_seed(seed)
    head_dim = hidden // heads
    folder.mkdir(parents=True, exist_ok=True)

    def rand(*shape, scale=0.05):
        return (torch.randn(*shape, generator=g) * scale).half()

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden, scale=1.0), "model.norm.weight": (1 + rand(hidden, scale=0.1)).half()}
    if not tie:
        tensors["lm_head.weight"] = rand(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": (1 + rand(hidden, scale=0.1)).half(),
            p + "post_attention_layernorm.weight": (1 + rand(hidden, scale=0.1)).half(),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(ffn, hidden),
            p + "mlp.up_proj.weight": rand(ffn, hidden),
            p + "mlp.down_proj.weight": rand(hidden, ffn),
        })
    save_file(tensors, str(folder / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048, "tie_word_embeddings": tie, "hidden_act": "silu",
        "bos_token_id": 0, "eos_token_id": 0, "rope_theta": 10000.0, "torch_dtype": "float16",
    }
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    (folder / "config.json").write_text(json.dumps(config))
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_from / name, folder / name)
    return folder


@pytest.fixture
def random_llama(tmp_path: Path, tiny_llama: Path) -> Path:
    return write_random_llama(tmp_path / "random-llama")
