"""qk_rope backends against the reference (dinfer_kernels/reference/qk_rope.py), which is the composition
the models ran before (rms_norm then rope of q and of k): every host backend on random inputs, awkward
shapes (T = 1, primes, Hq != Hk, no q heads, rotary_dim < D as LLaDA2's D / 2), with and without the
QK-norm, with poisoned outputs, strided views, positions at the table's ends; the host backend equal
bit for bit to rms_norm then rope on the host kernels (the CPU engine's path before this op); the
table; errors that name the argument. Without a GPU Triton runs in the interpreter, in fp32 / fp16 (its
bf16 rounding is unreliable); on a GPU every dtype, and inside a CUDA graph."""

import pytest
import torch
from conftest import HAS_GPU, assert_precision

import dinfer_kernels as dk
from dinfer_kernels import _backend, op_inputs
from dinfer_kernels.reference.qk_rope import qk_rope_reference
from dinfer_kernels.reference.rms_norm import rms_norm_reference
from dinfer_kernels.reference.rope import cos_sin_table, rope_reference

BACKENDS = _backend.available_backends("cpu", "qk_rope")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [  # B, T, Hq, Hk, D, rotary_dim
    (1, 1, 1, 1, 2, None),
    (2, 7, 3, 1, 16, None),
    (3, 5, 4, 2, 64, 32),
    (1, 13, 5, 3, 10, 2),
    (2, 11, 16, 4, 128, 64),  # LLaDA2-mini's heads
    (1, 3, 2, 5, 6, 4),
    (2, 3, 0, 3, 8, 4),
]


def interpreter_trap(backend, dtype):
    if backend == "triton" and dtype == torch.bfloat16 and not HAS_GPU:
        pytest.skip("the Triton interpreter's bf16 rounding is unreliable; bf16 runs on a GPU")


@pytest.fixture
def poisoned(monkeypatch):
    """The op's output allocations hold NaN, so an element it leaves unwritten fails the comparison."""
    empty = torch.empty

    def poison(*a, **k):
        t = empty(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poison)


def check(out, a, name):
    same = qk_rope_reference(**a)
    truth = qk_rope_reference(**a, compute_dtype=torch.float64)
    for got, want, true, x in zip(out, same, truth, (a["q"], a["k"])):
        assert got.shape == x.shape and got.dtype == x.dtype
        assert_precision(got, want, true, name)
    return same


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.usefixtures("host_isa", "poisoned")
def test_matches_reference(backend, dtype, norm, shape):
    interpreter_trap(backend, dtype)
    B, T, Hq, Hk, D, rd = shape
    a = op_inputs.qk_rope_inputs(B, T, Hq, Hk, D, rotary_dim=rd, norm=norm, dtype=dtype, max_position=5000)
    out = dk.qk_rope(**a, backend=backend)
    same = check(out, a, f"{backend} {dtype} {shape} norm={norm}")
    if not norm:  # the dims past rotary_dim pass through
        rot = D if rd is None else rd
        assert torch.equal(out[0][..., rot:], a["q"][..., rot:]) and torch.equal(
            out[1][..., rot:], a["k"][..., rot:]
        )
    if backend == "torch":
        assert all(torch.equal(o, s) for o, s in zip(out, same))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_reference_is_rms_norm_then_rope(dtype, norm, shape):
    """The spec is the models' old composition, bit for bit: rope_reference's angles are the table's."""
    B, T, Hq, Hk, D, rd = shape
    a = op_inputs.qk_rope_inputs(B, T, Hq, Hk, D, rotary_dim=rd, norm=norm, dtype=dtype, theta=1e4)
    for x, w, got in zip((a["q"], a["k"]), (a.get("q_norm"), a.get("k_norm")), qk_rope_reference(**a)):
        if norm:
            x = rms_norm_reference(x, w, a["eps"])
        assert torch.equal(got, rope_reference(x, a["positions"], 1e4, rd))


