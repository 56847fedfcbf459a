"""How the bench scripts time a case, each in a profiler range named after it, and the yardsticks they
measure in the same run (copy and read-only bandwidth, the matmul rate) beside the datasheet's figures.

Timing
------
GPU: each case is captured into a CUDA graph of many calls that cycle through rotating input copies
(sized to several times the L2 so that every call reads from HBM), and the graph replays are timed
with CUDA events; a case that cannot be captured (a host sync, say dInfer's credit decoder) falls back
to triton.testing.do_bench (which flushes the L2 before each call) and says so in its `timer` field.
CPU: warm-up, then the median of repeated time.perf_counter() measurements of single calls.
Every measured region sits in a range (dinfer_kernels.profiling: NVTX on CUDA builds of torch, and
torch.profiler's record_function while one records) named nvtx_name(case name): the case's name in
ASCII and dots, which nsys's --nvtx-capture and --nvtx-include take as typed. Tables and JSON keep the
human case names.

Yardsticks
----------
A bench's GB/s is shown as a % of three ceilings: the copy (`dst.copy_(src)`, bytes read + written),
the read-only kernel (read_bandwidth.py: what a kernel that streams weights or a cache does) and the
datasheet HBM bandwidth of the GPU at hand (environment.datasheet_hbm_tbs). The copy reads low on
Hopper (58 % of the H200's datasheet in the 802ee3b run, below the 68 % the MoE kernel streamed), so a
row above 100 % of it says the copy is a weak yardstick, not that the data came from the L2: the
percent of the datasheet is the one to compare across kernels and GPUs of one model.
"""

import math
import re
import statistics
import time

import checkout  # noqa: F401  (the checkout's dinfer_kernels)
from environment import datasheet_bf16_tflops, datasheet_hbm_tbs
from results_json import record

from dinfer_kernels import profiling

ROTATE_BYTES = {"cuda": 256 << 20, "cpu": 64 << 20}  # rotating-input footprint (H200 L2: 50 MB)


MAX_COPIES = 64


def nvtx_name(name: str) -> str:
    """`name` as an NVTX range name: ASCII letters, digits, '_' and '-' in dot-separated words, '='
    dropped ("ours moe[cuda] T=32" -> "ours.moe.cuda.T32"). Spaces, brackets, '/', '@' and '*' have
    meanings in nsys's --nvtx-capture / --nvtx-include expressions."""
    dotted = re.sub(r"[^A-Za-z0-9_-]+", ".", name.replace("=", "")).strip(".")
    if not dotted:
        raise ValueError(f"name: {name!r} has no ASCII letter or digit to name an NVTX range")
    return dotted


def nvtx_range(name: str):
    """A profiler range named nvtx_name(name) around a with-block (next to free when no profiler
    listens)."""
    return profiling.annotate(nvtx_name(name))


def num_copies(nbytes_per_copy, device):
    """How many rotating input copies make the working set exceed the caches."""
    target = ROTATE_BYTES["cuda" if str(device).startswith("cuda") else "cpu"]
    return int(max(1, min(MAX_COPIES, math.ceil(target / max(1, nbytes_per_copy)))))


class Case:
    """One thing to time. fn(i) runs one call on rotating input copy i (0 <= i < copies).

    restore(): resets whatever the calls mutate (tokens) for every copy, so each call sees the same
    input; it runs outside the timed calls on the CPU, and once per pass over the copies inside a
    captured graph (amortised over the copies). setup(): once before a measurement set (reset state).
    graph=False: never try CUDA-graph capture (the case synchronises with the host).
    """

    def __init__(self, name, fn, copies=1, restore=None, setup=None, graph=True):
        self.name, self.fn, self.copies = name, fn, copies
        self.restore, self.setup, self.graph = restore, setup, graph


def _restore(case):
    if case.restore is not None:
        case.restore()


def _time_cpu(case, warmup, reps, min_seconds, max_reps=500):
    """At least `reps` single-call samples, more until `min_seconds` of calls (the median is robust
    to a shared, busy host)."""
    for i in range(warmup):
        _restore(case)
        case.fn(i % case.copies)
    times = []
    with nvtx_range(case.name):
        while len(times) < reps or (sum(times) < min_seconds and len(times) < max_reps):
            _restore(case)
            t0 = time.perf_counter()
            case.fn(len(times) % case.copies)
            times.append(time.perf_counter() - t0)
    return times, "perf_counter"


def _time_cuda_graph(case, reps, min_calls=20):
    import torch

    calls = max(case.copies, min_calls)
    calls = math.ceil(calls / case.copies) * case.copies
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream before capture
        for i in range(case.copies):
            if i == 0:
                _restore(case)
            case.fn(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for j in range(calls):
            if j % case.copies == 0:
                _restore(case)
            case.fn(j % case.copies)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    with nvtx_range(case.name):
        for _ in range(reps):
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3 / calls)
    del g
    return times, f"cuda-graph x{calls}"


def _time_cuda_do_bench(case, reps, quick):
    import torch
    import triton.testing

    state = {"i": 0}

    def call():
        _restore(case)
        case.fn(state["i"] % case.copies)
        state["i"] += 1

    call()
    torch.cuda.synchronize()
    with nvtx_range(case.name):
        ms = triton.testing.do_bench(
            call, warmup=10 if quick else 25, rep=40 if quick else 100, return_mode="all"
        )
    return [t * 1e-3 for t in ms], "do_bench"


