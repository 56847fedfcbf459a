"""Mixture-of-experts layer (LLaDA-MoE, LLaDA2-MoE) — the spec.

hidden          [T, H] fp32 / fp16 / bf16
router_weight   [E, H] (kept in fp32 by the loaders, as dInfer does), or None when router_logits or
                topk_ids is given
router_logits   [T, E] or None: precomputed router logits (any float dtype, read as fp32)
topk_ids        [T, k] integer, with topk_weights [T, k] float, or None: a given routing instead of the
                router (the all-to-all path: rows arrive with their (expert, weight) pairs); weights read
                as fp32 and used as they are (the router's options below do not apply)
w13             [E_local, 2I, H]: experts [expert_offset, expert_offset + E_local) of the router's E;
                rows [0, I) are the gate projection, [I, 2I) the up projection (vLLM layout)
w2              [E_local, H, I]
expert_offset   the global id of w13[0] (0 <= offset <= E - E_local with a router; FlashInfer's
                local_expert_offset): a (token, slot) pair routed outside [offset, offset + E_local)
                contributes nothing and costs no expert compute (expert parallelism: the caller sums
                the partial outputs over ranks)
top_k           1 <= top_k <= experts in the kept groups (given top-k: k)
renormalize     divide the top-k weights by (their sum + 1e-20) (LLaDA-MoE: False; LLaDA2: True)
scoring         "softmax" (LLaDA-MoE) or "sigmoid" (LLaDA2)
expert_bias     [E] or None. softmax: added to the probabilities before top-k and *kept in the weights*
                (the released LLaDA-MoE HF code does this); sigmoid: used for the choice only (LLaDA2)
num_groups      experts split into num_groups equal consecutive groups (1: no grouping)
topk_groups     groups kept per token (group score: the sum of the top-2 selection scores in the group,
                or the one score of a single-expert group)
routed_scaling  multiplies the final weights (LLaDA2: 2.5)
shared_w13      [2S, H] or None: a shared expert (LLaDA2), rows [0, S) gate, [S, 2S) up; with
shared_w2       [H, S]: every token takes it with weight 1 (not renormalised, not scaled), whatever
                the routing, expert_offset or given top-k
w13_scale, w2_scale, shared_w13_scale, shared_w2_scale
                fp32 block scales when the weights are float8_e4m3fn (FP8 experts, W8A16), the
                layout of dinfer_kernels/fp8.py (128 x 128 blocks; the gate and up halves of a w13
                stack blocked on their own): w13_scale [E_local, 2*cdiv(I,128), cdiv(H,128)],
                w2_scale [E_local, cdiv(H,128), cdiv(I,128)], shared_w13_scale [2*cdiv(S,128),
                cdiv(H,128)], shared_w2_scale [cdiv(H,128), cdiv(S,128)]. Each weight is used as
                fp8_block_dequantize gives it: the fp32 product q * scale rounded to hidden's dtype.

    l = hidden·router_weightᵀ in fp32 (or router_logits in fp32); in fp64 with compute_dtype=float64, the exact
    routing that precision checks hold the fp32 routers to
    s = softmax(l) | sigmoid(l);  c = s + bias (selection score)
    groups: keep the topk_groups best groups by group score (lower group first on ties), c = -inf elsewhere
    e = top_k experts by c (lower expert first on ties), in descending order of c (the slot order)
    A NaN selection score ranks like -inf (in group scores and in the top-k): such an expert is chosen
    only when fewer than top_k others can be.
    w = c[e] (softmax) | s[e] (sigmoid);  w /= Σw + 1e-20 if renormalize;  w *= routed_scaling
    (given top-k: e = topk_ids, w = topk_weights)
    out[t] = Σ_k [offset <= e_k < offset + E_local] w_k · W2_e · cast(silu(g) ⊙ u),
             [g; u] = W13_e · hidden[t],  W13_e = w13[e - offset], W2_e = w2[e - offset]
    plus, with a shared expert, W2_s · cast(silu(g) ⊙ u), [g; u] = W13_s · hidden[t], added to the
    routed fp32 sum before the result is rounded

GEMMs run in the weights' dtype (fp32 accumulation); silu(g)·u in fp32, rounded to the dtype before
the second GEMM; the routed sum in fp32; result in hidden's dtype, [T, H]. Backends may keep more
precision (no rounding of g, u or W2·a to the dtype) and sum the k slots in slot order.
"""

import torch

from ..fp8 import FP8_DTYPE, fp8_block_dequantize

SCORINGS = ("softmax", "sigmoid")
RENORM_EPS = 1e-20


