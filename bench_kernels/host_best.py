"""Best-of-N host timings on a shared machine: every ISA copy and its baselines in interleaved rounds.

(Not a bench_*.py: it takes minutes at full size and is for tuning the host kernels on a loaded box;
the GPU check's host numbers come from bench_host_isa.py.)

    python bench_kernels/host_best.py decode [--rounds 15] [--isas avx512,avx2,generic] [--dtypes fp32,bf16]
    python bench_kernels/host_best.py moe [--rounds 6] [--shapes small4,small32,big4,big32] [--dtypes ...]

One thread (torch and the host kernels). Each round times every variant once, in turn; a variant's
time is its best round, in CPU time of the thread (time.thread_time: what the other jobs of a shared
box take from us does not count, their cache and memory traffic still does). Ratios come from the
same run. decode: dinfer_kernels.decode_step(backend="cpu") per ISA on bench_decode's logits
(N = 32, V = 157184) against one logits.max(-1) pass and dInfer's eager threshold decode. moe:
dinfer_kernels.moe(backend="cpu") per ISA against the torch reference, and what backend="auto" picks
with that ISA (dinfer_kernels/_backend.py MOE_HOST_WINS); shapes "small<T>" = E 8, H 256, I 128 and
"big<T>" = LLaDA-MoE's E 64, H 2048, I 1024, top-8, T tokens.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout  # noqa: F401  (puts the checkout's dinfer and dinfer_kernels on sys.path)
import cli_options
import torch

SHAPES = {"small": (8, 256, 128), "big": (64, 2048, 1024)}


def best_of(fns, rounds):
    """{name: best seconds} over `rounds` interleaved rounds of fns (name -> callable), after a warm-up."""
    best = {k: float("inf") for k in fns}
    for f in fns.values():
        f()
    for _ in range(rounds):
        for k, f in fns.items():
            t = time.thread_time()
            f()
            best[k] = min(best[k], time.thread_time() - t)
    return best


def decode(args):
    import dinfer_baseline as db
    from bench_decode import make_inputs

    import dinfer_kernels as dk
    from dinfer_kernels import _backend

    N, V = 32, 157184
    for dn in args.dtypes:
        logits, tok0, mask_id = make_inputs(N, V, cli_options.torch_dtype(dn), "cpu")
        off = torch.tensor([0, N], dtype=torch.int32)
        tok = tok0.clone()

        def ours(isa):
            def run():
                _backend.set_cpu_isa(isa)
                tok.copy_(tok0)
                dk.decode_step(logits, tok, off, mask_id, backend="cpu", validate=False)

            return run

        fns = {
            "max": lambda: logits.max(-1),
            "dinfer": lambda: db.dinfer_threshold_decode(
                logits.view(1, N, V), tok0.clone().view(1, N), mask_id, 0.9
            ),
        }
        fns.update({isa: ours(isa) for isa in args.isas})
        b = {k: v * 1e3 for k, v in best_of(fns, args.rounds).items()}
        print(f"decode_step {dn} N={N} V={V}: max(-1) {b['max']:.2f} ms, dInfer eager {b['dinfer']:.2f} ms")
        for isa in args.isas:
            print(
                f"  {isa:10s} {b[isa]:6.2f} ms  ÷ max(-1) {b[isa] / b['max']:.2f}  "
                f"× dInfer eager {b['dinfer'] / b[isa]:.2f}"
            )


def moe(args):
    import dinfer_kernels as dk
    from dinfer_kernels import _backend, op_inputs
    from dinfer_kernels.reference.moe import moe_reference

    g = torch.Generator().manual_seed(0)
    for shape in args.shapes:
        kind, T = shape.rstrip("0123456789"), int(shape.lstrip("abcdefghijklmnopqrstuvwxyz"))
        E, H, inter = SHAPES[kind]
        for dn in args.dtypes:
            dt = cli_options.torch_dtype(dn)
            a = op_inputs.moe_inputs(
                T,
                E,
                H,
                inter,
                8,
                dtype=dt,
                generator=g,
                weight_scale=1.0,
                router_scale=H**-0.5,
            )
            x, router, w13, w2 = a["hidden"], a["router_weight"], a["w13"], a["w2"]

            def ours(isa):
                def run():
                    _backend.set_cpu_isa(isa)
                    dk.moe(x, router, w13, w2, 8, backend="cpu")

                return run

            fns = {"torch": lambda: moe_reference(x, router, w13, w2, 8, static_shapes=False)}
            fns.update({isa: ours(isa) for isa in args.isas})
            b = {k: v * 1e3 for k, v in best_of(fns, args.rounds).items()}
            line = f"moe {shape} {dn} ({T * 8 / E:g} rows/expert) torch {b['torch']:.2f} ms |"
            for isa in args.isas:
                _backend.set_cpu_isa(isa)
                try:
                    auto = _backend.resolve(
                        "auto",
                        "cpu",
                        "moe",
                        dtype=dt,
                        rows_per_expert=T * 8 / E,
                        weight_bytes=(w13.numel() + w2.numel()) * w13.element_size(),
                    )
                except TypeError:  # an install from before the per-shape choice: the op-level one
                    auto = _backend.resolve("auto", "cpu", "moe") + " (op-level)"
                line += f" {isa} {b[isa]:.2f} ({b['torch'] / b[isa]:.2f}x, auto {auto})"
            print(line, flush=True)
            w13 = w2 = None  # frees this shape before the next (the lambdas above read them)


def main(argv=None):
    from dinfer_kernels import _backend

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("decode", "moe"))
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 15 decode, 6 moe)")
    p.add_argument("--isas", default=None, help="comma-separated ISAs (default: every one this CPU runs)")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--shapes", default="small4,small32,small128,big4,big32", help="moe shapes")
    args = p.parse_args(argv)
    args.isas = args.isas.split(",") if args.isas else _backend.cpu_isas()
    args.dtypes = args.dtypes.split(",")
    args.shapes = args.shapes.split(",")
    args.rounds = args.rounds or (15 if args.what == "decode" else 6)
    torch.set_num_threads(1)
    before = _backend.cpu_isa()
    try:
        (decode if args.what == "decode" else moe)(args)
    finally:
        _backend.set_cpu_isa(before)


if __name__ == "__main__":
    main()
