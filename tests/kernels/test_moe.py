"""dinfer_kernels.moe: every available backend against the float64 reference
(dinfer_kernels/reference/moe.py), plus the routing spec against a token-by-token formula.

Backends are called directly with a NaN-poisoned, caller-allocated output (an unwritten element
fails), and through the public op. Without a GPU the Triton kernels run in the interpreter
(conftest sets TRITON_INTERPRET): shapes stay small (H/I = 200/72, not powers of two), fp32 and
fp16 only (the interpreter's bf16 arithmetic is unreliable); some cases widen the GEMM tiles to keep
the interpreter's program count down. A shared expert and FP8 expert weights (issue 40) run through
the same checks; the FP8 truth is the reference on the weights dequantised in float64. bf16 runs on the host kernel and on a GPU; the LLaDA-MoE shape
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


def make_shared(S, dtype=torch.float32, h=H, seed=0, scale=0.9):
    """A shared expert of width S, scaled like make()'s experts: {shared_w13 [2S, h], shared_w2 [h, S]}."""
    g = torch.Generator().manual_seed(seed + 1000)
    return dict(
        shared_w13=(torch.randn(2 * S, h, generator=g) * scale / h**0.5).to(dtype),
        shared_w2=(torch.randn(h, S, generator=g) * scale / S**0.5).to(dtype),
    )


def quantized(w13, w2, shared=None):
    """The experts (and a shared expert) in FP8 with their block scales: (w13, w2, the moe keywords)."""
    q13, s13 = dk.fp8_block_quantize(w13, halves=2)
    q2, s2 = dk.fp8_block_quantize(w2)
    kw = dict(w13_scale=s13, w2_scale=s2)
    if shared is not None:
        kw["shared_w13"], kw["shared_w13_scale"] = dk.fp8_block_quantize(shared["shared_w13"], halves=2)
        kw["shared_w2"], kw["shared_w2_scale"] = dk.fp8_block_quantize(shared["shared_w2"])
    return q13, q2, kw


# moe's keywords of issue 40: a backend receives each only when given (as through the public op).
WEIGHT_KW = ("shared_w13", "shared_w2", "w13_scale", "w2_scale", "shared_w13_scale", "shared_w2_scale")


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
    expert_offset=0,
    topk_ids=None,
    topk_weights=None,
    config=None,
    **weights,
):
    """The backend's internal entry with a NaN-poisoned output (w13 / w2: the local experts; weights:
    the WEIGHT_KW given)."""
    mv = lambda t: None if t is None else t.to(device)
    assert set(weights) <= set(WEIGHT_KW), set(weights) - set(WEIGHT_KW)
    weights = {name: t.to(device) for name, t in weights.items() if t is not None}
    hidden_d = hidden.to(device)
    if topk_ids is not None:  # a given top-k: no router
        router = None
    if backend == "torch":  # the reference has no internal entry
        return dk.moe(
            hidden_d,
            mv(router) if router_logits is None else None,
            w13.to(device),
            w2.to(device),
            top_k,
            router_logits=mv(router_logits),
            topk_ids=mv(topk_ids),
            topk_weights=mv(topk_weights),
            renormalize=renormalize,
            scoring=scoring,
            expert_bias=mv(expert_bias),
            num_groups=num_groups,
            topk_groups=topk_groups,
            routed_scaling=routed_scaling,
            expert_offset=expert_offset,
            backend="torch",
            **weights,
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
        expert_offset=expert_offset,
        topk_ids=mv(topk_ids),
        topk_weights=mv(topk_weights),
        **weights,
        **kw,
    )
    return out.cpu()


def local(w13, w2, kw):
    """(w13, w2, kw) of the local experts kw["experts"] = (e0, e1) (expert_offset e0), or all (FP8
    block scales sliced with them)."""
    kw = dict(kw)
    e0, e1 = kw.pop("experts", (0, w13.shape[0]))
    for name in ("w13_scale", "w2_scale"):
        if kw.get(name) is not None:
            kw[name] = kw[name][e0:e1].contiguous()
    return w13[e0:e1].contiguous(), w2[e0:e1].contiguous(), dict(kw, expert_offset=e0)


def _float64(w, scale, halves=1):
    """A weight in float64; FP8 weights dequantised with their block scales."""
    return w.double() if scale is None else dk.fp8_block_dequantize(w, scale, torch.float64, halves=halves)


