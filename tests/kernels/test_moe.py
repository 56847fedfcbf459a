"""dinfer_kernels.moe: every available backend against the float64 reference
(dinfer_kernels/reference/moe.py), plus the routing spec against a token-by-token formula.

Backends are called directly with a NaN-poisoned, caller-allocated output (an unwritten element
fails), and through the public op. Without a GPU the Triton kernels run in the interpreter
(conftest sets TRITON_INTERPRET): shapes stay small (H/I = 200/72, not powers of two), fp32 and
fp16 only (the interpreter's bf16 arithmetic is unreliable); some cases widen the GEMM tiles to keep
the interpreter's program count down. bf16 runs on the host kernel and on a GPU; the LLaDA-MoE shape
on a GPU only.
Tolerance: conftest.assert_precision — the error against the float64 truth is at most twice that of
the reference run in the same dtype, plus a few fp32 ulps of the output's magnitude.
"""

import importlib

import pytest
import torch
from conftest import HAS_GPU, assert_precision

import dinfer_kernels as dk
from dinfer_kernels import _backend, op_inputs
from dinfer_kernels.reference.moe import moe_reference, route

H, I = 200, 72
GPU = "cuda"


def _pairs():
    pairs = [(b, "cpu") for b in _backend.available_backends("cpu", "moe")]
    if HAS_GPU:
        pairs += [(b, GPU) for b in _backend.available_backends(GPU, "moe")]
    return pairs


ALL_PAIRS = _pairs()
KERNEL_PAIRS = [p for p in ALL_PAIRS if p[0] != "torch"]  # the interpreter counts on the host
# Wider N tiles: fewer interpreter programs (the default small-token tiles are tested on small cases).
WIDE = {"bn1": 64, "bn2": 128}


