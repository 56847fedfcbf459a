"""Triton backend: the ops' kernels in Triton (GPU; on the host under TRITON_INTERPRET=1)."""

from .._lazy import submodule_loader

__getattr__ = submodule_loader(__name__)  # an op's module, hence Triton itself, loads on first use
