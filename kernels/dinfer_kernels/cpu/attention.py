"""attention on the host through the compiled C++ kernel (csrc/attention/attention_cpu.cpp).

Outputs are caller-allocated; contract: dinfer_kernels/reference/attention.py. Runs on torch's
intra-op thread count, like the torch backend it replaces on the host.
"""

import torch

from .._backend import compiled
from . import capsules


def attention(
    q,
    k,
    v,
    k_cache,
    v_cache,
    positions,
    seq_lens,
    write_back,
    kv_num_blocks,
    kv_indices,
    q_block,
    kv_block,
    scale,
    out,
    lse,
    block_mass,
):
    arrays = capsules(
        q, k, v, k_cache, v_cache, positions, seq_lens, out, lse, block_mass, kv_num_blocks, kv_indices
    )
    compiled().attention(
        *arrays,
        write_back=bool(write_back),
        q_block=int(q_block),
        kv_block=int(kv_block),
        scale=float(scale),
        num_threads=torch.get_num_threads(),
    )