def route(
    hidden,
    router_weight,
    top_k,
    renormalize=False,
    expert_bias=None,
    *,
    router_logits=None,
    scoring="softmax",
    num_groups=1,
    topk_groups=1,
    routed_scaling=1.0,
    compute_dtype=torch.float32,
):
    """(weights [T, k] in compute_dtype, experts [T, k] int64) of the router; slot j holds the j-th
    best expert. Scores in fp32, as the kernels compute them; fp64 gives the exact routing that a
    precision check measures every fp32 router against."""
    if router_logits is not None:
        logits = router_logits.to(compute_dtype)
    else:
        logits = hidden.to(compute_dtype) @ router_weight.to(compute_dtype).t()
    if scoring == "softmax":
        score = torch.softmax(logits, dim=-1)
    elif scoring == "sigmoid":
        score = torch.sigmoid(logits)
    else:
        raise ValueError(f"scoring: expected one of {SCORINGS}, got {scoring!r}")
    sel = score if expert_bias is None else score + expert_bias.to(compute_dtype)
    weight_src = sel if scoring == "softmax" else score
    sel = torch.where(sel.isnan(), float("-inf"), sel)  # ranks like -inf
    if num_groups > 1:
        T, E = sel.shape
        size = E // num_groups
        grouped = sel.view(T, num_groups, size)
        group_score = grouped.topk(min(2, size), dim=-1).values.sum(-1)
        kept = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[:, :topk_groups]
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)
        sel = sel.masked_fill(~keep.repeat_interleave(size, dim=1), float("-inf"))
    # A stable descending sort gives the lower expert first among equal scores.
    order = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = weight_src.gather(1, order)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + RENORM_EPS)
    if routed_scaling != 1.0:
        w = w * routed_scaling
    return w, order


def _expert(x, w13_e, w2_e, dt, acc, s13=None, s2=None):
    """One expert on rows x: W2 · cast(silu(g) ⊙ u), [g; u] = W13 · x, as the docstring above says
    (FP8 weights dequantised with their block scales s13 / s2 first)."""
    if w13_e.dtype == FP8_DTYPE:
        w13_e = fp8_block_dequantize(w13_e, s13, x.dtype, halves=2)
        w2_e = fp8_block_dequantize(w2_e, s2, x.dtype)
    gu = (x @ w13_e.to(dt).t()).to(acc)
    inter = gu.shape[1] // 2
    a = (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]).to(dt)
    return (a @ w2_e.to(dt).t()).to(acc)


def moe_reference(
    hidden,
    router_weight,
    w13,
    w2,
    top_k,
    renormalize=False,
    expert_bias=None,
    expert_offset=0,
    compute_dtype=None,
    static_shapes=None,
    *,
    router_logits=None,
    topk_ids=None,
    topk_weights=None,
    scoring="softmax",
    num_groups=1,
    topk_groups=1,
    routed_scaling=1.0,
    shared_w13=None,
    shared_w2=None,
    w13_scale=None,
    w2_scale=None,
    shared_w13_scale=None,
    shared_w2_scale=None,
):
    T, H = hidden.shape
    E_local = w13.shape[0]
    dt = hidden.dtype if compute_dtype is None else compute_dtype
    acc = torch.float32 if compute_dtype is None else compute_dtype
    if topk_ids is not None:
        w = topk_weights.to(torch.float64 if compute_dtype == torch.float64 else torch.float32)
        experts = topk_ids.long()
    else:
        w, experts = route(
            hidden,
            router_weight,
            top_k,
            renormalize,
            expert_bias,
            router_logits=router_logits,
            scoring=scoring,
            num_groups=num_groups,
            topk_groups=topk_groups,
            routed_scaling=routed_scaling,
            compute_dtype=torch.float64 if compute_dtype == torch.float64 else torch.float32,
        )
    out = torch.zeros(T, H, dtype=acc, device=hidden.device)
    x = hidden.to(dt)
    fp8 = w13.dtype == FP8_DTYPE

    def scales(e):
        return (w13_scale[e], w2_scale[e]) if fp8 else (None, None)

    def result():
        if shared_w13 is not None:
            out.add_(_expert(x, shared_w13, shared_w2, dt, acc, shared_w13_scale, shared_w2_scale))
        return out.to(hidden.dtype if compute_dtype is None else compute_dtype)

    local = experts - expert_offset  # index into w13 / w2; outside [0, E_local): another rank's
    # Under CUDA-graph capture no shape may depend on the routing: every local expert then runs on
    # every token with weight 0 where it was not chosen (same sums, more FLOPs).
    if static_shapes is None:
        static_shapes = hidden.is_cuda and torch.cuda.is_current_stream_capturing()
    if static_shapes:
        for e in range(E_local):
            chosen = (w * (local == e)).sum(-1, keepdim=True).to(acc)
            out += _expert(x, w13[e], w2[e], dt, acc, *scales(e)) * chosen
        return result()
    # The (token, slot) pairs of the local experts grouped by expert once: one sort, one gather, one
    # index_add (pairs of other experts are never gathered).
    flat = local.flatten()
    mine = ((flat >= 0) & (flat < E_local)).nonzero().flatten()
    if mine.numel():
        order = mine[flat[mine].argsort(stable=True)]
        counts = torch.bincount(flat[order], minlength=E_local).tolist()
        token = order // top_k
        ys = [
            _expert(rows, w13[e], w2[e], dt, acc, *scales(e))
            for e, rows in enumerate(x.index_select(0, token).split(counts))
        ]
        out.index_add_(0, token, torch.cat(ys) * w.flatten()[order, None].to(acc))
    return result()
