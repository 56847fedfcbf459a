"""Triton backend: decode_step and soft_embedding kernels (spec: dinfer_kernels.reference)."""
