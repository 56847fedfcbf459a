"""dinfer: the thin diffusion-LLM inference loop built on dinfer_kernels (models, decoders, caches)."""

# dinfer_kernels first: it sets OpenMP's wait policy before torch loads the OpenMP runtime
# (dinfer_kernels/_openmp_wait.py); every dinfer module, the CLI and the server come after this.
import dinfer_kernels  # noqa: F401

from .decoders import DecoderConfig
from .generate import GenerationConfig, NonFiniteLogitsError
from .llm import LLM, GenerateResult

__all__ = ["LLM", "GenerateResult", "GenerationConfig", "DecoderConfig", "NonFiniteLogitsError"]
