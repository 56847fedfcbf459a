"""Shared test setup: which backends can run here, the precision-tied comparison helpers, and a loader
for the bench_kernels scripts (a folder of scripts, not a package)."""
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

# Without a GPU, Triton kernels run in the interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dinfer_kernels import _backend  # noqa: E402

HAS_GPU = torch.cuda.is_available()
EXT = _backend.compiled()
HAS_TRITON = _backend.triton_version() is not None


def host_backends():
    """Backends that run on host tensors in this environment (the interpreter counts for Triton)."""
    found = ["torch"]
    if EXT is not None:
        found.append("cpu")
    if HAS_TRITON and not HAS_GPU:
        found.append("triton")
    return found


def device_backends():
    """(backend, device) pairs to test: every host backend, plus the GPU ones when a GPU is present."""
    pairs = [(b, "cpu") for b in host_backends()]
    if HAS_GPU:
        if EXT is not None and EXT.built_with_cuda():
            pairs.append(("cuda", "cuda"))
        if HAS_TRITON:
            pairs.append(("triton", "cuda"))
    return pairs


def max_err(a, b):
    """Max |a - b| over finite positions; positions must agree on being non-finite."""
    a, b = a.double(), b.double()
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    assert torch.equal(fa, fb), "outputs disagree on which elements are finite"
    assert torch.equal(a[~fa], b[~fb]), "non-finite outputs differ"
    return float((a[fa] - b[fb]).abs().max()) if fa.any() else 0.0


def assert_precision(out, same_precision, truth, name):
    """The precision-tied tolerance: our error against the high-precision truth is at most twice
    that of a same-precision torch run, plus a few fp32 ulps of the output's magnitude (for the
    cases where the torch run happens to be exact)."""
    ours = max_err(out, truth)
    theirs = max_err(same_precision, truth)
    finite = truth[torch.isfinite(truth)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    floor = 4 * torch.finfo(torch.float32).eps * max(scale, 1.0)
    assert ours <= 2 * theirs + floor, f"{name}: error {ours:.3g} > 2 x {theirs:.3g} + {floor:.3g}"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


# The host kernels' ISAs to test: every one this CPU runs, up to the one in use at start (so
# DINFER_CPU_ISA=avx2 tests what an AVX2-only machine runs). [None]: no per-ISA kernels here.
DEFAULT_ISA = _backend.cpu_isa()
HOST_ISAS = _backend.cpu_isas()[: _backend.cpu_isas().index(DEFAULT_ISA) + 1] if DEFAULT_ISA else [None]


@pytest.fixture(params=HOST_ISAS)
def host_isa(request):
    """Runs the test once per host-kernel ISA (the process-global switch, restored after). Tests that
    take a `backend` parameter run the lower ISAs for backend "cpu" only (pytest_collection_modifyitems)."""
    if request.param is not None:
        _backend.set_cpu_isa(request.param)
    try:
        yield request.param
    finally:
        if request.param is not None:
            _backend.set_cpu_isa(DEFAULT_ISA)


def pytest_collection_modifyitems(config, items):
    # Another backend never reaches a host kernel: one ISA is enough for it.
    def needless(item):
        params = item.callspec.params if hasattr(item, "callspec") else {}
        return params.get("host_isa", DEFAULT_ISA) != DEFAULT_ISA and params.get("backend", "cpu") != "cpu"

    dropped = [item for item in items if needless(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not needless(item)]


def load_bench(name):
    """bench_kernels/<name>.py as a module (its main(argv) runs the benchmark)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, "bench_kernels", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ROOT = Path(__file__).resolve().parent.parent


def build_cpp_examples(build, *cmake_args):
    """Builds the C++ programs of tests/cpp with CMake in `build` against the torch-free core, as a
    C++ runtime links it (every ISA's host kernels and the dispatcher, no CUDA): {name: path}."""
    cmake, ninja = shutil.which("cmake"), shutil.which("ninja")
    if cmake is None or ninja is None:
        pytest.skip("needs cmake and ninja")
    for cmd in ([cmake, "-S", str(ROOT), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                 "-DDINFER_CUDA=0", "-DDINFER_PYTHON_MODULE=OFF", "-DDINFER_CPP_EXAMPLES=ON",
                 f"-DPython_EXECUTABLE={sys.executable}", *cmake_args],
                [cmake, "--build", str(build), "-j", os.environ.get("MAX_JOBS", "2"), "--target",
                 "dinfer_cpp_examples"]):
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.returncode == 0, proc.stdout[-4000:]
    return {src.stem: build / src.stem for src in sorted((ROOT / "tests/cpp").glob("*_example.cpp"))}


@pytest.fixture(scope="session")
def cpp_examples(tmp_path_factory):
    """The C++ examples built for this machine (build_cpp_examples)."""
    if shutil.which("c++") is None:
        pytest.skip("needs a C++ compiler")
    return build_cpp_examples(tmp_path_factory.mktemp("cpp_examples"))
