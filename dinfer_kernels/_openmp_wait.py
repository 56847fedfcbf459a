"""OpenMP's wait policy for this process: waiting threads sleep at once instead of spinning, set
before the OpenMP runtime starts, unless the user chose a policy.

Why: torch's host ops (MKL's GEMMs, TensorIterator loops, softmax, index_select) and the host kernels
of dinfer_kernels._C run their parallel regions on one OpenMP runtime, the libgomp that `import
torch` loads (the extension's libgomp.so.1 resolves to that copy). With no policy set, libgomp makes
a thread that waits (at the barrier that ends a region, or in the pool for the next region) spin
300,000 times, milliseconds, before it sleeps. On cores that also run other work (a laptop building
something, a shared server) that is ruinous: the spinning thread holds a core while the thread it
waits for queues behind the other work, and every one of a generation's ~550 regions (one tiny
model's 8-prompt generate: ~450 of torch's, ~100 of ours) costs scheduler time slices instead of
microseconds. Measured on a 2-core VM beside a CPU hog: LLM().generate 50x its idle time with the
spinning default, ~3x with waiting threads asleep (bench_kernels/bench_contention.py, whose docstring
and docs/notes/results-log.md have the numbers and how they were found).

How: libgomp reads OMP_WAIT_POLICY and GOMP_SPINCOUNT once, when it is loaded, so this runs first
thing in dinfer_kernels/__init__.py (which dinfer imports before anything that imports torch). When
the runtime is already loaded (the program imported torch first) the setting cannot take effect any
more and is not made: the environment then does not claim a policy the process does not have.
A policy the user set (either variable, any value) is left alone; so is a child process's, which
inherits ours.
"""

import os
import sys

POLICY = "PASSIVE"
USER_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # what libgomp reads for its waits


def _runtime_loaded() -> bool:
    """Whether libgomp, the OpenMP runtime torch loads (and the one that reads these variables), is
    already mapped into this process (it has then read its environment). Another runtime loaded
    first (an MKL numpy's libiomp5) does not count: torch's libgomp still reads the policy when it
    loads. Linux lists the mapped libraries in /proc/self/maps; elsewhere torch having been imported
    stands for it."""
    try:
        with open("/proc/self/maps") as f:
            return any("libgomp" in line for line in f)
    except OSError:
        return "torch" in sys.modules


def apply() -> str:
    """Sets OMP_WAIT_POLICY=PASSIVE when it can still take effect and the user set no policy.
    Returns what happened: "set", "user" (a policy variable was set: left alone) or "late" (the
    runtime was loaded before dinfer_kernels: it keeps its default)."""
    if any(v in os.environ for v in USER_VARIABLES):
        return "user"
    if _runtime_loaded():
        return "late"
    os.environ["OMP_WAIT_POLICY"] = POLICY
    return "set"


STATE = apply()
