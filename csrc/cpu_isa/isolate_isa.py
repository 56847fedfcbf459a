"""Links one ISA's host-kernel objects into one relocatable object whose only global symbols are that
ISA's launchers (dinfer_kernels::isa_<name>::*). Run by CMakeLists.txt on x86-64.

Why: inline functions and template instances (std::vector, std::sort, ...) are emitted as weak
COMDAT symbols, and the final link keeps one copy for every object that uses them: an AVX-512 copy
of std::vector<float>'s growth path could then serve the generic kernels and fault on an AVX2 CPU.
Here each ISA's objects are linked together first with their section groups dissolved
(ld -r --force-group-allocation: duplicates resolve inside the ISA), then every defined symbol but
the launchers is made local, and those whose name does not already say their ISA get the suffix
".isa_<name>" (c++filt shows "[clone .isa_<name>]"), so a disassembly of the extension tells which
copy each function is (tests/cpp/test_cpu_isa.py checks every function's instructions against it).

usage: isolate_isa.py --ld LD --objcopy OBJCOPY --nm NM --isa NAME -o OUT OBJECT...
"""

import argparse
import subprocess
from pathlib import Path


def run(*cmd):
    subprocess.run([str(c) for c in cmd], check=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for tool in ("--ld", "--objcopy", "--nm"):
        ap.add_argument(tool, required=True)
    ap.add_argument("--isa", required=True)
    ap.add_argument("-o", dest="out", type=Path, required=True)
    ap.add_argument("objects", nargs="+")
    a = ap.parse_args()

    ns = f"isa_{a.isa}"
    launcher_prefix = f"_ZN14dinfer_kernels{len(ns)}{ns}"  # mangled dinfer_kernels::isa_<name>::
    merged = a.out.with_suffix(".merged.o")
    run(a.ld, "-r", "--force-group-allocation", "-o", merged, *a.objects)

    listing = subprocess.run(
        [a.nm, "--defined-only", "--extern-only", "--format=posix", str(merged)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    keep, rename = [], []
    for line in listing.splitlines():
        name, kind = line.split()[:2]
        if kind == "T" and name.startswith(launcher_prefix):
            keep.append(name)
        elif ns not in name:
            rename.append(f"{name} {name}.{ns}\n")
    renames = a.out.with_suffix(".renames")
    renames.write_text("".join(rename))
    keeps = a.out.with_suffix(".keep")
    keeps.write_text("".join(f"{k}\n" for k in keep))
    # Two passes: --keep-global-symbols must see the final names.
    run(a.objcopy, f"--redefine-syms={renames}", merged, a.out)
    run(a.objcopy, f"--keep-global-symbols={keeps}", a.out)


if __name__ == "__main__":
    main()
