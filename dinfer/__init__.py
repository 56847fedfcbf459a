"""dinfer: the thin diffusion-LLM inference loop built on dinfer_kernels (models, decoders, caches)."""

from .decoders import DecoderConfig
from .generate import GenerationConfig, NonFiniteLogitsError
from .llm import LLM, GenerateResult

__all__ = ["LLM", "GenerateResult", "GenerationConfig", "DecoderConfig", "NonFiniteLogitsError"]
