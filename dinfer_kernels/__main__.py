"""python -m dinfer_kernels: what this install built and what it can run.
python -m dinfer_kernels selftest [--quick]: every op on every backend here against its reference."""

import platform
import sys

import torch

from . import __version__
from ._backend import (
    available_backends,
    compiled,
    cpu_isa,
    cpu_isas,
    host_auto_ops,
    triton_interpreted,
    triton_version,
)


def main():
    ext = compiled()
    print(f"dinfer_kernels {__version__}")
    print(f"python           {platform.python_version()}")
    print(f"torch            {torch.__version__} (CUDA runtime {torch.version.cuda})")
    tv = triton_version()
    print(
        f"triton           {tv or 'not installed'}{' (TRITON_INTERPRET=1)' if tv and triton_interpreted() else ''}"
    )
    if ext is None:
        print("compiled layer   not built (dinfer_kernels._C missing): only torch/triton backends")
    else:
        archs = ext.cuda_archs() if ext.built_with_cuda() else "-"
        print(
            f"compiled layer   _C {ext.version()}: cpu{' + cuda' if ext.built_with_cuda() else ''}"
            f" (CUDA archs: {archs}; OpenMP threads: {ext.omp_max_threads()})"
        )
    if cpu_isa() is None:
        print("host kernel ISA  - (no per-ISA host kernels in this install)")
    else:
        print(
            f"host kernel ISA  {cpu_isa()} (this CPU runs: {', '.join(cpu_isas())}; DINFER_CPU_ISA lowers it;"
            f" auto picks cpu for: {', '.join(host_auto_ops()) or 'none'})"
        )
    gpu = torch.cuda.is_available()
    print(f"GPU visible      {torch.cuda.get_device_name(0) if gpu else 'no'}")
    print(f"backends (cpu)   {', '.join(available_backends('cpu'))}")
    if gpu:
        print(f"backends (cuda)  {', '.join(available_backends('cuda'))}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["selftest"]:
        from .selftest import main as selftest

        sys.exit(selftest(sys.argv[2:]))
    if sys.argv[1:]:
        sys.exit(f"python -m dinfer_kernels: unknown command {sys.argv[1]!r} (commands: selftest)")
    main()
