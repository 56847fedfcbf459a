"""Microbenchmark of the MoE layer at a released shape: the torch expert loop, torch._grouped_mm (alone
and in a pipeline), a plain Triton grouped GEMM and dinfer_kernels.moe, with the weights in the
activations' dtype or in FP8.

    python bench_kernels/bench_moe.py [--device cpu|cuda] [--shape llada-moe|llada2-mini]
        [--weights bf16,fp8] [--tokens 32,96,512,2048] [--experts E] [--top-k K] [--hidden H]
        [--inter I] [--shared S] [--small] [--dtype bf16|fp16|fp32] [--methods ...] [--quick]
        [--json out.json]

Shapes, from the released configs (bench_kernels/synthetic_model.py):
  llada-moe    LLaDA-MoE-7B: E = 64, top-8, H = 2048, I = 1024, softmax router, no renormalisation
  llada2-mini  LLaDA2.0-mini: E = 256, top-8, H = 2048, I = 512, sigmoid router with an expert bias
               (drawn as 0.05 * randn: it only chooses), 8 groups of which 4 kept, renormalised,
               routed_scaling 2.5, and one shared expert of width S = 512 passed to the op (fused)
--small (default on the CPU) shrinks them: llada-moe to E = 8, H = 256, I = 128; llada2-mini to
E = 16, H = 256, I = S = 64 (its groups and top-k kept). The router is in fp32, as loaders keep it.
--weights: the expert weights in the activations' dtype (its name: bf16 on a GPU, fp32 on the CPU by
default) and / or fp8 (float8_e4m3fn with 128 x 128 block scales from dinfer_kernels.fp8_block_quantize
of the same drawn values; activations stay in --dtype). Methods (--methods picks a subset):
  torch_loop        dinfer_kernels/reference/moe.py: one pair of GEMMs per touched expert (host syncs
                    on the routing, so timed with do_bench, never in a CUDA graph); fp8: it dequantises
  grouped_mm        "torch._grouped_mm": the reference's torch routing + sort, torch._grouped_mm over
                    w13, silu*mul, torch._grouped_mm over w2, a weighted index_add, the shared expert
                    as a separate dense MLP (torch matmuls)
  grouped_mm_alone  "torch._grouped_mm alone": only the two grouped GEMMs, on inputs sorted by expert
                    beforehand (the gathered rows and the silu*mul of the first GEMM's output, made
                    untimed), the shared expert as ceil(S/I) more groups of width I that every row
                    takes (zero-padded to I); its output combined untimed for the diff column
  triton_plain      our routing/alignment kernel, then a plain Triton grouped GEMM (no fused
                    epilogue; fp8: each weight tile dequantised on load) over w13, torch silu*mul, the
                    same GEMM over w2, a torch weighted index_add, the shared expert as a dense MLP
                    (fp8: its weights dequantised per call)
  ours              dinfer_kernels.moe(backend=b), shared expert and scales passed to the op, for the
                    kernel backends available here (--backends: a subset)
  ours_grouped_mm   "ours, GEMMs by torch._grouped_mm": the Triton backend with config gemm =
                    "grouped_mm" (our routing, alignment, silu*mul and combine around torch's grouped
                    GEMMs, experts_grouped_mm in dinfer_kernels/triton/moe.py): the delegation the default
                    takes where this row wins (weights in the activations' dtype, where the triton
                    backend and torch._grouped_mm both run)
The torch._grouped_mm rows need a torch that has it (on a GPU: SM80+, bf16) and weights in the
activations' dtype (it has no 128 x 128 block-scaled FP8); a note says where they did not run.
Measured in the same run: the bandwidth yardsticks of timing.py (copy, read-only kernel; beside the
GPU's datasheet HBM) and the dense matmul rate of the dtype (a square torch matmul). Columns: median
time, GB/s over the weight bytes the call must read (the distinct experts touched x an expert's bytes,
scales included, plus the shared expert's), % of each bandwidth yardstick (% HBM spec: of the
datasheet), TFLOP/s over the layer's FLOPs (6*T*k*H*I routed + 6*T*H*S shared), % of the matmul rate
and of the datasheet's dense bf16 rate, speedup vs the torch loop, max |diff| vs the torch loop
relative to its max |value|, (ours) whether two runs are bit-identical, and on the CPU what
backend="auto" picks for the shape (dinfer_kernels/_backend.py MOE_HOST_WINS, per ISA and dtype).
One table per T and weights, in that order (a run cut short keeps the T = 32 tables first).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout  # noqa: F401  (puts the checkout's dinfer and dinfer_kernels on sys.path)
import cli_options
import environment
import markdown_tables
import results_json
import synthetic_model
import timing
import torch

# --shape: the released model whose MoE layer is timed (synthetic_model.RELEASED's name)
SHAPES = {"llada-moe": "llada-moe-7b", "llada2-mini": "llada2-mini"}
SMALL = {
    "llada-moe": dict(experts=8, hidden=256, inter=128, shared=0),
    "llada2-mini": dict(experts=16, hidden=256, inter=64, shared=64),
}
BIAS_SCALE = 0.05  # LLaDA2's expert bias: drawn, as the synthetic model's zeros would not be read
METHODS = ("torch_loop", "grouped_mm", "grouped_mm_alone", "triton_plain", "ours", "ours_grouped_mm")


def layer_shape(args):
    """E, top-k, H, I, S and the router's options of --shape, with --small and the size options."""
    c = synthetic_model.config(SHAPES[args.shape], layers=1)
    small = SMALL[args.shape] if args.small else {}
    E = args.experts or small.get("experts") or c.num_experts
    pick = lambda given, name, full: given if given is not None else small.get(name, full)
    return dict(
        E=E,
        k=min(args.top_k or c.top_k, E),
        H=pick(args.hidden, "hidden", c.hidden_size),
        I=pick(args.inter, "inter", c.expert_intermediate_size),
        S=pick(args.shared, "shared", c.shared_intermediate_size),
        bias=c.expert_bias,
        routing=dict(
            renormalize=c.router_renormalize,
            scoring=c.router_scoring,
            num_groups=c.num_groups,
            topk_groups=c.topk_groups,
            routed_scaling=c.routed_scaling,
        ),
    )


