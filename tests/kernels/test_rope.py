"""rope backends against the reference (dinfer_kernels/reference/rope.py): every host backend on fresh
random inputs, awkward shapes, partial rotary dims, far positions and strided views, with the
precision-tied tolerance (and, for the host kernel, bit equality: its table is the reference's own
fp32 math); then the compiled entry point on its own (poisoned outputs, in place, thread-count
independence, errors that name the argument). Without a GPU Triton runs in
the interpreter, in fp32 / fp16 (its bf16 rounding is unreliable); on a GPU every dtype, and inside a
CUDA graph."""

import pytest
import torch
from conftest import EXT, HAS_GPU, assert_precision
from torch.utils.dlpack import to_dlpack

import dinfer_kernels as dk
from dinfer_kernels import _backend
from dinfer_kernels.cpu import rope as cpu_rope
from dinfer_kernels.reference.rope import cos_sin_table, rope_reference

BACKENDS = _backend.available_backends("cpu", "rope")
needs_kernel = pytest.mark.skipif("cpu" not in BACKENDS, reason="dinfer_kernels._C lacks the rope kernel")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def interpreter_trap(backend, dtype):
    if backend == "triton" and dtype == torch.bfloat16 and not HAS_GPU:
        pytest.skip("the Triton interpreter's bf16 rounding is unreliable; bf16 runs on a GPU")


def check(out, x, pos, theta, rd, name):
    assert out.shape == x.shape and out.dtype == x.dtype
    truth = rope_reference(x, pos, theta, rd, compute_dtype=torch.float64)
    same = rope_reference(x, pos, theta, rd)
    assert_precision(out, same, truth, name)
    return same


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape,rd,max_pos",
    [
        ((1, 1, 1, 2), None, 1),
        ((2, 7, 3, 16), None, 300),
        ((3, 5, 2, 64), 32, 4096),
        ((1, 13, 5, 10), 2, 50),
        ((2, 97, 4, 128), 64, 9000),
        ((1, 3, 2, 6), 4, 200_000),
    ],
)
@pytest.mark.usefixtures("host_isa")
def test_matches_reference(backend, dtype, shape, rd, max_pos):
    interpreter_trap(backend, dtype)
    x = torch.randn(shape).to(dtype)
    pos = torch.randint(0, max_pos, shape[:2])
    out = dk.rope(x, pos, 10000.0, rd, backend=backend)
    same = check(out, x, pos, 10000.0, rd, f"{backend} {dtype} {shape} rd={rd}")
    if backend == "cpu":
        assert torch.equal(out, same), "the host kernel should equal the reference bit for bit"
    rot = x.shape[-1] if rd is None else rd
    assert torch.equal(out[..., rot:], x[..., rot:]), "the dims past rotary_dim must pass through"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.usefixtures("host_isa")
def test_strided_views_int32_positions_and_other_theta(backend):
    proj = torch.randn(2, 9, 3 * 4 * 16)  # q | k | v of 4 heads x 16, as projected
    k = proj[..., 64:128].view(2, 9, 4, 16)  # a view: row stride 192
    pos = torch.randint(0, 500, (2, 9), dtype=torch.int32)
    check(dk.rope(k, pos, 5e5, backend=backend), k, pos, 5e5, None, "strided")
    t = torch.randn(2, 9, 16, 4).transpose(-1, -2)  # last dim not contiguous
    check(dk.rope(t, pos.long(), 1e4, backend=backend), t, pos.long(), 1e4, None, "transposed")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.usefixtures("host_isa")
def test_empty_and_negative_positions(backend):
    for shape in [(0, 3, 2, 8), (2, 0, 2, 8), (2, 3, 0, 8)]:
        x = torch.randn(shape)
        assert dk.rope(x, torch.zeros(shape[:2], dtype=torch.int64), 1e4, backend=backend).shape == x.shape
    with pytest.raises(ValueError, match="^positions:"):
        dk.rope(torch.randn(1, 2, 1, 8), torch.tensor([[3, -1]]), 1e4, backend=backend)


