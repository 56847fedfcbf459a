"""rms_norm backends against the reference (dinfer_kernels/reference/rms_norm.py): every host backend
on fresh random inputs, awkward shapes and strided views, with the precision-tied tolerance; then the
compiled entry point on its own (poisoned outputs, in place, thread-count independence, errors that
name the argument). Without a GPU Triton runs in
the interpreter, in fp32 / fp16 (its bf16 rounding is unreliable); on a GPU every dtype, and inside a
CUDA graph."""

import numpy as np
import pytest
import torch
from conftest import EXT, HAS_GPU, assert_precision
from torch.utils.dlpack import to_dlpack

import dinfer_kernels as dk
from dinfer_kernels import _backend, op_inputs
from dinfer_kernels.reference.rms_norm import rms_norm_reference

BACKENDS = _backend.available_backends("cpu", "rms_norm")
needs_kernel = pytest.mark.skipif("cpu" not in BACKENDS, reason="dinfer_kernels._C lacks the rms_norm kernel")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def case(shape, dtype, scale=3.0):
    a = op_inputs.rms_norm_inputs(shape, dtype=dtype, scale=scale)
    return a["x"], a["weight"]


def interpreter_trap(backend, dtype):
    if backend == "triton" and dtype == torch.bfloat16 and not HAS_GPU:
        pytest.skip("the Triton interpreter's bf16 rounding is unreliable; bf16 runs on a GPU")