# ------------------------------------------------------------------------------------- baselines
def torch_route(call):
    """The reference's routing of a call: (weights [T, k] fp32, experts [T, k] int64)."""
    from dinfer_kernels.reference.moe import route

    return route(
        call["hidden"],
        call["router_weight"],
        call["top_k"],
        call["renormalize"],
        call.get("expert_bias"),
        scoring=call["scoring"],
        num_groups=call["num_groups"],
        topk_groups=call["topk_groups"],
        routed_scaling=call["routed_scaling"],
    )


def silu_mul(gu, dtype):
    inter = gu.shape[-1] // 2
    return (torch.nn.functional.silu(gu[:, :inter].float()) * gu[:, inter:].float()).to(dtype)


def shared_mlp(x, call):
    """The shared expert as a separate dense MLP (torch matmuls), in fp32; fp8 weights dequantised."""
    import dinfer_kernels as dk

    w13, w2 = call["shared_w13"], call["shared_w2"]
    if "shared_w13_scale" in call:
        w13 = dk.fp8_block_dequantize(w13, call["shared_w13_scale"], x.dtype, halves=2)
        w2 = dk.fp8_block_dequantize(w2, call["shared_w2_scale"], x.dtype)
    return (silu_mul(x @ w13.t(), x.dtype) @ w2.t()).float()


def grouped_mm_moe(call):
    """The torch._grouped_mm pipeline; no host sync (counts stay on the device)."""
    hidden, w13, w2, top_k = call["hidden"], call["w13"], call["w2"], call["top_k"]
    T, H = hidden.shape
    w, e = torch_route(call)
    flat = e.flatten()
    order = torch.argsort(flat, stable=True)
    tok = order // top_k
    counts = torch.zeros(w13.shape[0], dtype=torch.int32, device=hidden.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32)
    )
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    gu = torch._grouped_mm(hidden[tok], w13.transpose(1, 2), offs=offs)
    y = torch._grouped_mm(silu_mul(gu, hidden.dtype), w2.transpose(1, 2), offs=offs)
    out = torch.zeros(T, H, dtype=torch.float32, device=hidden.device)
    out.index_add_(0, tok, y.float() * w.flatten()[order, None])
    if "shared_w13" in call:
        out += shared_mlp(hidden, call)
    return out.to(hidden.dtype)


