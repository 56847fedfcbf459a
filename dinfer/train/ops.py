"""Differentiable stand-ins for the dinfer_kernels ops, for training DiffusionLM (`ops=` argument).

The kernel ops are inference-only custom ops (no autograd). Training runs the same forward on the
pure-torch references, which are the kernels' spec, so a trained model means the same thing to both.
Attention is plain bidirectional softmax attention over the rows given: training always feeds whole
sequences from position 0 and no cache (the cache arguments are ignored); keys at or past seq_lens[b]
are padding.
"""

import torch

from dinfer_kernels.reference.moe import moe_reference
from dinfer_kernels.reference.rms_norm import rms_norm_reference
from dinfer_kernels.reference.rope import rope_reference


def rms_norm(x, weight, eps):
    return rms_norm_reference(x, weight, eps)


def rope(x, positions, theta, rotary_dim=None):
    return rope_reference(x, positions, theta, rotary_dim)


def attention(q, k, v, k_cache, v_cache, positions, seq_lens, write_back=True, attn_mask=None):
    """q [B, T, Hq, D], k/v [B, T, Hkv, D], seq_lens [B] or None -> [B, T, Hq, D]: every row attends
    to every row of its sequence. Written out rather than SDPA: at training's shapes (T ~ 70, D 32)
    the CPU flash kernel's backward took a third of each step, the matmuls a few percent."""
    B, T, Hq, D = q.shape
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if k.shape[2] != Hq:
        kt, vt = (t.repeat_interleave(Hq // k.shape[2], dim=1) for t in (kt, vt))
    scores = (qt @ kt.transpose(-1, -2)).float() * D**-0.5
    if seq_lens is not None:
        keep = torch.arange(T, device=q.device)[None, :] < seq_lens[:, None]
        scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    o = torch.softmax(scores, dim=-1).to(vt.dtype) @ vt
    return o.transpose(1, 2)


def moe(hidden, router_weight, w13, w2, top_k, renormalize=False, expert_bias=None):
    return moe_reference(hidden, router_weight, w13, w2, top_k, renormalize, expert_bias)
