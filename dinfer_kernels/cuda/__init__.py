"""GPU backend: the compiled CUDA kernels of dinfer_kernels._C, launched on torch's current stream."""

from .._lazy import submodule_loader

__getattr__ = submodule_loader(__name__)  # an op's module loads on first use