def shared_as_experts(shared_w13, shared_w2, inter):
    """The shared expert [2S, H], [H, S] as ceil(S/I) experts of width I, the last zero-padded:
    ([n, 2I, H], [n, H, I]) in the routed experts' layout (gate rows, then up rows)."""
    S, H = shared_w2.shape[1], shared_w2.shape[0]
    n = -(-S // inter)
    pad = lambda w: torch.nn.functional.pad(w, (0, 0, 0, n * inter - S)).view(n, inter, H)
    w13 = torch.cat([pad(shared_w13[:S]), pad(shared_w13[S:])], dim=1)
    w2 = torch.nn.functional.pad(shared_w2, (0, n * inter - S)).view(H, n, inter).transpose(0, 1)
    return w13, w2.contiguous()


def make_grouped_mm_alone(call):
    """(gemms, combine): gemms() runs only the two torch._grouped_mm calls on inputs sorted by expert
    beforehand; combine(y) is the layer's output from their result (untimed, for the diff column)."""
    hidden, w13, w2, top_k = call["hidden"], call["w13"], call["w2"], call["top_k"]
    T, H = hidden.shape
    E, inter = w13.shape[0], w13.shape[1] // 2
    w, e = torch_route(call)
    flat = e.flatten()
    order = torch.argsort(flat, stable=True)
    tok = order // top_k
    wgt = w.flatten()[order]
    counts = torch.bincount(flat, minlength=E)
    if "shared_w13" in call:  # every token in each of the shared expert's groups, weight 1
        sw13, sw2 = shared_as_experts(call["shared_w13"], call["shared_w2"], inter)
        w13, w2 = torch.cat([w13, sw13]), torch.cat([w2, sw2])
        n = sw13.shape[0]
        tok = torch.cat([tok, torch.arange(T, device=hidden.device).repeat(n)])
        wgt = torch.cat([wgt, torch.ones(n * T, device=hidden.device)])
        counts = torch.cat([counts, torch.full((n,), T, device=hidden.device)])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    rows = hidden[tok]
    w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)
    act = silu_mul(torch._grouped_mm(rows, w13_t, offs=offs), hidden.dtype)

    def gemms():
        torch._grouped_mm(rows, w13_t, offs=offs)
        return torch._grouped_mm(act, w2_t, offs=offs)

    def combine(y):
        out = torch.zeros(T, H, dtype=torch.float32, device=hidden.device)
        return out.index_add_(0, tok, y.float() * wgt[:, None]).to(hidden.dtype)

    return gemms, combine


