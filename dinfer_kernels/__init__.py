"""dinfer_kernels: fused kernels for diffusion-LLM inference.

Ops (each a torch.library custom op with backend="auto"|"cuda"|"triton"|"cpu"|"torch"):
  decode_step     one diffusion decode step: candidates, confidences, commits, sparse credit
  soft_embedding  the iteration-smoothing input E[MASK] + w * softmax(z / tau) @ E
  rms_norm, rope  the models' normalisation and rotary embedding
  qk_rope         an attention's q and k rotated in one call from a table built once (rope_table, a
                  plain function), QK-norm fused
  attention       window attention over a per-layer KV cache with in-place partial refresh,
                  block sparsity (BlockMask), log-sum-exp and per-key-block attention mass
  moe             routed mixture of experts (router, top-k, SwiGLU experts, weighted combine), on all
                  experts or a slice of local ones, from a router or a given top-k
  decode_step_vocab_parallel, soft_embedding_vocab_parallel
                  the two over a vocabulary split across a torch.distributed group (plain functions)
  fp8_block_quantize, fp8_block_dequantize
                  FP8 (e4m3) weights with 128 x 128 block scales, the form moe takes FP8 experts in
  moe_route       the MoE router alone, top-k experts and weights: the all-to-all path's pairs (a
                  plain function)
Contracts: dinfer_kernels/reference/ (the pure-torch references, the spec of every op).

What a caller of decode_step needs besides the ops, so that nothing outside the package reads
dinfer_kernels.reference:
  DECODE_RULES     decode_step's commit rules ("threshold", "hierarchical", "fixed", "joint")
  DECODE_DEFAULTS  the rule parameters' defaults (threshold, low_threshold, credit_alpha / beta / gamma)
  sequence_key     a prompt's uint32 sampling key (its tokens, and its rank among equal prompts)
  request_row_keys decode_step's row_keys from request keys, positions and iteration counts, so that a
                   request's samples never depend on the batch it runs in
"""

# First, before anything imports torch (which loads the OpenMP runtime): OpenMP's wait policy,
# read once when the runtime loads (_openmp_wait says why it matters on a busy machine).
from . import _openmp_wait  # noqa: F401
from ._backend import available_backends, prefer_backend
from .block_mask import BlockMask
from .fp8 import FP8_BLOCK, fp8_block_dequantize, fp8_block_quantize
from .ops.attention import attention
from .ops.decode import CreditState, decode_step
from .ops.moe import moe, moe_route
from .ops.qk_rope import qk_rope
from .ops.rms_norm import rms_norm
from .ops.rope import rope, rope_table
from .ops.soft_embedding import soft_embedding
from .ops.vocab_parallel import decode_step_vocab_parallel, soft_embedding_vocab_parallel
from .reference.decode import DEFAULTS as DECODE_DEFAULTS
from .reference.decode import RULES as DECODE_RULES
from .reference.decode import DecodeOutput
from .reference.rng import request_row_keys, sequence_key

__version__ = "0.1.0"

__all__ = [
    "BlockMask",
    "CreditState",
    "DECODE_DEFAULTS",
    "DECODE_RULES",
    "DecodeOutput",
    "FP8_BLOCK",
    "attention",
    "available_backends",
    "decode_step",
    "decode_step_vocab_parallel",
    "fp8_block_dequantize",
    "fp8_block_quantize",
    "moe",
    "moe_route",
    "prefer_backend",
    "qk_rope",
    "request_row_keys",
    "rms_norm",
    "rope",
    "rope_table",
    "sequence_key",
    "soft_embedding",
    "soft_embedding_vocab_parallel",
    "__version__",
]
