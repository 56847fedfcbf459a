"""rms_norm on the host through the compiled C++ kernel (csrc/rms_norm/rms_norm_cpu.cpp).

Contract: dinfer_kernels/reference/rms_norm.py. Runs on torch's intra-op thread count.
"""

import torch

from .._backend import compiled
from . import capsules


def rms_norm(x, weight, out, *, eps: float) -> None:
    """Writes out (contiguous, x's shape and dtype)."""
    if x.numel() == 0:
        return
    D = x.shape[-1]
    rows = x.reshape(-1, D)
    if rows.stride(1) != 1:  # the kernel reads each row as one contiguous run
        rows = rows.contiguous()
    compiled().rms_norm(
        *capsules(rows, weight.contiguous(), out.view(-1, D)), eps=eps, num_threads=torch.get_num_threads()
    )
