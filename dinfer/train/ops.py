"""Differentiable stand-ins for the dinfer_kernels ops, for training DiffusionLM (`ops=` argument).

The kernel ops are inference-only custom ops (no autograd). Training runs the same forward on the
pure-torch references, which are the kernels' spec, so a trained model means the same thing to both.
Attention is plain softmax attention over the rows given: training always feeds whole sequences and
no cache (the cache arguments are ignored); keys at or past seq_lens[b] are padding, and a dense
boolean attn_mask narrows what each row sees (the block-diffusion objective's two-copy layout).
The MoE records each call's expert load while `expert_loads()` is open (the expert bias's balancing).
"""

import contextlib
from typing import Iterator, List, Optional

import torch

from dinfer_kernels.reference.moe import moe_reference, route
from dinfer_kernels.reference.qk_rope import qk_rope_reference
from dinfer_kernels.reference.rms_norm import rms_norm_reference

_loads: Optional[List[torch.Tensor]] = None  # open while expert_loads() is


def rms_norm(x, weight, eps):
    return rms_norm_reference(x, weight, eps)


def qk_rope(q, k, positions, table, q_norm=None, k_norm=None, eps=None):
    return qk_rope_reference(q, k, positions, table, q_norm, k_norm, eps)


def attention(q, k, v, k_cache, v_cache, positions, seq_lens, write_back=True, attn_mask=None):
    """q [B, T, Hq, D], k/v [B, T, Hkv, D], seq_lens [B] or None, attn_mask [B, T, T] bool or None ->
    [B, T, Hq, D]: every row attends to the rows of its sequence before seq_lens[b] that attn_mask
    allows (True: attend); a row that may attend none gets 0, as the kernels' spec says. Written out
    rather than SDPA: at training's shapes (T ~ 70, D 32) the CPU flash kernel's backward took a
    third of each step, the matmuls a few percent."""
    B, T, Hq, D = q.shape
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if k.shape[2] != Hq:
        kt, vt = (t.repeat_interleave(Hq // k.shape[2], dim=1) for t in (kt, vt))
    scores = (qt @ kt.transpose(-1, -2)).float() * D**-0.5
    keep = None
    if seq_lens is not None:
        keep = torch.arange(T, device=q.device)[None, :] < seq_lens[:, None]
    if attn_mask is None:
        if keep is not None:
            scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
        o = torch.softmax(scores, dim=-1).to(vt.dtype) @ vt
        return o.transpose(1, 2)
    allowed = attn_mask if keep is None else attn_mask & keep[:, None, :]
    # A row with no key left would be all -inf (NaN, in the forward and the backward): it attends
    # every key instead, and its output is multiplied by 0. (Masks are [B, T, T], the scores
    # [B, H, T, T]: one pass over the scores.)
    empty = ~allowed.any(-1, keepdim=True)
    scores = scores.masked_fill(~(allowed | empty)[:, None], float("-inf"))
    o = torch.softmax(scores, dim=-1).to(vt.dtype) @ vt
    return (o * ~empty[:, None]).transpose(1, 2)


def moe(
    hidden,
    router_weight,
    w13,
    w2,
    top_k,
    renormalize=False,
    expert_bias=None,
    shared_w13=None,
    shared_w2=None,
    **routing,
):
    """routing: LLaDA2's router (scoring, num_groups, topk_groups, routed_scaling), as the kernel
    op takes it; shared_w13 / shared_w2: LLaDA2's shared expert, added for every token. The expert
    bias only chooses experts: no gradient reaches it."""
    if _loads is not None:
        with torch.no_grad():
            _, experts = route(hidden, router_weight, top_k, renormalize, expert_bias, **routing)
        _loads.append(torch.bincount(experts.flatten(), minlength=w13.shape[0]))
    return moe_reference(
        hidden,
        router_weight,
        w13,
        w2,
        top_k,
        renormalize,
        expert_bias,
        shared_w13=shared_w13,
        shared_w2=shared_w2,
        **routing,
    )


@contextlib.contextmanager
def expert_loads(into: Optional[list]) -> Iterator[None]:
    """Appends to `into`, per moe call in the block (one per MoE layer of a forward, in layer order),
    [E] int64: how many of the call's tokens chose each expert. None: records nothing."""
    global _loads
    _loads = into
    try:
        yield
    finally:
        _loads = None
