"""The host kernels' ISA layer (csrc/cpu_isa/, dinfer_kernels/cpu_isa.h): the choice at import and
its switch, that no function of the extension executes instructions its ISA does not allow (the
disassembly, function by function), and the C++ examples under QEMU on CPUs without AVX-512 or AVX."""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import EXT, build_cpp_examples

from dinfer_kernels import _backend

pytestmark = pytest.mark.skipif(EXT is None, reason="the extension is not built")
ON_X86 = EXT is not None and "avx2" in EXT.cpu_isas_built()


def run_python(code, **env):
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}
    )


def test_queries_and_switch():
    built, supported = EXT.cpu_isas_built(), EXT.cpu_isas_supported()
    assert built[0] == "generic" and set(supported) <= set(built) and "generic" in supported
    assert built == (["generic", "avx2", "avx512", "avx512bf16"] if ON_X86 else ["generic"])
    before = _backend.cpu_isa()
    try:
        for isa in supported:
            _backend.set_cpu_isa(isa)
            assert EXT.cpu_isa() == _backend.cpu_isa() == isa
            assert set(_backend.cpu_fast_ops()) <= set(EXT.host_kernels())
    finally:
        _backend.set_cpu_isa(before)
    with pytest.raises(ValueError, match=r"isa=sse9: unknown ISA \(this build has: generic"):
        _backend.set_cpu_isa("sse9")
    assert EXT.cpu_isa() == before


def test_auto_picks_the_host_kernel_only_where_it_is_faster(host_isa):
    cpu = torch.device("cpu")
    fast = _backend.cpu_fast_ops()
    for op in EXT.host_kernels():
        assert _backend.resolve("auto", cpu, op) == ("cpu" if op in fast else "torch"), (host_isa, op)
        assert _backend.resolve("cpu", cpu, op) == "cpu"  # an explicit choice always runs it
        with _backend.prefer_backend("cpu"):
            assert _backend.resolve("auto", cpu, op) == "cpu"


def test_environment_lowers_the_choice():
    for isa in EXT.cpu_isas_supported():
        proc = run_python("import dinfer_kernels._C as C; print(C.cpu_isa())", DINFER_CPU_ISA=isa)
        assert proc.stdout.strip() == isa, proc.stderr
    best = EXT.cpu_isas_supported()[-1]
    for auto in ("auto", ""):
        proc = run_python("import dinfer_kernels._C as C; print(C.cpu_isa())", DINFER_CPU_ISA=auto)
        assert proc.stdout.strip() == best, proc.stderr


def test_bad_environment_fails_at_import():
    proc = run_python("import dinfer_kernels", DINFER_CPU_ISA="avx1024")
    assert proc.returncode != 0
    assert "DINFER_CPU_ISA=avx1024: unknown ISA" in proc.stderr
    assert "this CPU supports: " + ", ".join(EXT.cpu_isas_supported()) in proc.stderr


# ---- the disassembly: every function within its ISA -------------------------------------------------

LEGACY_PREFIXES = {"26", "2e", "36", "3e", "64", "65", "66", "67", "f0", "f2", "f3"}
# Instructions past the x86-64 baseline that are not VEX-encoded (a generic copy must not have them).
NON_VEX_EXTENSIONS = {"popcnt", "lzcnt", "movbe"}


def encoding(raw_bytes):
    """'vex', 'evex' or 'legacy' from an instruction's bytes (c4/c5 and 62 are invalid opcodes in
    64-bit mode, so after the legacy prefixes they always start a VEX / EVEX prefix)."""
    rest = list(raw_bytes)
    while rest and rest[0] in LEGACY_PREFIXES:
        rest.pop(0)
    first = rest[0] if rest else ""
    return {"c4": "vex", "c5": "vex", "62": "evex"}.get(first, "legacy")


