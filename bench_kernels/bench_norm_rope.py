"""Microbenchmark of the per-layer small ops, rms_norm and rope: torch against dinfer_kernels backends.

    python bench_kernels/bench_norm_rope.py [--device cpu|cuda] [--dtype bf16|fp16|fp32] [--quick]
        [--json out.json] [--rows 1,70,560] [--shape tiny|llada-moe|llada2-mini] [--backends cpu,torch]

Shapes: `tiny` (the embedded tiny-llada-moe, default on the CPU: hidden 256, 8 heads x 32) or
`llada-moe` (LLaDA-MoE-7B: hidden 2048, 16 heads x 128, 16 KV heads) or `llada2-mini` (hidden 2048,
16 heads x 128, 4 KV heads, half the head dim rotating); rows = tokens per call (1: a decode row,
~70: one refresh block at batch 1, 560: eight of them). Per row count, the calls one layer's forward
makes:
  rms_norm       [rows, hidden] over hidden (the attention / MLP norms)
  qk_norm        [rows, heads, head_dim] over head_dim (LLaDA-MoE's per-head QK-norm)
  rope           [1, rows, heads, head_dim] at positions 100 + arange(rows)
  qk_rope        q [1, rows, heads, head_dim] and k [1, rows, kv heads, head_dim] QK-normed and
                 rotated at those positions: `ours` is one dk.qk_rope call (the engine's, from a table
                 built once), `norm+rope x2` the four calls the engine made before it (dk.rms_norm of q
                 and k, then dk.rope of each, which builds its angles per call on the GPU)
Methods: `torch fused` = torch.nn.functional.rms_norm, and for rope a cos / sin cache gathered per
call (what HF-style models do; the best plain-torch form), then dinfer_kernels per backend (`torch`
is our reference, which the engine ran before the host kernels). Columns: median time, GB/s of the
minimal traffic (input read, output written), speedup against the reference, max |diff| against it.
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

# hidden, heads, KV heads, head dim, rotary dim
SHAPES = {
    "tiny": (256, 8, 8, 32, 32),
    "llada-moe": (2048, 16, 16, 128, 128),
    "llada2-mini": (2048, 16, 4, 128, 64),
}
THETA = 10000.0
EPS = 1e-5


def cached_rope(cos_sin):
    """Plain-torch rope over a precomputed [P, rotary_dim] cos / sin table (rows gathered per call)."""

    def run(x, pos):
        cs = cos_sin[pos]  # [B, T, rotary_dim]
        rd = cs.shape[-1]
        half = rd // 2
        c, s = cs[..., :half].repeat(1, 1, 2)[:, :, None], cs[..., half:].repeat(1, 1, 2)[:, :, None]
        xf = x[..., :rd].float()
        rot = torch.cat([-xf[..., half:], xf[..., :half]], -1)
        return torch.cat([(xf * c + rot * s).to(x.dtype), x[..., rd:]], -1)

    return run


def flat(out):
    """An op's output, or its outputs one after the other, as one fp32 vector."""
    return torch.cat([o.float().flatten() for o in out]) if isinstance(out, tuple) else out.float().flatten()


