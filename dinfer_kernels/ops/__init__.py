"""Public ops, each registered as a torch.library custom op with a fake implementation.

OPS is the package's one list of ops: {op: its module name}. ops/<module>.py defines the op,
reference/<module>.py its reference <op>_reference (the contract), each kernel backend's
<backend>/<module>.py its kernel where it has one, and op_inputs.<op>_inputs the inputs of a valid
call. tests/kernels/test_op_registry.py checks that every op has all of these, a selftest case, a fuzz
generator and a benchmark, and that the package exports exactly these ops.
"""

OPS = {
    "decode_step": "decode",
    "soft_embedding": "soft_embedding",
    "rms_norm": "rms_norm",
    "rope": "rope",
    "attention": "attention",
    "moe": "moe",
}
