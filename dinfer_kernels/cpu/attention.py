"""attention on the host through the compiled C++ kernel (csrc/attention/attention_cpu.cpp).

Outputs are caller-allocated; contract: dinfer_kernels/reference/attention.py. Runs on torch's
intra-op thread count, like the torch backend it replaces on the host.
"""

import torch

from .._backend import compiled
from . import capsules

# What this backend takes (dinfer_kernels/_backend.py's supports hook): any head dim (the kernel
# loops over it); a dense attn_mask only the torch reference takes.
SUPPORTS = {"q.dtype": (torch.float16, torch.bfloat16, torch.float32), "attn_mask": (None,)}
# No dense key prefix to torch's SDPA (dinfer_kernels/attention_sdpa.py) on the host: the engine's CPU
# outputs stay bit-identical, and no host measurement says torch's flash kernel is faster.
SDPA_DENSE = None


def attention(
    q,
    k,
    v,
    k_cache,
    v_cache,
    positions,
    seq_lens,
    block_table,
    kv_num_blocks,
    kv_indices,
    out,
    lse,
    block_mass,
    *,
    write_back: bool,
    q_block: int,
    kv_block: int,
    scale: float,
) -> None:
    arrays = capsules(
        q,
        k,
        v,
        k_cache,
        v_cache,
        positions,
        seq_lens,
        out,
        lse,
        block_mass,
        kv_num_blocks,
        kv_indices,
        block_table,
    )
    compiled().attention(
        *arrays,
        write_back=bool(write_back),
        q_block=int(q_block),
        kv_block=int(kv_block),
        scale=float(scale),
        num_threads=torch.get_num_threads(),
    )