def make(T, E, dtype=torch.float32, h=H, inter=I, seed=0, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    a = op_inputs.moe_inputs(T, E, h, inter, dtype=dtype, generator=g, weight_scale=scale * 3)
    return a["hidden"], a["router_weight"], a["w13"], a["w2"]


def call_backend(
    backend,
    device,
    hidden,
    router,
    w13,
    w2,
    top_k,
    *,
    router_logits=None,
    renormalize=False,
    scoring="softmax",
    expert_bias=None,
    num_groups=1,
    topk_groups=1,
    routed_scaling=1.0,
    expert_range=None,
    config=None,
):
    """The backend's internal entry with a NaN-poisoned output."""
    E = w13.shape[0]
    e0, e1 = expert_range or (0, E)
    mv = lambda t: None if t is None else t.to(device)
    hidden_d = hidden.to(device)
    if backend == "torch":  # the reference has no internal entry
        return dk.moe(
            hidden_d,
            mv(router) if router_logits is None else None,
            w13.to(device),
            w2.to(device),
            top_k,
            router_logits=mv(router_logits),
            renormalize=renormalize,
            scoring=scoring,
            expert_bias=mv(expert_bias),
            num_groups=num_groups,
            topk_groups=topk_groups,
            routed_scaling=routed_scaling,
            expert_range=expert_range,
            backend="torch",
        ).cpu()
    out = torch.full(hidden.shape, float("nan"), dtype=hidden.dtype, device=device)
    mod = importlib.import_module(f"dinfer_kernels.{backend}.moe")
    kw = {"config": config} if (config and backend == "triton") else {}
    mod.moe(
        hidden_d,
        mv(router) if router_logits is None else None,
        mv(router_logits),
        w13.to(device),
        w2.to(device),
        mv(expert_bias),
        out,
        top_k=top_k,
        renormalize=renormalize,
        scoring=scoring,
        num_groups=num_groups,
        topk_groups=topk_groups,
        routed_scaling=routed_scaling,
        e0=e0,
        e1=e1,
        **kw,
    )
    return out.cpu()


def moe_truth(hidden, router, w13, w2, top_k, **kw):
    """The float64 reference: what every comparison's error is measured against."""
    return moe_reference(
        hidden.double(), router, w13.double(), w2.double(), top_k, compute_dtype=torch.float64, **kw
    )


def check(backend, device, hidden, router, w13, w2, top_k, name="moe", config=None, **kw):
    """The backend's output, after checking it against the reference (same dtype and float64)."""
    out = call_backend(backend, device, hidden, router, w13, w2, top_k, config=config, **kw)
    same = moe_reference(hidden, router, w13, w2, top_k, **kw)
    truth = moe_truth(hidden, router, w13, w2, top_k, **kw)
    assert out.dtype == hidden.dtype and out.shape == hidden.shape
    assert not out.isnan().any(), f"{name}: unwritten (NaN) output elements"
    assert_precision(out, same, truth, f"{name}[{backend}/{device}]")
    return out


# ---- the routing spec ------------------------------------------------------------------------------


def naive_route(logits, top_k, renorm, bias, scoring, groups, topk_groups, scaling, dtype=torch.float64):
    """Token by token, written from the docstring (independent of reference.route); weights computed
    in `dtype` (float64: the truth; float32: the same-precision run), returned as float64."""
    T, E = logits.shape
    ws, es = [], []
    for t in range(T):
        lt = logits[t].to(dtype)
        s = torch.softmax(lt, 0) if scoring == "softmax" else torch.sigmoid(lt)
        c = s + (bias.to(dtype) if bias is not None else 0)
        allowed = list(range(E))
        if groups > 1:
            size = E // groups
            gs = []
            for g in range(groups):
                vals = sorted(
                    (float("-inf") if v != v else v for v in c[g * size : (g + 1) * size].tolist()),
                    reverse=True,
                )
                gs.append((-sum(vals[:2]), g))
            kept = [g for _, g in sorted(gs)[:topk_groups]]
            allowed = [e for e in range(E) if e // size in kept]
        rank = lambda e: -float(c[e]) if not c[e].isnan() else float("inf")
        chosen = [e for _, e in sorted((rank(e), e) for e in allowed)[:top_k]]
        w = torch.stack([c[e] if scoring == "softmax" else s[e] for e in chosen])
        if renorm:
            w = w / (w.sum() + 1e-20)
        ws.append(w * scaling)
        es.append(chosen)
    return torch.stack(ws).double(), torch.tensor(es)


@pytest.mark.parametrize(
    "scoring,renorm,bias,groups,topk_groups,scaling,k",
    [
        ("softmax", False, False, 1, 1, 1.0, 8),
        ("softmax", True, True, 1, 1, 1.0, 3),
        ("sigmoid", True, True, 8, 4, 2.5, 8),
        ("sigmoid", False, False, 4, 1, 1.0, 2),
        ("softmax", False, True, 16, 3, 0.5, 5),
    ],
)
def test_route_matches_the_token_by_token_formula(scoring, renorm, bias, groups, topk_groups, scaling, k):
    T, E = 9, 32
    logits = torch.randn(T, E) * 2
    b = torch.rand(E) * 0.2 if bias else None
    w, e = route(
        None,
        None,
        k,
        renorm,
        b,
        router_logits=logits,
        scoring=scoring,
        num_groups=groups,
        topk_groups=topk_groups,
        routed_scaling=scaling,
    )
    nw, ne = naive_route(logits, k, renorm, b, scoring, groups, topk_groups, scaling)
    same = naive_route(logits, k, renorm, b, scoring, groups, topk_groups, scaling, torch.float32)[0]
    assert torch.equal(e, ne)
    assert_precision(w, same, nw, "routing weights")


def test_route_nan_scores_rank_like_minus_inf():
    """The spec ranks a NaN selection score like -inf: such experts are chosen last."""
    logits = torch.randn(6, 16)
    logits[:, 3] = float("nan")
    logits[2, 7] = float("nan")
    b = torch.rand(16) * 0.1
    for groups, topk_groups in ((1, 1), (4, 2)):
        w, e = route(
            None,
            None,
            4,
            True,
            b,
            router_logits=logits,
            scoring="sigmoid",
            num_groups=groups,
            topk_groups=topk_groups,
        )
        nw, ne = naive_route(logits, 4, True, b, "sigmoid", groups, topk_groups, 1.0)
        same = naive_route(logits, 4, True, b, "sigmoid", groups, topk_groups, 1.0, torch.float32)[0]
        assert torch.equal(e, ne) and not (e == 3).any()
        assert_precision(w, same, nw, "routing weights")


@pytest.mark.parametrize("backend,device", KERNEL_PAIRS)
@pytest.mark.usefixtures("host_isa")
def test_nan_router_logits_are_never_chosen(backend, device):
    """Sigmoid routing with a NaN logit per token: the expert is skipped (ranked like -inf), so the
    output equals the one where that logit is -inf (sigmoid 0: also never chosen, top_k < E)."""
    hidden, router, w13, w2 = make(7, 8)
    logits = torch.randn(7, 8)
    logits[torch.arange(7), torch.arange(7) % 8] = float("nan")
    kw = dict(scoring="sigmoid", renormalize=True)
    got = call_backend(backend, device, hidden, None, w13, w2, 3, router_logits=logits, **kw)
    clean = logits.nan_to_num(nan=float("-inf"))
    want = moe_reference(hidden, None, w13, w2, 3, router_logits=clean, **kw)
    assert not got.isnan().any()
    assert_precision(got, want, moe_truth(hidden, None, w13, w2, 3, router_logits=clean, **kw), "moe")


@pytest.mark.parametrize("backend,device", KERNEL_PAIRS)
@pytest.mark.usefixtures("host_isa")
def test_group_whose_second_best_is_minus_inf(backend, device):
    """A group of two whose second expert has a -inf selection score (a -inf bias) scores -inf (the
    top-2 sum), so it is kept last, like the reference's topk(2).sum; a one-expert group keeps its
    single score."""
    hidden, router, w13, w2 = make(6, 8)
    bias = torch.zeros(8)
    bias[1] = float("-inf")
    for groups in (4, 8):
        kw = dict(scoring="sigmoid", expert_bias=bias, num_groups=groups, topk_groups=2)
        check(backend, device, hidden, router, w13, w2, 2, name=f"groups={groups}", **kw)


def test_route_ties_pick_the_lower_expert_and_group():
    logits = torch.zeros(2, 8)
    w, e = route(None, None, 3, router_logits=logits)
    assert e.tolist() == [[0, 1, 2]] * 2
    w, e = route(None, None, 2, router_logits=logits, scoring="sigmoid", num_groups=4, topk_groups=1)
    assert e.tolist() == [[0, 1]] * 2


def test_static_shape_reference_with_llada2_routing():
    hidden, router, w13, w2 = make(6, 16)
    kw = dict(
        scoring="sigmoid",
        expert_bias=torch.rand(16) * 0.1,
        num_groups=4,
        topk_groups=2,
        renormalize=True,
        routed_scaling=2.5,
    )
    assert_precision(
        moe_reference(hidden, router, w13, w2, 4, static_shapes=True, **kw),
        moe_reference(hidden, router, w13, w2, 4, **kw),
        moe_truth(hidden, router, w13, w2, 4, **kw),
        "static shapes",
    )


# ---- backends against the reference ---------------------------------------------------------------

CASES = [  # T, E, top_k, dtype, config overrides
    (1, 8, 1, torch.float32, None),
    (5, 8, 2, torch.float32, None),
    (5, 8, 8, torch.float16, WIDE),
    (96, 8, 2, torch.float32, None),
    (96, 8, 1, torch.float16, WIDE),
    (1000, 8, 2, torch.float32, None),
    (1000, 8, 1, torch.float32, None),
    (1, 64, 8, torch.float32, None),
    (5, 64, 2, torch.float16, WIDE),
    (96, 64, 8, torch.float32, WIDE),
    (5, 8, 2, torch.bfloat16, None),
    (96, 64, 8, torch.bfloat16, None),
]


@pytest.mark.parametrize("backend,device", ALL_PAIRS)
@pytest.mark.parametrize("T,E,k,dtype,config", CASES)
@pytest.mark.usefixtures("host_isa")
def test_against_reference(backend, device, T, E, k, dtype, config):
    if dtype != torch.float32 and device == "cpu" and backend == "torch":
        pytest.skip("the reference against itself, with the host's slow 16-bit matmul")
    if dtype == torch.bfloat16 and device == "cpu" and backend == "triton":
        pytest.skip("the interpreter's bf16 arithmetic is unreliable")
    hidden, router, w13, w2 = make(T, E, dtype)
    check(backend, device, hidden, router, w13, w2, k, config=config)


@pytest.mark.parametrize("backend,device", KERNEL_PAIRS)
@pytest.mark.parametrize("T,E,k,groups,topk_groups", [(5, 64, 8, 8, 4), (96, 16, 4, 4, 2), (1, 8, 2, 8, 2)])
@pytest.mark.usefixtures("host_isa")
def test_llada2_routing(backend, device, T, E, k, groups, topk_groups):
    """Sigmoid scores, selection-only bias, group-limited top-k, renormalisation, scaling."""
    hidden, router, w13, w2 = make(T, E)
    bias = torch.rand(E) * 0.3
    check(
        backend,
        device,
        hidden,
        router,
        w13,
        w2,
        k,
        config=WIDE,
        scoring="sigmoid",
        expert_bias=bias,
        num_groups=groups,
        topk_groups=topk_groups,
        renormalize=True,
        routed_scaling=2.5,
    )


@pytest.mark.parametrize("backend,device", KERNEL_PAIRS)
@pytest.mark.usefixtures("host_isa")
def test_softmax_with_bias_and_renormalize(backend, device):
    """LLaDA-MoE's HF quirk: the bias stays in the weights."""
    hidden, router, w13, w2 = make(7, 8)
    check(backend, device, hidden, router, w13, w2, 3, expert_bias=torch.rand(8) * 0.2)
    check(
        backend,
        device,
        hidden,
        router,
        w13,
        w2,
        3,
        expert_bias=torch.rand(8) * 0.2,
        renormalize=True,
        routed_scaling=1.5,
    )


@pytest.mark.parametrize("backend,device", KERNEL_PAIRS)
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.usefixtures("host_isa")
def test_router_logits_input_and_ties(backend, device, scoring):
    hidden, router, w13, w2 = make(9, 8)
    logits = torch.randn(9, 8).to(torch.float16)
    check(backend, device, hidden, router, w13, w2, 2, router_logits=logits, scoring=scoring, config=WIDE)
    flat = torch.zeros(9, 8)  # every score equal: experts 0 and 1
    out = check(backend, device, hidden, router, w13, w2, 2, router_logits=flat, scoring=scoring, config=WIDE)
    only = check(
        backend,
        device,
        hidden,
        router,
        w13,
        w2,
        2,
        router_logits=flat,
        scoring=scoring,
        expert_range=(0, 2),
        config=WIDE,
    )
    assert torch.equal(out, only)


@pytest.mark.parametrize("backend,device", KERNEL_PAIRS)
@pytest.mark.usefixtures("host_isa")
def test_idle_experts_and_every_token_to_one_expert(backend, device):
    hidden, router, w13, w2 = make(96, 8)
    logits = torch.randn(96, 8)
    logits[:, [1, 4, 6]] = -30.0  # experts with no tokens
    check(backend, device, hidden, router, w13, w2, 2, router_logits=logits, config=WIDE)
    logits[:, 3] = 30.0  # every token picks expert 3 first
    check(backend, device, hidden, router, w13, w2, 1, router_logits=logits, config=WIDE)
    check(backend, device, hidden, router, w13, w2, 3, router_logits=logits, config=WIDE)
    hidden = hidden.abs()  # the same through the router weight
    router = torch.randn(8, H) * 0.01
    router[3] = 1.0
    check(backend, device, hidden, router, w13, w2, 1, config=WIDE)


@pytest.mark.parametrize("backend,device", KERNEL_PAIRS)
@pytest.mark.usefixtures("host_isa")
def test_expert_parallel_subsets(backend, device):
    hidden, router, w13, w2 = make(40, 16)
    parts = [
        check(backend, device, hidden, router, w13, w2, 4, expert_range=r, config=WIDE)
        for r in [(0, 5), (5, 6), (6, 16)]
    ]
    whole = check(backend, device, hidden, router, w13, w2, 4, config=WIDE)
    assert_precision(
        sum(p.double() for p in parts),
        whole,
        moe_truth(hidden, router, w13, w2, 4),
        "sum of the expert subsets",
    )
    empty = call_backend(backend, device, hidden, router, w13, w2, 4, expert_range=(7, 7))
    assert torch.equal(empty, torch.zeros_like(empty))


@pytest.mark.parametrize("backend,device", KERNEL_PAIRS)
@pytest.mark.usefixtures("host_isa")
def test_deterministic(backend, device):
    hidden, router, w13, w2 = make(96, 8)
    a = call_backend(backend, device, hidden, router, w13, w2, 2, config=WIDE)
    b = call_backend(backend, device, hidden, router, w13, w2, 2, config=WIDE)
    assert torch.equal(a, b)


# ---- the host kernel ---------------------------------------------------------------------------------

host_kernel = pytest.mark.skipif(
    "cpu" not in _backend.available_backends("cpu", "moe"),
    reason="dinfer_kernels._C lacks the host MoE kernel",
)


@host_kernel
@pytest.mark.parametrize(
    "T,E,k,h,inter,dtype",
    [
        (5, 8, 2, H, I, torch.bfloat16),
        (96, 64, 8, H, I, torch.bfloat16),
        (70, 8, 2, 256, 256, torch.bfloat16),
        (560, 8, 2, 256, 256, torch.float32),  # the embedded model
        (61, 4, 2, 257, 37, torch.float16),
        (61, 4, 2, 129, 37, torch.bfloat16),  # odd tails
        (7, 1, 1, 33, 5, torch.float32),
    ],
)  # one expert
@pytest.mark.usefixtures("host_isa")
def test_host_kernel_bf16_embedded_and_odd_shapes(T, E, k, h, inter, dtype):
    """bf16 (the interpreter cannot run it for Triton, the host kernel can), the embedded model's
    shapes (both GEMM paths: dot products below 8 rows per expert, transposed chunks above), and
    sizes that are no multiple of the kernel's 16-wide chunks or 8-row blocks."""
    hidden, router, w13, w2 = make(T, E, dtype, h=h, inter=inter, seed=T)
    check("cpu", "cpu", hidden, router, w13, w2, k, name=f"host T={T}")


@host_kernel
@pytest.mark.usefixtures("host_isa")
def test_host_kernel_results_do_not_depend_on_the_thread_count():
    hidden, router, w13, w2 = make(300, 8, torch.bfloat16, h=256, inter=256)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(call_backend("cpu", "cpu", hidden, router, w13, w2, 2))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


# ---- Triton internals ------------------------------------------------------------------------------


def triton_devices():
    return [d for b, d in KERNEL_PAIRS if b == "triton"]


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize(
    "overrides",
    [
        {"one_launch": False},
        {"route_dot": True, "route_bt": 16},
        {"route_dot": False, "route_bt": 2},
        {"block_m": 16, "split_k": 2, "bk2": 32, "bn1": 32, "bn2": 64},
        {"block_m": 64, "split_k": 3, "bk2": 16},
    ],
)
def test_triton_configs(device, overrides):
    from dinfer_kernels.triton import moe as tm

    hidden, router, w13, w2 = make(30, 8, seed=3)
    cfg = tm.replace(tm.choose_config(30, 3, 8, 8, H, I, torch.float32), **overrides)
    check(
        "triton",
        device,
        hidden,
        router,
        w13,
        w2,
        3,
        config=cfg,
        expert_range=(2, 7) if overrides.get("one_launch") is False else None,
    )


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize(
    "T,k,e0,e1,block_m", [(37, 3, 0, 8, 16), (5, 2, 3, 6, 16), (64, 8, 0, 8, 32), (3, 1, 7, 8, 16)]
)
def test_triton_alignment(device, T, k, e0, e1, block_m):
    """The permuted list: each local slot once, token-major inside its expert's padded segment;
    padding = the sentinel T*k; block_expert names each block's expert, -1 past the end."""
    from dinfer_kernels.triton import moe as tm

    E = 8
    hidden, router, w13, w2 = make(T, E, seed=5)
    cfg = tm.replace(tm.choose_config(T, k, E, e1 - e0, H, I, torch.float32), block_m=block_m)
    ws = tm.Workspace(T, k, e1 - e0, I, H, torch.float32, device, cfg)
    ws.sorted_ids.fill_(-7)
    ws.block_expert.fill_(-7)
    tm.route_and_align(
        hidden.to(device), router.to(device), None, k, False, "softmax", None, 1, 1, 1.0, e0, e1, E, cfg, ws
    )
    w_ref, e_ref = route(hidden, router, k)
    ids = ws.topk_ids.cpu().view(T, k).long()
    assert torch.equal(ids, e_ref)
    w_truth = naive_route(hidden.double() @ router.double().t(), k, False, None, "softmax", 1, 1, 1.0)[0]
    assert_precision(ws.topk_w.cpu().view(T, k), w_ref, w_truth, "routing weights")
    flat = ids.flatten()
    counts = [int((flat == e).sum()) for e in range(e0, e1)]
    padded = [-(-c // block_m) * block_m for c in counts]
    total = sum(padded)
    assert int(ws.meta[1]) == total <= ws.p_max
    sorted_ids = ws.sorted_ids.cpu()[:total].tolist()
    pos = 0
    for e, c, p in zip(range(e0, e1), counts, padded):
        expect = torch.nonzero(flat == e).flatten().tolist()
        assert sorted_ids[pos : pos + c] == expect
        assert sorted_ids[pos + c : pos + p] == [T * k] * (p - c)
        pos += p
    be = ws.block_expert.cpu().tolist()
    expect_be = [e for e, p in zip(range(e0, e1), padded) for _ in range(p // block_m)]
    assert be == expect_be + [-1] * (ws.nb_max - len(expect_be))


@pytest.mark.parametrize("device", triton_devices())
def test_triton_garbage_workspace_never_leaks(device, monkeypatch):
    """Workspace buffers hold NaN / garbage before the call: nothing unwritten may be read."""
    from dinfer_kernels.triton import moe as tm

    real_empty = torch.empty

    def poisoned(*a, **kw):
        t = real_empty(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(123456)

    monkeypatch.setattr(tm.torch, "empty", poisoned)
    hidden, router, w13, w2 = make(20, 8)
    check("triton", device, hidden, router, w13, w2, 2, config={"split_k": 2, "bk2": 32})
    check("triton", device, hidden, router, w13, w2, 2, expert_range=(1, 4))


# ---- the public op -----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend,device", ALL_PAIRS)
@pytest.mark.usefixtures("host_isa")
def test_public_op(backend, device):
    hidden, router, w13, w2 = make(6, 8)
    bias = torch.rand(8) * 0.1
    d = lambda t: t.to(device)
    kw = dict(scoring="sigmoid", num_groups=4, topk_groups=2, renormalize=True, routed_scaling=2.5)
    got = dk.moe(d(hidden), d(router), d(w13), d(w2), 2, expert_bias=d(bias), backend=backend, **kw)
    ref = moe_reference(hidden, router, w13, w2, 2, expert_bias=bias, **kw)
    assert got.shape == hidden.shape and got.dtype == hidden.dtype and got.device.type == device
    assert_precision(got.cpu(), ref, moe_truth(hidden, router, w13, w2, 2, expert_bias=bias, **kw), "moe")


def test_bad_inputs_name_the_argument():
    hidden, router, w13, w2 = make(4, 8)
    cases = [
        (dict(router_weight=None), "router_weight, router_logits"),
        (dict(router_logits=torch.zeros(4, 8)), "router_weight, router_logits"),
        (dict(scoring="relu"), "scoring"),
        (dict(num_groups=3), "num_groups"),
        (dict(num_groups=0), "num_groups"),
        (dict(num_groups=4, topk_groups=5), "topk_groups"),
        (dict(num_groups=4, topk_groups=1, top_k=3), "top_k"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=9), "top_k"),
        (dict(routed_scaling=float("nan")), "routed_scaling"),
        (dict(expert_bias=torch.zeros(7)), "expert_bias"),
        (dict(expert_range=(3, 2)), "expert_range[1]"),
        (dict(expert_range=(0, 9)), "expert_range"),
        (dict(expert_range=5), "expert_range"),
        (dict(w2=w2[:, :, :5]), "w2"),
        (dict(w13=w13[:, :5]), "w13"),
        (dict(w13=w13.half()), "w13"),
        (dict(router_weight=router[:, :5]), "router_weight"),
        (dict(hidden=hidden[0]), "hidden"),
        (dict(backend="nope"), "backend"),
    ]
    for over, name in cases:
        args = dict(hidden=hidden, router_weight=router, w13=w13, w2=w2, top_k=2)
        args.update(over)
        with pytest.raises((ValueError, TypeError), match=f"^{name.replace('[', '.').replace(']', '.')}"):
            dk.moe(
                args.pop("hidden"),
                args.pop("router_weight"),
                args.pop("w13"),
                args.pop("w2"),
                args.pop("top_k"),
                **args,
            )
    with pytest.raises(ValueError, match="^router_logits"):
        dk.moe(hidden, None, w13, w2, 2, router_logits=torch.zeros(3, 8))


def test_router_logits_through_the_public_op():
    hidden, router, w13, w2 = make(5, 8)
    logits = hidden @ router.t()
    a = dk.moe(hidden, None, w13, w2, 2, router_logits=logits)
    b = dk.moe(hidden, router, w13, w2, 2)
    assert_precision(a, b, moe_truth(hidden, router, w13, w2, 2), "moe from router logits")


@pytest.mark.parametrize("backend,device", ALL_PAIRS)
def test_opcheck(backend, device):
    hidden, router, w13, w2 = make(3, 8)
    d = lambda t: t.to(device)
    args = (d(hidden), d(router), None, d(w13), d(w2), 2, True, 1, d(torch.rand(8)), 4, 2, 2.5, 0, 8, backend)
    torch.library.opcheck(
        torch.ops.dinfer.moe.default,
        args,
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


@pytest.mark.parametrize("backend,device", ALL_PAIRS)
def test_torch_compile_fullgraph(backend, device):
    hidden, router, w13, w2 = make(4, 8)
    d = lambda t: t.to(device)
    bias = d(torch.rand(8) * 0.1)

    def f(x, r, a, b):
        return (
            dk.moe(
                x * 2.0,
                r,
                a,
                b,
                2,
                scoring="sigmoid",
                expert_bias=bias,
                num_groups=2,
                topk_groups=1,
                renormalize=True,
                backend=backend,
            )
            + 1.0
        )

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(d(hidden), d(router), d(w13), d(w2))
    torch.testing.assert_close(got, f(d(hidden), d(router), d(w13), d(w2)), rtol=1e-5, atol=1e-5)


# ---- GPU only: the LLaDA-MoE shape, bf16, CUDA graphs ---------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [b for b, d in KERNEL_PAIRS if d == GPU])
@pytest.mark.parametrize("T", [1, 32, 96, 512, 2048])
def test_llada_moe_shape_gpu(backend, T):
    E, h, inter = 64, 2048, 1024
    hidden, router, w13, w2 = make(T, E, torch.bfloat16, h=h, inter=inter)
    router = router.float()
    out = call_backend(backend, GPU, hidden, router, w13, w2, 8)
    dev = lambda t: t.to(GPU)
    same = moe_reference(dev(hidden), dev(router), dev(w13), dev(w2), 8).cpu()
    truth = moe_reference(
        dev(hidden).double(), dev(router), dev(w13).double(), dev(w2).double(), 8, compute_dtype=torch.float64
    ).cpu()
    assert not out.isnan().any()
    assert_precision(out, same, truth, f"moe T={T}[{backend}]")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [b for b, d in KERNEL_PAIRS if d == GPU])
def test_cuda_graph_capture_gpu(backend):
    hidden, router, w13, w2 = [t.to(GPU) for t in make(64, 64, torch.bfloat16, h=256, inter=128)]
    kw = dict(
        scoring="sigmoid",
        expert_bias=torch.rand(64, device=GPU) * 0.1,
        num_groups=8,
        topk_groups=4,
        renormalize=True,
        routed_scaling=2.5,
        backend=backend,
    )
    eager = dk.moe(hidden, router, w13, w2, 8, **kw)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dk.moe(hidden, router, w13, w2, 8, **kw)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = dk.moe(hidden, router, w13, w2, 8, **kw)
    hidden.copy_(hidden.flip(0))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, dk.moe(hidden, router, w13, w2, 8, **kw))
    torch.testing.assert_close(out.flip(0), eager)
