"""The compiled MoE entry on its own: dinfer_kernels._C.moe over DLPack. Its argument checks run
before the device is looked at, so they are tested with NumPy (host) arrays; host arrays run the host
kernel (poisoned outputs, against the reference, thread-count independence, no CUDA limits). With a
GPU: agreement with the reference, bit-reproducibility and the workspace checks. Numerical coverage of
every backend is in tests/kernels/test_moe.py (it runs every available backend)."""

import numpy as np
import pytest
import torch
from conftest import EXT, assert_precision

from dinfer_kernels.reference.moe import moe_reference

pytestmark = pytest.mark.skipif(
    EXT is None or "moe" not in getattr(EXT, "host_kernels", list)(),
    reason="dinfer_kernels._C was built without the MoE kernels",
)
needs_cuda_build = pytest.mark.skipif(
    EXT is None or not hasattr(EXT, "moe_workspace_bytes"),
    reason="dinfer_kernels._C was built without the CUDA kernels",
)

T, H, E, I, K = 5, 24, 8, 16, 2
ORDER = [
    "hidden",
    "router_weight",
    "router_logits",
    "w13",
    "w2",
    "top_k",
    "renormalize",
    "scoring",
    "expert_bias",
    "num_groups",
    "topk_groups",
    "routed_scaling",
    "expert_offset",
    "out",
]


def host_args(dtype=np.float32):
    rng = np.random.default_rng(0)
    return dict(
        hidden=rng.standard_normal((T, H)).astype(dtype),
        router_weight=rng.standard_normal((E, H)).astype(np.float32),
        router_logits=None,
        w13=rng.standard_normal((E, 2 * I, H)).astype(dtype),
        w2=rng.standard_normal((E, H, I)).astype(dtype),
        top_k=K,
        renormalize=False,
        scoring="softmax",
        expert_bias=np.zeros(E, np.float32),
        num_groups=1,
        topk_groups=1,
        routed_scaling=1.0,
        expert_offset=0,
        out=np.zeros((T, H), dtype),
    )


def call(a, **kw):
    """The binding on a dict of arguments (topk_ids / topk_weights, when in it, by keyword)."""
    given = {k: a[k] for k in ("topk_ids", "topk_weights") if k in a}
    EXT.moe(*[a[k] for k in ORDER], **given, **kw)


