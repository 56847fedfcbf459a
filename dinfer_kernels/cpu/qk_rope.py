"""qk_rope on the host: the compiled rms_norm and rope kernels (csrc/rms_norm, csrc/rope), the latter
reading the caller's table, so that the outputs are those of rms_norm then rope, bit for bit (the
models' composition before this op). Each of q and k is normalised into its output, then rotated
there in place. Contract: dinfer_kernels/reference/qk_rope.py."""

import torch

from .rms_norm import rms_norm
from .rope import rotate


def qk_rope(q, k, positions, table, q_norm, k_norm, q_out, k_out, *, eps: float) -> None:
    """Writes q_out and k_out (contiguous, q's and k's shapes, q's dtype)."""
    positions = positions.to(torch.int64).contiguous()
    for x, weight, out in ((q, q_norm, q_out), (k, k_norm, k_out)):
        if x.numel() == 0:
            continue
        if weight is not None:
            rms_norm(x, weight, out, eps=eps)
            x = out
        rotate(x, positions, table, out)
