"""Which backends exist in this install, and the `backend=` switch every op shares.

Backends: "cuda" (compiled CUDA kernels), "triton", "cpu" (compiled C++ kernels), "torch" (the pure-torch
reference; runs anywhere, not CUDA-graph capturable). "auto" picks the fastest available for the
tensor's device: cuda > triton > torch on a GPU; on the host cpu > torch for the ops whose host kernel
beats the reference with the ISA in use (cpu_fast_ops()), torch for the others; for moe also only in the
dtypes and shapes where it was measured faster (MOE_HOST_WINS, moe_host_wins()).

The host kernels exist once per x86-64 ISA in the extension; cpu_isa() names the copy in use (the best
the CPU runs, or the DINFER_CPU_ISA environment variable's), set_cpu_isa() switches it for the whole
process (tests, benchmarks).

The kernel backends' functions (impl()) share one contract: dinfer_kernels/{cuda,triton,cpu}/<op>.py
defines <op>(inputs, outputs, *, scalars) -> None, writing the outputs the public op allocated.
"""

import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
import sys
from types import ModuleType
from typing import Callable, Optional

BACKENDS = ("auto", "cuda", "triton", "cpu", "torch")


def _load_extension():
    try:
        return importlib.import_module("dinfer_kernels._C")
    except ImportError:
        return None


def _find_triton():
    if importlib.util.find_spec("triton") is None:
        return None
    return importlib.metadata.version("triton")


# Looked up once at import: torch.compile traces the backend choice, and must see constants.
_EXTENSION = _load_extension()
_TRITON_VERSION = _find_triton()
_EXTENSION_HAS_CUDA = _EXTENSION is not None and _EXTENSION.built_with_cuda()
# Kernels came with their own build steps: an op's host kernel is only usable once _C lists it (a
# build from an older tree lacks the newer ones, and lists nothing: there, a binding meant a host
# kernel, except moe's); the CUDA attention also needs its workspace query.
if _EXTENSION is not None and hasattr(_EXTENSION, "host_kernels"):
    _EXTENSION_HOST_OPS = set(_EXTENSION.host_kernels())
else:
    _EXTENSION_HOST_OPS = {op for op in ("decode_step", "attention") if hasattr(_EXTENSION, op)}
_EXTENSION_HAS_ATTENTION = _EXTENSION_HAS_CUDA and hasattr(_EXTENSION, "attention_workspace_bytes")
# Likewise the CUDA MoE kernels (csrc/moe): only usable once _C exports them.
_EXTENSION_HAS_MOE = _EXTENSION_HAS_CUDA and hasattr(_EXTENSION, "moe")
# The host kernels' ISA: asking now makes a bad DINFER_CPU_ISA fail the import, naming the variable
# (a build from before the per-ISA layer has one copy, fast for every op it has).
_EXTENSION_HAS_ISAS = _EXTENSION is not None and hasattr(_EXTENSION, "cpu_isa")
# Kept here, as the fast-op set is, so that resolving a backend calls nothing compiled (torch.compile
# traces the ops' resolve; set_cpu_isa updates both).
try:
    _isa = _EXTENSION.cpu_isa() if _EXTENSION_HAS_ISAS else None
except ValueError as _bad_isa:
    # A setting of the environment, not a bug: a program that does not catch it (the dinfer and
    # python -m dinfer_kernels commands) ends with its one line, not a traceback through every import.
    def _one_line(kind, exc, tb, previous=sys.excepthook, bad=_bad_isa):
        if exc is bad:
            print(f"dinfer_kernels: error: {exc}", file=sys.stderr)
        else:
            previous(kind, exc, tb)

    sys.excepthook = _one_line
    raise
_host_fast_ops = frozenset(_EXTENSION.cpu_isa_fast_ops() if _EXTENSION_HAS_ISAS else _EXTENSION_HOST_OPS)


def compiled():
    """The compiled extension dinfer_kernels._C, or None when it was not built."""
    return _EXTENSION


def triton_version():
    """The installed Triton's version, or None (Triton itself is imported only when used)."""
    return _TRITON_VERSION


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def cpu_isa():
    """The ISA whose copy of the host kernels runs ("generic", "avx2", "avx512", "avx512bf16"), or None
    without the extension."""
    return _isa


