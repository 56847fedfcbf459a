"""Microbenchmark of the routed MoE layer: the torch expert loop, torch._grouped_mm, a plain Triton
grouped GEMM and dinfer_kernels.moe.

    python bench_kernels/bench_moe.py [--device cpu|cuda] [--tokens 32,64,96,512,2048] [--experts 64]
        [--top-k 8] [--hidden 2048] [--inter 1024] [--small] [--dtype bf16|fp16|fp32] [--quick]
        [--json out.json]

LLaDA-MoE shape by default (E = 64, top-8, H = 2048, I = 1024, softmax router in fp32, no
renormalisation); --small (default on the CPU) shrinks it to E = 8, H = 256, I = 128. Methods:
  torch loop       dinfer_kernels/reference/moe.py: one pair of GEMMs per touched expert (host syncs
                   on the routing, so timed with do_bench, never in a CUDA graph)
  grouped_mm       torch routing + sort, torch._grouped_mm over w13, silu*mul, torch._grouped_mm over
                   w2, weighted index_add (GPU, bf16, SM80+; skipped where unavailable)
  triton plain     our routing/alignment kernel, then a plain Triton grouped GEMM (no fused epilogue)
                   over w13, torch silu*mul, the same GEMM over w2, a torch weighted index_add
  ours[b]          dinfer_kernels.moe(backend=b) for the kernel backends available here
Measured in the same run: the bandwidth yardsticks of timing.py (copy, read-only kernel; beside the
GPU's datasheet HBM) and the dense matmul rate of the dtype (a square torch matmul). Columns: median
time, GB/s over the expert weights actually read (touched experts x 3*H*I*itemsize), % of each
bandwidth yardstick, TFLOP/s over the routed rows (6*T*k*H*I), % of the matmul rate and of the
datasheet's dense bf16 rate, speedup vs the torch loop, max |diff| vs the torch loop
relative to its max |value|, (ours) whether two runs are bit-identical, and on the CPU what
backend="auto" picks for the shape (dinfer_kernels/_backend.py MOE_HOST_WINS, per ISA and dtype).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout  # noqa: F401  (puts the checkout's dinfer and dinfer_kernels on sys.path)
import cli_options
import environment
import markdown_tables
import results_json
import timing
import torch

SMALL = dict(experts=8, hidden=256, inter=128)


# ------------------------------------------------------------------------------------- baselines
def torch_route(hidden, router, top_k):
    p = torch.softmax(hidden.float() @ router.float().t(), dim=-1)
    w, e = torch.topk(p, top_k, dim=-1)
    return w, e


def grouped_mm_moe(hidden, router, w13, w2, top_k):
    """torch._grouped_mm path; no host sync (counts stay on the device)."""
    T, H = hidden.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    w, e = torch_route(hidden, router, top_k)
    flat = e.flatten()
    order = torch.argsort(flat, stable=True)
    tok = order // top_k
    counts = torch.zeros(E, dtype=torch.int32, device=hidden.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32)
    )
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    a = hidden[tok]
    gu = torch._grouped_mm(a, w13.transpose(1, 2), offs=offs)
    act = (torch.nn.functional.silu(gu[:, :inter].float()) * gu[:, inter:].float()).to(hidden.dtype)
    y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
    out = torch.zeros(T, H, dtype=torch.float32, device=hidden.device)
    out.index_add_(0, tok, y.float() * w.flatten()[order, None])
    return out.to(hidden.dtype)


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
        c,
        sorted_ids,
        block_expert,
        n_assign,
        N,
        K,
        TOP_K: tl.constexpr,
        GATHER: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        """C[p] = A[row(p)] @ B[e]^T for the rows p of block program_id(0), expert e of the block;
        row(p) = token of the slot (GATHER) or p itself."""
        blk = tl.program_id(0)
        e = tl.load(block_expert + blk)
        if e < 0:
            return
        p = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        slot = tl.load(sorted_ids + p)
        valid = slot < n_assign
        rows = (slot // TOP_K) if GATHER else p
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
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
            acc = tl.dot(x, tl.trans(w), acc)
        tl.store(
            c + p.to(tl.int64)[:, None] * N + cols[None, :],
            acc.to(c.dtype.element_ty),
            mask=cols[None, :] < N,
        )

    return plain_grouped_gemm


def make_plain_triton(hidden, router, w13, w2, top_k):
    """Our routing + alignment, then unfused grouped GEMMs (vLLM's small-M fallback tile, BN 32-64)."""
    import triton

    from dinfer_kernels.triton import moe as tm

    kernel = _plain_kernel()
    T, H = hidden.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    cfg = tm.choose_config(T, top_k, E, E, H, inter, hidden.dtype)
    bn, bk = 64, 64
    n = T * top_k

    def run(x):
        ws = tm.Workspace(T, top_k, E, inter, H, x.dtype, x.device, cfg)
        tm.route_and_align(x, router, None, top_k, False, "softmax", None, 1, 1, 1.0, 0, E, E, cfg, ws)
        gu = torch.zeros((ws.p_max, two_i), dtype=x.dtype, device=x.device)
        kernel[(ws.nb_max, triton.cdiv(two_i, bn))](
            x,
            x.stride(0),
            x.stride(1),
            w13,
            *w13.stride(),
            gu,
            ws.sorted_ids,
            ws.block_expert,
            n,
            two_i,
            H,
            TOP_K=top_k,
            GATHER=True,
            BLOCK_M=cfg.block_m,
            BN=bn,
            BK=bk,
            num_warps=4,
            num_stages=3,
        )
        act = (torch.nn.functional.silu(gu[:, :inter].float()) * gu[:, inter:].float()).to(x.dtype)
        y = torch.zeros((ws.p_max, H), dtype=x.dtype, device=x.device)
        kernel[(ws.nb_max, triton.cdiv(H, bn))](
            act,
            act.stride(0),
            act.stride(1),
            w2,
            *w2.stride(),
            y,
            ws.sorted_ids,
            ws.block_expert,
            n,
            H,
            inter,
            TOP_K=top_k,
            GATHER=False,
            BLOCK_M=cfg.block_m,
            BN=bn,
            BK=bk,
            num_warps=4,
            num_stages=3,
        )
        rows = torch.arange(ws.p_max, device=x.device)
        slot = ws.sorted_ids.long()
        valid = (ws.block_expert.long()[rows // cfg.block_m] >= 0) & (slot >= 0) & (slot < n)
        slot = torch.where(valid, slot, 0)
        wgt = torch.where(valid, ws.topk_w[slot], 0.0)
        out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
        out.index_add_(0, slot // top_k, torch.nan_to_num(y.float()) * wgt[:, None])
        return out.to(x.dtype)

    return run


# --------------------------------------------------------------------------------------- helpers
def touched_experts(hidden, router, top_k):
    return int(torch.unique(torch_route(hidden, router, top_k)[1]).numel())


def grouped_mm_available(device, dtype):
    if device != "cuda" or dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    return torch.cuda.get_device_capability()[0] >= 8


# ------------------------------------------------------------------------------------------- run
def run(args):
    import dinfer_kernels
    from dinfer_kernels import _backend, op_inputs
    from dinfer_kernels.reference.moe import moe_reference

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU visible")
    small = args.small if args.small is not None else device == "cpu"
    E = args.experts or (SMALL["experts"] if small else 64)
    H = args.hidden or (SMALL["hidden"] if small else 2048)
    inter = args.inter or (SMALL["inter"] if small else 1024)
    k = min(args.top_k, E)
    tokens = (
        cli_options.parse_ints(args.tokens)
        if args.tokens
        else (
            [4, 32]
            if device == "cpu" and args.quick
            else [32, 96, 2048]
            if args.quick
            else [32, 64, 96, 512, 2048]
        )
    )
    if args.dtype is None:  # the host's bf16 matmul is very slow: fp32 there by default
        args.dtype = "bf16" if device == "cuda" else "fp32"
    dtype = cli_options.torch_dtype(args.dtype)
    env = environment.environment(device)
    notes = []
    print(
        f"# bench_moe  device={device} ({env.get('gpu') or env['cpu']})  E={E} top-{k} H={H} I={inter}  "
        f"dtype={args.dtype}  T={tokens}  commit={env['commit']}"
    )
    bw = timing.bandwidth_yardsticks(device, quick=args.quick)
    mm = timing.matmul_rate(device, dtype, args.quick)
    print(
        f"bandwidth: {timing.bandwidth_text(bw)}   {args.dtype} matmul ({mm['n']}^3): {mm['TFLOPs']:.3g} TFLOP/s"
    )

    g = torch.Generator(device=device).manual_seed(0)  # on the device: 0.8 GB of weights
    # the router in fp32, as loaders keep it; the largest T's hidden rows, the first T of them per T
    layer = op_inputs.moe_inputs(
        max(tokens),
        E,
        H,
        inter,
        k,
        dtype=dtype,
        device=device,
        generator=g,
        weight_scale=1.0,
        router_scale=H**-0.5,
    )
    router, w13, w2 = layer["router_weight"], layer["w13"], layer["w2"]
    ours = [b for b in dinfer_kernels.available_backends(device, "moe") if b != "torch"]
    if device == "cpu" and _backend.triton_interpreted() and dtype != torch.bfloat16 and "triton" not in ours:
        ours.append("triton")
    if device == "cpu" and "triton" in ours and dtype == torch.bfloat16:
        ours.remove("triton")
        notes.append("triton skipped on the CPU in bf16 (the interpreter's bf16 arithmetic is unreliable)")
    if args.backends:
        ours = [b for b in ours if b in args.backends.split(",")]
    plain = device == "cuda" or (_backend.triton_interpreted() and dtype != torch.bfloat16)
    use_gmm = grouped_mm_available(device, dtype)
    if not use_gmm:
        notes.append("torch._grouped_mm: not run (needs a GPU of SM80+, bf16 and a torch that has it)")

    results, tables = [], []
    for T in tokens:
        hidden = layer["hidden"][:T]
        touched = touched_experts(hidden, router, k)
        wbytes = touched * 3 * H * inter * w13.element_size()
        flops = 6.0 * T * k * H * inter
        base_out = moe_reference(hidden, router, w13, w2, k, static_shapes=False).float()
        auto = _backend.resolve(
            "auto",
            device,
            "moe",
            dtype=dtype,
            rows_per_expert=T * k / E,
            weight_bytes=(w13.numel() + w2.numel()) * w13.element_size(),
        )
        scale = float(base_out.abs().max()) or 1.0
        cases = [
            (
                "torch_loop",
                "torch loop",
                "eager",
                lambda i: moe_reference(hidden, router, w13, w2, k, static_shapes=False),
                False,
            )
        ]
        if use_gmm:
            cases.append(
                (
                    "grouped_mm",
                    "torch._grouped_mm",
                    "eager",
                    lambda i: grouped_mm_moe(hidden, router, w13, w2, k),
                    True,
                )
            )
        if plain:
            fn = make_plain_triton(hidden, router, w13, w2, k)
            cases.append(
                ("triton_plain", "triton plain grouped GEMM", "triton", lambda i, fn=fn: fn(hidden), True)
            )
        for be in ours:
            cases.append(
                (
                    f"ours_{be}",
                    "ours moe",
                    be,
                    lambda i, be=be: dinfer_kernels.moe(hidden, router, w13, w2, k, backend=be),
                    True,
                )
            )
        rows_out = []
        for key, label, be, fn, graph in cases:
            try:
                first = fn(0)
                timing.sync(device)
                err = float((first.float() - base_out).abs().max()) / scale
                repeat = None
                if key.startswith("ours"):
                    repeat = "yes" if torch.equal(first, fn(0)) else "NO"
                m = timing.measure(
                    timing.Case(f"{label}[{be}] T={T}", fn, 1, graph=graph),
                    device,
                    quick=args.quick,
                    reps=args.reps,
                )
            except Exception as e:
                print(f"  {label}[{be}]: FAILED ({type(e).__name__}: {str(e)[:200]})")
                notes.append(f"T={T} {label}[{be}] failed: {type(e).__name__}: {str(e)[:160]}")
                continue
            if m["note"]:
                notes.append(f"T={T} {label}[{be}]: {m['note']}")
            r = dict(
                T=T,
                E=E,
                top_k=k,
                H=H,
                I=inter,
                touched=touched,
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
        title = (
            f"T = {T} tokens ({T * k / E:g} rows per expert; auto picks {auto}"
            f"{' with the ' + _backend.cpu_isa() + ' copy' if device == 'cpu' and _backend.cpu_isa() else ''}), E = {E}, top-{k}, H = {H}, I = {inter}, {args.dtype}, {touched} experts "
            f"touched ({wbytes / 1e6:.0f} MB of weights), {device} ({env.get('gpu') or env['cpu']}); "
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
    p.add_argument(
        "--tokens",
        default=None,
        help="comma-separated T (default 32,64,96,512,2048; --quick: 32,96,2048, on the CPU 4,32)",
    )
    p.add_argument("--experts", type=int, default=None, help="E (default 64, --small 8)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=None, help="H (default 2048, --small 256)")
    p.add_argument("--inter", type=int, default=None, help="I (default 1024, --small 128)")
    p.add_argument(
        "--small",
        action="store_true",
        default=None,
        help="small E, H, I (default on the CPU); --no-small for full size on the CPU",
    )
    p.add_argument("--no-small", dest="small", action="store_false")
    p.add_argument("--backends", default=None, help="comma-separated subset of our backends")
    p.set_defaults(dtype=None)  # bf16 on a GPU, fp32 on the CPU
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
