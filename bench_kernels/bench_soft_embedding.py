"""Microbenchmark of the iteration-smoothing input: torch softmax + matmul vs dinfer_kernels.soft_embedding.

    python bench_kernels/bench_soft_embedding.py [--device cpu|cuda] [--rows 64,256,1024]
        [--vocab 157184] [--dim 2048] [--small] [--dtype bf16] [--quick] [--json out.json]

out[i] = E[x_i] + w * softmax(z_i / tau) @ E on masked rows (iteration smoothing, dInfer: arXiv 2510.08666; LLaDA-MoE:
V = 157184, d = 2048). Baseline = what dInfer's H2Embed does in eager torch: an fp32 softmax [M, V]
materialised, cast to the embedding dtype, a GEMM with E, then the additive blend. --small (default
on the CPU) shrinks V and d so that the host finishes in seconds.
On a GPU the Triton backend has two routes, chosen by a shape rule on the rows
(dinfer_kernels/triton/soft_embedding.py: route, ONE_PASS_MAX_ROWS): the public op's row runs the rule's
choice and one more row forces the other route, so that each M shows both sides of the rule.
Columns: median time, GB/s of the minimal traffic (logits + E read once, output written once),
% of each bandwidth yardstick of timing.py (copy, read-only kernel, the GPU's datasheet HBM), TFLOP/s of the 2*M*V*d GEMM, speedup vs the torch baseline,
max |difference| vs the baseline relative to max |baseline|.
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

SMALL = (16384, 512)
UNMASK_EVERY = 16


def torch_soft_embedding(logits, embedding, tokens, mask_id, weight, tau=1.0):
    """dInfer-style eager baseline (H2Embed): full fp32 softmax, GEMM in the embedding dtype."""
    p = torch.softmax(logits.float() / tau, dim=-1).to(embedding.dtype)
    e = embedding[tokens]
    masked = (tokens == mask_id).unsqueeze(-1)
    return torch.where(masked, e + weight * (p @ embedding), e)


def forced_route(route, z, E, tok, mask_id, w_rows, tau):
    """The Triton backend's function with its route forced (the route the shape rule does not pick)."""
    from dinfer_kernels.triton import soft_embedding as triton_soft_embedding

    out = torch.empty((z.shape[0], E.shape[1]), dtype=E.dtype, device=z.device)
    triton_soft_embedding.soft_embedding(z, E, tok, w_rows, out, mask_id=mask_id, tau=tau, force_route=route)
    return out


