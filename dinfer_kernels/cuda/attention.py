"""attention on a GPU through the compiled CUDA kernels (csrc/attention/attention.cu).

The workspace comes from torch's caching allocator (capture-safe) and the kernels run on the current
stream, so the call can sit inside a CUDA graph. Outputs are caller-allocated; contract:
dinfer_kernels/reference/attention.py.
"""

import torch

from .._backend import compiled

# Dense key prefixes to torch's SDPA (dinfer_kernels/attention_sdpa.py): full refreshes and other calls of
# >= 1024 rows over >= 2048 keys that every row attends. Why: on the one H200 run (802ee3b) SDPA (cuDNN)
# took 992 us at W = S = 8192 against this backend's 2193 us; window
# steps (W ~ 96) stay ours (3.4x SDPA + merge at W 96, S 8192: no whole-cache copy, block lists). Retune from bench_attention's "ours" /
# "ours+sdpa" / "sdpa" refresh rows.
SDPA_DENSE = {"min_rows": 1024, "min_keys": 2048}
# What this backend takes (dinfer_kernels/_backend.py's supports hook): the head dims are the kernels'
# tile widths; a dense attn_mask only the torch reference takes.
SUPPORTS = {"q.dtype": (torch.float16, torch.bfloat16), "q.head_dim": (64, 128), "attn_mask": (None,)}


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
    ext = compiled()
    B, W, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    S = k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]
    max_blocks = -1 if kv_indices is None else kv_indices.shape[-1]
    nbytes = ext.attention_workspace_bytes(
        B, W, Hq, Hkv, D, S, q_block, kv_block, max_blocks, bool(write_back), block_mass is not None
    )
    workspace = torch.empty(nbytes, dtype=torch.uint8, device=q.device) if nbytes else None
    stream = torch.cuda.current_stream(q.device).cuda_stream
    with torch.cuda.device(q.device):  # launches go to the current device
        ext.attention(
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
            write_back=bool(write_back),
            q_block=int(q_block),
            kv_block=int(kv_block),
            scale=float(scale),
            workspace=workspace,
            stream=stream,
        )