@pytest.mark.skipif("cpu" not in BACKENDS, reason="dinfer_kernels._C lacks the host kernels")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.usefixtures("host_isa")
def test_host_backend_is_the_host_kernels_composition(dtype, shape):
    """What the CPU engine ran before this op (dk.rms_norm then dk.rope on the host kernels), bit for
    bit, also on strided views (LLaDA2's q and k are views of one projection)."""
    B, T, Hq, Hk, D, rd = shape
    a = op_inputs.qk_rope_inputs(B, T, Hq, Hk, D, rotary_dim=rd, dtype=dtype, theta=1e4, max_position=300)
    qkv = torch.cat([a["q"], a["k"], a["k"]], dim=2)  # [B, T, Hq + 2 Hk, D]: q and k as views
    q, k = qkv[:, :, :Hq], qkv[:, :, Hq : Hq + Hk]
    for norm in (True, False):
        kw = dict(q_norm=a["q_norm"], k_norm=a["k_norm"], eps=a["eps"]) if norm else {}
        got = dk.qk_rope(q, k, a["positions"], a["table"], backend="cpu", **kw)
        for x, w, g in zip((q, k), (a["q_norm"], a["k_norm"]), got):
            if norm:
                x = dk.rms_norm(x, w, a["eps"], backend="cpu")
            assert torch.equal(g, dk.rope(x, a["positions"], 1e4, rd, backend="cpu"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.usefixtures("poisoned")
def test_table_ends_int32_positions_strided_and_empty(backend):
    a = op_inputs.qk_rope_inputs(2, 5, 3, 2, 16, rotary_dim=8, max_position=40)
    a["positions"][0, :2] = torch.tensor([0, 39])  # the table's first and last rows
    a["positions"] = a["positions"].to(torch.int32)
    proj = torch.randn(2, 5, 7, 16)  # q | k heads of one projection: views with a head stride
    a.update(q=proj[:, :, :3], k=proj[:, :, 3:5])
    check(dk.qk_rope(**a, backend=backend), a, f"{backend} views")
    for B, T in ((0, 3), (2, 0)):
        b = op_inputs.qk_rope_inputs(B, T, 2, 1, 8)
        out = dk.qk_rope(**b, backend=backend)
        assert [o.shape for o in out] == [b["q"].shape, b["k"].shape]


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    a = op_inputs.qk_rope_inputs(2, 5, 3, 2, 8, rotary_dim=4, max_position=40)
    args = (a["q"], a["k"], a["positions"], a["table"])
    for norms in ((a["q_norm"], a["k_norm"], a["eps"]), (None, None, 0.0)):
        torch.library.opcheck(torch.ops.dinfer.qk_rope.default, args + norms + (backend,))


def test_compile_fullgraph():
    a = op_inputs.qk_rope_inputs(2, 5, 3, 2, 8, rotary_dim=4, max_position=40)

    def f(q, k):
        return dk.qk_rope(
            q, k, a["positions"], a["table"], q_norm=a["q_norm"], k_norm=a["k_norm"], eps=a["eps"]
        )

    want = f(a["q"], a["k"])
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(a["q"], a["k"]), want)


def test_rope_table_is_the_references_table():
    table = dk.rope_table(5e5, 12, 33)
    assert table.shape == (33, 12) and table.dtype == torch.float32 and table.is_contiguous()
    assert torch.equal(table, cos_sin_table(torch.arange(33), 5e5, 12))
    assert dk.rope_table(1e4, 4, 0).shape == (0, 4)
    for call, name in [
        (lambda: dk.rope_table(0.0, 4, 8), "theta"),
        (lambda: dk.rope_table(1e4, 3, 8), "rotary_dim"),
        (lambda: dk.rope_table(1e4, 0, 8), "rotary_dim"),
        (lambda: dk.rope_table(1e4, 4, -1), "max_positions"),
        (lambda: dk.rope_table(1e4, 4, 8.0), "max_positions"),
    ]:
        with pytest.raises((TypeError, ValueError), match=f"^{name}:"):
            call()


def bad_calls():
    a = op_inputs.qk_rope_inputs(2, 3, 4, 2, 8, rotary_dim=4, max_position=10)
    q, k, pos, table = a["q"], a["k"], a["positions"], a["table"]
    w = dict(q_norm=a["q_norm"], k_norm=a["k_norm"], eps=a["eps"])
    return [
        ((q[0], k, pos, table), {}, "q"),
        ((q.double(), k, pos, table), {}, "q"),
        ((q, k.half(), pos, table), {}, "k"),
        ((q, k[:, :2], pos, table), {}, "k"),
        ((q, torch.randn(2, 3, 2, 6), pos, table), {}, "k"),
        ((q, k, pos.float(), table), {}, "positions"),
        ((q, k, pos[:1], table), {}, "positions"),
        ((q, k, torch.tensor([[0, 1, 10], [0, 1, 2]]), table), {}, "positions"),  # past the table
        ((q, k, torch.tensor([[0, -1, 1], [0, 1, 2]]), table), {}, "positions"),
        ((q, k, pos, table.double()), {}, "table"),
        ((q, k, pos, table[None]), {}, "table"),
        ((q, k, pos, torch.zeros(10, 3)), {}, "table"),
        ((q, k, pos, torch.zeros(10, 10)), {}, "table"),  # rotary_dim > D
        ((q, k, pos, torch.zeros(10, 8)[:, ::2]), {}, "table"),
        ((q, k, pos, table.to("meta")), {}, "table"),
        ((q, k, pos, table), dict(w, k_norm=None), "q_norm, k_norm"),
        ((q, k, pos, table), dict(w, q_norm=torch.ones(7)), "q_norm"),
        ((q, k, pos, table), dict(w, k_norm=torch.ones(8).half()), "k_norm"),
        ((q, k, pos, table), dict(w, eps=0.0), "eps"),
        ((q, k, pos, table), dict(w, eps=None), "eps"),
        ((q, k, pos, table), dict(backend="gpu"), "backend"),
    ]


@pytest.mark.parametrize("args,kw,name", bad_calls(), ids=lambda v: v if isinstance(v, str) else "")
def test_errors_name_the_argument(args, kw, name):
    with pytest.raises((TypeError, ValueError), match=f"^{name}:"):
        dk.qk_rope(*args, **kw)


def test_auto_on_the_host_runs_the_host_kernels_where_both_win():
    fast = set(_backend.cpu_fast_ops())
    want = "cpu" if "cpu" in BACKENDS and {"rms_norm", "rope"} <= fast else "torch"
    assert _backend.resolve("auto", torch.device("cpu"), "qk_rope") == want


# ---- on a GPU -------------------------------------------------------------------------------------

GPU_BACKENDS = [b for b in _backend.available_backends("cuda", "qk_rope") if b != "torch"]
GPU_SHAPES = SHAPES + [(2, 97, 16, 4, 128, 64), (1, 70, 16, 16, 128, 128)]  # and LLaDA-MoE's


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_matches_reference_and_captures(backend, dtype, norm, shape):
    B, T, Hq, Hk, D, rd = shape
    a = op_inputs.qk_rope_inputs(B, T, Hq, Hk, D, rotary_dim=rd, norm=norm, dtype=dtype, max_position=9000)
    dev = {n: v.cuda() if isinstance(v, torch.Tensor) else v for n, v in a.items()}
    out = dk.qk_rope(**dev, backend=backend)
    check([o.cpu() for o in out], a, f"{backend} {dtype} {shape} norm={norm}")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = dk.qk_rope(**dev, backend=backend)
    dev["positions"].copy_(torch.randint(0, 9000, (B, T)))  # new positions, same graph
    g.replay()
    for c, e in zip(captured, dk.qk_rope(**dev, backend=backend)):
        torch.testing.assert_close(c, e, rtol=0, atol=0)
