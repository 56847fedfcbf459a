"""GPU backend: the compiled CUDA kernels of dinfer_kernels._C, launched on torch's current stream."""
