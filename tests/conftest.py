"""Shared test setup: which backends can run here, the `gpu` marker, the precision-tied comparison
helpers and a loader for the bench_kernels
scripts (a folder of scripts, not a package).

The `gpu` marker: every test case that exercises a GPU backend carries it, so that the GPU check runs
exactly those (`pytest -m gpu`). GPU-only test functions are marked `@pytest.mark.gpu` explicitly;
parametrized cases whose `device` is a CUDA device or whose `backend` is "cuda" are marked here. Marked
cases skip without a GPU. DINFER_TEST_COLLECT_GPU=1 makes `pytest --collect-only` collect as if a GPU
were present (tests/kernels/test_gpu_marker.py uses it to prove that every case existing only with a GPU is
marked); it is refused for a real run."""

import faulthandler
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import torch

# Without a GPU, Triton kernels run in the interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from dinfer_kernels import _backend, precision

REAL_GPU = torch.cuda.is_available()
COLLECT_AS_GPU = os.environ.get("DINFER_TEST_COLLECT_GPU") == "1"
HAS_GPU = REAL_GPU or COLLECT_AS_GPU
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


def _is_gpu_param(name, value):
    if name == "backend":
        return value == "cuda"
    if name == "device":
        return torch.device(value).type == "cuda" if isinstance(value, (str, torch.device)) else False
    return False


def pytest_configure(config):
    if COLLECT_AS_GPU and not REAL_GPU and not config.option.collectonly:
        raise pytest.UsageError("DINFER_TEST_COLLECT_GPU=1 is for --collect-only: there is no GPU to run on")


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        params = getattr(item, "callspec", None)
        if params is not None and any(_is_gpu_param(k, v) for k, v in params.params.items()):
            item.add_marker(pytest.mark.gpu)
        if not REAL_GPU and item.get_closest_marker("gpu") is not None:
            item.add_marker(no_gpu)
        if "cpp_examples" in getattr(item, "fixturenames", ()):  # builds and installs the C++ package
            item.add_marker(pytest.mark.slow)
    _drop_needless_isa_cases(config, items)


def assert_precision(out, same_precision, truth, name):
    """The precision-tied tolerance (dinfer_kernels.precision.within_precision) as an assert."""
    ok, msg, _, _ = precision.within_precision(out, same_precision, truth)
    assert ok, f"{name}: {msg}"


def assert_no_spills(build_log, archs):
    """The `-Xptxas -v` report in a build log: every kernel compiled for each of `archs` (e.g. "90a")
    with 0 spill bytes."""
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", build_log)
    kernels = re.findall(r"Compiling entry function '(\w+)' for '(sm_\w+)'", build_log)
    assert kernels, "no ptxas report in the build log (is -Xptxas -v set?)"
    assert spills and len(spills) >= len(kernels)
    assert all(s == ("0", "0") for s in spills), f"register spills: {spills}"
    assert {arch for _, arch in kernels} >= {f"sm_{a}" for a in archs}


# A per-test time limit where pytest-timeout is missing: DINFER_TEST_TIMEOUT_S=seconds fails a test
# that runs longer (with every thread's stack on stderr), so one hung test cannot eat the GPU check's
# budget. With pytest-timeout installed, its --timeout does the same and this stays off.
TEST_TIMEOUT_S = float(os.environ.get("DINFER_TEST_TIMEOUT_S", "0") or 0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if TEST_TIMEOUT_S <= 0 or item.config.pluginmanager.hasplugin("timeout"):
        yield
        return

    def expire(signum, frame):
        faulthandler.dump_traceback()
        pytest.fail(f"timed out after {TEST_TIMEOUT_S:g}s (DINFER_TEST_TIMEOUT_S)", pytrace=False)

    before = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, TEST_TIMEOUT_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


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
    take a `backend` parameter run the lower ISAs for backend "cpu" only (_drop_needless_isa_cases)."""
    if request.param is not None:
        _backend.set_cpu_isa(request.param)
    try:
        yield request.param
    finally:
        if request.param is not None:
            _backend.set_cpu_isa(DEFAULT_ISA)


def _drop_needless_isa_cases(config, items):
    # Another backend never reaches a host kernel: one ISA is enough for it.
    def needless(item):
        params = item.callspec.params if hasattr(item, "callspec") else {}
        return params.get("host_isa", DEFAULT_ISA) != DEFAULT_ISA and params.get("backend", "cpu") != "cpu"

    dropped = [item for item in items if needless(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not needless(item)]


ROOT = Path(__file__).resolve().parent.parent  # the repository


def load_bench(name):
    """bench_kernels/<name>.py as a module (its main(argv) runs the benchmark)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench_kernels" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_cpp_examples(build, *cmake_args, cuda_archs=None):
    """Builds the C++ programs of tests/cpp as a C++ runtime would: the torch-free kernels (every ISA's
    host kernels and the dispatcher; the CUDA kernels for `cuda_archs`, e.g. "90a", when given, else
    none) configured, built and installed from the root CMakeLists.txt into a prefix, then tests/cpp found against
    that prefix by find_package(dinfer_kernels). `cmake_args` go to both configures (a cross
    toolchain). {name: path} of examples/*_example.cpp, and with CUDA of cuda/*_example.cu."""
    cmake, ninja = shutil.which("cmake"), shutil.which("ninja")
    if cmake is None or ninja is None:
        pytest.skip("needs cmake and ninja")
    build = Path(build)
    prefix, jobs = build / "prefix", os.environ.get("MAX_JOBS", "2")
    common = ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", *cmake_args]
    cuda = (
        ["-DDINFER_CUDA=0"]
        if cuda_archs is None
        else ["-DDINFER_CUDA=1", f"-DDINFER_CUDA_ARCHS={cuda_archs}"]
    )
    for cmd in (
        [
            cmake,
            "-S",
            str(ROOT),
            "-B",
            str(build / "kernels"),
            *common,
            *cuda,
            "-DDINFER_PYTHON_MODULE=OFF",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_INSTALL_PREFIX={prefix}",
        ],
        [cmake, "--build", str(build / "kernels"), "-j", jobs],
        [cmake, "--install", str(build / "kernels")],
        [
            cmake,
            "-S",
            str(ROOT / "tests/cpp"),
            "-B",
            str(build / "examples"),
            *common,
            f"-DCMAKE_PREFIX_PATH={prefix}",
        ],
        [cmake, "--build", str(build / "examples"), "-j", jobs],
    ):
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.returncode == 0, proc.stdout[-4000:]
    sources = sorted((ROOT / "tests/cpp/examples").glob("*_example.cpp"))
    if cuda_archs is not None:
        sources += sorted((ROOT / "tests/cpp/cuda").glob("*_example.cu"))
    return {src.stem: build / "examples" / src.stem for src in sources}


@pytest.fixture(scope="session")
def cpp_examples(tmp_path_factory):
    """The C++ examples built for this machine (build_cpp_examples)."""
    if shutil.which("c++") is None:
        pytest.skip("needs a C++ compiler")
    return build_cpp_examples(tmp_path_factory.mktemp("cpp_examples"))