def check(out, x, w, eps, name):
    assert out.shape == x.shape and out.dtype == x.dtype
    truth = rms_norm_reference(x, w, eps, compute_dtype=torch.float64)
    assert_precision(out, rms_norm_reference(x, w, eps), truth, name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", [(1, 1), (7, 1), (1, 13), (3, 5, 33), (61, 256), (2, 3, 4, 127), (9, 4096), (97, 1024)]
)
@pytest.mark.usefixtures("host_isa")
def test_matches_reference(backend, dtype, shape):
    interpreter_trap(backend, dtype)
    x, w = case(shape, dtype)
    check(dk.rms_norm(x, w, 1e-5, backend=backend), x, w, 1e-5, f"{backend} {dtype} {shape}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.usefixtures("host_isa")
def test_extreme_rows(backend):
    """A zero row (the statistic is eps alone), tiny and huge magnitudes, a large eps."""
    x = torch.stack([torch.zeros(40), torch.full((40,), 1e-20), torch.randn(40) * 1e18, torch.randn(40)])
    w = torch.rand(40) + 0.5
    for eps in (1e-6, 10.0):
        check(dk.rms_norm(x, w, eps, backend=backend), x, w, eps, f"{backend} eps={eps}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.usefixtures("host_isa")
def test_strided_views(backend, dtype):
    interpreter_trap(backend, dtype)
    big, w = case((6, 80), dtype)
    w = w[:33]
    rows = big[:, 5:38]  # row stride 80
    check(dk.rms_norm(rows, w, 1e-5, backend=backend), rows, w, 1e-5, "row-strided")
    cols = big[:, :33].t().contiguous().t()  # last dim not contiguous
    check(dk.rms_norm(cols, w, 1e-5, backend=backend), cols, w, 1e-5, "column-major")
    w2 = torch.rand(66).to(dtype)[::2]  # strided weight
    check(dk.rms_norm(rows, w2, 1e-5, backend=backend), rows, w2, 1e-5, "strided weight")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.usefixtures("host_isa")
def test_empty(backend):
    for shape in [(0, 8), (3, 0), (2, 0, 5)]:
        x = torch.randn(shape)
        out = dk.rms_norm(x, torch.ones(shape[-1]), 1e-5, backend=backend)
        assert out.shape == x.shape


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    x, w = case((5, 24), torch.float32)
    torch.library.opcheck(torch.ops.dinfer.rms_norm.default, (x, w, 1e-5, backend))


# ---- the compiled entry point ---------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.usefixtures("host_isa")
def test_binding_writes_every_element_whatever_the_threads(dtype):
    x, w = case((333, 256), dtype)  # large enough to split across threads
    ref = rms_norm_reference(x, w, 1e-5)
    results = []
    for threads in (1, 2, 3):
        out = torch.full_like(x, float("nan"))
        EXT.rms_norm(x, w, out, eps=1e-5, num_threads=threads)
        assert torch.isfinite(out).all()
        results.append(out)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    assert_precision(results[0], ref, rms_norm_reference(x, w, 1e-5, compute_dtype=torch.float64), "binding")


@needs_kernel
@pytest.mark.usefixtures("host_isa")
def test_binding_in_place_numpy_and_capsules():
    x, w = case((5, 24), torch.float32)
    want = rms_norm_reference(x, w, 1e-5)
    y = x.clone()
    EXT.rms_norm(y, w, y, eps=1e-5)
    torch.testing.assert_close(y, want, rtol=2e-6, atol=1e-6)
    xn, out = x.numpy(), np.full((5, 24), np.nan, dtype=np.float32)
    EXT.rms_norm(xn, w.numpy(), out, eps=1e-5)
    torch.testing.assert_close(torch.from_numpy(out), want, rtol=2e-6, atol=1e-6)
    out2 = torch.full_like(x, float("nan"))
    EXT.rms_norm(to_dlpack(x), to_dlpack(w), to_dlpack(out2), eps=1e-5)
    assert torch.equal(out2, torch.from_numpy(out))


def good():
    return dict(x=torch.randn(4, 8), weight=torch.randn(8), out=torch.empty(4, 8))


@needs_kernel
@pytest.mark.parametrize(
    "change,name,exc",
    [
        (dict(x=torch.randn(4, 8).to(torch.int32)), "x", TypeError),
        (dict(x=torch.randn(2, 4, 8)), "x", ValueError),
        (dict(x=torch.randn(8, 4).t()), "x", ValueError),
        (dict(x="not an array"), "x", TypeError),
        (dict(weight=torch.randn(8).double()), "weight", TypeError),
        (dict(weight=torch.randn(7)), "weight", ValueError),
        (dict(weight=torch.randn(16)[::2]), "weight", ValueError),
        (dict(out=torch.empty(4, 8).to(torch.bfloat16)), "out", TypeError),
        (dict(out=torch.empty(5, 8)), "out", ValueError),
        (dict(eps=0.0), "eps", ValueError),
        (dict(eps=float("nan")), "eps", ValueError),
        (dict(eps=1e300), "eps", ValueError),
        (dict(eps="1e-5"), "eps", TypeError),
        (dict(num_threads=-1), "num_threads", ValueError),
    ],
)
def test_binding_errors_name_the_argument(change, name, exc):
    a = good()
    a.update(eps=1e-5, num_threads=0)
    a.update(change)
    with pytest.raises(exc, match=f"^{name}:"):
        EXT.rms_norm(a["x"], a["weight"], a["out"], eps=a["eps"], num_threads=a["num_threads"])


@needs_kernel
def test_binding_refuses_read_only_out_and_used_capsules():
    a = good()
    ro = np.zeros((4, 8), dtype=np.float32)
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="^out:.*read-only"):
        EXT.rms_norm(a["x"].numpy(), a["weight"].numpy(), ro, eps=1e-5)
    cap = to_dlpack(a["x"])
    EXT.rms_norm(cap, a["weight"], a["out"], eps=1e-5)
    with pytest.raises(TypeError, match="^x:.*capsule"):
        EXT.rms_norm(cap, a["weight"], a["out"], eps=1e-5)


# ---- on a GPU -------------------------------------------------------------------------------------

GPU_BACKENDS = [b for b in _backend.available_backends("cuda", "rms_norm") if b != "torch"]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 5, 33), (61, 2048), (9, 4097), (1000, 128)])
def test_gpu_matches_reference_and_captures(backend, dtype, shape):
    x, w = case(shape, dtype)
    out = dk.rms_norm(x.cuda(), w.cuda(), 1e-5, backend=backend)
    check(out.cpu(), x, w, 1e-5, f"{backend} {dtype} {shape}")
    xs, ws = x.cuda(), w.cuda()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = dk.rms_norm(xs, ws, 1e-5, backend=backend)
    xs.copy_(xs * 2)
    g.replay()
    torch.testing.assert_close(captured, dk.rms_norm(xs, ws, 1e-5, backend=backend), rtol=0, atol=0)
