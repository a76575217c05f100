"""The artifact's probe: a fixed token sequence and the logits the quantizer's reference forward gives for it.

    probe.safetensors   prompt_ids (P,) int64    the prompt, fed in two chunks (the second continues the first
                                                 through the paged cache, as a cached prefix does)
                        decode_ids (D,) int64    then fed one token at a time (teacher-forced decode steps)
                        logits (D + 1, V) fp32   the reference logits after the prompt's last token and after
                                                 each decode token (positions P - 1 .. P + D - 1)

The quantizer's accuracy gate runs the reference numerics (shared.model), never the GPU kernels a worker will
serve with. A worker runs the probe through its own runner (kernels, CUDA graphs, paged KV cache) before it
serves and compares: a kernel that computes finite but wrong numbers on this GPU (a policy variant broken on
one shape, a driver or compiler change) would otherwise serve plausible-looking garbage that no error count
or latency budget notices. Artifacts made before the probe existed have none; workers then skip the check."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

PROBE_FILE = "probe.safetensors"
PROMPT_TOKENS = 24  # two prefill chunks: GEMMs at M = 12, prefill and continuing-chunk (paged) attention
DECODE_TOKENS = 8  # decode steps: the GEMV / small-M paths, paged KV4 attention and the decode graphs
_SEED = 20261207
# What Probe.read accepts: the quantizer writes int64 ids and fp32 logits.
_ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_LOGITS_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class Probe:
    prompt_ids: list[int]
    decode_ids: list[int]
    logits: torch.Tensor  # (len(decode_ids) + 1, V) fp32

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.decode_ids

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"prompt_ids": torch.tensor(self.prompt_ids, dtype=torch.int64),
                "decode_ids": torch.tensor(self.decode_ids, dtype=torch.int64),
                "logits": self.logits.float().cpu()}

    @classmethod
    def read(cls, path: Path) -> Probe:
        try:
            t = load_file(str(path))
            prompt_ids, decode_ids, logits = t["prompt_ids"], t["decode_ids"], t["logits"]
        except Exception as exc:  # safetensors' own error type for a damaged header, KeyError for a missing tensor
            raise ValueError(f"{path}: {exc}") from exc
        # Other ranks or dtypes failed in the worker's comparison with a traceback (nested lists of ids, the norm of
        # integer logits), or float ids were truncated without a word.
        for name, ids in (("prompt_ids", prompt_ids), ("decode_ids", decode_ids)):
            if ids.dim() != 1 or ids.dtype not in _ID_DTYPES:
                raise ValueError(f"{path}: {name} is {tuple(ids.shape)} {ids.dtype}, not a 1-D tensor of integer ids")
        if logits.dim() != 2 or logits.dtype not in _LOGITS_DTYPES:
            raise ValueError(f"{path}: logits are {tuple(logits.shape)} {logits.dtype}, not a 2-D floating point "
                             "tensor")
        probe = cls(prompt_ids.tolist(), decode_ids.tolist(), logits)
        if probe.logits.shape[0] != len(probe.decode_ids) + 1 or not probe.prompt_ids:
            raise ValueError(f"{path}: {probe.logits.shape[0]} logits rows for {len(probe.prompt_ids)} prompt and "
                             f"{len(probe.decode_ids)} decode tokens (expected decode + 1 rows, a prompt)")
        return probe

    def errors(self, rows: torch.Tensor) -> list[float]:
        """Each row's relative L2 error against the reference row (rows: (D + 1, V), as `logits`)."""
        ref = self.logits.to(rows.device)
        return ((rows.float() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12)).tolist()


def probe_token_ids(vocab_size: int, length: int) -> list[int]:
    """`length` pseudo-random ids over the whole vocabulary, the same for every artifact of a vocabulary size:
    rows of the embedding table and LM head far apart, not only the common tokens."""
    g = torch.Generator().manual_seed(_SEED)
    return torch.randint(0, vocab_size, (length,), generator=g).tolist()


def probe_bytes(vocab_size: int) -> int:
    """The probe file's tensor bytes (its header is allowed for with the other files')."""
    return 4 * vocab_size * (DECODE_TOKENS + 1) + 8 * (PROMPT_TOKENS + DECODE_TOKENS)
