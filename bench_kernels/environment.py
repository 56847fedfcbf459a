"""Where a measurement was made: the commit (and whether the code was changed), the host, the
CPU, the load, the versions and the GPU, recorded in every benchmark's JSON."""

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

from checkout import ROOT


def git_commit():
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        # Changed results (this folder's outputs) do not make the code dirty: one benchmark's
        # new JSON must not mark the next run's.
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench_kernels/results"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return (out.stdout.strip() or "unknown") + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def cpu_name():
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                return f"{ln.split(':', 1)[1].strip()} ({os.cpu_count()} threads)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device):
    import torch

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
        "cpu": cpu_name(),
        "cpu_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "loadavg_1min": round(os.getloadavg()[0], 2),
        "argv": " ".join(sys.argv),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if str(device).startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    return env


def datasheet_hbm_tbs(name):
    """The datasheet HBM bandwidth (TB/s) of the GPU named `name` (torch.cuda.get_device_name), None
    when not known (or on the host): H200 4.8, H100 SXM 3.35, H100 PCIe 2.0."""
    name = str(name or "")
    if "H200" in name:
        return 4.8
    if "H100" in name:  # the SXM part reports as "NVIDIA H100 80GB HBM3"
        return 2.0 if "PCIe" in name else 3.35 if ("SXM" in name or "HBM3" in name) else None
    return None
