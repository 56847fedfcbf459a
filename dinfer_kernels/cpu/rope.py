"""rope on the host through the compiled C++ kernel (csrc/rope/rope_cpu.cpp).

The kernel reads its angles from a cos / sin table (row p: cos, then sin, of p * inv_freq). The table
is built here once per (theta, rotary_dim) with the reference's own fp32 formula, so the kernel equals
the reference bit for bit, and grows (to the next power of two) when a later call reaches past it.
Positions past kMaxCachedPositions get a table of this call's rows only, so that one far position
cannot make a huge cached table. Contract: dinfer_kernels/reference/rope.py.
"""

import torch

from .._backend import compiled
from ..reference.rope import cos_sin_table
from . import capsules

kMaxCachedPositions = 1 << 16
_tables = {}  # (theta, rotary_dim) -> [P, rotary_dim] fp32


def cached_table(theta, rotary_dim, need):
    """The cached table of (theta, rotary_dim), covering at least positions [0, need)."""
    table = _tables.get((theta, rotary_dim))
    if table is None or table.shape[0] < need:
        size = max(256, 1 << (need - 1).bit_length())
        table = cos_sin_table(torch.arange(size), theta, rotary_dim)
        _tables[(theta, rotary_dim)] = table
    return table


def rope(x, positions, out, *, theta: float, rotary_dim: int) -> None:
    """Writes out (contiguous, x's shape and dtype)."""
    if x.numel() == 0:
        return
    positions = positions.to(torch.int64).contiguous()
    need = int(positions.max()) + 1
    if need <= kMaxCachedPositions:
        table = cached_table(theta, rotary_dim, need)
    else:
        table = cos_sin_table(positions.reshape(-1), theta, rotary_dim)
        positions = torch.arange(positions.numel()).view(positions.shape)
    rotate(x, positions, table, out)


def rotate(x, positions, table, out) -> None:
    """Writes out (contiguous, or x itself: the kernel rotates in place too): x [B, T, H, D] rotated at
    positions [B, T] int64 (contiguous) with the angles of table [P, rotary_dim] fp32, the rows the
    positions pick (the binding checks each position against P)."""
    if x.stride(-1) != 1:  # the kernel reads each head row as one run
        x = x.contiguous()
    compiled().rope(*capsules(x, positions, table, out), num_threads=torch.get_num_threads())
