"""dinfer_kernels.attention, the torch.library op `dinfer::attention`: window queries attending
bidirectionally over a per-layer KV cache whose window rows are refreshed (in place with
write_back=True). Contract: dinfer_kernels/reference/attention.py."""
from typing import Optional

import torch

from .. import _backend, _checks
from ..reference.attention import attention_reference


@torch.library.custom_op("dinfer::attention", mutates_args=("k_cache", "v_cache"))
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                  write_back: bool, attn_mask: Optional[torch.Tensor], scale: float,
                  backend: str) -> torch.Tensor:
    return attention_reference(q, k, v, k_cache, v_cache, positions, seq_lens, write_back,
                               attn_mask, scale)


@_attention_op.register_fake
def _(q, k, v, k_cache, v_cache, positions, seq_lens, write_back, attn_mask, scale, backend):
    return torch.empty_like(q)


def attention(q, k, v, k_cache, v_cache, positions, seq_lens, *, write_back: bool = True,
              attn_mask: Optional[torch.Tensor] = None, scale: Optional[float] = None,
              backend: str = "auto", validate: Optional[bool] = None) -> torch.Tensor:
    """out [B, W, Hq, D]; see the reference docstring for every argument."""
    _checks.tensor("q", q, _checks.FLOAT_DTYPES, ndim=4)
    dev = q.device
    B, W, Hq, D = q.shape
    _checks.tensor("k_cache", k_cache, (q.dtype,), ndim=4, device=dev)
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    _checks.shape("k_cache", k_cache, [B, S, Hkv, D])
    _checks.tensor("v_cache", v_cache, (q.dtype,), ndim=4, device=dev)
    _checks.shape("v_cache", v_cache, [B, S, Hkv, D])
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"k_cache: query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    for name, t in (("k", k), ("v", v)):
        _checks.tensor(name, t, (q.dtype,), ndim=4, device=dev)
        _checks.shape(name, t, [B, W, Hkv, D])
    _checks.tensor("positions", positions, (torch.int64,), ndim=2, device=dev)
    _checks.shape("positions", positions, [B, W])
    _checks.tensor("seq_lens", seq_lens, (torch.int32,), ndim=1, device=dev)
    _checks.shape("seq_lens", seq_lens, [B])
    if attn_mask is not None:
        _checks.tensor("attn_mask", attn_mask, (torch.bool,), ndim=3, device=dev)
        _checks.shape("attn_mask", attn_mask, [B, W, S])
    scale = D ** -0.5 if scale is None else _checks.number("scale", scale, lo=0.0, lo_open=True)
    if _checks.data_checks_possible(q) if validate is None else validate:
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= S):
            raise ValueError(f"positions: must be in [0, {S}) (the cache length)")
        if seq_lens.numel() and (int(seq_lens.min()) < 0 or int(seq_lens.max()) > S):
            raise ValueError(f"seq_lens: must be in [0, {S}]")
    return torch.ops.dinfer.attention(q, k, v, k_cache, v_cache, positions, seq_lens, bool(write_back),
                                      attn_mask, float(scale), _backend.resolve(backend, dev, "attention"))
