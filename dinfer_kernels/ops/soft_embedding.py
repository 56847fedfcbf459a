"""dinfer_kernels.soft_embedding: the iteration-smoothing input, registered as the torch.library op
`dinfer::soft_embedding`. Contract: dinfer_kernels/reference/soft_embedding.py.

Backends: "triton" (the GPU path: a one-pass split-K GEMM over the vocabulary with the softmax in its
prologue, or past a number of rows a cuBLAS GEMM on the probabilities: triton/soft_embedding.py) and
"torch" (the reference: a BLAS GEMM, which is what the host runs). There is no separate compiled
backend for this op: on the host it *is* a GEMM, and on a GPU the Triton kernel fuses it.
"""

from typing import Optional, Union

import torch

from .. import _backend, _checks, _dispatch
from ..reference.soft_embedding import soft_embedding_reference


@_dispatch.op("soft_embedding")
def _soft_embedding_op(
    logits: torch.Tensor,
    embedding: torch.Tensor,
    tokens: torch.Tensor,
    weight: torch.Tensor,
    mask_id: int,
    tau: float,
    backend: str,
) -> torch.Tensor:
    if backend == "torch":
        return soft_embedding_reference(logits, embedding, tokens, mask_id, weight, tau)
    out = torch.empty((logits.shape[0], embedding.shape[1]), dtype=embedding.dtype, device=logits.device)
    _backend.impl("soft_embedding", backend)(logits, embedding, tokens, weight, out, mask_id=mask_id, tau=tau)
    return out


@_soft_embedding_op.register_fake
def _(logits, embedding, tokens, weight, mask_id, tau, backend):
    return embedding.new_empty((logits.shape[0], embedding.shape[1]))


def soft_embedding(
    logits: torch.Tensor,
    embedding: torch.Tensor,
    tokens: torch.Tensor,
    mask_id: int,
    weight: Union[float, torch.Tensor],
    tau: float = 1.0,
    backend: str = "auto",
    validate: Optional[bool] = None,
) -> torch.Tensor:
    """E[tokens] + weight * softmax(logits / tau) @ E on masked rows; [M, d] in the embedding's dtype.

    weight may be a float, or a tensor on the logits' device of one element or [M] (a weight per row),
    so that a captured CUDA graph can change it between replays. validate: check the token range (ValueError naming `tokens`);
    default: on host tensors only, since on a GPU it would synchronise. An unchecked token outside
    [0, V) gives a row of zeros on every backend, never a read outside the embedding.
    """
    M, V = _checks.logits_matrix("logits", logits)
    dev = logits.device
    _checks.tensor("embedding", embedding, _checks.FLOAT_DTYPES, ndim=2, device=dev)
    if embedding.shape[0] != V:
        raise ValueError(f"embedding: expected {V} rows (the logits' vocabulary), got {embedding.shape[0]}")
    if embedding.shape[1] < 1:
        raise ValueError("embedding: the hidden dimension must be >= 1")
    embedding = embedding.contiguous()
    _checks.tensor("tokens", tokens, (torch.int64,), ndim=1, device=dev)
    _checks.shape("tokens", tokens, [M])
    mask_id = _checks.integer("mask_id", mask_id, 0, V)
    _checks.number("tau", tau, lo=0.0, lo_open=True)
    # The backends read one fp32 weight per row.
    if isinstance(weight, torch.Tensor):
        _checks.tensor("weight", weight, device=dev)
        if weight.numel() not in (1, M):
            raise ValueError(
                f"weight: expected one element or [{M}] (one per row), got shape {list(weight.shape)}"
            )
        w = weight.reshape(-1).to(torch.float32).expand(M).contiguous()
    else:
        w = torch.full((M,), _checks.number("weight", weight), dtype=torch.float32, device=dev)
    backend = _backend.resolve(backend, dev, "soft_embedding")
    if _checks.data_checks_possible(logits) if validate is None else validate:
        _checks.token_range("tokens", tokens, V)
    return _soft_embedding_op(logits, embedding, tokens.contiguous(), w, mask_id, float(tau), backend)
