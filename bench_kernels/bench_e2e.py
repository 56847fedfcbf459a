"""End to end: accuracy, tokens/forward and tokens/s of the published decoding recipes on an embedded
model, in one process, on the same held-out prompts of the task suite.

    python bench_kernels/bench_e2e.py [--model tiny-llada-moe] [--num-problems 40] [--device cpu]
                                      [--repeats 3] [--quick] [--json out.json] [--plot out.png]

Recipes (dinfer.generate options; every one decodes the same canvas of the model's gen_length):
  vanilla      LLaDA: one token per step (lowest-confidence remasking), no cache, no early stop
  fast-dllm    Fast-dLLM: threshold 0.9, dual cache refreshed at each block, no early stop
  dinfer       threshold 0.9 + vicinity refresh + unrolled loop + early stop
  dinfer-full  credit decoding + iteration smoothing + vicinity refresh + unrolled loop + early stop;
               smoothing without dInfer's threshold warm-up (tau from 1.0 down by 0.02 per forward),
               which is tuned for ~1k-token requests and holds back most of a 32-token one
  dinfer-credit  dinfer-full without iteration smoothing
  hierarchical hierarchical decoding (0.9 / 0.6) + vicinity refresh + unrolled loop + early stop
Every recipe decodes the same block layout, LLaDA's: block 0 starts right after the prompt (dInfer's
start_block_align, the engine's default, starts it at the block boundary below the prompt's end,
which on these models costs accuracy and tokens/forward alike; see docs/notes/results-log.md).
Each runs with our kernels (backend "auto") and on the pure-torch references ("/torch"), and
dinfer-full also at batch 8. Speedups are tokens/s over vanilla and over fast-dllm, both with kernels.
Each row is timed --repeats times, in passes over all rows (so the host's drift lands on every row
alike); its tokens/s is the median run's, and the JSON keeps every run's ("tps_runs").
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

import dinfer_kernels as dk
from dinfer.evaluate import evaluate
from dinfer.tasks import TASKS

RECIPES = {
    "vanilla": dict(decoder="fixed", steps_per_block=0, cache="none", early_stop=False, unroll=1),
    "fast-dllm": dict(decoder="threshold", threshold=0.9, cache="dual", early_stop=False, unroll=1),
    "dinfer": dict(decoder="threshold", threshold=0.9, cache="vicinity", write_back=False, unroll=4),
    "dinfer-full": dict(
        decoder="credit",
        threshold=0.9,
        smoothing=True,
        smoothing_threshold_start=0.0,
        cache="vicinity",
        write_back=False,
        unroll=4,
    ),
    "dinfer-credit": dict(decoder="credit", threshold=0.9, cache="vicinity", write_back=False, unroll=4),
    "hierarchical": dict(
        decoder="hierarchical", threshold=0.9, low_threshold=0.6, cache="vicinity", write_back=False, unroll=4
    ),
}


def run_once(llm, row, args, first):
    """One timed evaluation of row (recipe, backend, batch); first: with evaluate's warm-up."""
    recipe, backend, batch = row
    options = dict(RECIPES[recipe], align_blocks=False)
    with dk.prefer_backend(backend), common.nvtx_range(f"{recipe}/{backend}/b{batch}"):
        r = evaluate(
            llm, args.tasks, num_problems=args.num_problems, batch_size=batch, warmup=first, **options
        )
    o = r["overall"]
    return {
        "recipe": recipe,
        "backend": backend,
        "batch": batch,
        "accuracy": o["accuracy"],
        "tokens_per_forward": o["tokens_per_forward"],
        "tokens_per_second": o["tokens_per_second"],
        "forwards": o["forwards"],
        "refreshes": o["refreshes"],
        "tokens": o["tokens"],
        "seconds": o["seconds"],
        "per_task_accuracy": {t: v["accuracy"] for t, v in r["tasks"].items()},
        "options": options,
    }


