"""The one distribution `dinfer` (packages dinfer and dinfer_kernels). Builds dinfer_kernels._C with CMake +
Ninja (CPU kernels always, CUDA kernels when nvcc is found).

Environment:
  DINFER_CUDA        auto (default) | 1 (fail if nvcc is missing) | 0
  DINFER_CUDA_ARCHS  default "80;90a", and "100a" too when the nvcc is CUDA 12.8+ (CMakeLists.txt)
  DINFER_WERROR      1 (default): compiler warnings are errors; 0: warnings only
  DINFER_CPU_ISAS    the host ISA copies to build, comma-separated, generic among them (default: all;
                     the GPU check builds generic alone)
  MAX_JOBS           parallel compile jobs
The host kernels are compiled once per x86-64 ISA (generic, avx2, avx512, avx512bf16; generic only
elsewhere) into the one extension, and the best the CPU runs is chosen at import (DINFER_CPU_ISA lowers
it at run time): a build made on one x86-64 machine runs on any other.
The full compiler output, including the `-Xptxas -v` register/spill report, is kept in
dinfer_kernels/build_log.txt next to the extension.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
VERSION = re.search(r'^__version__ = "(.+)"', (ROOT / "dinfer_kernels/__init__.py").read_text(), re.M)[1]


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
        if "DINFER_CPU_ARCH" in os.environ:
            raise SystemExit(
                "DINFER_CPU_ARCH is gone: the host kernels are built for every ISA and the "
                "best the CPU runs is chosen at import (DINFER_CPU_ISA lowers it at run time)"
            )
        nvcc = find_nvcc() if mode != "0" else None
        if mode == "1" and nvcc is None:
            raise SystemExit("DINFER_CUDA=1 but nvcc was not found: put nvcc on PATH or set CUDACXX")
        if mode == "auto" and nvcc is None:
            print("dinfer: nvcc not found; building the CPU kernels only (set DINFER_CUDA=1 to require CUDA)")

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        args = [
            "cmake",
            "-S",
            str(ROOT),
            "-B",
            str(build_dir),
            "-G",
            "Ninja",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DDINFER_CUDA={'1' if nvcc else '0'}",
            f"-DDINFER_CUDA_ARCHS={os.environ.get('DINFER_CUDA_ARCHS', '')}",
            f"-DDINFER_WERROR={'OFF' if os.environ.get('DINFER_WERROR', '1').strip() == '0' else 'ON'}",
            f"-DDINFER_CPU_ISAS={os.environ.get('DINFER_CPU_ISAS', '').replace(',', ';')}",
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
        # Next to the built extension, and for editable installs in the source package it runs from
        # (--inplace builds copy it there with the extension, below).
        dirs = {out_dir}
        if getattr(self, "editable_mode", False):
            dirs.add(ROOT / "dinfer_kernels")
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
            (d / "build_log.txt").write_text("\n".join(log))
        self._build_log = out_dir / "build_log.txt"

    def copy_extensions_to_source(self):
        super().copy_extensions_to_source()
        if getattr(self, "_build_log", None) is not None:
            shutil.copyfile(self._build_log, ROOT / "dinfer_kernels" / "build_log.txt")


setup(
    version=VERSION,
    ext_modules=[Extension("dinfer_kernels._C", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
)