def moe_truth(hidden, router, w13, w2, top_k, **kw):
    """The float64 reference: what every comparison's error is measured against (FP8 weights
    dequantised in float64)."""
    w13, w2, kw = local(w13, w2, kw)
    w13 = _float64(w13, kw.pop("w13_scale", None), 2)
    w2 = _float64(w2, kw.pop("w2_scale", None))
    if kw.get("shared_w13") is not None:
        kw["shared_w13"] = _float64(kw["shared_w13"], kw.pop("shared_w13_scale", None), 2)
        kw["shared_w2"] = _float64(kw["shared_w2"], kw.pop("shared_w2_scale", None))
    return moe_reference(hidden.double(), router, w13, w2, top_k, compute_dtype=torch.float64, **kw)


def check(backend, device, hidden, router, w13, w2, top_k, name="moe", config=None, **kw):
    """The backend's output, after checking it against the reference (same dtype and float64);
    kw["experts"] = (e0, e1): on those local experts only (w13 / w2 sliced, expert_offset e0)."""
    truth = moe_truth(hidden, router, w13, w2, top_k, **kw)
    w13, w2, kw = local(w13, w2, kw)
    if kw.get("topk_ids") is not None:
        router = None
    out = call_backend(backend, device, hidden, router, w13, w2, top_k, config=config, **kw)
    same = moe_reference(hidden, router, w13, w2, top_k, **kw)
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
        experts=(0, 2),
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
        check(backend, device, hidden, router, w13, w2, 4, experts=r, config=WIDE)
        for r in [(0, 5), (5, 6), (6, 16)]
    ]
    whole = check(backend, device, hidden, router, w13, w2, 4, config=WIDE)
    assert_precision(
        sum(p.double() for p in parts),
        whole,
        moe_truth(hidden, router, w13, w2, 4),
        "sum of the expert subsets",
    )
    d = lambda t: t.to(device)
    empty = dk.moe(d(hidden), d(router), d(w13[7:7]), d(w2[7:7]), 4, expert_offset=7, backend=backend)
    assert torch.equal(empty.cpu(), torch.zeros_like(hidden))


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
        experts=(2, 7) if overrides.get("one_launch") is False else (0, 8),
    )


GROUPED = {"gemm": "grouped_mm"}


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "T,E,k,S,experts",
    [
        (1, 8, 2, 0, (0, 8)),
        (37, 8, 3, 0, (0, 8)),
        (64, 16, 4, 0, (5, 11)),
        (13, 8, 2, 29, (0, 8)),
        (29, 8, 3, 40, (2, 6)),
    ],
)
def test_triton_grouped_mm_path(device, dtype, T, E, k, S, experts):
    """The expert GEMMs through torch._grouped_mm behind our routing and combine (config gemm =
    "grouped_mm"): the same contract, with a shared expert and on a slice of local experts."""
    hidden, router, w13, w2 = make(T, E, dtype, seed=T)
    kw = make_shared(S, dtype) if S else {}
    check("triton", device, hidden, router, w13, w2, k, config=GROUPED, experts=experts, **kw)


@pytest.mark.parametrize("device", triton_devices())
def test_triton_grouped_mm_path_given_topk_and_llada2_routing(device):
    hidden, router, w13, w2 = make(23, 16, seed=4)
    ids, weights = given_topk(23, 16, 3, seed=4)
    check("triton", device, hidden, None, w13, w2, 3, config=GROUPED, topk_ids=ids, topk_weights=weights)
    routing = dict(scoring="sigmoid", num_groups=4, topk_groups=2, renormalize=True, routed_scaling=2.5)
    check(
        "triton",
        device,
        hidden,
        router,
        w13,
        w2,
        4,
        config=GROUPED,
        expert_bias=torch.rand(16) * 0.1,
        **routing,
    )