def run(args):
    import dinfer_kernels
    from dinfer_kernels import op_inputs

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU visible")
    small = args.small if args.small is not None else device == "cpu"
    V = args.vocab or (SMALL[0] if small else 157184)
    d = args.dim or (SMALL[1] if small else 2048)
    rows = (
        cli_options.parse_ints(args.rows)
        if args.rows
        else ([64] if args.quick and device == "cpu" else [64, 1024] if args.quick else [64, 256, 1024])
    )
    dtype = cli_options.torch_dtype(args.dtype)
    env = environment.environment(device)
    notes = []
    print(
        f"# bench_soft_embedding  device={device} ({env.get('gpu') or env['cpu']})  V={V} d={d}  "
        f"dtype={args.dtype}  rows={rows}  commit={env['commit']}"
    )
    bw = timing.bandwidth_yardsticks(device, quick=args.quick)
    print(f"bandwidth: {timing.bandwidth_text(bw)}")

    w = torch.full((1,), 0.3, dtype=torch.float32, device=device)
    # the largest M's rows, the first M of them per M; one position in UNMASK_EVERY already decoded
    inputs = op_inputs.soft_embedding_inputs(
        max(rows),
        V,
        d,
        dtype=dtype,
        device=device,
        generator=torch.Generator(device="cpu").manual_seed(0),
        mask_id=V - 289 if V > 289 else V - 1,
        masked_frac=1 - 1 / UNMASK_EVERY,
        scale=2.0,
        embedding_scale=0.02,
        weight=w,
    )
    E, mask_id = inputs["embedding"], inputs["mask_id"]
    backends = [
        b
        for b in dinfer_kernels.available_backends(device, "soft_embedding")
        if not args.backends or b in args.backends.split(",")
    ]
    results, tables = [], []
    for M in rows:
        z, tok = inputs["logits"][:M], inputs["tokens"][:M]
        copies = timing.num_copies(z.numel() * z.element_size(), device) if device == "cuda" else 1
        zs = [z] + [z.clone() for _ in range(copies - 1)]
        nbytes = z.numel() * z.element_size() + E.numel() * E.element_size() + M * d * E.element_size()
        flops = 2.0 * M * V * d
        base_out = torch_soft_embedding(z, E, tok, mask_id, w, args.tau).float()
        scale = float(base_out.abs().max()) or 1.0
        cases = [
            (
                "torch_baseline",
                "torch softmax+matmul",
                "eager",
                lambda i: torch_soft_embedding(zs[i], E, tok, mask_id, w, args.tau),
            )
        ]
        routes = {}  # the Triton backend's route of each of its rows
        for be in backends:
            cases.append(
                (
                    f"ours_{be}",
                    "ours soft_embedding",
                    be,
                    lambda i, be=be: dinfer_kernels.soft_embedding(
                        zs[i], E, tok, mask_id, w, args.tau, backend=be
                    ),
                )
            )
            if be == "triton" and E.dtype != torch.float32:  # fp32 E has the one pass only
                from dinfer_kernels.triton.soft_embedding import ONE_PASS_MAX_ROWS, route

                chosen = route(M, E.dtype)
                other = "gemm" if chosen == "one_pass" else "one_pass"
                print(
                    f"  shape rule: M={M} -> {chosen} (one pass up to ONE_PASS_MAX_ROWS={ONE_PASS_MAX_ROWS})"
                )
                w_rows = w.expand(M).contiguous()
                routes[f"ours_{be}"], routes[f"ours_{be}_{other}"] = chosen, other
                cases.append(
                    (
                        f"ours_{be}_{other}",
                        f"ours, {other} route forced",
                        be,
                        lambda i, other=other, w_rows=w_rows: forced_route(
                            other, zs[i], E, tok, mask_id, w_rows, args.tau
                        ),
                    )
                )
        rows_out = []
        for key, label, be, fn in cases:
            try:
                err = float((fn(0).float() - base_out).abs().max()) / scale
                m = timing.measure(
                    timing.Case(f"{label}[{be}] M={M}", fn, copies), device, quick=args.quick, reps=args.reps
                )
            except Exception as e:
                print(f"  {label}[{be}]: FAILED ({type(e).__name__}: {e})")
                notes.append(f"M={M} {label}[{be}] failed: {type(e).__name__}: {str(e)[:160]}")
                continue
            if m["note"]:
                notes.append(f"M={M} {label}[{be}]: {m['note']}")
            r = dict(
                M=M,
                V=V,
                d=d,
                key=key,
                method=label,
                backend=be,
                timer=m["timer"],
                median_s=m["median_s"],
                p20_s=m["p20_s"],
                p80_s=m["p80_s"],
                us=m["median_s"] * 1e6,
                GBps=nbytes / m["median_s"] / 1e9,
                TFLOPs=flops / m["median_s"] / 1e12,
                rel_err=err,
                route=routes.get(key),
            )
            r.update(timing.bandwidth_percents(r["GBps"], bw))
            rows_out.append(r)
            print(
                f"  {label:36s} {be:7s} {r['us']:10.1f} us  {r['GBps']:8.1f} GB/s  {r['TFLOPs']:7.2f} TFLOP/s"
            )
        base = next((r for r in rows_out if r["key"] == "torch_baseline"), None)
        for r in rows_out:
            r["speedup"] = base["median_s"] / r["median_s"] if base else None
        results += rows_out
        title = (
            f"M = {M} rows, V = {V}, d = {d}, {args.dtype}, {device} ({env.get('gpu') or env['cpu']}), "
            f"{timing.bandwidth_text(bw)}"
        )
        cols = [
            ("method", "method", None),
            ("backend", "backend", None),
            ("route", "route", None),
            ("median µs", "us", ".1f"),
            ("GB/s", "GBps", ".1f"),
            *timing.BANDWIDTH_COLUMNS,
            ("TFLOP/s", "TFLOPs", ".2f"),
            ("× torch", "speedup", ".2f"),
            ("rel. max diff", "rel_err", ".1e"),
            ("timer", "timer", None),
        ]
        table = f"**{title}**\n\n" + markdown_tables.markdown_table(rows_out, cols)
        print("\n" + table + "\n")
        tables.append(table)
        zs = z = base_out = None  # frees this shape before the next (the lambdas above read zs)
        if device == "cuda":
            torch.cuda.empty_cache()
    return results_json.finish("soft_embedding", env, args, bw, results, tables, notes)


def main(argv=None):
    p = cli_options.base_parser(__doc__.splitlines()[0])
    p.add_argument("--rows", default=None, help="comma-separated M (default 64,256,1024)")
    p.add_argument("--vocab", type=int, default=None, help="V (default 157184, --small 16384)")
    p.add_argument("--dim", type=int, default=None, help="d (default 2048, --small 512)")
    p.add_argument(
        "--small",
        action="store_true",
        default=None,
        help="small V and d (default on the CPU); --no-small for full size on the CPU",
    )
    p.add_argument("--no-small", dest="small", action="store_false")
    p.add_argument("--tau", type=float, default=1.0)
    p.add_argument("--backends", default=None, help="comma-separated subset of our backends")
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
