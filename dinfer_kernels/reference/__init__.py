"""Pure-torch references: the specification of every op (shapes, dtypes, edge cases in docstrings).

One reference per op, named <op>_reference, in the module of the op's contract; the modules also hold
what the references share with the backends (the decode step's rules, defaults and grouped parameters
in decode.py, the sampling noise in rng.py). The engine reaches these through the ops and the package
face (dinfer_kernels), never from here.
"""

from .attention import attention_reference
from .decode import (
    DEFAULTS,
    RULES,
    CreditParams,
    DecodeOutput,
    DecodeParams,
    EditParams,
    RuleParams,
    SamplingParams,
    decode_params,
    decode_step_reference,
    sanitize_logits,
)
from .moe import moe_reference
from .qk_rope import qk_rope_reference
from .rms_norm import rms_norm_reference
from .rope import rope_reference
from .soft_embedding import soft_embedding_reference
from .vocab_parallel import decode_step_vocab_parallel_reference, soft_embedding_vocab_parallel_reference

__all__ = [
    "DEFAULTS",
    "RULES",
    "CreditParams",
    "DecodeOutput",
    "DecodeParams",
    "EditParams",
    "RuleParams",
    "SamplingParams",
    "attention_reference",
    "decode_params",
    "decode_step_reference",
    "decode_step_vocab_parallel_reference",
    "moe_reference",
    "qk_rope_reference",
    "rms_norm_reference",
    "rope_reference",
    "sanitize_logits",
    "soft_embedding_reference",
    "soft_embedding_vocab_parallel_reference",
]
