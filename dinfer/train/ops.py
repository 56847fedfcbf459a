"""Differentiable stand-ins for the dinfer_kernels ops, for training DiffusionLM (`ops=` argument).

The kernel ops are inference-only custom ops (no autograd). Training runs the same forward on the
pure-torch references, which are the kernels' spec, so a trained model means the same thing to both.
Attention is plain bidirectional SDPA over the rows given: training always feeds whole sequences from
position 0 and no cache (the cache arguments are ignored); keys at or past seq_lens[b] are padding.
"""
import torch
import torch.nn.functional as F

from dinfer_kernels.reference.moe import moe_reference
from dinfer_kernels.reference.rms_norm import rms_norm_reference
from dinfer_kernels.reference.rope import rope_reference


def rms_norm(x, weight, eps):
    return rms_norm_reference(x, weight, eps)


def rope(x, positions, theta, rotary_dim=None):
    return rope_reference(x, positions, theta, rotary_dim)


def attention(q, k, v, k_cache, v_cache, positions, seq_lens, write_back=True, attn_mask=None):
    """q [B, T, Hq, D], k/v [B, T, Hkv, D], seq_lens [B] or None -> [B, T, Hq, D]: every row attends
    to every row of its sequence."""
    mask = None
    if seq_lens is not None:
        mask = (torch.arange(q.shape[1], device=q.device)[None, :] < seq_lens[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask, enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2)


def moe(hidden, router_weight, w13, w2, top_k, renormalize=False, expert_bias=None):
    return moe_reference(hidden, router_weight, w13, w2, top_k, renormalize, expert_bias)
