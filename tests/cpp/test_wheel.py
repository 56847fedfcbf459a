"""The wheel: `python -m build` of the checkout (the sdist, then the wheel from it) gives one wheel with
both packages and the compiled layer for every host ISA and, when nvcc is found, the CUDA kernels for
every architecture of the default list with 0 spill bytes. Installed into a fresh venv with no nvcc
on the PATH it needs no compiler: it imports and runs the host and Triton backends with `dinfer`
unimportable (the op package needs nothing from the engine; a runtime that embeds our kernels uses
dinfer_kernels alone), and the installed engine answers as the checkout does."""

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
from conftest import ROOT, assert_no_spills

PROMPT = "add:048213+000937"

# Runs in the venv with `import dinfer` failing; argv[1]: the venv. Prints what it found as JSON,
# then runs the selftest (its exit status is the child's).
KERNELS_ALONE = """
import json, runpy, sys
sys.modules["dinfer"] = None
import dinfer_kernels
from dinfer_kernels import _backend
ext = _backend.compiled()
print(json.dumps({
    "package": dinfer_kernels.__file__,
    "extension": None if ext is None else ext.__file__,
    "cuda_archs": ext.cuda_archs().split(",") if ext is not None and ext.built_with_cuda() else [],
    "host_isas": list(ext.cpu_isas_built()) if ext is not None else [],
}))
sys.stdout.flush()
sys.argv = ["dinfer_kernels", "selftest", "--quick"]
runpy.run_module("dinfer_kernels", run_name="__main__")
"""


def find_nvcc():
    """The nvcc the build finds (setup.py looks in the same places, in the same order)."""
    for cand in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand):
            return cand
    return None


def wanted_cuda_archs(nvcc):
    """A100, H100 and, from CUDA 12.8 (the first to know it), B200: what a wheel ships."""
    if nvcc is None:
        return []
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    major, minor = map(int, re.search(r"release (\d+)\.(\d+)", out).groups())
    return ["80", "90a"] + (["100a"] if (major, minor) >= (12, 8) else [])


def without_nvcc(venv):
    """The environment of the installed wheel: its venv's bin first, no nvcc on the PATH, no CUDACXX,
    no PYTHONPATH (the checkout must not be what runs)."""
    dirs = [str(venv / "bin")] + [
        d
        for d in os.environ.get("PATH", "").split(os.pathsep)
        if d and not os.path.isfile(os.path.join(d, "nvcc"))
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("CUDACXX", "CUDA_HOME", "PYTHONPATH")}
    env.update(PATH=os.pathsep.join(dirs), OMP_NUM_THREADS="1")
    assert shutil.which("nvcc", path=env["PATH"]) is None
    return env


@pytest.mark.slow
@pytest.mark.timeout(3600)  # a full build (every host ISA, the CUDA kernels for 3 architectures) on 2 cores
def test_wheel_installs_and_runs_without_nvcc(tmp_path):
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool}")
    for module in ("pybind11", "build"):
        pytest.importorskip(module)
    nvcc = find_nvcc()
    # No build isolation and no index: the build requirements are the test environment's.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["MAX_JOBS"] = os.environ.get("MAX_JOBS", "2")
    dist = tmp_path / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=3000,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        build_log = z.read("dinfer_kernels/build_log.txt").decode()
    assert any(re.fullmatch(r"dinfer_kernels/_C\..*\.so", n) for n in names), names
    assert "dinfer/cli.py" in names and "dinfer_kernels/selftest.py" in names
    cuda_archs = wanted_cuda_archs(nvcc)
    if cuda_archs:
        assert_no_spills(build_log, cuda_archs)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    install = subprocess.run(
        [py, "-m", "pip", "install", "--no-deps", "--no-index", "--no-cache-dir", str(wheel)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]

    hidden = without_nvcc(venv)
    run = subprocess.run(
        [py, "-c", KERNELS_ALONE], env=hidden, cwd=tmp_path, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    found = json.loads(run.stdout.splitlines()[0])
    site = str(venv)
    assert found["package"].startswith(site) and (found["extension"] or "").startswith(site), found
    assert found["cuda_archs"] == cuda_archs
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    assert found["host_isas"] == (["generic", "avx2", "avx512", "avx512bf16"] if x86 else ["generic"])
    assert re.search(r"selftest: (\d+)/\1 ok", run.stdout), run.stdout[-2000:]

    installed = subprocess.run(
        [venv / "bin" / "dinfer", "generate", "--prompt", PROMPT],
        env=hidden, cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr[-3000:]
    where = subprocess.run(
        [py, "-c", "import dinfer; print(dinfer.__file__)"],
        env=hidden,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert where.stdout.startswith(site), where.stdout + where.stderr
    checkout = subprocess.run(
        [sys.executable, "-m", "dinfer", "generate", "--prompt", PROMPT],
        env=dict(env, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"), cwd=tmp_path, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert checkout.returncode == 0, checkout.stderr[-3000:]
    assert installed.stdout == checkout.stdout