def functions(path):
    """{function name: [(encoding, mnemonic)]} of the executable sections of `path`."""
    out = subprocess.run(
        ["objdump", "-d", "-C", "-w", "--insn-width=16", str(path)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    funcs, current = {}, None
    head = re.compile(r"^[0-9a-f]+ <(.+)>:$")
    insn = re.compile(r"^\s+[0-9a-f]+:\t([0-9a-f ]+?)\s*\t(\S+)")
    for line in out.splitlines():
        m = head.match(line)
        if m:
            current = funcs.setdefault(m.group(1), [])
            continue
        m = insn.match(line)
        if m and current is not None:
            current.append((encoding(m.group(1).split()), m.group(2)))
    return funcs


def violation(isa, insns):
    """Why `insns` cannot belong to `isa`'s copy (None if they can); isa None: outside every copy,
    where only the baseline is allowed."""
    kinds = {e for e, _ in insns}
    names = {m for _, m in insns}
    if isa in (None, "generic"):
        if kinds & {"vex", "evex"} or names & NON_VEX_EXTENSIONS:
            return f"{sorted(kinds - {'legacy'})} {sorted(names & NON_VEX_EXTENSIONS)}"
    elif isa == "avx2":
        if "evex" in kinds:
            return "EVEX (AVX-512) instructions"
    elif isa == "avx512":
        bf16 = sorted(m for m in names if "bf16" in m)
        if bf16:
            return f"AVX512-BF16 instructions {bf16}"
    return None


def owner(name):
    """The ISA copy a function belongs to: its namespace dinfer_kernels::isa_<name>, or the suffix
    .isa_<name> csrc/cpu_isa/isolate_isa.py gives the symbols it localises."""
    m = re.search(r"isa_(generic|avx2|avx512bf16|avx512)\b", name)
    return m.group(1) if m else None


@pytest.mark.skipif(not ON_X86 or shutil.which("objdump") is None, reason="x86-64 with objdump only")
def test_every_function_uses_only_its_isa():
    funcs = functions(EXT.__file__)
    bad = {name: why for name, insns in funcs.items() if (why := violation(owner(name), insns)) is not None}
    assert not bad, "functions outside their ISA:\n" + "\n".join(f"{n}: {w}" for n, w in sorted(bad.items()))
    # The check sees what it must: every copy's launchers, and the wider encodings where allowed.
    by_isa = {}
    for name, insns in funcs.items():
        by_isa.setdefault(owner(name), set()).update(e for e, _ in insns)
    for isa in EXT.cpu_isas_built():
        launchers = [n for n in funcs if n.startswith(f"dinfer_kernels::isa_{isa}::decode_step_cpu(")]
        assert launchers, f"no {isa} copy of decode_step_cpu in the disassembly"
    assert "vex" in by_isa["avx2"] and "evex" in by_isa["avx512"] and "evex" in by_isa["avx512bf16"]


def test_violation_catches_what_it_must():
    """The classifier of the test above, on hand-made instruction lists."""
    assert encoding(["62", "f1", "7d", "48", "ef", "c0"]) == "evex"  # vpxord zmm
    assert encoding(["c5", "fc", "77"]) == "vex" and encoding(["66", "0f", "ef", "c0"]) == "legacy"
    assert violation("generic", [("vex", "vaddps")]) and violation(None, [("legacy", "popcnt")])
    assert violation("avx2", [("evex", "vpxord")]) and not violation("avx2", [("vex", "vfmadd231ps")])
    assert violation("avx512", [("evex", "vdpbf16ps")]) and not violation(
        "avx512bf16", [("evex", "vdpbf16ps")]
    )
    assert owner("std::vector<float>::_M_default_append(unsigned long) [clone .isa_avx512]") == "avx512"
    assert (
        owner("dinfer_kernels::isa_avx512bf16::moe_cpu(dinfer_kernels::MoeParams const&, int)")
        == "avx512bf16"
    )


# ---- the C++ examples on CPUs without AVX-512 / without AVX (QEMU's user-mode emulation) -------------

QEMU = shutil.which("qemu-x86_64")
needs_qemu = pytest.mark.skipif(
    not ON_X86 or QEMU is None, reason="needs qemu-x86_64 (apt-get install qemu-user) on x86-64"
)


def clean_env(**env):
    """This process's environment without its DINFER_CPU_ISA, plus `env`."""
    return {**{k: v for k, v in os.environ.items() if k != "DINFER_CPU_ISA"}, **env}


def under_qemu(cpu, exe, **env):
    return subprocess.run(
        [QEMU, "-cpu", cpu, str(exe)], capture_output=True, text=True, env=clean_env(**env), timeout=300
    )


@needs_qemu
def test_qemu_faults_on_avx512(tmp_path):
    """The emulated Haswell really lacks AVX-512 (else the tests below prove nothing)."""
    src = tmp_path / "zmm.cpp"
    src.write_text('int main() { __asm__ volatile("vpxord %%zmm0, %%zmm0, %%zmm0" ::: "xmm0"); }\n')
    subprocess.run(["c++", str(src), "-o", str(tmp_path / "zmm")], check=True)
    assert under_qemu("Haswell", tmp_path / "zmm").returncode == -4  # SIGILL


@needs_qemu
@pytest.mark.parametrize(
    "cpu,env,isa",
    [
        ("Haswell", {}, "avx2"),
        ("Haswell", {"DINFER_CPU_ISA": "generic"}, "generic"),
        ("qemu64", {}, "generic"),
    ],
)
def test_examples_run_on_older_cpus(cpp_examples, cpu, env, isa):
    proc = under_qemu(cpu, cpp_examples["cpu_isa_example"], **env)
    assert proc.returncode == 0 and proc.stdout.split(":")[0] == isa, proc.stdout + proc.stderr
    for name, exe in cpp_examples.items():
        if name != "cpu_isa_example":
            proc = under_qemu(cpu, exe, **env)
            assert proc.returncode == 0 and proc.stdout.strip() == "OK", f"{name}: {proc.stderr[-2000:]}"


@needs_qemu
def test_asking_for_more_than_the_cpu_has_is_an_error(cpp_examples):
    proc = under_qemu("Haswell", cpp_examples["cpu_isa_example"], DINFER_CPU_ISA="avx512")
    assert proc.returncode == 2
    assert "DINFER_CPU_ISA=avx512: this CPU does not support it (supported: generic, avx2)" in proc.stderr


CROSS, QEMU_ARM = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")


@pytest.mark.skipif(
    CROSS is None or QEMU_ARM is None,
    reason="needs aarch64-linux-gnu-g++ and qemu-aarch64 (apt-get install g++-aarch64-linux-gnu qemu-user)",
)
def test_aarch64_builds_and_runs_the_generic_copy(tmp_path):
    exes = build_cpp_examples(
        tmp_path,
        "-DCMAKE_SYSTEM_NAME=Linux",
        "-DCMAKE_SYSTEM_PROCESSOR=aarch64",
        f"-DCMAKE_CXX_COMPILER={CROSS}",
    )

    def run(exe, **env):
        return subprocess.run(
            [QEMU_ARM, "-L", "/usr/aarch64-linux-gnu", str(exe)],
            capture_output=True,
            text=True,
            env=clean_env(**env),
            timeout=300,
        )

    assert run(exes["cpu_isa_example"]).stdout.strip() == "generic: generic"
    for name, exe in exes.items():
        if name != "cpu_isa_example":
            proc = run(exe)
            assert proc.returncode == 0 and proc.stdout.strip() == "OK", f"{name}: {proc.stderr[-2000:]}"
    proc = run(exes["cpu_isa_example"], DINFER_CPU_ISA="avx2")
    assert (
        proc.returncode == 2 and "DINFER_CPU_ISA=avx2: unknown ISA (this build has: generic;" in proc.stderr
    )
