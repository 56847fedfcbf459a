"""Pure-torch references: the specification of every op (shapes, dtypes, edge cases in docstrings)."""

from .decode import RULES, DecodeOutput, decode_step_reference, sanitize_logits
from .soft_embedding import soft_embedding_reference

__all__ = ["RULES", "DecodeOutput", "decode_step_reference", "sanitize_logits", "soft_embedding_reference"]
