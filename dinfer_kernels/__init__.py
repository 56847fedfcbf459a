"""dinfer_kernels: fused kernels for diffusion-LLM inference.

Ops (each a torch.library custom op with backend="auto"|"cuda"|"triton"|"cpu"|"torch"):
  decode_step     one diffusion decode step: candidates, confidences, commits, sparse credit
  soft_embedding  the iteration-smoothing input E[MASK] + w * softmax(z / tau) @ E
  rms_norm, rope  the models' normalisation and rotary embedding
  attention       window attention over a per-layer KV cache with in-place partial refresh,
                  block sparsity (BlockMask), log-sum-exp and per-key-block attention mass
  moe             routed mixture of experts (router, top-k, SwiGLU experts, weighted combine), on all
                  experts or a slice of local ones, from a router or a given top-k
  decode_step_vocab_parallel, soft_embedding_vocab_parallel
                  the two over a vocabulary split across a torch.distributed group (plain functions)
  moe_route       the MoE router alone, top-k experts and weights: the all-to-all path's pairs (a
                  plain function)
Contracts: dinfer_kernels/reference/.
"""

from ._backend import available_backends, prefer_backend
from .block_mask import BlockMask
from .ops.attention import attention
from .ops.decode import CreditState, decode_step
from .ops.moe import moe, moe_route
from .ops.rms_norm import rms_norm
from .ops.rope import rope
from .ops.soft_embedding import soft_embedding
from .ops.vocab_parallel import decode_step_vocab_parallel, soft_embedding_vocab_parallel
from .reference.decode import DecodeOutput

__version__ = "0.1.0"

__all__ = [
    "BlockMask",
    "CreditState",
    "DecodeOutput",
    "attention",
    "available_backends",
    "decode_step",
    "decode_step_vocab_parallel",
    "moe",
    "moe_route",
    "prefer_backend",
    "rms_norm",
    "rope",
    "soft_embedding",
    "soft_embedding_vocab_parallel",
    "__version__",
]
