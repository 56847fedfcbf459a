"""The one distribution installs both packages; the op package imports and runs with the engine
unimportable (a runtime that embeds our kernels uses dinfer_kernels alone)."""

import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

# Runs in a child whose only copy of dinfer_kernels is the installed one and where `import dinfer`
# fails: the op package must need nothing from the engine.
CHILD = """
import sys
sys.modules["dinfer"] = None
import torch
import dinfer_kernels
assert dinfer_kernels.__file__.startswith(sys.argv[1]), dinfer_kernels.__file__
from dinfer_kernels import _backend
ext = _backend.compiled()
assert ext is not None and ext.__file__.startswith(sys.argv[1]), ext
from dinfer_kernels.precision import within_precision
from dinfer_kernels.reference.rms_norm import rms_norm_reference
x = torch.randn(3, 8)
w = torch.rand(8) + 0.5
out = dinfer_kernels.rms_norm(x, w, 1e-6, backend="cpu")
truth = rms_norm_reference(x.double(), w.double(), 1e-6)
ok, msg, _, _ = within_precision(out, rms_norm_reference(x, w, 1e-6), truth)
assert ok, msg
print("OK", dinfer_kernels.__version__)
"""


@pytest.mark.slow
def test_installed_kernels_run_without_the_engine(tmp_path):
    if shutil.which("cmake") is None or shutil.which("ninja") is None:
        pytest.skip("needs cmake and ninja")
    pytest.importorskip("pybind11")
    target = tmp_path / "site"
    # No build isolation: the build requirements (setuptools, pybind11, cmake, ninja) are the
    # test environment's, so the test needs no index. The CPU kernels only, to keep it short.
    env = dict(os.environ, DINFER_CUDA="0", MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-cache-dir",
         "--target", str(target), str(ROOT)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    installed = {p.name for p in target.iterdir()}
    assert {"dinfer_kernels", "dinfer"} <= installed, installed
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(target)],
        env=dict(env, PYTHONPATH=str(target)), cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0 and run.stdout.startswith("OK"), run.stdout + run.stderr[-3000:]