def measure(case, device, quick=False, reps=None):
    """Times `case`; returns a dict with median_s, p20_s, p80_s, timer, note."""
    note = ""
    if case.setup is not None:
        case.setup()
    if str(device).startswith("cuda"):
        import torch

        reps = reps or (10 if quick else 30)
        times = None
        if case.graph:
            try:
                times, timer = _time_cuda_graph(case, reps)
            except Exception as e:
                note = f"graph capture failed ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
                torch.cuda.synchronize()
                if case.setup is not None:
                    case.setup()
        if times is None:
            times, timer = _time_cuda_do_bench(case, reps, quick)
    else:
        reps = reps or (5 if quick else 15)
        times, timer = _time_cpu(case, warmup=1 if quick else 2, reps=reps, min_seconds=0.2 if quick else 1.0)
    q = statistics.quantiles(times, n=5) if len(times) >= 2 else [times[0]] * 4
    res = {
        "median_s": statistics.median(times),
        "p20_s": q[0],
        "p80_s": q[3],
        "timer": timer,
        "n": len(times),
        "note": note,
    }
    record(case.name, res)
    return res


def copy_bandwidth(device, nbytes=None, quick=False):
    """Measured device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    import torch

    cuda = str(device).startswith("cuda")
    nbytes = nbytes or ((1 << 30) if cuda else (256 << 20))
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    res = measure(Case("copy_bandwidth", lambda i: dst.copy_(src)), device, quick=quick)
    res["GBps"] = 2 * nbytes / res["median_s"] / 1e9
    res["bytes"] = nbytes
    return res


def read_bandwidth(device, nbytes=None, quick=False):
    """Measured read-only bandwidth in GB/s, counting the bytes read: on a GPU the Triton kernel of
    read_bandwidth.py over 1 GiB (20x an H200's L2; one partial sum written per program, 4 programs per
    SM), on the host torch's sum() over 256 MiB. None on a GPU without triton."""
    import torch

    cuda = str(device).startswith("cuda")
    nbytes = nbytes or ((1 << 30) if cuda else (256 << 20))
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    if cuda:
        try:
            import read_bandwidth as kernel
        except ImportError:
            return None
        out = torch.empty(4 * torch.cuda.get_device_properties(device).multi_processor_count, device=device)
        fn, method = (lambda i: kernel.partial_sums(x, out)), "triton partial sums"
    else:
        fn, method = (lambda i: x.sum()), "torch sum"
    res = measure(Case("read_bandwidth", fn), device, quick=quick)
    res.update(GBps=nbytes / res["median_s"] / 1e9, bytes=x.numel() * 4, method=method)
    return res


def gpu_name(device):
    """The GPU's name as torch reports it, None on the host."""
    import torch

    return torch.cuda.get_device_name(torch.device(device)) if str(device).startswith("cuda") else None


def bandwidth_yardsticks(device, quick=False):
    """The bandwidth ceilings of a bench's GB/s: the measured copy and read-only bandwidths and the
    datasheet HBM bandwidth of the GPU at hand (datasheet_GBps None on the host or an unknown GPU)."""
    gpu = gpu_name(device)
    spec = datasheet_hbm_tbs(gpu)
    return {
        "copy": copy_bandwidth(device, quick=quick),
        "read": read_bandwidth(device, quick=quick),
        "gpu": gpu,
        "datasheet_GBps": None if spec is None else 1000.0 * spec,
    }


def bandwidth_percents(gbps, yard):
    """A rate in GB/s as % of each yardstick of bandwidth_yardsticks (None where one is missing)."""
    read = yard["read"]["GBps"] if yard["read"] else None
    return {
        "pct_copy": 100.0 * gbps / yard["copy"]["GBps"],
        "pct_read": None if read is None else 100.0 * gbps / read,
        "pct_spec": None if yard["datasheet_GBps"] is None else 100.0 * gbps / yard["datasheet_GBps"],
    }


# The table columns of bandwidth_percents' keys.
BANDWIDTH_COLUMNS = [
    ("% copy BW", "pct_copy", ".1f"),
    ("% read BW", "pct_read", ".1f"),
    ("% HBM spec", "pct_spec", ".1f"),
]


def bandwidth_text(yard):
    """The yardsticks in a table title: "copy 2762 GB/s, read 4100 GB/s, HBM spec 4800 GB/s"."""
    parts = [f"copy {yard['copy']['GBps']:.0f} GB/s"]
    parts.append(f"read {yard['read']['GBps']:.0f} GB/s" if yard["read"] else "read: not measured")
    if yard["datasheet_GBps"] is not None:
        parts.append(f"HBM spec {yard['datasheet_GBps']:.0f} GB/s")
    return ", ".join(parts)


def matmul_rate(device, dtype, quick):
    """Measured dense matmul rate (TFLOP/s) of `dtype` on a square problem, with the datasheet's dense
    bf16 rate of the GPU at hand where dtype is bf16 (datasheet_TFLOPs; None otherwise)."""
    import torch

    n = (8192 if not quick else 4096) if device == "cuda" else 512
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    res = measure(Case(f"matmul {n}^3", lambda i: a @ b), device, quick=quick)
    res["TFLOPs"] = 2.0 * n**3 / res["median_s"] / 1e12
    res["n"] = n
    res["datasheet_TFLOPs"] = datasheet_bf16_tflops(gpu_name(device)) if dtype == torch.bfloat16 else None
    return res


def matmul_percents(tflops, mm):
    """A rate in TFLOP/s as % of the measured matmul rate and of the datasheet's (None if unknown)."""
    spec = mm.get("datasheet_TFLOPs")
    return {
        "pct_mm": 100.0 * tflops / mm["TFLOPs"],
        "pct_mm_spec": None if spec is None else 100.0 * tflops / spec,
    }


def sync(device):
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
