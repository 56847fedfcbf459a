"""Host backend: the compiled C++ kernels of dinfer_kernels._C (OpenMP)."""
