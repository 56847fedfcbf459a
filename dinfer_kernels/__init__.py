"""dinfer_kernels: fused kernels for diffusion-LLM inference.

Ops (each a torch.library custom op with backend="auto"|"cuda"|"triton"|"cpu"|"torch"):
  decode_step     one diffusion decode step: candidates, confidences, commits, sparse credit
  soft_embedding  the iteration-smoothing input E[MASK] + w * softmax(z / tau) @ E
Contracts: dinfer_kernels/reference/.
"""
from ._backend import available_backends
from .ops.decode import CreditState, decode_step
from .ops.soft_embedding import soft_embedding
from .reference.decode import DecodeOutput

__version__ = "0.1.0"

__all__ = ["CreditState", "DecodeOutput", "available_backends", "decode_step", "soft_embedding",
           "__version__"]
