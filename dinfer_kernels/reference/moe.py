"""Mixture-of-experts layer (LLaDA-MoE) — the spec.

hidden         [T, H] fp32 / fp16 / bf16
router_weight  [E, H] (kept in fp32 by the loaders, as dInfer does)
w13            [E, 2I, H]: rows [0, I) are the gate projection, [I, 2I) the up projection (vLLM layout)
w2             [E, H, I]
top_k          1 <= top_k <= E
renormalize    divide the top-k weights by their sum (LLaDA-MoE: False)
expert_bias    [E] fp32 or None: added to the router probabilities before top-k and kept in the
               weights (the released HF code does this when moe_router_enable_expert_bias is set)
expert_range   (e0, e1) or None: only experts in [e0, e1) contribute (expert parallelism: the caller
               sums the partial outputs over ranks)

    p = softmax(hidden·router_weightᵀ) in fp32;  (w, e) = topk(p [+ bias], top_k) (ties: lower expert)
    out[t] = Σ_k w_k · W2_e · cast(silu(g) ⊙ u),  [g; u] = W13_e · hidden[t]

GEMMs run in the weights' dtype (fp32 accumulation); silu(g)·u in fp32, rounded to the dtype before
the second GEMM; the routed sum in fp32; result in hidden's dtype, [T, H].
"""
import torch


def route(hidden, router_weight, top_k, renormalize=False, expert_bias=None):
    """(weights [T, k] fp32, experts [T, k] int64) of the router."""
    p = torch.softmax(hidden.float() @ router_weight.float().t(), dim=-1)
    if expert_bias is not None:
        p = p + expert_bias.float()
    # A stable descending sort gives the lower expert first among equal scores.
    order = torch.sort(p, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = p.gather(1, order)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w, order


def moe_reference(hidden, router_weight, w13, w2, top_k, renormalize=False, expert_bias=None,
                  expert_range=None, compute_dtype=None, static_shapes=None):
    T, H = hidden.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    e0, e1 = (0, E) if expert_range is None else expert_range
    dt = hidden.dtype if compute_dtype is None else compute_dtype
    acc = torch.float32 if compute_dtype is None else compute_dtype
    w, experts = route(hidden, router_weight, top_k, renormalize, expert_bias)
    out = torch.zeros(T, H, dtype=acc, device=hidden.device)
    x = hidden.to(dt)
    # Under CUDA-graph capture no shape may depend on the routing: every expert then runs on every
    # token with weight 0 where it was not chosen (same sums, more FLOPs).
    if static_shapes is None:
        static_shapes = hidden.is_cuda and torch.cuda.is_current_stream_capturing()
    for e in range(e0, e1):
        if static_shapes:
            tok = torch.arange(T, device=hidden.device)
            weight = (w * (experts == e)).sum(-1)
        else:
            tok, slot = torch.nonzero(experts == e, as_tuple=True)
            if tok.numel() == 0:
                continue
            weight = w[tok, slot]
        gu = (x[tok] @ w13[e].to(dt).t()).to(acc)
        a = (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]).to(dt)
        y = (a @ w2[e].to(dt).t()).to(acc)
        out.index_add_(0, tok, y * weight[:, None].to(acc))
    return out.to(hidden.dtype if compute_dtype is None else compute_dtype)