def cpu_isas():
    """The ISAs of the host kernels this CPU runs, lowest first ([] without the extension)."""
    return list(_EXTENSION.cpu_isas_supported()) if _EXTENSION_HAS_ISAS else []


def set_cpu_isa(isa: str):
    """Runs every later host-kernel call with `isa`'s copy, in the whole process (not while another
    thread runs a host kernel). ValueError for an unknown ISA or one this CPU does not run."""
    global _host_fast_ops, _isa
    if not _EXTENSION_HAS_ISAS:
        raise ValueError("isa: this install has no per-ISA host kernels")
    _EXTENSION.set_cpu_isa(isa)
    _isa = _EXTENSION.cpu_isa()
    _host_fast_ops = frozenset(_EXTENSION.cpu_isa_fast_ops())


def cpu_fast_ops():
    """The ops whose host kernel, with the ISA in use, beats the torch reference: "auto" picks "cpu"
    for these only."""
    return sorted(_host_fast_ops)


# Where the host MoE kernel beats the torch reference, per ISA copy and dtype, as the largest mean
# number of rows per expert (T * top_k / E) at which it was measured faster: (with small experts,
# with large ones: weights of LARGE_MOE_BYTES or more in all, streamed from memory on every call).
# None: never. The kernel streams each expert's weights once for all of its rows (dot products under
# 8 rows), so it wins with few rows per expert; torch's GEMMs win with many, and in 16-bit over large
# experts torch's GEMMs stream the weights faster than the kernel's convert-and-FMA loop.
# Measured with bench_kernels/host_best.py moe (1 thread, best of 5 interleaved rounds) on an
# AMD EPYC (Zen 4) at commit c3778d8, reference time / ours (docs/notes/results-log.md, "auto per dtype and shape"):
# small = E 8, H 256, I 128 at 4, 32, 128 rows per expert | large = LLaDA-MoE's E 64, H 2048, I 1024
# at 0.5, 4 rows per expert (T 4, 32):
#   generic    fp32 2.86, 0.65, 0.52 | 1.19, 1.20    bf16 3.32, 0.85, 0.37 | 0.75, 0.47
#   avx2       fp32 3.59, 1.30, 1.30 | 1.44, 1.56    bf16 6.56, 1.20, 0.87 | 1.78, 0.86
#   avx512     fp32 3.58, 1.48, 1.59 | 1.36, 1.55    bf16 7.23, 1.60, 1.19 | 1.64, 0.93
#   avx512bf16 fp32 3.59, 1.62, 1.49 | 1.36, 1.49    bf16 6.91, 3.96, 2.08 | 1.66, 1.05
# fp16 (an earlier run): generic 0.48, 1.30 (small 4, 32), 0.05 (large 0.5); avx2 / AVX-512 2.8-4.5
# (small 4, 32), 0.52-0.77 (large 0.5). Ratios under ~1.1 count as losses (the box is shared), and
# where runs disagreed (small fp32 at 128 rows: 0.98-1.09 in an earlier run) the lower one stands.
# Re-measure when the kernel changes.
LARGE_MOE_BYTES = 64 << 20
MOE_HOST_WINS: dict[str, dict[str, tuple[Optional[float], Optional[float]]]] = {
    "generic": {"float32": (4, 4), "bfloat16": (4, None), "float16": (None, None)},
    "avx2": {"float32": (32, 4), "bfloat16": (32, 0.5), "float16": (32, None)},
    "avx512": {"float32": (32, 4), "bfloat16": (32, 0.5), "float16": (32, None)},
    "avx512bf16": {"float32": (32, 4), "bfloat16": (128, 0.5), "float16": (32, None)},
}


def moe_host_wins(dtype, rows_per_expert: float, weight_bytes: int, isa: Optional[str] = None) -> bool:
    """Whether the host MoE kernel of `isa` (default: the one in use) beats the torch reference for
    hidden states of `dtype` with `rows_per_expert` = T * top_k / E routed rows per expert on average
    and expert weights (w13 + w2) of `weight_bytes` in all, per MOE_HOST_WINS."""
    limits = MOE_HOST_WINS.get(isa or cpu_isa() or "", {}).get(str(dtype).replace("torch.", ""))
    if limits is None:
        return False
    limit = limits[1] if weight_bytes >= LARGE_MOE_BYTES else limits[0]
    return limit is not None and rows_per_expert <= limit


