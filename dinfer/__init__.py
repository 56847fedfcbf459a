"""dinfer: the thin diffusion-LLM inference loop built on dinfer_kernels (models, decoders, caches)."""