def _plain_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def plain_grouped_gemm(
        a,
        s_am,
        s_ak,
        b,
        s_be,
        s_bn,
        s_bk,
        scale,
        s_se,
        s_sn,
        s_sk,
        c,
        sorted_ids,
        block_expert,
        n_assign,
        N,
        K,
        HALF,
        TOP_K: tl.constexpr,
        GATHER: tl.constexpr,
        SCALED: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        """C[p] = A[row(p)] @ B[e]^T for the rows p of block program_id(0), expert e of the block;
        row(p) = token of the slot (GATHER) or p itself. SCALED: B is fp8 with 128 x 128 block scales
        [E, blocks of N, blocks of K], rows [HALF, N) on a block grid of their own (a gate/up stack);
        each tile is dequantised on load (fp32 product, rounded to A's dtype). BK divides 128."""
        blk = tl.program_id(0)
        e = tl.load(block_expert + blk)
        if e < 0:
            return
        p = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        slot = tl.load(sorted_ids + p)
        valid = slot < n_assign
        rows = (slot // TOP_K) if GATHER else p
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        if SCALED:
            srow = tl.where(cols < HALF, cols // 128, (HALF + 127) // 128 + (cols - HALF) // 128)
        acc = tl.zeros([BLOCK_M, BN], tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            x = tl.load(
                a + rows.to(tl.int64)[:, None] * s_am + kk[None, :] * s_ak,
                mask=valid[:, None] & (kk[None, :] < K),
                other=0.0,
            )
            w = tl.load(
                b + e.to(tl.int64) * s_be + cols.to(tl.int64)[:, None] * s_bn + kk[None, :] * s_bk,
                mask=(cols[:, None] < N) & (kk[None, :] < K),
                other=0.0,
            )
            if SCALED:
                sc = tl.load(
                    scale + e.to(tl.int64) * s_se + srow * s_sn + (k0 // 128) * s_sk,
                    mask=cols < N,
                    other=0.0,
                )
                w = (w.to(tl.float32) * sc[:, None]).to(x.dtype)
            acc = tl.dot(x, tl.trans(w), acc)
        tl.store(
            c + p.to(tl.int64)[:, None] * N + cols[None, :],
            acc.to(c.dtype.element_ty),
            mask=cols[None, :] < N,
        )

    return plain_grouped_gemm


def make_plain_triton(call):
    """Our routing + alignment, then unfused grouped GEMMs (vLLM's small-M fallback tile, BN 32-64)."""
    import triton

    from dinfer_kernels.triton import moe as tm

    kernel = _plain_kernel()
    hidden, router, w13, w2, top_k = (call[n] for n in ("hidden", "router_weight", "w13", "w2", "top_k"))
    T, H = hidden.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    cfg = tm.choose_config(T, top_k, E, E, H, inter, hidden.dtype)
    bn, bk = 64, 64
    n = T * top_k
    s13, s2 = call.get("w13_scale"), call.get("w2_scale")
    scaled = s13 is not None

    def gemm(x, w, s, out, N, K, half, gather, ws):
        kernel[(ws.nb_max, triton.cdiv(N, bn))](
            x,
            x.stride(0),
            x.stride(1),
            w,
            *w.stride(),
            s if scaled else w,
            *(s.stride() if scaled else (0, 0, 0)),
            out,
            ws.sorted_ids,
            ws.block_expert,
            n,
            N,
            K,
            half,
            TOP_K=top_k,
            GATHER=gather,
            SCALED=scaled,
            BLOCK_M=cfg.block_m,
            BN=bn,
            BK=bk,
            num_warps=4,
            num_stages=3,
        )

    def run(x):
        ws = tm.Workspace(T, top_k, E, inter, H, x.dtype, x.device, cfg)
        tm.route_and_align(
            x,
            router,
            None,
            top_k,
            call["renormalize"],
            call["scoring"],
            call.get("expert_bias"),
            call["num_groups"],
            call["topk_groups"],
            call["routed_scaling"],
            0,
            E,
            E,
            cfg,
            ws,
        )
        gu = torch.zeros((ws.p_max, two_i), dtype=x.dtype, device=x.device)
        gemm(x, w13, s13, gu, two_i, H, inter, True, ws)
        y = torch.zeros((ws.p_max, H), dtype=x.dtype, device=x.device)
        gemm(silu_mul(gu, x.dtype), w2, s2, y, H, inter, H, False, ws)
        rows = torch.arange(ws.p_max, device=x.device)
        slot = ws.sorted_ids.long()
        valid = (ws.block_expert.long()[rows // cfg.block_m] >= 0) & (slot >= 0) & (slot < n)
        slot = torch.where(valid, slot, 0)
        wgt = torch.where(valid, ws.topk_w[slot], 0.0)
        out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
        out.index_add_(0, slot // top_k, torch.nan_to_num(y.float()) * wgt[:, None])
        if "shared_w13" in call:
            out += shared_mlp(x, call)
        return out.to(x.dtype)

    return run


# --------------------------------------------------------------------------------------- helpers
def weight_bytes(call, touched):
    """The bytes a call must read: touched experts x one expert's weights and scales, plus the shared
    expert's."""
    per_expert = sum(
        t[0].numel() * t.element_size()
        for n, t in call.items()
        if n in ("w13", "w2", "w13_scale", "w2_scale")
    )
    shared = sum(t.numel() * t.element_size() for n, t in call.items() if n.startswith("shared_"))
    return touched * per_expert + shared


def ours_grouped_mm(call):
    """The Triton backend with its expert GEMMs delegated to torch._grouped_mm (a config override, not
    reachable through dinfer_kernels.moe until a GPU run picks it)."""
    from dinfer_kernels.triton.moe import moe as triton_moe

    out = torch.empty_like(call["hidden"])
    opts = dict(renormalize=False, scoring="softmax", num_groups=1, topk_groups=1, routed_scaling=1.0)
    opts.update({name: call[name] for name in opts if name in call})
    shared = {name: call[name] for name in ("shared_w13", "shared_w2") if call.get(name) is not None}
    triton_moe(
        call["hidden"],
        call["router_weight"],
        None,
        call["w13"],
        call["w2"],
        call.get("expert_bias"),
        out,
        top_k=call["top_k"],
        expert_offset=0,
        config={"gemm": "grouped_mm"},
        **opts,
        **shared,
    )
    return out


def grouped_mm_available(device, dtype):
    """torch._grouped_mm at this dtype: on a GPU its CUTLASS path (SM80+, bf16), on the host whatever
    this torch's fallback runs (a tiny call tried)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability()[0] >= 8
    try:
        a, b = torch.ones(2, 8, dtype=dtype), torch.ones(2, 8, 8, dtype=dtype)
        torch._grouped_mm(a, b, offs=torch.tensor([1, 2], dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def parse_weights(text, dtype_name):
    """--weights: names of the activations' dtype and / or fp8."""
    kinds = [w.strip() for w in text.split(",") if w.strip()] if text else [dtype_name]
    bad = [w for w in kinds if w not in (dtype_name, "fp8")]
    if bad or not kinds:
        raise SystemExit(
            f"--weights: expected {dtype_name} (the --dtype of the activations) and / or fp8, got {text!r}"
        )
    return kinds


def parse_methods(text):
    methods = [m.strip() for m in text.split(",") if m.strip()] if text else list(METHODS)
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise SystemExit(f"--methods: expected a subset of {','.join(METHODS)}, got {text!r}")
    return methods


# ------------------------------------------------------------------------------------------- run
def run(args):
    import dinfer_kernels
    from dinfer_kernels import _backend, op_inputs
    from dinfer_kernels.reference.moe import moe_reference

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU visible")
    if args.small is None:
        args.small = device == "cpu"
    shape = layer_shape(args)
    E, k, H, inter, S = (shape[n] for n in ("E", "k", "H", "I", "S"))
    tokens = (
        cli_options.parse_ints(args.tokens)
        if args.tokens
        else (
            [4, 32]
            if device == "cpu" and args.quick
            else [32, 96, 2048]
            if args.quick
            else [32, 96, 512, 2048]
        )
    )
    if args.dtype is None:  # the host's bf16 matmul is very slow: fp32 there by default
        args.dtype = "bf16" if device == "cuda" else "fp32"
    dtype = cli_options.torch_dtype(args.dtype)
    kinds = parse_weights(args.weights, args.dtype)
    methods = parse_methods(args.methods)
    env = environment.environment(device)
    notes = []
    print(
        f"# bench_moe  {args.shape}  device={device} ({env.get('gpu') or env['cpu']})  E={E} top-{k} H={H} "
        f"I={inter} S={S}  dtype={args.dtype}  weights={','.join(kinds)}  T={tokens}  commit={env['commit']}"
    )
    bw = timing.bandwidth_yardsticks(device, quick=args.quick)
    mm = timing.matmul_rate(device, dtype, args.quick)
    print(
        f"bandwidth: {timing.bandwidth_text(bw)}   {args.dtype} matmul ({mm['n']}^3): {mm['TFLOPs']:.3g} TFLOP/s"
    )

    # The same drawn values for every kind of weights (fp8: quantised), on the device (1.6 GB of
    # weights for LLaDA2-mini); the largest T's hidden rows, the first T of them per T.
    layers = {}
    for kind in kinds:
        layers[kind] = op_inputs.moe_inputs(
            max(tokens),
            E,
            H,
            inter,
            k,
            dtype=dtype,
            device=device,
            generator=torch.Generator(device=device).manual_seed(0),
            weight_scale=1.0,
            router_scale=H**-0.5,
            shared_inter=S,
            bias_scale=BIAS_SCALE if shape["bias"] else 0.0,
            fp8=kind == "fp8",
        )
        layers[kind].update(shape["routing"])
    ours = [b for b in dinfer_kernels.available_backends(device, "moe") if b != "torch"]
    if device == "cpu" and _backend.triton_interpreted() and dtype != torch.bfloat16 and "triton" not in ours:
        ours.append("triton")
    if device == "cpu" and "triton" in ours and dtype == torch.bfloat16:
        ours.remove("triton")
        notes.append("triton skipped on the CPU in bf16 (the interpreter's bf16 arithmetic is unreliable)")
    if args.backends:
        ours = [b for b in ours if b in args.backends.split(",")]
    if "ours" not in methods:
        ours = []
    plain = "triton_plain" in methods and (
        device == "cuda" or (_backend.triton_interpreted() and dtype != torch.bfloat16)
    )
    use_gmm = grouped_mm_available(device, dtype)
    if not use_gmm and {"grouped_mm", "grouped_mm_alone"} & set(methods):
        notes.append(
            f"torch._grouped_mm: not run (needs a torch that has it, on a GPU of SM80+ in bf16; here {args.dtype})"
        )
    if use_gmm and "fp8" in kinds:
        notes.append(
            "torch._grouped_mm: not run on fp8 weights (no 128 x 128 block-scaled FP8 there); "
            f"its {args.dtype} rows are the yardstick"
        )

    results, tables = [], []
    for T in tokens:
        for kind in kinds:
            call = dict(layers[kind], hidden=layers[kind]["hidden"][:T])
            tag = "".join(f" {t}" for t in (args.shape, kind) if t not in ("llada-moe", args.dtype))
            _, e = torch_route(call)
            touched = int(torch.unique(e).numel())
            wbytes = weight_bytes(call, touched)
            flops = 6.0 * T * k * H * inter + 6.0 * T * H * S
            base_out = moe_reference(**call, static_shapes=False).float()
            auto = _backend.resolve(
                "auto",
                device,
                "moe",
                dtype=dtype,
                rows_per_expert=T * k / E,
                weight_bytes=weight_bytes(call, E) - weight_bytes(call, 0),
            )
            scale = float(base_out.abs().max()) or 1.0
            # (key, method, backend, fn, captured in a graph, the layer's output from fn's result)
            same = lambda out: out
            cases = []
            if "torch_loop" in methods:
                loop = lambda i, c=call: moe_reference(**c, static_shapes=False)
                cases.append(("torch_loop", "torch loop", "eager", loop, False, same))
            if use_gmm and kind != "fp8" and "grouped_mm" in methods:
                pipeline = lambda i, c=call: grouped_mm_moe(c)
                cases.append(("grouped_mm", "torch._grouped_mm", "eager", pipeline, True, same))
            if use_gmm and kind != "fp8" and "grouped_mm_alone" in methods:
                gemms, combine = make_grouped_mm_alone(call)
                cases.append(
                    (
                        "grouped_mm_alone",
                        "torch._grouped_mm alone",
                        "eager",
                        lambda i, g=gemms: g(),
                        True,
                        combine,
                    )
                )
            if plain:
                fn = make_plain_triton(call)
                x = call["hidden"]
                cases.append(
                    (
                        "triton_plain",
                        "triton plain grouped GEMM",
                        "triton",
                        lambda i, fn=fn, x=x: fn(x),
                        True,
                        same,
                    )
                )
            for be in ours:
                op = lambda i, be=be, c=call: dinfer_kernels.moe(**c, backend=be)
                cases.append((f"ours_{be}", "ours moe", be, op, True, same))
            if use_gmm and kind != "fp8" and "ours_grouped_mm" in methods and "triton" in ours:
                op = lambda i, c=call: ours_grouped_mm(c)
                cases.append(("ours_grouped_mm", "ours, GEMMs by _grouped_mm", "triton", op, True, same))
            rows_out = []
            for key, label, be, fn, graph, output in cases:
                try:
                    first = fn(0)
                    timing.sync(device)
                    err = float((output(first).float() - base_out).abs().max()) / scale
                    repeat = None
                    if key.startswith("ours"):
                        repeat = "yes" if torch.equal(first, fn(0)) else "NO"
                    m = timing.measure(
                        timing.Case(f"{label}[{be}]{tag} T={T}", fn, 1, graph=graph),
                        device,
                        quick=args.quick,
                        reps=args.reps,
                    )
                except Exception as ex:
                    print(f"  {label}[{be}]{tag}: FAILED ({type(ex).__name__}: {str(ex)[:200]})")
                    notes.append(f"T={T}{tag} {label}[{be}] failed: {type(ex).__name__}: {str(ex)[:160]}")
                    continue
                if m["note"]:
                    notes.append(f"T={T}{tag} {label}[{be}]: {m['note']}")
                r = dict(
                    shape=args.shape,
                    weights=kind,
                    T=T,
                    E=E,
                    top_k=k,
                    H=H,
                    I=inter,
                    S=S,
                    touched=touched,
                    weight_MB=wbytes / 1e6,
                    key=key,
                    method=label,
                    backend=be,
                    timer=m["timer"],
                    median_s=m["median_s"],
                    p20_s=m["p20_s"],
                    p80_s=m["p80_s"],
                    us=m["median_s"] * 1e6,
                    GBps=wbytes / m["median_s"] / 1e9,
                    TFLOPs=flops / m["median_s"] / 1e12,
                    rel_err=err,
                    bitwise_repeat=repeat,
                    auto=auto,
                )
                r.update(timing.bandwidth_percents(r["GBps"], bw))
                r.update(timing.matmul_percents(r["TFLOPs"], mm))
                r["matmul_TFLOPs"] = mm["TFLOPs"]
                rows_out.append(r)
                print(
                    f"  {label:26s} {be:7s} {r['us']:10.1f} us  {r['GBps']:8.1f} GB/s ({r['pct_copy']:5.1f}% copy)  "
                    f"{r['TFLOPs']:7.2f} TFLOP/s ({r['pct_mm']:5.1f}%)"
                )
            base = next((r for r in rows_out if r["key"] == "torch_loop"), None)
            for r in rows_out:
                r["speedup"] = base["median_s"] / r["median_s"] if base else None
            results += rows_out
            isa = _backend.cpu_isa() if device == "cpu" else None
            title = (
                f"{args.shape}, T = {T} tokens ({T * k / E:g} rows per expert; auto picks {auto}"
                f"{' with the ' + isa + ' copy' if isa else ''}), E = {E}, top-{k}, H = {H}, I = {inter}"
                f"{f', shared expert S = {S}' if S else ''}, {args.dtype}, {kind} weights, {touched} experts "
                f"touched ({wbytes / 1e6:.4g} MB of weights), {device} ({env.get('gpu') or env['cpu']}); "
                f"{timing.bandwidth_text(bw)}, matmul {mm['TFLOPs']:.3g} TFLOP/s"
            )
            cols = [
                ("method", "method", None),
                ("backend", "backend", None),
                ("median µs", "us", ".1f"),
                ("GB/s", "GBps", ".1f"),
                *timing.BANDWIDTH_COLUMNS,
                ("TFLOP/s", "TFLOPs", ".2f"),
                ("% matmul", "pct_mm", ".1f"),
                ("% bf16 spec", "pct_mm_spec", ".1f"),
                ("× torch loop", "speedup", ".2f"),
                ("rel. max diff", "rel_err", ".1e"),
                ("bitwise repeat", "bitwise_repeat", None),
                ("auto picks", "auto", None),
                ("timer", "timer", None),
            ]
            table = f"**{title}**\n\n" + markdown_tables.markdown_table(rows_out, cols)
            print("\n" + table + "\n")
            tables.append(table)
            if device == "cuda":
                torch.cuda.empty_cache()
    notes.append(
        f"{args.dtype} matmul rate {mm['TFLOPs']:.3g} TFLOP/s ({mm['n']}^3, {mm['timer']}); "
        f"{timing.bandwidth_text(bw)}"
    )
    return results_json.finish("moe", env, args, bw, results, tables, notes)


def main(argv=None):
    p = cli_options.base_parser(__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llada-moe", help="the released MoE layer")
    p.add_argument(
        "--weights",
        default=None,
        help="comma-separated expert weights: the --dtype's name and / or fp8 (default: the --dtype's)",
    )
    p.add_argument(
        "--tokens",
        default=None,
        help="comma-separated T (default 32,96,512,2048; --quick: 32,96,2048, on the CPU 4,32)",
    )
    p.add_argument("--experts", type=int, default=None, help="E (default: the shape's, or --small's)")
    p.add_argument("--top-k", type=int, default=None, help="k (default: the shape's)")
    p.add_argument("--hidden", type=int, default=None, help="H (default: the shape's, or --small's)")
    p.add_argument("--inter", type=int, default=None, help="I (default: the shape's, or --small's)")
    p.add_argument("--shared", type=int, default=None, help="S, 0: none (default: the shape's, or --small's)")
    p.add_argument(
        "--small",
        action="store_true",
        default=None,
        help="small E, H, I, S (default on the CPU); --no-small for full size on the CPU",
    )
    p.add_argument("--no-small", dest="small", action="store_false")
    p.add_argument("--backends", default=None, help="comma-separated subset of our backends")
    p.add_argument(
        "--methods", default=None, help=f"comma-separated subset of {','.join(METHODS)} (default: all)"
    )
    p.set_defaults(dtype=None)  # bf16 on a GPU, fp32 on the CPU
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
