"""Activation-aware channel reordering of down_proj inputs.

Sorting the intermediate channels by activation magnitude puts channels of similar salience into
the same group of 128, so one group's scale is not stretched by a few salient channels. The
permutation is applied to gate/up rows and down columns together: the function is unchanged.
"""

from __future__ import annotations

import torch

from shared.quant.block import WorkBlock


def salience_order(x: torch.Tensor) -> torch.Tensor:
    """x (T, F) -> permutation (F,) sorting channels by max |x|, largest first."""
    return torch.argsort(x.abs().amax(dim=0), descending=True)


def apply_down_reorder(block: WorkBlock, perm: torch.Tensor) -> None:
    gate_rows, up_rows = block.gate_up_rows()
    gate, up = block.gate_up[gate_rows][perm], block.gate_up[up_rows][perm]
    block.gate_up = torch.cat([gate, up])
    block.down = block.down[:, perm]