def reference_of(a):
    """The reference's output for a dict of host arguments (NumPy)."""
    t = {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in a.items()}
    return moe_reference(
        t["hidden"],
        t["router_weight"],
        t["w13"],
        t["w2"],
        t["top_k"],
        t["renormalize"],
        t["expert_bias"],
        t["expert_offset"],
        router_logits=t["router_logits"],
        topk_ids=t.get("topk_ids"),
        topk_weights=t.get("topk_weights"),
        scoring=t["scoring"],
        num_groups=t["num_groups"],
        topk_groups=t["topk_groups"],
        routed_scaling=t["routed_scaling"],
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.usefixtures("host_isa")
def test_host_arrays_run_the_host_kernel(dtype, threads):
    a = host_args(dtype)
    a["out"] = np.full((T, H), np.nan, dtype)
    call(a, num_threads=threads)
    assert np.isfinite(a["out"]).all()
    want = reference_of(a)
    truth = moe_reference(
        *[torch.from_numpy(a[k]).double() for k in ("hidden", "router_weight", "w13", "w2")],
        K,
        False,
        torch.from_numpy(a["expert_bias"]),
        compute_dtype=torch.float64,
    )
    assert_precision(torch.from_numpy(a["out"]), want, truth, "host moe")
    first = a["out"].copy()
    call(a, num_threads=1)
    assert np.array_equal(a["out"], first), "the result must not depend on the thread count"


def _readonly(x):
    x = x.copy()
    x.flags.writeable = False
    return x


BAD = [
    ("hidden", lambda a: a["hidden"].astype(np.float64), TypeError),
    ("hidden", lambda a: a["hidden"][0], ValueError),
    ("hidden", lambda a: np.asfortranarray(a["hidden"]), ValueError),
    ("hidden", lambda a: [[1.0]], TypeError),
    ("w13", lambda a: a["w13"].astype(np.float16), TypeError),
    ("w13", lambda a: a["w13"][:, :-1], ValueError),
    ("w13", lambda a: a["w13"][:, :, :-1], ValueError),
    ("w13", lambda a: a["w13"][:0], ValueError),
    ("w13", lambda a: a["w13"][None], ValueError),
    ("w2", lambda a: a["w2"][:, :, :-1], ValueError),
    ("w2", lambda a: a["w2"].astype(np.float16), TypeError),
    ("w2", lambda a: a["w2"].transpose(0, 2, 1).copy().transpose(0, 2, 1), ValueError),
    ("router_weight", lambda a: a["router_weight"][:, :-1], ValueError),
    ("router_weight", lambda a: a["router_weight"].astype(np.int32), TypeError),
    ("router_weight", lambda a: a["router_weight"].astype(np.float16), TypeError),  # hidden is fp32
    ("expert_bias", lambda a: a["expert_bias"][:-1], ValueError),
    ("expert_bias", lambda a: a["expert_bias"].astype(np.float16), TypeError),
    ("out", lambda a: a["out"][:-1], ValueError),
    ("out", lambda a: a["out"].astype(np.float16), TypeError),
    ("out", lambda a: _readonly(a["out"]), ValueError),
    ("top_k", lambda a: 0, ValueError),
    ("top_k", lambda a: E + 1, ValueError),
    ("top_k", lambda a: 2.0, TypeError),
    ("top_k", lambda a: True, TypeError),
    ("renormalize", lambda a: 1, TypeError),
    ("scoring", lambda a: "relu", ValueError),
    ("scoring", lambda a: 0, TypeError),
    ("num_groups", lambda a: 0, ValueError),
    ("num_groups", lambda a: 3, ValueError),
    ("num_groups", lambda a: E + 8, ValueError),
    ("topk_groups", lambda a: 2, ValueError),  # num_groups is 1
    ("routed_scaling", lambda a: float("nan"), ValueError),
    ("routed_scaling", lambda a: 1e39, ValueError),  # not finite in fp32
    ("routed_scaling", lambda a: "2", TypeError),
    ("expert_offset", lambda a: -1, ValueError),
    ("expert_offset", lambda a: 1, ValueError),  # w13 holds all E experts
    ("expert_offset", lambda a: 1.0, TypeError),
]


@pytest.mark.parametrize("name,make,exc", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_binding_errors_name_the_argument(name, make, exc):
    a = host_args()
    a[name] = make(a)
    with pytest.raises(exc, match=rf"^{name}\b"):
        call(a)


def test_router_source_and_group_errors():
    a = host_args()
    a["router_logits"] = np.zeros((T, E), np.float32)  # both given
    with pytest.raises(ValueError, match=r"^router_weight\b.*exactly one"):
        call(a)
    a["router_weight"] = None
    a["router_logits"] = None  # neither
    with pytest.raises(ValueError, match=r"^router_weight\b.*exactly one"):
        call(a)
    a["router_logits"] = np.zeros((T + 1, E), np.float32)  # (E + 1 columns: a router of more experts)
    with pytest.raises(ValueError, match=r"^router_logits\b"):
        call(a)
    a["router_logits"] = np.zeros((T, E), np.float16)
    with pytest.raises(TypeError, match=r"^router_logits\b"):
        call(a)
    a = host_args()
    a.update(num_groups=4, topk_groups=1, top_k=3)  # 1 group of 2 experts: at most 2
    with pytest.raises(ValueError, match=r"^top_k\b"):
        call(a)
    a = host_args()
    a.update(w13=a["w13"][2:5], w2=a["w2"][2:5], expert_offset=E - 2)  # past the router's experts
    with pytest.raises(ValueError, match=r"^expert_offset\b"):
        call(a)
    a.update(router_weight=a["router_weight"][:2], expert_bias=None)  # fewer than the local experts
    with pytest.raises(ValueError, match=r"^router_weight\b"):
        call(a)


def given_args(El=3, offset=2, k=3, dtype=np.float32):
    """Host arguments of a given top-k on experts [offset, offset + El): ids over [-1, E + 1]."""
    rng = np.random.default_rng(2)
    a = host_args(dtype)
    a.update(
        router_weight=None,
        expert_bias=None,
        w13=a["w13"][offset : offset + El].copy(),
        w2=a["w2"][offset : offset + El].copy(),
        expert_offset=offset,
        top_k=k,
        topk_ids=rng.integers(-1, E + 2, (T, k)).astype(np.int32),
        topk_weights=rng.random((T, k)).astype(np.float32),
        out=np.full((T, H), np.nan, dtype),
    )
    return a


@pytest.mark.parametrize("El,offset,k", [(3, 2, 3), (1, 0, 1), (2, E - 2, 4)])
@pytest.mark.usefixtures("host_isa")
def test_given_topk_on_local_experts(El, offset, k):
    a = given_args(El, offset, k)
    call(a, num_threads=2)
    assert np.isfinite(a["out"]).all()
    t = {n: torch.from_numpy(a[n]) for n in ("hidden", "w13", "w2", "topk_ids", "topk_weights")}
    truth = moe_reference(
        t["hidden"].double(),
        None,
        t["w13"].double(),
        t["w2"].double(),
        k,
        expert_offset=offset,
        compute_dtype=torch.float64,
        topk_ids=t["topk_ids"],
        topk_weights=t["topk_weights"],
    )
    assert_precision(torch.from_numpy(a["out"]), reference_of(a), truth, "host moe, given top-k")


def test_given_topk_errors_name_the_argument():
    for name, change, exc in [
        ("topk_ids", lambda a: a.update(topk_ids=a["topk_ids"].astype(np.int64)), TypeError),
        ("topk_ids", lambda a: a.update(topk_ids=a["topk_ids"][:, :2]), ValueError),
        ("topk_weights", lambda a: a.update(topk_weights=a["topk_weights"][:-1]), ValueError),
        ("topk_weights", lambda a: a.update(topk_weights=a["topk_weights"].astype(np.float16)), TypeError),
        ("topk_ids", lambda a: a.update(topk_weights=None), ValueError),
        ("router_weight", lambda a: a.update(router_weight=np.zeros((E, H), np.float32)), ValueError),
        ("num_groups", lambda a: a.update(num_groups=2), ValueError),
        ("expert_offset", lambda a: a.update(expert_offset=-1), ValueError),
    ]:
        a = given_args()
        change(a)
        with pytest.raises(exc, match=rf"^{name}\b"):
            call(a)


@pytest.mark.usefixtures("host_isa")
def test_host_kernel_has_no_cuda_limits():
    """More than 512 experts and top_k past 32 (the CUDA kernels' limits) run on the host."""
    rng = np.random.default_rng(1)
    for E_, k in ((40, 33), (600, 3)):
        a = host_args()
        a.update(
            w13=(rng.standard_normal((E_, 2 * I, H)) / H**0.5).astype(np.float32),
            w2=(rng.standard_normal((E_, H, I)) / I**0.5).astype(np.float32),
            router_weight=(rng.standard_normal((E_, H)) * 0.2).astype(np.float32),
            expert_bias=None,
            top_k=k,
            out=np.full((T, H), np.nan, np.float32),
        )
        call(a)
        truth = moe_reference(
            *[torch.from_numpy(a[n]).double() for n in ("hidden", "router_weight", "w13", "w2")],
            k,
            compute_dtype=torch.float64,
        )
        assert_precision(torch.from_numpy(a["out"]), reference_of(a), truth, f"host moe E={E_} k={k}")


# ---- the shared expert and FP8 weights ---------------------------------------------------------------


def torch_case(T_, H_, E_, I_, k, S, dtype, seed=0, device="cpu"):
    """hidden, router and the experts (w13, w2, shared_w13, shared_w2; the shared pair None when S is 0)
    in `dtype`, random with ~unit outputs."""
    g = torch.Generator().manual_seed(seed)
    w = dict(
        hidden=torch.randn(T_, H_, generator=g),
        router_weight=torch.randn(E_, H_, generator=g) * 0.2,
        w13=torch.randn(E_, 2 * I_, H_, generator=g) / H_**0.5,
        w2=torch.randn(E_, H_, I_, generator=g) / I_**0.5,
        shared_w13=torch.randn(2 * S, H_, generator=g) / H_**0.5 if S else None,
        shared_w2=torch.randn(H_, S, generator=g) / max(S, 1) ** 0.5 if S else None,
    )
    return {
        n: None if t is None else t.to(dtype if n != "router_weight" else torch.float32).to(device)
        for n, t in w.items()
    }


def quantized(case):
    """The case's expert weights as FP8 with block scales (dk.fp8_block_quantize), and the weights
    those stand for in hidden's dtype (what the FP8 call must equal)."""
    from dinfer_kernels import fp8_block_dequantize, fp8_block_quantize

    dt = case["hidden"].dtype
    q, deq = dict(case), dict(case)
    for name, halves in (("w13", 2), ("w2", 1), ("shared_w13", 2), ("shared_w2", 1)):
        if case[name] is None:
            continue
        w, scale = fp8_block_quantize(case[name].float(), halves=halves)
        q[name], q[name + "_scale"] = w, scale
        deq[name] = fp8_block_dequantize(w, scale, dt, halves=halves)
    return q, deq


OPTIONAL = ("shared_w13", "shared_w2", "w13_scale", "w2_scale", "shared_w13_scale", "shared_w2_scale")


def call_torch(c, k, threads=0, **kw):
    """The binding on a dict of torch host tensors (torch_case / quantized); returns the output."""
    out = torch.full_like(c["hidden"], float("nan"))
    EXT.moe(
        c["hidden"],
        c.get("router_weight"),
        None,
        c["w13"],
        c["w2"],
        k,
        False,
        "softmax",
        None,
        1,
        1,
        1.0,
        kw.pop("expert_offset", 0),
        out,
        **{n: c.get(n) for n in OPTIONAL},
        num_threads=threads,
        **kw,
    )
    return out


def reference_torch(c, k, **kw):
    """(the reference in the case's precision, the fp64 truth) of a dict of torch tensors."""
    args = {n: c.get(n) for n in OPTIONAL if c.get(n) is not None}
    same = moe_reference(c["hidden"], c.get("router_weight"), c["w13"], c["w2"], k, **args, **kw)
    exact = {n: t.double() for n, t in args.items()}
    w = [None if c.get(n) is None else c[n].double() for n in ("hidden", "router_weight", "w13", "w2")]
    truth = moe_reference(*w, k, compute_dtype=torch.float64, **exact, **kw)
    return same, truth


SHARED_SHAPES = [  # T, H, E, I, k, S: S below, equal to and past I; primes; one token
    (5, 24, 8, 16, 2, 16),
    (13, 37, 6, 11, 3, 1),
    (1, 8, 4, 8, 1, 29),
    (70, 64, 4, 32, 2, 48),
]


@pytest.mark.parametrize("shape", SHARED_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.usefixtures("host_isa")
def test_host_shared_expert(shape, dtype):
    T_, H_, E_, I_, k, S = shape
    c = torch_case(T_, H_, E_, I_, k, S, dtype)
    out = call_torch(c, k, threads=2)
    same, truth = reference_torch(c, k)
    assert_precision(out, same, truth, f"host moe, shared expert S={S}")
    assert torch.equal(out, call_torch(c, k, threads=1)), "the result must not depend on the thread count"
    # The shared expert is in the sum: without it the output moves.
    assert not torch.equal(out, call_torch({**c, "shared_w13": None, "shared_w2": None}, k))


@pytest.mark.usefixtures("host_isa")
def test_host_shared_expert_with_given_topk_outside_the_local_experts():
    """Every token takes the shared expert, even one whose routed experts are all another rank's."""
    c = torch_case(6, 40, 8, 16, 2, 24, torch.bfloat16)
    c.update(router_weight=None, w13=c["w13"][2:5].contiguous(), w2=c["w2"][2:5].contiguous())
    ids = torch.tensor([[0, 1], [2, 7], [3, 4], [6, 7], [4, 2], [0, 0]], dtype=torch.int32)
    weights = torch.rand(6, 2)
    out = call_torch(c, 2, expert_offset=2, topk_ids=ids, topk_weights=weights)
    same, truth = reference_torch(c, 2, expert_offset=2, topk_ids=ids, topk_weights=weights)
    assert_precision(out, same, truth, "host moe, shared expert and a given top-k")


FP8_SHAPES = [  # T, H, E, I, k, S: block grids with partial blocks (130, 129, 300) and one block
    (5, 24, 8, 16, 2, 0),
    (9, 130, 3, 129, 3, 300),
    (37, 257, 6, 131, 3, 131),
    (300, 64, 4, 32, 2, 48),  # chunk GEMMs (many rows per expert)
]


@pytest.mark.parametrize("shape", FP8_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.usefixtures("host_isa")
def test_host_fp8_weights_equal_their_dequantised_weights(shape, dtype):
    """The contract: an FP8 call is the call on fp8_block_dequantize's weights (the same rounding
    points), so the host kernel's two results are bit-identical; and both meet the reference."""
    T_, H_, E_, I_, k, S = shape
    q, deq = quantized(torch_case(T_, H_, E_, I_, k, S, dtype))
    out = call_torch(q, k, threads=2)
    assert torch.equal(out, call_torch(deq, k, threads=1))
    same, truth = reference_torch(q, k)
    assert_precision(out, same, truth, "host moe, FP8 weights")


@pytest.mark.usefixtures("host_isa")
def test_host_fp8_decodes_every_finite_byte():
    """Weights holding every finite e4m3fn byte (subnormals, both zeros, +-448) with non-trivial scales:
    decoded and scaled as torch does."""
    c = torch_case(3, 256, 2, 8, 1, 8, torch.float32)
    q, _ = quantized(c)
    every = torch.arange(256, dtype=torch.uint8)
    every = every[(every & 0x7F) != 0x7F]  # the two NaN codes
    for name in ("w13", "w2", "shared_w13", "shared_w2"):
        flat = every.repeat(q[name].numel() // every.numel() + 1)[: q[name].numel()]
        q[name] = flat[torch.randperm(flat.numel())].view(torch.float8_e4m3fn).reshape(q[name].shape)
        q[name + "_scale"] = torch.rand(q[name + "_scale"].shape) * 2.0**-8
    from dinfer_kernels import fp8_block_dequantize

    deq = dict(q)
    for name, halves in (("w13", 2), ("w2", 1), ("shared_w13", 2), ("shared_w2", 1)):
        deq[name] = fp8_block_dequantize(q[name], q[name + "_scale"], torch.float32, halves=halves)
    for n in OPTIONAL[2:]:
        deq[n] = None
    assert torch.equal(call_torch(q, 1), call_torch(deq, 1))


def fp8_errors():
    q, _ = quantized(torch_case(T, H, E, I, K, 16, torch.float32))
    plain = torch_case(T, H, E, I, K, 16, torch.float32)
    return [
        ("w13_scale", dict(q, w13_scale=None), ValueError),  # FP8 without scales
        ("shared_w2_scale", dict(q, shared_w2_scale=None), ValueError),
        ("w2_scale", dict(plain, w2_scale=q["w2_scale"]), ValueError),  # scales without FP8
        ("shared_w13_scale", dict(q, shared_w13=None, shared_w2=None), ValueError),  # no shared expert
        ("w2", dict(q, w2=plain["w2"]), TypeError),  # one FP8, the other not
        ("shared_w13", dict(q, shared_w13=plain["shared_w13"]), TypeError),
        ("w13_scale", dict(q, w13_scale=q["w13_scale"][:, :-1].contiguous()), ValueError),
        ("w2_scale", dict(q, w2_scale=q["w2_scale"].double()), TypeError),
        ("shared_w2_scale", dict(q, shared_w2_scale=q["shared_w2_scale"].repeat(1, 2)), ValueError),
        ("shared_w13", dict(plain, shared_w13=plain["shared_w13"][1:]), ValueError),  # odd rows
        ("shared_w2", dict(plain, shared_w2=plain["shared_w2"][:, 1:]), ValueError),
        ("shared_w2", dict(plain, shared_w2=None), ValueError),  # the pair comes together
        ("shared_w13", dict(plain, shared_w13=None), ValueError),
        ("shared_w13", dict(plain, shared_w13=plain["shared_w13"].half()), TypeError),
    ]


@pytest.mark.parametrize("i", range(14))
def test_shared_and_fp8_errors_name_the_argument(i):
    name, c, exc = fp8_errors()[i]
    with pytest.raises(exc, match=rf"^{name}\b"):
        call_torch(c, K)


@needs_cuda_build
def test_workspace_bytes():
    small = EXT.moe_workspace_bytes(96, 64, 64, 8, 2048, 1024)
    assert small > 96 * 8 * 2048 * 4  # at least the per-slot fp32 rows
    assert EXT.moe_workspace_bytes(2048, 64, 64, 8, 2048, 1024) > small
    assert EXT.moe_workspace_bytes(96, 0, 8, 8, 2048, 1024) > 96 * 8 * 2048 * 4  # a given top-k
    assert EXT.moe_workspace_bytes(0, 64, 64, 8, 2048, 1024) == 0
    # A shared expert: one more row per token for each of its ceil(S / I) virtual experts.
    shared = EXT.moe_workspace_bytes(96, 64, 64, 8, 2048, 1024, 1536)
    assert shared >= small + 96 * 2 * 2048 * 4


# ---- on a GPU ----------------------------------------------------------------------------------------


def gpu_case(T_, E_, k, dtype, h=256, inter=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T_, h, generator=g).to(dtype)
    router = torch.randn(E_, h, generator=g) * 0.1
    w13 = (torch.randn(E_, 2 * inter, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(E_, h, inter, generator=g) / inter**0.5).to(dtype)
    return [x.cuda() for x in (hidden, router, w13, w2)]


def run_cuda(hidden, router, w13, w2, k, **kw):
    from dinfer_kernels.cuda.moe import moe

    out = torch.full_like(hidden, float("nan"))
    moe(
        hidden,
        router,
        None,
        w13,
        w2,
        kw.get("expert_bias"),
        out,
        top_k=k,
        renormalize=kw.get("renormalize", False),
        scoring=kw.get("scoring", "softmax"),
        num_groups=kw.get("num_groups", 1),
        topk_groups=kw.get("topk_groups", 1),
        routed_scaling=kw.get("routed_scaling", 1.0),
        expert_offset=0,
    )
    return out


@pytest.mark.gpu
@pytest.mark.parametrize(
    "T_,E_,k,dtype",
    [
        (1, 64, 8, torch.bfloat16),
        (96, 64, 8, torch.bfloat16),
        (96, 64, 8, torch.float16),
        (700, 16, 4, torch.bfloat16),
        (33, 8, 2, torch.float32),
    ],
)
def test_gpu_matches_reference_and_is_bit_reproducible(T_, E_, k, dtype):
    from conftest import assert_precision

    from dinfer_kernels.reference.moe import moe_reference

    hidden, router, w13, w2 = gpu_case(T_, E_, k, dtype)
    a = run_cuda(hidden, router, w13, w2, k)
    b = run_cuda(hidden, router, w13, w2, k)
    assert torch.equal(a, b)  # no float atomics anywhere
    same = moe_reference(hidden, router, w13, w2, k)
    truth = moe_reference(
        hidden.double(), router.double(), w13.double(), w2.double(), k, compute_dtype=torch.float64
    )
    assert_precision(a.cpu(), same.cpu(), truth.cpu(), f"moe cuda T={T_}")


@pytest.mark.gpu
def test_gpu_limits_of_the_cuda_kernels():
    hidden, router, w13, w2 = gpu_case(4, 40, 2, torch.bfloat16)
    args = [
        hidden,
        router,
        None,
        w13,
        w2,
        33,
        False,
        "softmax",
        None,
        1,
        1,
        1.0,
        0,
        torch.empty_like(hidden),
    ]
    with pytest.raises(ValueError, match=r"^top_k\b.*at most 32"):
        EXT.moe(*args)
    big = gpu_case(4, 513, 2, torch.bfloat16, h=8, inter=8)
    with pytest.raises(ValueError, match=r"^w13\b.*at most 512"):
        EXT.moe(
            big[0],
            big[1],
            None,
            big[2],
            big[3],
            2,
            False,
            "softmax",
            None,
            1,
            1,
            1.0,
            0,
            torch.empty_like(big[0]),
        )


@pytest.mark.gpu
def test_gpu_workspace_checks():
    hidden, router, w13, w2 = gpu_case(4, 8, 2, torch.bfloat16)
    out = torch.empty_like(hidden)
    args = [hidden, router, None, w13, w2, 2, False, "softmax", None, 1, 1, 1.0, 0, out]
    with pytest.raises(ValueError, match=r"^workspace\b"):
        EXT.moe(*args)
    with pytest.raises(ValueError, match=r"^workspace\b"):
        EXT.moe(*args, workspace=torch.empty(16, dtype=torch.uint8, device="cuda"))
    with pytest.raises(ValueError, match=r"^out\b"):
        EXT.moe(*args[:-1], out.cpu(), workspace=torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))


def cuda_call(c, k):
    """dinfer_kernels.cuda.moe on a dict of CUDA tensors (torch_case / quantized, device="cuda")."""
    from dinfer_kernels.cuda.moe import moe

    out = torch.full_like(c["hidden"], float("nan"))
    extra = {n: c.get(n) for n in OPTIONAL}
    moe(
        c["hidden"], c["router_weight"], None, c["w13"], c["w2"], None, out, top_k=k, renormalize=False,
        scoring="softmax", num_groups=1, topk_groups=1, routed_scaling=1.0, expert_offset=0, **extra,
    )  # fmt: skip
    return out


@pytest.mark.gpu
@pytest.mark.parametrize(
    "T_,H_,E_,I_,k,S",
    [
        (1, 256, 64, 128, 8, 128),  # small tiles, one virtual expert (LLaDA2's S = I)
        (96, 256, 64, 128, 8, 384),  # three virtual experts
        (700, 256, 16, 128, 4, 200),  # large tiles, the last virtual expert narrower
        (9, 200, 8, 72, 2, 40),  # FP8: not multiples of 16, the SIMT GEMMs
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_shared_expert_and_fp8(T_, H_, E_, I_, k, S, dtype):
    """The shared expert and FP8 weights on the CUDA kernels: against the reference, and the FP8 call
    bit-identical to the call on the dequantised weights where both take the same GEMMs (same tiles,
    same rounding points; FP8's tensor-core path needs multiples of 16, b16's of 8)."""
    c = torch_case(T_, H_, E_, I_, k, S, dtype, device="cuda")
    out = cuda_call(c, k)
    same, truth = reference_torch(c, k)
    assert_precision(out.cpu(), same.cpu(), truth.cpu(), f"moe cuda, shared expert S={S}")
    q, deq = quantized(c)
    fp8 = cuda_call(q, k)
    if dtype == torch.float32 or all(n % 16 == 0 for n in (H_, I_, S)):  # the same GEMMs both ways
        assert torch.equal(fp8, cuda_call(deq, k))
    same, truth = reference_torch(q, k)
    assert_precision(fp8.cpu(), same.cpu(), truth.cpu(), "moe cuda, FP8 weights")
    assert torch.equal(fp8, cuda_call(q, k))  # no float atomics anywhere


@pytest.mark.gpu
def test_gpu_shared_expert_counts_against_the_expert_limit():
    c = torch_case(4, 16, 510, 8, 2, 24, torch.bfloat16, device="cuda")  # 510 + 3 virtual experts
    with pytest.raises(ValueError, match=r"^shared_w13\b.*at most 512"):
        cuda_call(c, 2)
