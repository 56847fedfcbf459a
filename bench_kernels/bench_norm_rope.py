"""Microbenchmark of the per-layer small ops, rms_norm and rope: torch against dinfer_kernels backends.

    python bench_kernels/bench_norm_rope.py [--device cpu|cuda] [--dtype bf16|fp16|fp32] [--quick]
        [--json out.json] [--rows 1,70,560] [--shape tiny|llada-moe] [--backends cpu,torch]

Shapes: `tiny` (the embedded tiny-llada-moe, default on the CPU: hidden 256, 8 heads x 32) or
`llada-moe` (LLaDA-MoE-7B: hidden 2048, 16 heads x 128); rows = tokens per call (1: a decode row,
~70: one refresh block at batch 1, 560: eight of them). Per row count, three calls as one forward
makes them:
  rms_norm       [rows, hidden] over hidden (the attention / MLP norms)
  qk_norm        [rows, heads, head_dim] over head_dim (LLaDA-MoE's per-head QK-norm)
  rope           [1, rows, heads, head_dim] at positions 100 + arange(rows)
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

SHAPES = {"tiny": (256, 8, 32), "llada-moe": (2048, 16, 128)}
THETA = 10000.0


def cached_rope(cos_sin):
    """Plain-torch rope over a precomputed [P, D] cos / sin table (rows gathered per call)."""

    def run(x, pos):
        cs = cos_sin[pos]  # [B, T, D]
        half = x.shape[-1] // 2
        c, s = cs[..., :half].repeat(1, 1, 2)[:, :, None], cs[..., half:].repeat(1, 1, 2)[:, :, None]
        xf = x.float()
        rot = torch.cat([-xf[..., half:], xf[..., :half]], -1)
        return (xf * c + rot * s).to(x.dtype)

    return run


def run(args):
    import dinfer_kernels as dk
    from dinfer_kernels import op_inputs
    from dinfer_kernels.reference.rope import cos_sin_table

    device, dtype = args.device, cli_options.torch_dtype(args.dtype)
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU visible")
    shape = args.shape or ("tiny" if device == "cpu" else "llada-moe")
    H, heads, D = SHAPES[shape]
    rows_list = cli_options.parse_ints(args.rows) if args.rows else ([1, 70] if args.quick else [1, 70, 560])
    env = environment.environment(device)
    print(
        f"# bench_norm_rope  device={device} ({env.get('gpu') or env['cpu']})  shape={shape} "
        f"(hidden {H}, {heads} x {D})  dtype={args.dtype}  rows={rows_list}  commit={env['commit']}"
    )
    bw = timing.copy_bandwidth(device, quick=args.quick)
    g = torch.Generator().manual_seed(0)
    table = cos_sin_table(torch.arange(8192), THETA, D).to(device)
    torch_rope = cached_rope(table)
    results, tables, notes = [], [], []
    for rows in rows_list:
        norm = op_inputs.rms_norm_inputs((rows, H), dtype=dtype, device=device, generator=g, scale=2.0)
        qk_norm = op_inputs.rms_norm_inputs(
            (rows, heads, D), dtype=dtype, device=device, generator=g, scale=2.0
        )
        x, w, qk, wqk = norm["x"], norm["weight"], qk_norm["x"], qk_norm["weight"]
        q = op_inputs.rope_inputs(1, rows, heads, D, dtype=dtype, device=device, generator=g)["x"]
        pos = (100 + torch.arange(rows))[None].to(device)
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
        ]
        rows_out = []
        for op, inp, fused, ours, name in ops:
            nbytes = 2 * inp.numel() * inp.element_size()
            ref = ours("torch").float()
            scale = float(ref.abs().max()) or 1.0
            backends = [
                b
                for b in dk.available_backends(device, name)
                if not args.backends or b in args.backends.split(",")
            ]
            cases = [("torch fused", "eager", fused)] + [
                ("ours", be, lambda be=be: ours(be)) for be in backends
            ]
            timed = []
            for method, be, fn in cases:
                m = timing.measure(
                    timing.Case(f"{op}/{method}[{be}] rows={rows}", lambda i, fn=fn: fn()),
                    device,
                    quick=args.quick,
                    reps=args.reps,
                )
                err = float((fn().float() - ref).abs().max()) / scale
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
                    f"  {op:8s} rows={rows:<5d} {method:11s} {be:6s} {r['us']:9.1f} us  {r['GBps']:7.2f} GB/s"
                )
            base = next((r for r in timed if r["backend"] == "torch"), None)
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
            f"{rows} rows, {shape} (hidden {H}, {heads} x {D}), {args.dtype}, {device} "
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
