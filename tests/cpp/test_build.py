"""The build: what `python -m dinfer_kernels` reports, the ptxas report of the CUDA kernels (0 spill
bytes), and the torch-free C++ API used from a plain C++ program, on the host and on CUDA."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import EXT, assert_no_spills, build_cpp_examples

import dinfer_kernels

BUILD_LOG = Path(dinfer_kernels.__file__).parent / "build_log.txt"


def test_info_command():
    out = subprocess.run(
        [sys.executable, "-m", "dinfer_kernels"], capture_output=True, text=True, check=True
    ).stdout
    for field in (
        "dinfer_kernels",
        "torch",
        "triton",
        "compiled layer",
        "GPU visible",
        "backends (cpu)",
        "host kernel ISA",
    ):
        assert field in out


def test_cuda_required_means_built():
    """CI sets DINFER_CUDA=1 for the install: then the CUDA kernels must be in the extension."""
    if os.environ.get("DINFER_CUDA") != "1":
        pytest.skip("DINFER_CUDA=1 not requested")
    assert EXT is not None and EXT.built_with_cuda()
    assert EXT.cuda_archs()


def test_ptxas_reports_no_spills():
    if EXT is None or not EXT.built_with_cuda():
        pytest.skip("the extension was built without CUDA")
    assert_no_spills(BUILD_LOG.read_text(), EXT.cuda_archs().split(","))


@pytest.mark.parametrize(
    "example",
    [
        "decode_cpu_example",
        "attention_cpu_example",
        "rms_norm_cpu_example",
        "rope_cpu_example",
        "moe_cpu_example",
    ],
)
def test_cpp_runtime_calls_the_kernel_without_python(cpp_examples, example):
    out = subprocess.run([str(cpp_examples[example])], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "OK"


@pytest.fixture(scope="module")
def cuda_cpp_examples(tmp_path_factory):
    """The C++ examples against the package built with CUDA (sm_90a only, to keep the compile short)."""
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    return build_cpp_examples(tmp_path_factory.mktemp("cuda_cpp_examples"), cuda_archs="90a")


@pytest.mark.slow
def test_cuda_cpp_runtime_builds_against_the_installed_package(cuda_cpp_examples):
    assert cuda_cpp_examples["decode_cuda_example"].is_file()


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.timeout(240)  # its fixture builds the package with CUDA first: longer than one test's limit
def test_cuda_cpp_runtime_calls_the_kernel_without_python(cuda_cpp_examples):
    out = subprocess.run(
        [str(cuda_cpp_examples["decode_cuda_example"])], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "OK"
