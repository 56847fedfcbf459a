"""Named ranges for profilers: each op call as dinfer::<op>[<backend>] and, from the engine, its loop
phases, model forwards and layers; the benchmarks' timed regions.

DINFER_NVTX=1 in the environment (read once, at import; set_enabled() switches it, for tests) turns
the ops' and the engine's ranges on (region()); off, an op call pays one check of ENABLED and a
region() returns one shared no-op context. The benchmarks name their timed regions always
(annotate()): those lie outside the timed calls.

A range is pushed to both profilers users reach for, by the same name:
- NVTX (torch.cuda.nvtx's functions), which Nsight Systems (`nsys -t nvtx`) and Nsight Compute
  (`ncu --nvtx`) read. CPU-only builds of torch have no NVTX (torch.cuda.nvtx raises), so there
  only the profiler's half below remains. NVTX ranges are host-side: inside a captured CUDA graph
  they mark the capture, never the replays.
- torch.profiler's record_function, while a torch profiler records, so that its trace and
  key_averages() show the same names, on the CPU too. Not under torch's NVTX mode (emit_nvtx, which
  `nsys --pytorch=autograd-nvtx` turns on): there record_function emits an NVTX range itself, the
  second copy of ours.
"""

import contextlib
import os
from typing import Optional

import torch
from torch._C._profiler import ActiveProfilerType

ENABLED = os.environ.get("DINFER_NVTX", "0") == "1"

_NVTX = getattr(torch._C, "_nvtx", None)  # torch builds with CUDA only (torch.cuda.nvtx's functions)
_profiler_enabled = torch._C._autograd._profiler_enabled
_profiler_type = torch._C._autograd._profiler_type
_OFF = contextlib.nullcontext()


def set_enabled(on: bool) -> bool:
    """Turns region()'s ranges on or off for the whole process; returns the previous setting."""
    global ENABLED
    previous, ENABLED = ENABLED, bool(on)
    return previous


class annotate:
    """A range named `name` around a with-block, whatever DINFER_NVTX says."""

    __slots__ = ("name", "_record")

    def __init__(self, name: str):
        self.name = name
        self._record: Optional[torch.profiler.record_function] = None

    def __enter__(self):
        if _profiler_enabled() and _profiler_type() != ActiveProfilerType.NVTX:
            self._record = torch.profiler.record_function(self.name).__enter__()
        if _NVTX is not None:
            _NVTX.rangePushA(self.name)
        return self

    def __exit__(self, *exc):
        if _NVTX is not None:
            _NVTX.rangePop()
        if self._record is not None:
            self._record.__exit__(*exc)
            self._record = None
        return False


def region(name: str):
    """A range named `name` with DINFER_NVTX=1, nothing otherwise; nothing while torch.compile
    traces (a compiled graph has no host code to push from)."""
    if not ENABLED or torch.compiler.is_compiling():
        return _OFF
    return annotate(name)