@needs_kernel
@pytest.mark.usefixtures("host_isa")
def test_table_grows_and_far_positions_get_their_own():
    x = torch.randn(1, 4, 2, 8)
    theta = 1234.5  # a (theta, rd) no other test uses
    for top in (10, 300, 5000, cpu_rope.kMaxCachedPositions + 7):
        pos = torch.tensor([[0, 1, top // 2, top]])
        assert torch.equal(dk.rope(x, pos, theta, backend="cpu"), rope_reference(x, pos, theta))
    assert cpu_rope.cached_table(theta, 8, 1).shape[0] == 8192  # the far call did not grow it


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    x = torch.randn(2, 5, 3, 8)
    torch.library.opcheck(torch.ops.dinfer.rope.default, (x, torch.randint(0, 40, (2, 5)), 1e4, 6, backend))


# ---- the compiled entry point ---------------------------------------------------------------------


def table(n, rd, theta=1e4):
    return cos_sin_table(torch.arange(n), theta, rd)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.usefixtures("host_isa")
def test_binding_writes_every_element_whatever_the_threads(dtype):
    x = torch.randn(3, 50, 8, 64).to(dtype)  # large enough to split across threads
    pos = torch.randint(0, 1000, (3, 50))
    want = rope_reference(x, pos, 1e4, 48)
    for threads in (1, 2, 3):
        out = torch.full_like(x, float("nan"))
        EXT.rope(x, pos, table(1000, 48), out, num_threads=threads)
        assert torch.equal(out, want)


@needs_kernel
@pytest.mark.usefixtures("host_isa")
def test_binding_in_place_numpy_and_capsules():
    x = torch.randn(2, 5, 3, 8)
    pos = torch.randint(0, 64, (2, 5))
    want = rope_reference(x, pos, 1e4, 6)
    y = x.clone()
    EXT.rope(y, pos, table(64, 6), y)
    assert torch.equal(y, want)
    out = torch.full_like(x, float("nan")).numpy()
    EXT.rope(x.numpy(), pos.numpy(), table(64, 6).numpy(), out)
    assert torch.equal(torch.from_numpy(out), want)
    out2 = torch.full_like(x, float("nan"))
    EXT.rope(to_dlpack(x), to_dlpack(pos), to_dlpack(table(64, 6)), to_dlpack(out2))
    assert torch.equal(out2, want)


def good():
    return dict(
        x=torch.randn(2, 3, 4, 8),
        positions=torch.randint(0, 10, (2, 3)),
        cos_sin=table(10, 8),
        out=torch.empty(2, 3, 4, 8),
        num_threads=0,
    )


@needs_kernel
@pytest.mark.parametrize(
    "change,name,exc",
    [
        (dict(x=torch.randn(2, 3, 4, 8).double()), "x", TypeError),
        (dict(x=torch.randn(2, 3, 32)), "x", ValueError),
        (dict(x=torch.randn(2, 3, 8, 4).transpose(-1, -2)), "x", ValueError),
        (dict(positions=torch.randint(0, 10, (2, 3), dtype=torch.int32)), "positions", TypeError),
        (dict(positions=torch.randint(0, 10, (3, 2))), "positions", ValueError),
        (dict(positions=torch.randint(0, 10, (3, 2)).t()), "positions", ValueError),
        (dict(positions=torch.tensor([[0, 1, 2], [3, 10, 4]])), "positions", ValueError),
        (dict(positions=torch.tensor([[0, 1, 2], [3, -1, 4]])), "positions", ValueError),
        (dict(cos_sin=table(10, 8).double()), "cos_sin", TypeError),
        (dict(cos_sin=table(10, 8)[None]), "cos_sin", ValueError),
        (dict(cos_sin=torch.randn(10, 7)), "cos_sin", ValueError),
        (dict(cos_sin=torch.randn(10, 10)), "cos_sin", ValueError),
        (dict(cos_sin=torch.randn(10, 16)[:, ::2]), "cos_sin", ValueError),
        (dict(out=torch.empty(2, 3, 4, 8).half()), "out", TypeError),
        (dict(out=torch.empty(2, 3, 4, 9)), "out", ValueError),
        (dict(num_threads=5000), "num_threads", ValueError),
    ],
)
def test_binding_errors_name_the_argument(change, name, exc):
    a = good()
    a.update(change)
    with pytest.raises(exc, match=f"^{name}:"):
        EXT.rope(a["x"], a["positions"], a["cos_sin"], a["out"], num_threads=a["num_threads"])


# ---- on a GPU -------------------------------------------------------------------------------------

GPU_BACKENDS = [b for b in _backend.available_backends("cuda", "rope") if b != "torch"]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape,rd,max_pos",
    [
        ((2, 7, 3, 16), None, 300),
        ((3, 5, 2, 128), 64, 9000),
        ((1, 97, 16, 128), None, 4096),
        ((2, 3, 5, 10), 2, 50),
    ],
)
def test_gpu_matches_reference_and_captures(backend, dtype, shape, rd, max_pos):
    x = torch.randn(shape).to(dtype)
    pos = torch.randint(0, max_pos, shape[:2])
    out = dk.rope(x.cuda(), pos.cuda(), 10000.0, rd, backend=backend)
    check(out.cpu(), x, pos, 10000.0, rd, f"{backend} {dtype} {shape}")
    xs, ps = x.cuda(), pos.cuda()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = dk.rope(xs, ps, 10000.0, rd, backend=backend)
    ps.add_(1)  # new positions, same graph
    g.replay()
    torch.testing.assert_close(captured, dk.rope(xs, ps, 10000.0, rd, backend=backend), rtol=0, atol=0)
