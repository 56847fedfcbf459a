"""The `gpu` marker selects exactly the test cases that exercise a GPU backend, so that the GPU check
(`pytest -m gpu`) runs all of them and nothing CPU-only. On a CPU machine the marked cases skip.

Proof without a GPU: collecting as if a GPU were present (DINFER_TEST_COLLECT_GPU=1, see conftest),
every case that is not marked `gpu` must also exist on this machine, i.e. every case that exists only
because a GPU is present carries the marker; and no test skips itself on the absence of a GPU
instead of carrying the marker (such a test would exist on both and escape the first check)."""

import os
import re
import subprocess
import sys

import pytest
from conftest import REAL_GPU, ROOT


def collect(*args, as_gpu=False):
    env = dict(os.environ)
    env.pop("DINFER_TEST_COLLECT_GPU", None)
    if as_gpu:
        env["DINFER_TEST_COLLECT_GPU"] = "1"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--co", "-p", "no:cacheprovider", *args, "tests"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode in (0, 5), out.stdout[-2000:] + out.stderr[-2000:]  # 5: none collected
    return {ln.strip() for ln in out.stdout.splitlines() if "::" in ln}


def test_no_test_skips_itself_for_want_of_a_gpu():
    pattern = re.compile(r"skipif\(\s*not\s+(HAS_GPU|torch\.cuda\.is_available\(\))")
    offenders = [
        f"{p.name}:{i + 1}"
        for p in sorted((ROOT / "tests").rglob("*.py"))
        for i, ln in enumerate(p.read_text().splitlines())
        if pattern.search(ln)
    ]
    assert not offenders, f"mark GPU-only tests @pytest.mark.gpu instead of a skipif: {offenders}"


@pytest.mark.skipif(REAL_GPU, reason="the collection as if a GPU were present is for CPU machines")
def test_every_gpu_only_case_is_marked():
    here = collect()
    gpu_free = collect("-m", "not gpu", as_gpu=True)
    gpu = collect("-m", "gpu", as_gpu=True)
    unmarked = sorted(gpu_free - here)
    assert not unmarked, f"cases that exist only with a GPU but lack the gpu marker: {unmarked[:20]}"
    # The marker reaches every kind of GPU case: parametrized by device and by backend, explicit
    # GPU-only functions, and a module that runs on the GPU whenever one is present.
    for needle in (
        "-cuda]",
        "[cuda",
        "test_cuda_graph_capture",
        "test_gpu_",
        "test_soft_embedding.py",
        "test_engine.py::test_cuda_graph_replay",
    ):
        assert any(needle in t for t in gpu), f"no gpu-marked case matching {needle!r}"
    assert not any(t.split("::")[-1].startswith("test_gpu_") or "-cuda]" in t for t in gpu_free)


def test_marked_cases_skip_without_a_gpu():
    if REAL_GPU:
        pytest.skip("there is a GPU: the marked cases run")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rs", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    tail = out.stdout.strip().splitlines()[-1]
    assert out.returncode == 0 and re.fullmatch(r"=*\s*\d+ skipped, \d+ deselected in .*", tail), tail


def test_time_limit_without_pytest_timeout(tmp_path):
    """The conftest's fallback for pytest-timeout (the GPU check sets DINFER_TEST_TIMEOUT_S)."""
    (tmp_path / "test_hangs.py").write_text(
        "import time\n\ndef test_hangs():\n    time.sleep(30)\n\ndef test_quick():\n    pass\n"
    )
    env = dict(
        os.environ, DINFER_TEST_TIMEOUT_S="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "conftest",
            "-p",
            "no:timeout",
            "--rootdir",
            str(tmp_path),
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "1 failed, 1 passed" in out.stdout, out.stdout[-2000:]
    assert "timed out after 1s" in out.stdout
