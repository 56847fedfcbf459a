"""Public ops, each registered as a torch.library custom op with a fake implementation.

OP_TABLE is the package's one list of ops (OPS: {op: its module name}; COMPILED: its compiled kernel
families, which CMakeLists.txt reads from this file). ops/<module>.py defines the op,
reference/<module>.py its reference <op>_reference (the contract), each kernel backend's
<backend>/<module>.py its kernel where it has one, and op_inputs.<op>_inputs the inputs of a valid
call. tests/kernels/test_op_registry.py checks that every op has all of these, a selftest case, a fuzz
generator and a benchmark, and that the package exports exactly these ops.
"""

# The one list of ops: (op, module, compiled kernels), one row per line in exactly this form, because
# CMakeLists.txt reads these lines too. "module" names ops/<module>.py, reference/<module>.py and each
# kernel backend's <backend>/<module>.py. "compiled kernels" is "" (no compiled family of its own: torch
# and Triton, and a cpu module where it runs other families' host kernels, _backend.HOST_COMPOSED), "cpu" or
# "cpu cuda": the op is then a compiled kernel family, csrc/<module>/ holding <module>_cpu.cpp
# (compiled once per host ISA) and, with "cuda", <module>.cu, bound by
# csrc/bindings/<module>_bindings.cpp (register_<module>), its launchers dinfer_kernels::<op>_cpu (and
# <op>_cuda) taking a <Op>Params (the op's name in CamelCase; csrc/include/dinfer_kernels/<module>.h).
OP_TABLE = (
    ("decode_step", "decode", "cpu cuda"),
    ("soft_embedding", "soft_embedding", ""),
    ("rms_norm", "rms_norm", "cpu"),
    ("rope", "rope", "cpu"),
    ("qk_rope", "qk_rope", ""),
    ("attention", "attention", "cpu cuda"),
    ("moe", "moe", "cpu cuda"),
)
OPS = {op: module for op, module, _ in OP_TABLE}
# {op: its compiled kernels} of the compiled kernel families, in the table's order (_C's order too).
COMPILED = {op: tuple(kernels.split()) for op, _, kernels in OP_TABLE if kernels}
