"""Host backend: the compiled C++ kernels of dinfer_kernels._C (OpenMP)."""

from torch.utils.dlpack import to_dlpack

from .._lazy import submodule_loader

__getattr__ = submodule_loader(__name__)  # an op's module loads on first use


def capsules(*tensors):
    """The tensors as DLPack capsules (None stays None). The bindings take any __dlpack__ array, but
    torch's __dlpack__ is a Python method costing a few microseconds per array, as much as a small
    kernel; a capsule from to_dlpack costs a tenth of that."""
    return [None if t is None else to_dlpack(t) for t in tensors]
