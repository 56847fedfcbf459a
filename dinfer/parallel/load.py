"""Sliced loading: each rank reads only its part of every sharded tensor from the memory-mapped
safetensors (dinfer.models.checkpoint's parser, the same header checks as load_weights).

A checkpoint tensor is a view of the file mapping until something reads it; a rank narrows that view
to its slice before any copy, so only the slice's pages are read (rows: contiguous byte ranges;
columns: the slice's part of each row). Per-expert tensors of the other ranks' experts are never
touched. A dim-0 slice already in the target dtype on the host stays a zero-copy view of the file; any
other slice is copied once. So the weight bytes a rank holds are its slices plus the replicated
tensors: about 1/N of the sharded ones (dinfer.parallel.plan.weight_bytes measures it).
"""

from __future__ import annotations

from typing import Dict

import torch

from ..models.checkpoint import open_checked, tensor_plan
from ..models.config import ModelConfig
from .plan import ShardPlan


def _coverage(index: tuple, rows: int):
    """The canonical dim-0 interval a source fills ((): the whole tensor; an int: one row; a slice)."""
    if not index:
        return 0, rows
    first = index[0]
    if isinstance(first, int):
        return first, first + 1
    return first.start, first.stop


def load_shard(
    path, config: ModelConfig, plan: ShardPlan, dtype=torch.bfloat16, device="cpu"
) -> Dict[str, torch.Tensor]:
    """This rank's canonical weights (plan.take of load_weights' tensors, without reading the rest).
    An FP8 checkpoint's routed experts stay FP8, their block scales sliced with them; its shared
    expert is dequantised like its other FP8 tensors (each read whole, then sliced): the ranks run
    their column slices of it (dinfer/parallel/tp.py), which need not fall on 128-wide blocks."""
    ckpt, sources_of = open_checked(path, config)
    out = {}
    for name, (sources, shape, to) in tensor_plan(ckpt, config, sources_of, dtype, fp8_shared=False).items():
        if len(sources) == 1 and sources[0][1] == ():
            src = sources[0][0]
            part = plan.take(name, ckpt.read(src, to))
            out[name] = part.to(dtype=to, device=device).contiguous()
            continue
        # Stacked experts or the shared expert's gate / up halves: each source fills a dim-0 interval
        # of the canonical tensor; only its intersection with the rank's ranges is read.
        r = plan.ranges(name)
        dim, ranges = r if r is not None else (0, [(0, shape[0])])
        assert dim == 0, f"{name}: multi-source tensors are only split along their first dimension"
        rows = sum(hi - lo for lo, hi in ranges)
        t = torch.empty((rows, *shape[1:]), dtype=to, device=device)
        at = 0
        for lo, hi in ranges:
            for src, index in sources:
                c0, c1 = _coverage(index, shape[0])
                a, b = max(lo, c0), min(hi, c1)
                if a >= b:
                    continue
                view = ckpt.read(src, to)
                if index and isinstance(index[0], int):  # one row of the canonical tensor
                    t[(at + a - lo, *index[1:])].copy_(view)
                else:
                    t[(slice(at + a - lo, at + b - lo), *index[1:])].copy_(view.narrow(0, a - c0, b - a))
            at += hi - lo
        out[name] = t
    return out
