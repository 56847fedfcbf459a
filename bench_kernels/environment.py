"""Where a measurement was made: the commit (and whether the code was changed), the host, the
CPU, the load, the versions and the GPU, recorded in every benchmark's JSON; and what the GPU at hand
is: its short name in result files (gpu_slug) and its datasheet's HBM bandwidth and dense bf16 rate,
the ceilings a measured rate is a percentage of beside the measured yardsticks (timing.py)."""

import datetime
import os
import platform
import re
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


# The vendor's datasheet figures per GPU model, matched on the name nvidia-smi and torch report ("NVIDIA
# H100 80GB HBM3" is the SXM part, "NVIDIA H100 PCIe", "NVIDIA H200"): (pattern, short name for result
# files, HBM TB/s, dense bf16 TFLOP/s without sparsity). The first match wins, so the PCIe and NVL parts
# come before the plain H100; "GH200" matches none (its memory differs by model) and gets no figures.
# None: not in the datasheet we hold.
GPU_MODELS = (
    (r"\bH100\b.*\bPCIe\b", "h100-pcie", 2.0, 756.0),
    (r"\bH100\b.*\bNVL\b", "h100-nvl", 3.9, 835.0),
    (r"\bH100\b", "h100", 3.35, 989.0),
    (r"\bH200\b.*\bNVL\b", "h200-nvl", 4.8, 835.0),
    (r"\bH200\b", "h200", 4.8, 989.0),
    (r"\bB200\b", "b200", 8.0, None),
)


def _model(name):
    for pattern, slug, tbs, tflops in GPU_MODELS:
        if name and re.search(pattern, name):
            return slug, tbs, tflops
    return None


def datasheet_hbm_tbs(name):
    """The datasheet HBM bandwidth (TB/s) of the GPU called `name` (as nvidia-smi or torch names it),
    or None for a GPU not in GPU_MODELS."""
    found = _model(name)
    return found[1] if found else None


def datasheet_bf16_tflops(name):
    """The datasheet dense bf16 tensor-core rate (TFLOP/s, no sparsity) of the GPU called `name`, or None
    for a GPU not in GPU_MODELS (or one whose figure we do not hold)."""
    found = _model(name)
    return found[2] if found else None


def gpu_slug(name):
    """The short name of a device in result file names (`decode_h100.json`): a known model's (h100,
    h100-pcie, h200, ...), else the name lower-cased without its "NVIDIA" with every run of other
    characters than letters and digits turned into one "-"; "cpu" for no GPU (None or "")."""
    if not name:
        return "cpu"
    found = _model(name)
    if found:
        return found[0]
    words = re.sub(r"^nvidia\s+", "", str(name).strip(), flags=re.I).lower()
    return re.sub(r"[^a-z0-9]+", "-", words).strip("-") or "gpu"


if __name__ == "__main__":
    # `python bench_kernels/environment.py slug NAME`: the GPU check names its result files with it.
    if len(sys.argv) == 3 and sys.argv[1] == "slug":
        print(gpu_slug(sys.argv[2]))
    else:
        sys.exit("usage: python bench_kernels/environment.py slug GPU_NAME")