# Which backends implement each op, fastest first.
IMPLEMENTED = {
    "decode_step": ("cuda", "triton", "cpu", "torch"),
    "soft_embedding": ("triton", "torch"),
    "rms_norm": ("triton", "cpu", "torch"),
    "rope": ("triton", "cpu", "torch"),
    "attention": ("cuda", "triton", "cpu", "torch"),
    "moe": ("cuda", "triton", "cpu", "torch"),
}
# The module of an op in each kernel backend's package, where it is not named after the op.
_MODULES = {"decode_step": "decode"}


def module(op: str, backend: str) -> ModuleType:
    """dinfer_kernels/<backend>/<op's module>.py, the kernel backend `backend` of `op` (ValueError
    for "torch", the op's reference, and for a backend that does not implement `op`)."""
    if backend == "torch" or backend not in IMPLEMENTED[op]:
        raise ValueError(f"backend: {backend!r} does not implement {op}")
    from . import cpu, cuda, triton  # torch.compile traces import statements (not importlib)

    package = {"cpu": cpu, "cuda": cuda, "triton": triton}[backend]
    return getattr(package, _MODULES.get(op, op))


def impl(op: str, backend: str) -> Callable[..., None]:
    """The function of the kernel backend `backend` that runs `op` (see the module docstring), looked
    up on every call, so that a test may stand in for it."""
    return getattr(module(op, backend), op)


def available_backends(device, op: str = "decode_step") -> list[str]:
    """Backends that can run `op` on tensors of `device`, fastest first."""
    import torch

    kind = torch.device(device).type
    usable = {"torch"}
    if kind == "cpu" and op in _EXTENSION_HOST_OPS:
        usable.add("cpu")
    if (
        _EXTENSION_HAS_CUDA
        and kind == "cuda"
        and (op != "attention" or _EXTENSION_HAS_ATTENTION)
        and (op != "moe" or _EXTENSION_HAS_MOE)
    ):
        usable.add("cuda")
    if _TRITON_VERSION is not None and (kind == "cuda" or (kind == "cpu" and triton_interpreted())):
        usable.add("triton")
    return [b for b in IMPLEMENTED[op] if b in usable]


_preferred: Optional[str] = None  # set by prefer_backend()


@contextlib.contextmanager
def prefer_backend(backend: str):
    """Inside the block, backend="auto" resolves to `backend` for every op that `backend` can run
    (others keep their usual choice): e.g. prefer_backend("torch") runs a model on the references."""
    global _preferred
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    before, _preferred = _preferred, (None if backend == "auto" else backend)
    try:
        yield
    finally:
        _preferred = before


def _host_wins(op, work) -> bool:
    """Whether the host kernel of `op` (in cpu_fast_ops()) also wins for this call's dtype and shape,
    `work` (the op's keyword arguments to resolve; none: the op-level answer)."""
    if op == "moe" and work:
        return moe_host_wins(work["dtype"], work["rows_per_expert"], work["weight_bytes"])
    return True


def auto_backends(device, op: str, **work) -> list[str]:
    """The backends "auto" may pick for `op` on `device`, fastest first: the available ones less the
    Triton interpreter (a correctness tool on the host) and a host kernel slower than the reference
    (for this call's dtype and shape where `work` gives them: moe's dtype, rows_per_expert and
    weight_bytes, see moe_host_wins)."""
    host = str(device).startswith("cpu")
    slow_host = op not in _host_fast_ops or not _host_wins(op, work)
    return [
        b
        for b in available_backends(device, op)
        if not (host and (b == "triton" or (b == "cpu" and slow_host)))
    ]


def resolve(backend: str, device, op: str, **work) -> str:
    """Validates `backend` and turns "auto" into a concrete backend for `device` (and, on the host,
    for the call's dtype and shape in `work`, see auto_backends)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    avail = available_backends(device, op)
    if backend == "auto" and _preferred is not None and _preferred in avail:
        return _preferred
    if backend == "auto":
        return auto_backends(device, op, **work)[0]
    if backend not in avail:
        raise ValueError(
            f"backend: {backend!r} cannot run {op} on {device} in this install (available: {avail})"
        )
    return backend
