"""Soft embedding — the iteration-smoothing input (dInfer, arXiv 2510.08666), the spec.

    out[i] = E[tokens[i]]                                          if tokens[i] != mask_id
    out[i] = E[mask_id] + weight * softmax(z_i / tau) @ E          if tokens[i] == mask_id

logits     [M, V] fp32 / fp16 / bf16 (last dim contiguous), the most recent logits of each row.
embedding  [V, d] fp32 / fp16 / bf16, the model's *input* embedding table.
tokens     [M] int64 in [0, V). The op checks this on host tensors (ValueError naming `tokens`); an
           unchecked token outside [0, V) (on a GPU, where checking would sync) gives a row of zeros.
mask_id    int in [0, V).
weight     float, or an fp32 tensor of one element or [M] (one weight per row: each sequence's w_n of
           the schedule), so that a captured graph can change it.
tau        float > 0.
Logits are sanitised as in decode (NaN -> -inf, +inf -> FLT_MAX); a masked row whose logits are all
-inf adds nothing. Math in fp32; the result has the embedding's dtype, shape [M, d].
It is additive (the mask embedding keeps weight 1), not a convex blend, exactly as dInfer's H2Embed.
"""

import torch

from .decode import sanitize_logits


def soft_embedding_reference(
    logits, embedding, tokens, mask_id, weight, tau=1.0, compute_dtype=torch.float32
):
    z = sanitize_logits(logits, compute_dtype) / tau
    m = z.max(dim=-1, keepdim=True).values
    dead = m == float("-inf")
    p = torch.exp(z - torch.where(dead, torch.zeros_like(m), m))
    p = p / p.sum(-1, keepdim=True).clamp(min=torch.finfo(compute_dtype).tiny)
    masked = (tokens == mask_id) & ~dead[:, 0]
    w = torch.as_tensor(weight, dtype=compute_dtype, device=logits.device).reshape(-1, 1)
    E = embedding.to(compute_dtype)
    V = E.shape[0]
    hard = torch.where(
        ((tokens >= 0) & (tokens < V))[:, None],
        E[tokens.clamp(0, max(V - 1, 0))],
        torch.zeros((), dtype=compute_dtype),
    )
    out = hard + torch.where(masked[:, None], w * (p @ E), torch.zeros((), dtype=compute_dtype))
    return out.to(embedding.dtype)
