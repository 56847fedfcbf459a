"""The one list of ops is complete. dinfer_kernels.ops.OPS names every op the package registers and
exports, and each op in it has an op module, a reference, an input factory, a selftest case, a fuzz
generator and a benchmark; its compiled kernel families (OP_TABLE's rows with compiled kernels, which
CMakeLists.txt reads too) have their sources, bindings and backend modules, and are what _C builds."""

import ast
import importlib
import inspect
from pathlib import Path

import pytest
import torch

import dinfer_kernels as dk
from dinfer_kernels import _backend, op_inputs, selftest
from dinfer_kernels.ops import COMPILED, OPS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dinfer_kernels"


def defined_functions(path):
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}


def test_the_package_registers_and_exports_exactly_the_listed_ops():
    registered = {
        n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("dinfer::")
    }
    assert registered == set(OPS)
    for op, module in OPS.items():
        assert op in dk.__all__, f"{op}: not exported by dinfer_kernels"
        assert getattr(dk, op).__module__ == f"dinfer_kernels.ops.{module}", op
    # the resolver found a kernel backend module for each of these ops and for no other
    assert set(_backend._KERNELS) == set(OPS)


@pytest.mark.parametrize("op", list(OPS))
def test_every_op_has_a_reference_an_input_factory_and_a_selftest_case_on_them(op):
    """The selftest case builds its call with the op's factory and passes the factory's arguments
    by name to the op and to its reference: running it proves that they fit both signatures."""
    reference = getattr(importlib.import_module(f"dinfer_kernels.reference.{OPS[op]}"), f"{op}_reference")
    assert callable(reference)
    assert op_inputs.INPUTS[op] is getattr(op_inputs, f"{op}_inputs")
    case = selftest.CASES[op]
    assert f"op_inputs.{op}_inputs(" in inspect.getsource(case), (
        f"selftest's {case.__name__} skips the factory"
    )
    shape = selftest._shapes("cpu", quick=True)[op]
    outs, sames, truths, _ = case("torch", "cpu", torch.float32, **shape)
    assert len(outs) == len(sames) == len(truths) > 0


def test_every_op_has_a_fuzz_generator():
    generators = defined_functions(ROOT / "tests/kernels/test_fuzz_ops.py")
    assert {f"gen_{op}" for op in OPS} <= generators


@pytest.mark.parametrize("op", list(OPS))
def test_every_op_has_a_benchmark_built_on_its_input_factory(op):
    benches = [
        p.name
        for p in sorted((ROOT / "bench_kernels").glob("bench_*.py"))
        if f"{op}_inputs(" in p.read_text()
    ]
    assert benches, f"no bench_kernels/bench_*.py builds {op}'s inputs with op_inputs.{op}_inputs"


def test_every_kernel_family_has_its_sources_bindings_and_backend_modules():
    for op, kernels in COMPILED.items():
        family = OPS[op]
        for backend in kernels:
            assert (PACKAGE / backend / f"{family}.py").is_file(), (
                f"{op}: no dinfer_kernels/{backend}/{family}.py"
            )
        assert (ROOT / "csrc" / family / f"{family}_cpu.cpp").is_file()
        assert (ROOT / "csrc" / family / f"{family}.cu").is_file() == ("cuda" in kernels), op
        assert (ROOT / "csrc/bindings" / f"{family}_bindings.cpp").is_file()
    # and every kernel source in csrc/ belongs to a listed family
    families = {OPS[op] for op in COMPILED}
    for source in (ROOT / "csrc").glob("*/*_cpu.cpp"):
        assert source.parent.name in families, f"{source.relative_to(ROOT)}: not a family of OP_TABLE"
    ext = _backend.compiled()
    if ext is not None:  # CMakeLists.txt read the same table
        assert ext.host_kernels() == list(COMPILED)


def test_every_backend_module_belongs_to_a_listed_op():
    modules = set(OPS.values())
    for backend in ("cpu", "cuda", "triton"):
        for path in (PACKAGE / backend).glob("*.py"):
            assert path.stem == "__init__" or path.stem in modules, (
                f"dinfer_kernels/{backend}/{path.name}: no op"
            )
