"""Where credit decoding and iteration smoothing pay: tokens per forward against threshold-only decoding
over confidence thresholds and block lengths, next to the floor of one forward per block.

    python bench_kernels/bench_credit.py [--model tiny-llada-moe] [--num-problems 30]
                                         [--thresholds 0.9,0.95,0.99,0.999] [--block-lengths 8,32]
                                         [--device cpu] [--quick] [--json out.json]

Every block costs at least one forward, so threshold-only forwards / blocks is the most any decoder
can gain over it (`ceiling`). Credit (and smoothing) remove the forwards a block spends after its
first, which are few when a block's first forward already commits almost all of it (low thresholds,
short blocks) and many when it does not. Recipes: bench_e2e's dinfer (threshold), dinfer-credit and
dinfer-full (credit + smoothing), batch 1, with `unroll` 1 so that the loop's chunking (dInfer's
expected_tpf sizing) never sets a floor of its own.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkout  # noqa: F401  (puts the checkout's dinfer and dinfer_kernels on sys.path)
import cli_options
import engine_runs
import markdown_tables
import results_json
from bench_e2e import RECIPES

from dinfer.tasks import TASKS, check_tasks, eval_problems

COMPARED = {"threshold": "dinfer", "credit": "dinfer-credit", "credit+smoothing": "dinfer-full"}


def measure(llm, problems, options):
    out = llm.generate([p for p, _ in problems], batch_size=1, **options)
    s = out.stats
    return {
        "forwards": s["forwards"],
        "blocks": s["refreshes"],
        "tokens": s["tokens"],
        "tokens_per_forward": round(s["tokens"] / s["forwards"], 3),
        "accuracy": round(sum(t == a for t, (_, a) in zip(out.texts, problems)) / len(problems), 4),
    }


def main(argv=None):
    p = cli_options.engine_parser(__doc__.splitlines()[0], ",".join(TASKS), 30, timed=False)
    p.add_argument("--thresholds", default="0.9,0.95,0.99,0.999")
    p.add_argument("--block-lengths", default=None, help="default: the model's and the whole canvas")
    args = p.parse_args(argv)
    thresholds = [float(t) for t in args.thresholds.split(",")]
    if args.quick:
        args.num_problems, thresholds = min(args.num_problems, 4), [thresholds[0], thresholds[-1]]
    llm = engine_runs.engine_llm(args)
    gen_length = llm.defaults["gen_length"]
    block_lengths = (
        cli_options.parse_ints(args.block_lengths)
        if args.block_lengths
        else sorted({llm.defaults["block_length"], gen_length})
    )
    if args.quick:
        block_lengths = block_lengths[:1]
    problems = [prob for t in check_tasks(args.tasks) for prob in eval_problems(t, args.num_problems)]
    results = []
    for bl in block_lengths:
        for tau in thresholds:
            base = None
            for label, recipe in COMPARED.items():
                # Refreshes only at block starts (the recipes' defaults): refreshes count blocks.
                options = dict(
                    RECIPES[recipe],
                    align_blocks=False,
                    block_length=bl,
                    threshold=tau,
                    unroll=1,
                    warmup_steps=0,
                    refresh_every=0,
                )
                r = {
                    "block_length": bl,
                    "threshold": tau,
                    "decoder": label,
                    **measure(llm, problems, options),
                }
                base = base or r
                r["tpf_vs_threshold"] = round(r["tokens_per_forward"] / base["tokens_per_forward"], 3)
                r["ceiling"] = round(base["forwards"] / base["blocks"], 3)
                results.append(r)
                results_json.record(f"bl {bl} tau {tau} {label}", r)
                print(
                    f"bl {bl:3d} tau {tau:<6} {label:<17} forwards {r['forwards']:5d} blocks {r['blocks']:4d} "
                    f"TPF {r['tokens_per_forward']:5.2f} x{r['tpf_vs_threshold']:.2f} (ceiling "
                    f"x{r['ceiling']:.2f}) acc {100 * r['accuracy']:.1f}%",
                    flush=True,
                )
    columns = [
        ("block", "block_length", None),
        ("tau", "threshold", None),
        ("decoder", "decoder", None),
        ("accuracy", "accuracy", ".3f"),
        ("forwards", "forwards", None),
        ("blocks", "blocks", None),
        ("TPF", "tokens_per_forward", ".2f"),
        ("x threshold", "tpf_vs_threshold", ".2f"),
        ("ceiling", "ceiling", ".2f"),
    ]
    best = max(
        (r for r in results if r["decoder"] == "credit+smoothing"), key=lambda r: r["tpf_vs_threshold"]
    )
    notes = [
        f"credit+smoothing TPF / threshold-only, best: x{best['tpf_vs_threshold']} at block "
        f"{best['block_length']}, tau {best['threshold']}"
    ]
    engine_runs.finish_engine(
        "credit", args, results, markdown_tables.markdown_table(results, columns), notes
    )


if __name__ == "__main__":
    main()
