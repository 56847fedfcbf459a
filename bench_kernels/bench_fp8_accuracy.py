"""What FP8 expert weights cost in accuracy: the embedded MoE models' task accuracy and tokens per
forward with bf16 vs FP8 experts, and the MoE layer's output error with FP8 weights at the released
shapes.

    python bench_kernels/bench_fp8_accuracy.py [--models tiny-llada-moe,tiny-llada2] [--tasks ...]
        [--num-problems 50] [--batch-size 8] [--tokens 32] [--no-tasks] [--no-layers] [--backend auto] [--quick]
        [--json out.json]

Task runs: dinfer.evaluate on the same held-out problems, the model in bf16 with its experts as
stored (bf16) and converted at load (LLM(quantize="fp8"): e4m3, 128 x 128 block scales; the shared
expert too). Layer runs: dinfer_kernels.moe on random weights (N(0, 0.02²), hidden N(0, 1)) at
LLaDA-MoE-7B's shape (E 64, top-8, H 2048, I 1024, softmax) and LLaDA2-mini's (E 256, top-8 of 4 of 8
groups, H 2048, I 512, a shared expert of 512, sigmoid, routed scaling 2.5), T tokens, hidden bf16:
the FP8 call's error against the bf16 call, relative to the bf16 output's scale (max and RMS), beside
the bf16 call's own error against a float64 run of the bf16 weights. An FP8 call equals the bf16 call on
its dequantised weights on every backend (dinfer_kernels/fp8.py), so the error is the weights'
rounding, whichever backend runs it (--backend, recorded).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkout  # noqa: F401  (puts the checkout's dinfer and dinfer_kernels on sys.path)
import engine_runs
import markdown_tables
import results_json
import torch
from cli_options import engine_parser

import dinfer_kernels as dk
from dinfer.evaluate import evaluate
from dinfer.llm import LLM
from dinfer.tasks import TASKS

# (name, E, top_k, H, I, S, routing options of dk.moe)
SHAPES = (
    ("LLaDA-MoE-7B", 64, 8, 2048, 1024, 0, {}),
    (
        "LLaDA2-mini",
        256,
        8,
        2048,
        512,
        512,
        dict(scoring="sigmoid", num_groups=8, topk_groups=4, renormalize=True, routed_scaling=2.5),
    ),
)


def task_rows(args, backend):
    rows = []
    for model in args.models.split(","):
        for experts in ("bf16", "fp8"):
            quantize = None if experts == "bf16" else "fp8"
            llm = LLM(model, device=args.device, dtype=args.dtype or "bf16", quantize=quantize)
            with dk.prefer_backend(backend):
                result = evaluate(llm, args.tasks, num_problems=args.num_problems, batch_size=args.batch_size)
            row = {
                "model": model,
                "experts": experts,
                **{f"accuracy_{t}": r["accuracy"] for t, r in result["tasks"].items()},
                "accuracy": result["overall"]["accuracy"],
                "tokens_per_forward": result["overall"]["tokens_per_forward"],
                "forwards": result["overall"]["forwards"],
                "tokens": result["overall"]["tokens"],
            }
            rows.append(row)
            results_json.record(f"{model} {experts} experts", row)
            print(
                f"{model:15s} {experts} experts: accuracy {100 * row['accuracy']:.1f}% "
                f"TPF {row['tokens_per_forward']:.3f}",
                flush=True,
            )
    return rows


def fp8_weight(w, halves):
    """(q, scale) of an expert stack, quantised one expert at a time (bounded host memory)."""
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scales = [None] * w.shape[0]
    for e in range(w.shape[0]):
        q[e], scales[e] = dk.fp8_block_quantize(w[e], halves=halves)
    return q, torch.stack(scales)


def layer_rows(args, backend):
    from dinfer_kernels.reference.moe import moe_reference

    rows = []
    gen = torch.Generator().manual_seed(0)
    for name, E, k, H, I, S, routing in SHAPES:
        E, H, I, S = (n // args.shrink for n in (E, H, I, S))
        randn = lambda *shape: torch.randn(*shape, generator=gen)
        hidden = randn(args.tokens, H).bfloat16()
        router = randn(E, H) * 0.02
        w13, w2 = (randn(E, 2 * I, H) * 0.02).bfloat16(), (randn(E, H, I) * 0.02).bfloat16()
        if routing:
            routing = dict(routing, expert_bias=randn(E) * 0.01)
        shared = {}
        if S:
            shared = dict(
                shared_w13=(randn(2 * S, H) * 0.02).bfloat16(), shared_w2=(randn(H, S) * 0.02).bfloat16()
            )
        q13, s13 = fp8_weight(w13, 2)
        q2, s2 = fp8_weight(w2, 1)
        fp8 = dict(w13_scale=s13, w2_scale=s2)
        if S:
            sq13, fp8["shared_w13_scale"] = dk.fp8_block_quantize(shared["shared_w13"], halves=2)
            sq2, fp8["shared_w2_scale"] = dk.fp8_block_quantize(shared["shared_w2"])
            fp8.update(shared_w13=sq13, shared_w2=sq2)
        bf16 = dk.moe(hidden, router, w13, w2, k, **routing, **shared, backend=backend).double()
        out8 = dk.moe(hidden, router, q13, q2, k, **routing, **fp8, backend=backend).double()
        truth = moe_reference(hidden, router, w13, w2, k, compute_dtype=torch.float64, **routing, **shared)
        rms = lambda t: float(t.pow(2).mean().sqrt())
        weights_bf16 = 2 * (w13.numel() + w2.numel() + sum(t.numel() for t in shared.values()))
        weights_fp8 = sum(t.numel() * t.element_size() for t in (q13, q2, *fp8.values()))
        row = {
            "shape": name,
            "E": E,
            "top_k": k,
            "H": H,
            "I": I,
            "S": S,
            "T": args.tokens,
            "fp8_err_max_rel": float((out8 - bf16).abs().max() / bf16.abs().max()),
            "fp8_err_rms_rel": rms(out8 - bf16) / rms(bf16),
            "bf16_err_rms_rel": rms(bf16 - truth) / rms(truth),
            "expert_bytes_ratio": round(weights_fp8 / weights_bf16, 4),
        }
        rows.append(row)
        results_json.record(f"layer {name}", row)
        print(
            f"{name}: FP8 vs bf16 output error max {row['fp8_err_max_rel']:.3%} rms "
            f"{row['fp8_err_rms_rel']:.3%} of the output scale (bf16 vs fp64: rms "
            f"{row['bf16_err_rms_rel']:.3%}); expert bytes x{row['expert_bytes_ratio']}",
            flush=True,
        )
        del w13, w2, q13, q2
    return rows


def main(argv=None):
    p = engine_parser(__doc__.splitlines()[0], ",".join(TASKS), 50, timed=False)
    p.add_argument("--models", default="tiny-llada-moe,tiny-llada2")
    p.add_argument("--batch-size", type=int, default=8, help="prompts in flight per task (default 8)")
    p.add_argument("--tokens", type=int, default=32, help="tokens of the layer runs (default 32)")
    p.add_argument("--shrink", type=int, default=1, help="layer runs: E, H, I and S divided by this (tests)")
    p.add_argument("--no-layers", dest="layers", action="store_false", help="skip the layer runs")
    p.add_argument("--no-tasks", dest="tasks_run", action="store_false", help="skip the task runs")
    p.add_argument(
        "--backend",
        default="auto",
        help="backend the runs prefer (dk.prefer_backend; default auto); 'torch': the reference",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.num_problems, args.tokens = min(args.num_problems, 4), min(args.tokens, 8)
    if args.threads:
        torch.set_num_threads(args.threads)
    tasks = task_rows(args, args.backend) if args.tasks_run else []
    layers = layer_rows(args, args.backend) if args.layers else []
    columns = [("model", "model", None), ("experts", "experts", None), ("accuracy", "accuracy", ".3f")]
    columns += [(t, f"accuracy_{t}", ".2f") for t in args.tasks.split(",")]
    columns += [("TPF", "tokens_per_forward", ".3f"), ("forwards", "forwards", None)]
    layer_columns = [
        ("shape", "shape", None),
        ("T", "T", None),
        ("FP8 err max", "fp8_err_max_rel", ".2e"),
        ("FP8 err rms", "fp8_err_rms_rel", ".2e"),
        ("bf16 err rms", "bf16_err_rms_rel", ".2e"),
        ("expert bytes", "expert_bytes_ratio", ".3f"),
    ]
    tables = [markdown_tables.markdown_table(tasks, columns)] if tasks else []
    tables += [markdown_tables.markdown_table(layers, layer_columns)] if layers else []
    notes = [
        f"backend preferred: {args.backend}; model dtype {args.dtype or 'bf16'}; layer runs: hidden bf16, "
        "random weights, on the host"
    ]
    args.model = args.models  # the run's models, for its environment record
    engine_runs.finish_engine(
        "fp8_accuracy", args, {"tasks": tasks, "layers": layers}, "\n\n".join(tables), notes
    )


if __name__ == "__main__":
    main()