def run(args):
    import dinfer_kernels as dk
    from dinfer_kernels import op_inputs

    device, dtype = args.device, cli_options.torch_dtype(args.dtype)
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU visible")
    shape = args.shape or ("tiny" if device == "cpu" else "llada-moe")
    H, heads, kv_heads, D, rd = SHAPES[shape]
    rows_list = cli_options.parse_ints(args.rows) if args.rows else ([1, 70] if args.quick else [1, 70, 560])
    env = environment.environment(device)
    print(
        f"# bench_norm_rope  device={device} ({env.get('gpu') or env['cpu']})  shape={shape} "
        f"(hidden {H}, {heads} x {D}, {kv_heads} KV heads, rotary {rd})  dtype={args.dtype}  rows={rows_list}  "
        f"commit={env['commit']}"
    )
    bw = timing.copy_bandwidth(device, quick=args.quick)
    g = torch.Generator().manual_seed(0)
    torch_rope = cached_rope(dk.rope_table(THETA, D, 8192, device))
    torch_partial_rope = cached_rope(dk.rope_table(THETA, rd, 8192, device))
    results, tables, notes = [], [], []
    bf16_host = device == "cpu" and dtype == torch.bfloat16
    if bf16_host:
        notes.append("triton skipped on the CPU in bf16 (the interpreter's bf16 arithmetic is unreliable)")
    for rows in rows_list:
        norm = op_inputs.rms_norm_inputs((rows, H), dtype=dtype, device=device, generator=g, scale=2.0)
        qk_norm = op_inputs.rms_norm_inputs(
            (rows, heads, D), dtype=dtype, device=device, generator=g, scale=2.0
        )
        x, w, qk, wqk = norm["x"], norm["weight"], qk_norm["x"], qk_norm["weight"]
        q = op_inputs.rope_inputs(1, rows, heads, D, dtype=dtype, device=device, generator=g)["x"]
        pos = (100 + torch.arange(rows))[None].to(device)
        qkr = op_inputs.qk_rope_inputs(
            1, rows, heads, kv_heads, D, rotary_dim=rd, dtype=dtype, device=device, generator=g,
            max_position=8192, theta=THETA, scale=2.0, eps=EPS,
        )  # fmt: skip
        qkr["positions"] = pos
        qq, kk, wq, wk = qkr["q"], qkr["k"], qkr["q_norm"], qkr["k_norm"]

        def torch_qk_rope():
            qn, kn = (torch.nn.functional.rms_norm(x, (D,), w, EPS) for x, w in ((qq, wq), (kk, wk)))
            return torch_partial_rope(qn, pos), torch_partial_rope(kn, pos)

        def four_calls(be):
            qn, kn = dk.rms_norm(qq, wq, EPS, backend=be), dk.rms_norm(kk, wk, EPS, backend=be)
            return dk.rope(qn, pos, THETA, rd, backend=be), dk.rope(kn, pos, THETA, rd, backend=be)

        ops = [
            (
                "rms_norm",
                x,
                lambda: torch.nn.functional.rms_norm(x, (H,), w, 1e-5),
                lambda be: dk.rms_norm(x, w, 1e-5, backend=be),
                "rms_norm",
            ),
            (
                "qk_norm",
                qk,
                lambda: torch.nn.functional.rms_norm(qk, (D,), wqk, 1e-5),
                lambda be: dk.rms_norm(qk, wqk, 1e-5, backend=be),
                "rms_norm",
            ),
            ("rope", q, lambda: torch_rope(q, pos), lambda be: dk.rope(q, pos, THETA, backend=be), "rope"),
            ("qk_rope", (qq, kk), torch_qk_rope, lambda be: dk.qk_rope(**qkr, backend=be), "qk_rope"),
        ]
        rows_out = []
        for op, inp, fused, ours, name in ops:
            nbytes = 2 * sum(
                x.numel() * x.element_size() for x in (inp if isinstance(inp, tuple) else (inp,))
            )
            ref = flat(ours("torch"))
            scale = float(ref.abs().max()) or 1.0

            def backends(name):
                return [
                    b
                    for b in dk.available_backends(device, name)
                    if (not args.backends or b in args.backends.split(","))
                    and not (b == "triton" and bf16_host)
                ]

            cases = [("torch fused", "eager", fused)] + [
                ("ours", be, lambda be=be: ours(be)) for be in backends(name)
            ]
            if op == "qk_rope":  # what the engine ran before qk_rope
                cases += [("norm+rope x2", be, lambda be=be: four_calls(be)) for be in backends("rope")]
            timed = []
            for method, be, fn in cases:
                m = timing.measure(
                    timing.Case(f"{op}/{method}[{be}] rows={rows}", lambda i, fn=fn: fn()),
                    device,
                    quick=args.quick,
                    reps=args.reps,
                )
                err = float((flat(fn()) - ref).abs().max()) / scale
                r = dict(
                    op=op,
                    rows=rows,
                    method=method,
                    backend=be,
                    shape=shape,
                    us=m["median_s"] * 1e6,
                    median_s=m["median_s"],
                    p20_s=m["p20_s"],
                    p80_s=m["p80_s"],
                    timer=m["timer"],
                    GBps=nbytes / m["median_s"] / 1e9,
                    rel_err=err,
                )
                timed.append(r)
                print(
                    f"  {op:8s} rows={rows:<5d} {method:12s} {be:6s} {r['us']:9.1f} us  {r['GBps']:7.2f} GB/s"
                )
            base = next((r for r in timed if (r["method"], r["backend"]) == ("ours", "torch")), None)
            for r in timed:
                r["speedup"] = base["median_s"] / r["median_s"] if base else None
            rows_out += timed
        cols = [
            ("op", "op", None),
            ("method", "method", None),
            ("backend", "backend", None),
            ("median µs", "us", ".1f"),
            ("GB/s", "GBps", ".2f"),
            ("× reference", "speedup", ".2f"),
            ("rel. max diff", "rel_err", ".1e"),
        ]
        title = (
            f"{rows} rows, {shape} (hidden {H}, {heads} x {D}, {kv_heads} KV heads, rotary {rd}), "
            f"{args.dtype}, {device} "
            f"({env.get('gpu') or env['cpu']}, {torch.get_num_threads()} threads)"
        )
        table_md = f"**{title}**\n\n" + markdown_tables.markdown_table(rows_out, cols)
        print("\n" + table_md + "\n")
        tables.append(table_md)
        results += rows_out
    return results_json.finish("norm_rope", env, args, bw, results, tables, notes)


def main(argv=None):
    p = cli_options.base_parser(__doc__.splitlines()[0])
    p.add_argument("--rows", default=None, help="comma-separated tokens per call (default 1,70,560)")
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default=None,
        help="model shapes (default: tiny on the CPU, llada-moe on a GPU)",
    )
    p.add_argument("--backends", default=None, help="comma-separated subset of dinfer_kernels backends")
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
