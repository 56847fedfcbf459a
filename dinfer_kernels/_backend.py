"""Which backends exist in this install, and the `backend=` switch every op shares: one resolver,
resolve(), turns every op's backend= into the backend that runs the call.

Backends: "cuda" (compiled CUDA kernels), "triton", "cpu" (compiled C++ kernels), "torch" (the pure-torch
reference; runs anywhere, not CUDA-graph capturable). A kernel backend implements the ops it has a
module for (dinfer_kernels/<backend>/<op>.py: found, not listed) and takes the inputs that module's
SUPPORTS allows (the supports hook, unsupported()). "auto" picks the fastest available backend that
takes the call's inputs: cuda > triton > torch on a GPU; on the host cpu > torch for the ops whose
host kernel beats the reference with the ISA in use (cpu_fast_ops(); an op whose host backend is built
from other ops' kernels, HOST_COMPOSED, where all of them do), torch for the others; for moe
also only in the dtypes and shapes where it was measured faster (MOE_HOST_WINS, moe_host_wins()).
prefer_backend() overrides "auto" for every op whose call the preferred backend can run.

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
import pkgutil
import sys
from types import ModuleType
from typing import Callable, Optional

import torch

from .ops import OPS

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
# The host kernels' ISA: asking now makes a bad DINFER_CPU_ISA fail the import, naming the variable.
# Kept here, as the fast-op set is, so that resolving a backend calls nothing compiled (torch.compile
# traces the ops' resolve; set_cpu_isa updates both).
try:
    _isa = _EXTENSION.cpu_isa() if _EXTENSION is not None else None
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
_host_fast_ops = frozenset(_EXTENSION.cpu_isa_fast_ops() if _EXTENSION is not None else ())


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
    return list(_EXTENSION.cpu_isas_supported()) if _EXTENSION is not None else []


def set_cpu_isa(isa: str):
    """Runs every later host-kernel call with `isa`'s copy, in the whole process (not while another
    thread runs a host kernel). ValueError for an unknown ISA or one this CPU does not run."""
    global _host_fast_ops, _isa
    if _EXTENSION is None:
        raise ValueError("isa: this install has no host kernels (dinfer_kernels._C was not built)")
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
# FP8 weights (float8_e4m3fn, any hidden dtype): the reference dequantises every chosen expert's
# weights on each call, the kernel streams the bytes once, so it wins wherever measured: a timing of
# dk.moe(backend="cpu") against moe_reference (1 thread, best of 3 interleaved, thread CPU time) on a
# shared 2-core AVX2 box (no AVX-512), reference / ours, bf16 and fp32 hidden states: small 4, 32, 128
# rows per expert | E 16, H 2048, I 1024 (100 MB) at 0.5, 4:
#   generic   bf16 4.6, 3.6, 3.6 | 7.8, 3.9    fp32 5.5, 2.1, 1.00 | 10.3, 5.6
#   avx2      bf16 7.5, 8.1, 8.7 | 13.7, 7.1   fp32 7.7, 4.7, 2.4  | 14.6, 8.2
# The AVX-512 copies were not measured (no AVX-512 there): they take avx2's limits.
# Re-measure when the kernel changes.
LARGE_MOE_BYTES = 64 << 20
MOE_HOST_WINS: dict[str, dict[str, tuple[Optional[float], Optional[float]]]] = {
    "generic": {"float32": (4, 4), "bfloat16": (4, None), "float16": (None, None), "float8_e4m3fn": (32, 4)},
    "avx2": {"float32": (32, 4), "bfloat16": (32, 0.5), "float16": (32, None), "float8_e4m3fn": (128, 4)},
    "avx512": {"float32": (32, 4), "bfloat16": (32, 0.5), "float16": (32, None), "float8_e4m3fn": (128, 4)},
    "avx512bf16": {
        "float32": (32, 4),
        "bfloat16": (128, 0.5),
        "float16": (32, None),
        "float8_e4m3fn": (128, 4),
    },
}


def moe_host_wins(
    dtype, rows_per_expert: float, weight_bytes: int, isa: Optional[str] = None, weight_dtype=None
) -> bool:
    """Whether the host MoE kernel of `isa` (default: the one in use) beats the torch reference for
    hidden states of `dtype` with `rows_per_expert` = T * top_k / E routed rows per expert on average
    and expert weights (w13 + w2) of `weight_bytes` in all, per MOE_HOST_WINS (FP8 weights,
    weight_dtype float8_e4m3fn: its "float8_e4m3fn" row, whatever the hidden states' dtype)."""
    key = weight_dtype if weight_dtype == torch.float8_e4m3fn else dtype
    limits = MOE_HOST_WINS.get(isa or cpu_isa() or "", {}).get(str(key).replace("torch.", ""))
    if limits is None:
        return False
    limit = limits[1] if weight_bytes >= LARGE_MOE_BYTES else limits[0]
    return limit is not None and rows_per_expert <= limit


# The kernel backends, fastest first: each is a package dinfer_kernels/<backend>/ holding one module per
# op it implements. "torch", the reference, implements every op.
KERNEL_BACKENDS = ("cuda", "triton", "cpu")


def _find_kernels() -> dict[str, tuple[str, ...]]:
    """{op: the kernel backends with a module for it, fastest first}, from the modules that exist
    (none is imported: Triton loads only when used); a module must belong to an op of OPS."""
    ops_of = {module: op for op, module in OPS.items()}
    here = os.path.dirname(os.path.abspath(__file__))
    found: dict[str, tuple[str, ...]] = {}
    for backend in KERNEL_BACKENDS:
        for info in pkgutil.iter_modules([os.path.join(here, backend)]):
            if not info.name.startswith("_"):
                if info.name not in ops_of:
                    raise ImportError(
                        f"dinfer_kernels/{backend}/{info.name}.py: no op of ops.OPS has that module"
                    )
                op = ops_of[info.name]
                found[op] = found.get(op, ()) + (backend,)
    return found


_KERNELS = _find_kernels()


def implemented(op: str) -> tuple[str, ...]:
    """The backends that implement `op`, fastest first: those with a module for it, then "torch"."""
    return _KERNELS.get(op, ()) + ("torch",)


def module(op: str, backend: str) -> ModuleType:
    """dinfer_kernels/<backend>/<op's module>.py, the kernel backend `backend` of `op` (ValueError
    for "torch", the op's reference, and for a backend that does not implement `op`)."""
    if backend not in _KERNELS.get(op, ()):
        raise ValueError(f"backend: {backend!r} does not implement {op}")
    from . import cpu, cuda, triton  # torch.compile traces import statements (not importlib)

    package = {"cpu": cpu, "cuda": cuda, "triton": triton}[backend]
    return getattr(package, OPS[op])


def impl(op: str, backend: str) -> Callable[..., None]:
    """The function of the kernel backend `backend` that runs `op` (see the module docstring), looked
    up on every call, so that a test may stand in for it."""
    return getattr(module(op, backend), op)


def _runs_on(backend: str, kind: str) -> bool:
    """Whether `backend` runs in this install on tensors of the device type `kind`."""
    if backend == "cpu":
        return kind == "cpu" and _EXTENSION is not None
    if backend == "cuda":
        return kind == "cuda" and _EXTENSION_HAS_CUDA
    if backend == "triton":
        return _TRITON_VERSION is not None and (kind == "cuda" or (kind == "cpu" and triton_interpreted()))
    return True  # torch


def available_backends(device, op: str = "decode_step") -> list[str]:
    """Backends that can run `op` on tensors of `device`, fastest first."""
    kind = torch.device(device).type
    return [b for b in implemented(op) if _runs_on(b, kind)]


def _shown(value) -> str:
    """An input's value or a list of them as an error message says them (float32, not torch.float32)."""
    if isinstance(value, (tuple, list, frozenset, set)):
        return ", ".join(map(_shown, value))
    return str(value).replace("torch.", "")


def unsupported(op: str, backend: str, call: dict) -> Optional[Exception]:
    """The supports hook: None when `backend` takes the inputs `call` describes, else the error that
    says why, naming the input. A kernel backend module may declare SUPPORTS = {input: the values it
    takes}; each input the op describes (its keyword arguments to resolve, e.g. attention's
    "q.dtype", "q.head_dim", "attn_mask") must be one of them. Inputs it does not declare, or that the
    call does not describe, it takes all of; "torch", the reference, takes every input."""
    if backend == "torch":
        return None
    for name, allowed in getattr(module(op, backend), "SUPPORTS", {}).items():
        if name in call and call[name] not in allowed:
            kind = TypeError if isinstance(call[name], torch.dtype) else ValueError
            return kind(
                f"{name}: {_shown(call[name])} is not supported by the {backend} backend of {op} "
                f"(supported: {_shown(allowed)}; backend='torch', the reference, takes any)"
            )
    return None


_preferred: Optional[str] = None  # set by prefer_backend()


@contextlib.contextmanager
def prefer_backend(backend: str):
    """Inside the block, backend="auto" resolves to `backend` for every op that `backend` can run
    with the call's inputs (others keep their usual choice): e.g. prefer_backend("torch") runs a
    model on the references."""
    global _preferred
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    before, _preferred = _preferred, (None if backend == "auto" else backend)
    try:
        yield
    finally:
        _preferred = before


# Host backends built from other ops' host kernels, with no compiled family of their own: {op: those
# ops}. Such a backend beats the reference where each of its kernels does (cpu_fast_ops()).
HOST_COMPOSED = {"qk_rope": ("rms_norm", "rope")}


def _host_fast(op) -> bool:
    """Whether the host kernels of `op` (or those it is built from) beat the reference, per
    cpu_fast_ops()."""
    return all(part in _host_fast_ops for part in HOST_COMPOSED.get(op, (op,)))


def host_auto_ops():
    """The ops for which "auto" picks the host backend (moe: at some shapes only): cpu_fast_ops() and
    the HOST_COMPOSED ones whose kernels are all among them."""
    return sorted(set(_host_fast_ops) | {op for op in HOST_COMPOSED if _host_fast(op)})


def _host_wins(op, call) -> bool:
    """Whether the host kernel of `op` (in cpu_fast_ops()) also wins for this call's dtype and shape
    (moe: `call` gives them; without them, the op-level answer)."""
    if op == "moe" and "rows_per_expert" in call:
        return moe_host_wins(
            call["dtype"],
            call["rows_per_expert"],
            call["weight_bytes"],
            weight_dtype=call.get("weight_dtype"),
        )
    return True


def auto_backends(device, op: str, **call) -> list[str]:
    """The backends "auto" may pick for `op` on `device`, fastest first: the available ones less the
    Triton interpreter (a correctness tool on the host) and a host kernel slower than the reference
    (for this call's dtype and shape where `call` gives them: moe's dtype, rows_per_expert and
    weight_bytes, see moe_host_wins)."""
    host = str(device).startswith("cpu")
    slow_host = not _host_fast(op) or not _host_wins(op, call)
    return [
        b
        for b in available_backends(device, op)
        if not (host and (b == "triton" or (b == "cpu" and slow_host)))
    ]


def resolve(backend: str, device, op: str, **call) -> str:
    """The backend that runs this call of `op` on `device`: `backend` when it is available and takes
    the inputs `call` describes (else an error naming what it lacks); for "auto", the preferred
    backend (prefer_backend) if it can, else the fastest backend that can (auto_backends: on the
    host, also for the call's dtype and shape), the reference at worst. Every op resolves here."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    avail = available_backends(device, op)
    if backend == "auto":
        if _preferred in avail and unsupported(op, _preferred, call) is None:
            return _preferred
        return next(b for b in auto_backends(device, op, **call) if unsupported(op, b, call) is None)
    if backend not in avail:
        raise ValueError(
            f"backend: {backend!r} cannot run {op} on {device} in this install (available: {avail})"
        )
    error = unsupported(op, backend, call)
    if error is not None:
        raise error
    return backend