def test_triton_grouped_mm_path_refuses_fp8_and_unknown_gemms():
    from dinfer_kernels.triton import moe as tm

    hidden, router, w13, w2 = make(5, 8)
    q13, q2, scales = quantized(w13, w2)
    out = torch.empty_like(hidden)
    args = dict(
        top_k=2, renormalize=False, scoring="softmax", num_groups=1, topk_groups=1, routed_scaling=1.0
    )
    with pytest.raises(ValueError, match="config: gemm='grouped_mm' takes no FP8"):
        tm.moe(hidden, router, None, q13, q2, None, out, expert_offset=0, config=GROUPED, **args, **scales)
    with pytest.raises(ValueError, match="config: gemm must be"):
        tm.moe(hidden, router, None, w13, w2, None, out, expert_offset=0, config={"gemm": "cublas"}, **args)


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize(
    "T,k,e0,e1,block_m,n_virt",
    [
        (37, 3, 0, 8, 16, 0),
        (5, 2, 3, 6, 16, 0),
        (64, 8, 0, 8, 32, 0),
        (3, 1, 7, 8, 16, 0),
        (37, 3, 2, 5, 16, 3),
    ]
    + [(5, 2, 0, 8, 16, 1), (64, 8, 7, 8, 32, 2)],
)
@pytest.mark.parametrize("one_launch", [True, False])
def test_triton_alignment(device, T, k, e0, e1, block_m, n_virt, one_launch):
    """The permuted list: each local slot once, token-major inside its expert's padded segment, then
    each virtual expert of a shared expert (every token: slots T*k + v*T + t); padding = the sentinel
    T*(k + n_virt); block_expert names each block's expert, -1 past the end."""
    from dinfer_kernels.triton import moe as tm

    E = 8
    hidden, router, w13, w2 = make(T, E, seed=5)
    cfg = tm.replace(
        tm.choose_config(T, k, E, e1 - e0, H, I, torch.float32), block_m=block_m, one_launch=one_launch
    )
    ws = tm.Workspace(T, k, e1 - e0, I, H, torch.float32, device, cfg, n_virt=n_virt)
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
    members = [torch.nonzero(flat == e).flatten().tolist() for e in range(e0, e1)]
    members += [list(range(T * k + v * T, T * k + (v + 1) * T)) for v in range(n_virt)]
    padded = [-(-len(m) // block_m) * block_m for m in members]
    total = sum(padded)
    assert int(ws.meta[1]) == total <= ws.p_max
    sorted_ids = ws.sorted_ids.cpu()[:total].tolist()
    pos = 0
    for expect, p in zip(members, padded):
        c = len(expect)
        assert sorted_ids[pos : pos + c] == expect
        assert sorted_ids[pos + c : pos + p] == [T * (k + n_virt)] * (p - c)
        pos += p
    be = ws.block_expert.cpu().tolist()
    expect_be = [e for e, p in enumerate(padded) for _ in range(p // block_m)]  # local
    assert be == expect_be + [-1] * (ws.nb_max - len(expect_be))


@pytest.mark.parametrize("device", triton_devices())
def test_triton_tiles_for_fp8_weights(device):
    """Every chosen K tile divides an FP8 scale block (a tile lies in one scale column), FP8 weights
    count 1 byte a stage (never fewer stages than 16-bit ones), and a config whose K tile does not
    divide the block is refused, naming it."""
    from dinfer_kernels.triton import moe as tm

    for T, k, E, h, inter in [(1, 8, 256, 2048, 512), (32, 8, 64, 2048, 1024), (4096, 8, 64, 4096, 1536)]:
        for dtype in (torch.float32, torch.bfloat16):
            plain = tm.choose_config(T, k, E, E, h, inter, dtype, n_virt=1)
            fp8 = tm.choose_config(T, k, E, E, h, inter, dtype, n_virt=1, weight_dtype=torch.float8_e4m3fn)
            assert dk.FP8_BLOCK % fp8.bk1 == 0 and dk.FP8_BLOCK % fp8.bk2 == 0
            assert fp8.stages1 >= plain.stages1 and fp8.stages2 >= plain.stages2
    hidden, router, w13, w2 = make(3, 4)
    q13, q2, kw = quantized(w13, w2)
    with pytest.raises(ValueError, match="^config"):
        call_backend("triton", device, hidden, router, q13, q2, 2, config={"bk1": 256}, **kw)


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
    check("triton", device, hidden, router, w13, w2, 2, experts=(1, 4))
    # A shared expert of 2 virtual experts (the last 28 wide: act columns past it stay unwritten), FP8.
    q13, q2, kw = quantized(w13, w2, make_shared(100))
    check(
        "triton", device, hidden, router, q13, q2, 2, experts=(1, 4), config={"split_k": 2, "bk2": 32}, **kw
    )


# ---- local experts and a given top-k (expert parallelism) ---------------------------------------------

# (T, E, k, dtype): one token, prime counts; bf16 on the host kernel and GPUs only (the interpreter's
# bf16 arithmetic is unreliable).
SLICE_CASES = [(1, 8, 2, torch.float32), (13, 7, 3, torch.float16), (31, 12, 4, torch.float32)]


def slices(E):
    """Offset 0, a middle slice, the last expert alone."""
    return [(0, E // 3), (E // 3, E // 3 + 2), (E - 1, E)]


def dtype_ok(backend, device, dtype):
    return dtype != torch.bfloat16 or backend != "triton" or device != "cpu"


@pytest.mark.parametrize("backend,device", ALL_PAIRS)
@pytest.mark.parametrize("T,E,k,dtype", SLICE_CASES + [(17, 8, 2, torch.bfloat16)])
@pytest.mark.usefixtures("host_isa")
def test_local_experts_against_reference(backend, device, T, E, k, dtype):
    if not dtype_ok(backend, device, dtype):
        pytest.skip("bf16 under the Triton interpreter")
    hidden, router, w13, w2 = make(T, E, dtype, seed=T)
    parts = [check(backend, device, hidden, router, w13, w2, k, experts=r, config=WIDE) for r in slices(E)]
    rest = (slices(E)[1][1], E - 1)  # the experts between the middle slice and the last
    parts.append(check(backend, device, hidden, router, w13, w2, k, experts=rest, config=WIDE))
    whole = check(backend, device, hidden, router, w13, w2, k, config=WIDE)
    if dtype == torch.float32:  # (16-bit parts are each rounded: their sum is not the layer's precision)
        total = sum(p.double() for p in parts).float()
        assert_precision(total, whole, moe_truth(hidden, router, w13, w2, k), "sum of the slices")


@pytest.mark.parametrize("backend,device", ALL_PAIRS)
@pytest.mark.usefixtures("host_isa")
def test_local_experts_with_llada2_routing_and_a_slice_nobody_routes_to(backend, device):
    hidden, router, w13, w2 = make(11, 8, seed=3)
    bias = torch.rand(8) * 0.1
    kw = dict(scoring="sigmoid", num_groups=4, topk_groups=2, renormalize=True, routed_scaling=2.5)
    for r in ((0, 2), (2, 5), (6, 8)):
        check(backend, device, hidden, router, w13, w2, 3, experts=r, expert_bias=bias, config=WIDE, **kw)
    logits = torch.randn(11, 8)
    logits[:, 2:4] = -40.0  # experts 2 and 3: no token
    out = check(backend, device, hidden, router, w13, w2, 2, router_logits=logits, experts=(2, 4))
    assert torch.equal(out, torch.zeros_like(out))


def given_topk(T, E, k, seed, id_dtype=torch.int64):
    """Random distinct experts per row and weights; some ids outside [0, E) (-1, E + 5)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E + 2, generator=g)[:k] for _ in range(T)]) - 1
    ids = torch.where(ids == E, E + 5, ids).to(id_dtype)
    return ids, torch.rand(T, k, generator=g) * 2 - 0.5


@pytest.mark.parametrize("backend,device", ALL_PAIRS)
@pytest.mark.parametrize("T,E,k,dtype", SLICE_CASES + [(5, 6, 1, torch.float32), (17, 8, 2, torch.bfloat16)])
@pytest.mark.usefixtures("host_isa")
def test_given_topk_against_reference(backend, device, T, E, k, dtype):
    if not dtype_ok(backend, device, dtype):
        pytest.skip("bf16 under the Triton interpreter")
    hidden, router, w13, w2 = make(T, E, dtype, seed=T + 1)
    for i, r in enumerate(slices(E) + [(0, E)]):
        ids, w = given_topk(T, E, k, seed=i, id_dtype=(torch.int32, torch.int64)[i % 2])
        check(backend, device, hidden, None, w13, w2, k, topk_ids=ids, topk_weights=w, experts=r, config=WIDE)
    ids = torch.full((T, 1), 1, dtype=torch.int64)  # the all-to-all rows: one pair each, all to one expert
    ids[::2] = 2**40  # far outside (an int64 id must not wrap into the slice)
    check(
        backend, device, hidden, None, w13, w2, 1, topk_ids=ids, topk_weights=torch.rand(T, 1), experts=(1, 3)
    )


@pytest.mark.parametrize("backend,device", ALL_PAIRS)
@pytest.mark.usefixtures("host_isa")
def test_given_topk_repeating_an_expert(backend, device):
    hidden, router, w13, w2 = make(9, 6, seed=4)
    ids = torch.tensor([[2, 2, 3]] * 9)
    check(
        backend, device, hidden, None, w13, w2, 3, topk_ids=ids, topk_weights=torch.rand(9, 3), experts=(1, 4)
    )


def test_given_topk_of_the_router_is_the_routed_layer():
    hidden, router, w13, w2 = make(10, 8)
    bias = torch.rand(8) * 0.1
    kw = dict(scoring="sigmoid", num_groups=4, topk_groups=2, renormalize=True, routed_scaling=2.5)
    weights, ids = dk.moe_route(hidden, router, 3, expert_bias=bias, **kw)
    want_w, want_ids = route(hidden, router, 3, expert_bias=bias, **kw)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
    got = dk.moe(hidden, None, w13[2:6], w2[2:6], 3, topk_ids=ids, topk_weights=weights, expert_offset=2)
    want = dk.moe(hidden, router, w13[2:6], w2[2:6], 3, expert_bias=bias, expert_offset=2, **kw)
    truth = moe_truth(hidden, router, w13, w2, 3, expert_bias=bias, experts=(2, 6), **kw)
    assert_precision(got, want, truth, "moe of moe_route's top-k")


def test_pairs_outside_the_slice_cost_no_expert_compute():
    """The reference (the spec) runs the expert GEMMs on the local pairs' rows only."""
    from torch.utils.flop_counter import FlopCounterMode

    hidden, router, w13, w2 = make(12, 8)
    ids = torch.tensor([[0, 5]] * 3 + [[1, 2]] * 9)
    w = torch.rand(12, 2)

    def flops(e0, e1):
        # The reference itself: through the registered op the counter sees one opaque dinfer::moe.
        with FlopCounterMode(display=False) as counter:
            moe_reference(
                hidden, None, w13[e0:e1], w2[e0:e1], 2, expert_offset=e0, topk_ids=ids, topk_weights=w
            )
        return counter.get_total_flops()

    per_row = 2 * 3 * H * I  # gate, up and down: 3 H x I products per routed row
    assert flops(4, 8) == 3 * per_row and flops(0, 2) == 12 * per_row and flops(6, 8) == 0


def test_bad_given_topk_and_offsets_name_the_argument():
    hidden, router, w13, w2 = make(4, 8)
    ids, w = torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2)
    cases = [
        (dict(topk_ids=ids.float()), "topk_ids"),
        (dict(topk_ids=ids[:3]), "topk_ids"),
        (dict(topk_weights=w[:, :1]), "topk_weights"),
        (dict(topk_weights=w.long()), "topk_weights"),
        (dict(top_k=3), "top_k"),
        (dict(expert_offset=-2), "expert_offset"),
        (dict(renormalize=True), "renormalize"),
        (dict(scoring="sigmoid"), "scoring"),
        (dict(expert_bias=torch.zeros(8)), "expert_bias"),
        (dict(num_groups=2), "num_groups"),
        (dict(routed_scaling=2.5), "routed_scaling"),
        (dict(router_logits=torch.zeros(4, 8)), "router_weight, router_logits, topk_ids"),
    ]
    for over, name in cases:
        args = dict(top_k=2, topk_ids=ids, topk_weights=w)
        args.update(over)
        with pytest.raises((ValueError, TypeError), match=f"^{name}"):
            dk.moe(hidden, None, w13, w2, args.pop("top_k"), **args)
    with pytest.raises(ValueError, match="^router_weight"):
        dk.moe_route(hidden, None, 2)
    with pytest.raises(ValueError, match="^top_k"):
        dk.moe_route(hidden, router, 9)


# ---- a shared expert and FP8 weights (issue 40) --------------------------------------------------------

# (T, E, k, S, dtype): S = I (one virtual expert of the Triton kernels), S < I, S > I and no multiple of
# it (72 + 72 + 6), one token and primes; bf16 where the interpreter is not involved.
SHARED_CASES = [
    (1, 8, 2, I, torch.float32),
    (13, 7, 3, 150, torch.float16),
    (31, 8, 2, 40, torch.float32),
    (17, 8, 2, 150, torch.bfloat16),
]


@pytest.mark.parametrize("backend,device", ALL_PAIRS)
@pytest.mark.parametrize("T,E,k,S,dtype", SHARED_CASES)
@pytest.mark.usefixtures("host_isa")
def test_shared_expert_against_reference(backend, device, T, E, k, S, dtype):
    """Every token takes the shared expert with weight 1, added to the routed sum: with the router,
    router logits, a given top-k, and on slices of the local experts (expert_offset)."""
    if not dtype_ok(backend, device, dtype):
        pytest.skip("bf16 under the Triton interpreter")
    hidden, router, w13, w2 = make(T, E, dtype, seed=T)
    shared = make_shared(S, dtype, seed=T)
    check(backend, device, hidden, router, w13, w2, k, config=WIDE, **shared)
    check(backend, device, hidden, router, w13, w2, k, experts=(2, 5), config=WIDE, **shared)
    logits = torch.randn(T, E)
    check(backend, device, hidden, router, w13, w2, k, router_logits=logits, experts=(E - 1, E), **shared)
    ids, w = given_topk(T, E, k, seed=T)
    check(backend, device, hidden, None, w13, w2, k, topk_ids=ids, topk_weights=w, experts=(1, 4), **shared)


@pytest.mark.parametrize("backend,device", ALL_PAIRS)
@pytest.mark.usefixtures("host_isa")
def test_shared_expert_with_llada2_routing_and_no_routed_rows(backend, device):
    """LLaDA2's grouped sigmoid routing (renormalised, scaled by 2.5: the shared expert is not); a
    slice nobody routes to and a given top-k that never names the slice give the shared expert alone."""
    hidden, router, w13, w2 = make(11, 8, seed=3)
    shared = make_shared(96, seed=3)
    kw = dict(scoring="sigmoid", num_groups=4, topk_groups=2, renormalize=True, routed_scaling=2.5)
    bias = torch.rand(8) * 0.1
    check(backend, device, hidden, router, w13, w2, 3, expert_bias=bias, config=WIDE, **kw, **shared)
    check(backend, device, hidden, router, w13, w2, 3, experts=(2, 5), expert_bias=bias, **kw, **shared)
    logits = torch.randn(11, 8)
    logits[:, 2:4] = -40.0  # experts 2 and 3: no token
    alone = check(backend, device, hidden, router, w13, w2, 2, router_logits=logits, experts=(2, 4), **shared)
    ids = torch.full((11, 2), 7)
    also = check(
        backend,
        device,
        hidden,
        None,
        w13,
        w2,
        2,
        topk_ids=ids,
        topk_weights=torch.rand(11, 2),
        experts=(2, 4),
        **shared,
    )
    assert torch.equal(alone, also)
    assert alone.abs().amax() > 0
    # Shared weights stored column-major (their K stride is not 1).
    strided = {name: t.t().contiguous().t() for name, t in shared.items()}
    check(backend, device, hidden, router, w13, w2, 2, router_logits=logits, experts=(1, 4), **strided)


# (T, E, k, h, inter, S, dtype): I = 72 (one partial scale block, no multiple of 16), I = 200 over two
# blocks with H = 300 over three; S = 0 (none), S = 150 whose second virtual expert starts mid-block.
FP8_CASES = [
    (1, 8, 2, H, I, 0, torch.float32),
    (13, 8, 3, H, I, 150, torch.float16),
    (5, 4, 2, 300, 200, 300, torch.float32),
    (17, 8, 2, H, I, 150, torch.bfloat16),
]


@pytest.mark.parametrize("backend,device", ALL_PAIRS)
@pytest.mark.parametrize("T,E,k,h,inter,S,dtype", FP8_CASES)
@pytest.mark.usefixtures("host_isa")
def test_fp8_weights_against_reference(backend, device, T, E, k, h, inter, S, dtype):
    """float8_e4m3fn experts with 128 x 128 block scales (and a shared expert in FP8 when S > 0),
    against the truth on the float64-dequantised weights; with a slice of local experts."""
    if not dtype_ok(backend, device, dtype):
        pytest.skip("bf16 under the Triton interpreter")
    hidden, router, w13, w2 = make(T, E, dtype, h=h, inter=inter, seed=T)
    q13, q2, kw = quantized(w13.float(), w2.float(), make_shared(S, h=h, seed=T) if S else None)
    check(backend, device, hidden, router, q13, q2, k, config=WIDE, **kw)
    check(backend, device, hidden, router, q13, q2, k, experts=(1, 3), config=WIDE, **kw)


@pytest.mark.parametrize("backend,device", ALL_PAIRS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.usefixtures("host_isa")
def test_fp8_call_equals_the_call_on_dequantised_weights(backend, device, dtype):
    """The contract's dequantisation (fp32 product rounded to the activations' dtype) is what the
    backend computes with: the FP8 call equals the call on fp8_block_dequantize's weights, to a few
    fp32 ulps with fp32 activations, within the same-precision bound in fp16. LLaDA2's routing, a
    shared expert over three virtual experts, a slice of local experts."""
    hidden, router, w13, w2 = make(9, 8, dtype, seed=5)
    q13, q2, kw = quantized(w13.float(), w2.float(), make_shared(150, seed=5))
    deq = dict(
        shared_w13=dk.fp8_block_dequantize(kw["shared_w13"], kw["shared_w13_scale"], dtype, halves=2),
        shared_w2=dk.fp8_block_dequantize(kw["shared_w2"], kw["shared_w2_scale"], dtype),
    )
    w13_d = dk.fp8_block_dequantize(q13, kw["w13_scale"], dtype, halves=2)
    w2_d = dk.fp8_block_dequantize(q2, kw["w2_scale"], dtype)
    routing = dict(scoring="sigmoid", num_groups=4, topk_groups=2, renormalize=True, routed_scaling=2.5)
    routing["expert_bias"] = torch.rand(8) * 0.1
    e0, e1 = 1, 6
    fp8_kw = dict(kw, w13_scale=kw["w13_scale"][e0:e1], w2_scale=kw["w2_scale"][e0:e1])
    args = (backend, device, hidden, router)
    got = call_backend(*args, q13[e0:e1], q2[e0:e1], 3, expert_offset=e0, config=WIDE, **routing, **fp8_kw)
    want = call_backend(*args, w13_d[e0:e1], w2_d[e0:e1], 3, expert_offset=e0, config=WIDE, **routing, **deq)
    assert not got.isnan().any()
    if dtype == torch.float32:
        assert_precision(got, want, want, "FP8 against its dequantised weights")
    else:
        truth = moe_truth(hidden, router, q13, q2, 3, experts=(e0, e1), **routing, **kw)
        assert_precision(got, want, truth, "FP8 against its dequantised weights")


def test_bad_shared_and_fp8_inputs_name_the_argument():
    hidden, router, w13, w2 = make(4, 8, inter=130)
    sh = make_shared(20)
    q13, q2, kw = quantized(w13, w2, make_shared(20))
    plain = dict(w13=w13, w2=w2)
    fp8 = dict(w13=q13, w2=q2, w13_scale=kw["w13_scale"], w2_scale=kw["w2_scale"])
    fp8_shared = dict(fp8, **kw)
    cases = [
        (dict(plain, shared_w13=sh["shared_w13"]), "shared_w2"),
        (dict(plain, shared_w2=sh["shared_w2"]), "shared_w13"),
        (dict(plain, shared_w13=sh["shared_w13"][:-1], shared_w2=sh["shared_w2"]), "shared_w13"),
        (dict(plain, shared_w13=sh["shared_w13"][:, :-1], shared_w2=sh["shared_w2"]), "shared_w13"),
        (dict(plain, shared_w13=sh["shared_w13"], shared_w2=sh["shared_w2"][:, :-1]), "shared_w2"),
        (dict(plain, shared_w13=sh["shared_w13"].half(), shared_w2=sh["shared_w2"]), "shared_w13"),
        (dict(plain, shared_w13=sh["shared_w13"][None], shared_w2=sh["shared_w2"]), "shared_w13"),
        (dict(plain, w13_scale=kw["w13_scale"]), "w13_scale"),
        (dict(plain, **sh, shared_w13_scale=kw["shared_w13_scale"]), "shared_w13_scale"),
        (dict(fp8, w13_scale=None), "w13_scale"),
        (dict(fp8, w2_scale=None), "w2_scale"),
        (dict(fp8, w2=w2), "w2"),
        (dict(fp8, w13_scale=kw["w13_scale"].half()), "w13_scale"),
        (dict(fp8, w13_scale=kw["w13_scale"][:, :-1]), "w13_scale"),  # the plain grid of 2I rows
        (dict(fp8, w2_scale=kw["w2_scale"][:-1]), "w2_scale"),
        (dict(fp8, w2_scale=kw["w2_scale"].transpose(1, 2).contiguous().transpose(1, 2)), "w2_scale"),
        (dict(fp8, shared_w13_scale=kw["shared_w13_scale"]), "shared_w13_scale"),  # no shared expert
        (dict(fp8, shared_w13=kw["shared_w13"], shared_w2=kw["shared_w2"]), "shared_w13_scale"),
        (dict(fp8_shared, shared_w2_scale=None), "shared_w2_scale"),
        (dict(fp8_shared, shared_w2_scale=kw["shared_w2_scale"][:, :0]), "shared_w2_scale"),
        (dict(fp8_shared, shared_w13=sh["shared_w13"]), "shared_w13"),  # fp32 next to FP8 experts
        (dict(plain, shared_w13=kw["shared_w13"], shared_w2=kw["shared_w2"]), "shared_w13"),
    ]
    for args, name in cases:
        args = dict(args)
        with pytest.raises((ValueError, TypeError), match=f"^{name}"):
            dk.moe(hidden, router, args.pop("w13"), args.pop("w2"), 2, **args)


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
        (dict(expert_offset=1), "expert_offset"),
        (dict(expert_offset=-1), "expert_offset"),
        (dict(expert_offset=1.0), "expert_offset"),
        (dict(w13=w13[3:], w2=w2[3:], expert_offset=4), "expert_offset"),
        (dict(w13=torch.cat([w13, w13[:1]]), w2=torch.cat([w2, w2[:1]])), "w13"),
        (dict(router_weight=None, topk_ids=torch.zeros(4, 2, dtype=torch.int64)), "topk_weights"),
        (dict(router_weight=None, topk_weights=torch.ones(4, 2)), "topk_ids"),
        (dict(topk_ids=torch.zeros(4, 2, dtype=torch.int64), topk_weights=torch.ones(4, 2)), "router_weight"),
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
    bias = d(torch.rand(8))
    plain = (None,) * 6  # no shared expert, no FP8 scales
    routed = (
        d(hidden),
        d(router),
        None,
        None,
        None,
        d(w13),
        d(w2),
        2,
        True,
        1,
        bias,
        4,
        2,
        2.5,
        0,
        *plain,
        backend,
    )
    ids, w = d(torch.tensor([[5, 6], [0, 7], [6, 6]])), d(torch.rand(3, 2))
    given = (
        d(hidden),
        None,
        None,
        ids,
        w,
        d(w13[5:]),
        d(w2[5:]),
        2,
        False,
        0,
        None,
        1,
        1,
        1.0,
        5,
        *plain,
        backend,
    )
    # FP8 experts and an FP8 shared expert on a slice, from router logits.
    q13, q2, kw = quantized(w13, w2, make_shared(80))
    weights = [d(kw[name]) for name in WEIGHT_KW]
    weights[2:4] = [d(kw["w13_scale"][2:6]), d(kw["w2_scale"][2:6])]
    issue40 = (
        d(hidden.half()),
        None,
        d(torch.randn(3, 8)),
        None,
        None,
        d(q13[2:6]),
        d(q2[2:6]),
        3,
        False,
        0,
        None,
        1,
        1,
        1.0,
        2,
        *weights,
        backend,
    )
    for args in (routed, given):
        torch.library.opcheck(
            torch.ops.dinfer.moe.default,
            args,
            test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
        )
    # test_schema's mutation check compares every input with allclose, which torch lacks for
    # float8_e4m3fn: the schema is the one checked above; the rest runs with FP8 inputs.
    torch.library.opcheck(
        torch.ops.dinfer.moe.default, issue40, test_utils=("test_faketensor", "test_aot_dispatch_dynamic")
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

    q13, q2, kw = quantized(w13, w2, make_shared(80))
    kw = {name: d(t) for name, t in kw.items()}

    def g(x, r, a, b):  # FP8 experts and shared expert
        return dk.moe(x * 2.0, r, a, b, 2, backend=backend, **kw) + 1.0

    torch._dynamo.reset()
    got = torch.compile(g, fullgraph=True, backend="aot_eager")(d(hidden), d(router), d(q13), d(q2))
    assert torch.equal(got, g(d(hidden), d(router), d(q13), d(q2)))


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
@pytest.mark.parametrize("T", [1, 32, 512])
def test_llada2_shape_shared_fp8_gpu(backend, T):
    """LLaDA2-mini's expert shapes (H 2048, I = S = 512, grouped sigmoid routing, a shared expert)
    with FP8 experts in bf16, on 64 of its experts (the weights stay small)."""
    E, h, inter = 64, 2048, 512
    hidden, router, w13, w2 = make(T, E, torch.bfloat16, h=h, inter=inter)
    dev = lambda t: t.to(GPU)
    q13, q2, kw = quantized(dev(w13).float(), dev(w2).float(), make_shared(inter, h=h))
    kw.update(
        scoring="sigmoid",
        expert_bias=torch.rand(E) * 0.1,
        num_groups=8,
        topk_groups=4,
        renormalize=True,
        routed_scaling=2.5,
    )
    kw = {name: dev(t) if isinstance(t, torch.Tensor) else t for name, t in kw.items()}
    hidden, router = dev(hidden), dev(router)
    out = call_backend(backend, GPU, hidden, router, q13, q2, 8, **kw)
    same = moe_reference(hidden, router, q13, q2, 8, **kw).cpu()
    truth = moe_truth(hidden, router, q13, q2, 8, **kw).cpu()
    assert not out.isnan().any()
    assert_precision(out, same, truth, f"LLaDA2 shape T={T}[{backend}]")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [b for b, d in KERNEL_PAIRS if d == GPU])
@pytest.mark.parametrize("variant", ["bf16", "shared_fp8"])
def test_cuda_graph_capture_gpu(backend, variant):
    """Grids and buffers fixed by the shapes: a captured call replays on new hidden states (with a
    shared expert and FP8 weights too: the virtual experts' rows are fixed by T)."""
    hidden, router, w13, w2 = make(64, 64, torch.bfloat16, h=256, inter=128)
    kw = {}
    if variant == "shared_fp8":
        w13, w2, kw = quantized(w13.float(), w2.float(), make_shared(200, h=256))
    hidden, router, w13, w2 = [t.to(GPU) for t in (hidden, router, w13, w2)]
    kw = {name: t.to(GPU) for name, t in kw.items()}
    kw.update(
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
