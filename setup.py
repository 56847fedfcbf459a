"""Builds dinfer_kernels._C with CMake + Ninja (CPU kernels always, CUDA kernels when nvcc is found).

Environment:
  DINFER_CUDA        auto (default) | 1 (fail if nvcc is missing) | 0
  DINFER_CUDA_ARCHS  default "80;90a"
  DINFER_CPU_ARCH    -march for the CPU kernels, default "native" ("" for the compiler default)
  DINFER_WERROR      1 (default): compiler warnings are errors; 0: warnings only
  MAX_JOBS           parallel compile jobs
The full compiler output, including the `-Xptxas -v` register/spill report, is kept in
dinfer_kernels/build_log.txt next to the extension.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
VERSION = "0.1.0"


def find_nvcc():
    for cand in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).is_file():
            return cand
    return None


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        import pybind11

        mode = os.environ.get("DINFER_CUDA", "auto").strip().lower()
        if mode not in ("auto", "1", "0"):
            raise SystemExit(f"DINFER_CUDA must be auto, 1 or 0, got {mode!r}")
        nvcc = find_nvcc() if mode != "0" else None
        if mode == "1" and nvcc is None:
            raise SystemExit("DINFER_CUDA=1 but nvcc was not found: put nvcc on PATH or set CUDACXX")
        if mode == "auto" and nvcc is None:
            print("dinfer: nvcc not found; building the CPU kernels only (set DINFER_CUDA=1 to require CUDA)")

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        args = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DDINFER_CUDA={'1' if nvcc else '0'}",
            f"-DDINFER_CUDA_ARCHS={os.environ.get('DINFER_CUDA_ARCHS', '80;90a')}",
            f"-DDINFER_CPU_ARCH={os.environ.get('DINFER_CPU_ARCH', 'native')}",
            f"-DDINFER_VERSION={VERSION}",
            f"-DDINFER_WERROR={'OFF' if os.environ.get('DINFER_WERROR', '1').strip() == '0' else 'ON'}",
        ]
        if nvcc:
            args.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        log = []
        for cmd in (args, ["cmake", "--build", str(build_dir), "-j", jobs, "--verbose"]):
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            log.append("$ " + " ".join(cmd) + "\n" + proc.stdout)
            if proc.returncode != 0:
                sys.stdout.write(proc.stdout)
                raise SystemExit(f"dinfer: build failed ({cmd[0]} exited {proc.returncode})")
        # Next to the built extension, and for editable installs in the source package it runs from.
        dirs = {out_dir}
        if self.inplace or getattr(self, "editable_mode", False):
            dirs.add(ROOT / "dinfer_kernels")
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
            (d / "build_log.txt").write_text("\n".join(log))


setup(
    version=VERSION,
    ext_modules=[Extension("dinfer_kernels._C", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
)