def main(argv=None):
    p = common.engine_parser(__doc__.splitlines()[0], ",".join(TASKS), 40)
    p.add_argument("--plot", default=None, help="PNG of accuracy against tokens/s (needs matplotlib)")
    args = p.parse_args(argv)
    if args.quick:
        args.num_problems = min(args.num_problems, 4)
    llm = common.engine_llm(args)
    rows = [(recipe, backend, 1) for recipe in RECIPES for backend in ("auto", "torch")]
    rows.append(("dinfer-full", "auto", 8))

    def once(row, i):
        r = run_once(llm, row, args, first=i == 0)
        print(f"pass {i + 1}  " + _row(r), flush=True)
        return r

    results = common.interleaved_medians(rows, once, common.repeats(args))

    get = {(r["recipe"], r["backend"], r["batch"]): r for r in results}
    van, fast = get["vanilla", "auto", 1], get["fast-dllm", "auto", 1]
    for r in results:
        r["speedup_vs_vanilla"] = round(r["tokens_per_second"] / van["tokens_per_second"], 2)
        r["speedup_vs_fast_dllm"] = round(r["tokens_per_second"] / fast["tokens_per_second"], 2)
    full, thr, full8 = get["dinfer-full", "auto", 1], get["dinfer", "auto", 1], get["dinfer-full", "auto", 8]
    credit = get["dinfer-credit", "auto", 1]
    checks = {
        "dinfer-full TPS / vanilla (target >= 10)": full["speedup_vs_vanilla"],
        "dinfer-full TPS / fast-dllm (target >= 2)": full["speedup_vs_fast_dllm"],
        "dinfer-full accuracy - vanilla, points (target >= -1)": round(
            100 * (full["accuracy"] - van["accuracy"]), 1
        ),
        "dinfer-credit TPS / vanilla": credit["speedup_vs_vanilla"],
        "dinfer-credit TPS / fast-dllm": credit["speedup_vs_fast_dllm"],
        "dinfer-credit accuracy - vanilla, points": round(100 * (credit["accuracy"] - van["accuracy"]), 1),
        "credit TPF / threshold-only TPF": round(credit["tokens_per_forward"] / thr["tokens_per_forward"], 2),
        "credit+smoothing TPF / threshold-only TPF (target >= 1.2)": round(
            full["tokens_per_forward"] / thr["tokens_per_forward"], 2
        ),
        # Every block costs a forward (its refresh), so no decoder can do better than this here.
        "threshold-only forwards / blocks (the most any decoder can gain at this layout)": round(
            thr["forwards"] / thr["refreshes"], 2
        ),
        "credit+smoothing accuracy - threshold-only, points": round(
            100 * (full["accuracy"] - thr["accuracy"]), 1
        ),
        "batch 8 TPS / batch 1 TPS, dinfer-full (target >= 3)": round(
            full8["tokens_per_second"] / full["tokens_per_second"], 2
        ),
    }
    columns = [
        ("recipe", "recipe", None),
        ("backend", "backend", None),
        ("batch", "batch", None),
        ("accuracy", "accuracy", ".3f"),
        ("TPF", "tokens_per_forward", ".2f"),
        ("TPS", "tokens_per_second", ".1f"),
        ("x vanilla", "speedup_vs_vanilla", ".2f"),
        ("x fast-dllm", "speedup_vs_fast_dllm", ".2f"),
        ("forwards", "forwards", None),
    ]
    notes = [f"{k}: {v}" for k, v in checks.items()]
    common.finish_engine("e2e", args, results, common.markdown_table(results, columns), notes)
    if args.plot:
        plot(results, args.plot, os.path.basename(llm.path))


def _row(r):
    return (
        f"{r['recipe']:<12} {r['backend']:<6} b{r['batch']}  acc {100 * r['accuracy']:5.1f}%  "
        f"TPF {r['tokens_per_forward']:5.2f}  TPS {r['tokens_per_second']:8.1f}"
    )


def plot(results, path, model):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed (pip install -e '.[bench]'); no plot written")
        return
    # Recipes often land on the same point (equal accuracy, close speeds), so a legend names them
    # rather than labels that would overprint: one colour per recipe, the marker says which run.
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colours = {recipe: f"C{i}" for i, recipe in enumerate(RECIPES)}
    for r in results:
        marker = "s" if r["batch"] > 1 else ("o" if r["backend"] == "auto" else "x")
        label = f"{r['recipe']}{'' if r['backend'] == 'auto' else ' (torch)'}" + (
            "" if r["batch"] == 1 else f" batch {r['batch']}"
        )
        ax.scatter(
            r["tokens_per_second"],
            100 * r["accuracy"],
            marker=marker,
            s=40,
            color=colours[r["recipe"]],
            label=label,
            alpha=0.8,
        )
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    ax.set_xscale("log")
    ax.set_xlabel("tokens / s (log)")
    ax.set_ylabel("exact match, %")
    ax.set_title(f"{model}: accuracy against speed")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
