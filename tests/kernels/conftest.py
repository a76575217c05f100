"""Kernel tests run Triton's interpreter on the CPU (CI has no GPU).

`triton.jit` reads TRITON_INTERPRET when a kernel is decorated, that is when its module is imported,
so the variable is set here, at this conftest's import, before the test modules import the kernels.
A kernel module some earlier test already imported in compiled mode is imported again.
"""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

for _name in ("services.worker.kernels.w4a8_gemm", "services.worker.kernels.act_quant"):
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])
