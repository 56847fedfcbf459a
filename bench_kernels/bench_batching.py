"""Continuous batching against fixed runs, on one stream of prompts from every task, interleaved.

    python bench_kernels/bench_batching.py [--model tiny-llada-moe] [--num-problems 30] [--batch 8]
                                           [--device cpu] [--repeats 3] [--quick] [--json out.json]

Rows (all dInfer full's recipe, the embedded model, the same prompts in the same order):
  batch 1     one prompt at a time
  runs        `batch` prompts at a time; the next run starts when the last of the run is done
              (a finished sequence leaves its run, so the run shrinks)
  continuous  at most `batch` in flight; a finished sequence's slot goes to the next prompt at the next
              block boundary (dinfer.generate's batch_size)
Prints accuracy, forwards, sequence-forwards, TPS and the ratios to batch 1 and of continuous to runs.
Each row is timed --repeats times, in passes over the three; its TPS is the median run's (every
run's is in the JSON).
Tasks differ in answer length, so sequences finish on different blocks: that is what refills use.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkout  # noqa: F401  (puts the checkout's dinfer and dinfer_kernels on sys.path)
import cli_options
import engine_runs
import markdown_tables
from bench_e2e import RECIPES

from dinfer.tasks import TASKS, check_tasks, eval_problems


def measure_once(llm, problems, batch, runs, options):
    prompts = [p for p, _ in problems]
    parts = [prompts[i : i + batch] for i in range(0, len(prompts), batch)] if runs else [prompts]
    texts, forwards, seq_forwards, tokens = [], 0, 0, 0
    t0 = time.perf_counter()
    for part in parts:
        out = llm.generate(part, batch_size=batch, **options)
        texts += out.texts
        forwards += out.stats["forwards"]
        seq_forwards += out.stats["sequence_forwards"]
        tokens += out.stats["tokens"]
    seconds = time.perf_counter() - t0
    correct = sum(t == a for t, (_, a) in zip(texts, problems))
    return {
        "mode": "batch 1" if batch == 1 else ("runs" if runs else "continuous"),
        "batch": batch,
        "accuracy": round(correct / len(problems), 4),
        "forwards": forwards,
        "sequence_forwards": seq_forwards,
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_second": round(tokens / seconds, 1),
    }


def main(argv=None):
    p = cli_options.engine_parser(__doc__.splitlines()[0], ",".join(TASKS), 30)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args(argv)
    if args.quick:
        args.num_problems = min(args.num_problems, 8)
    llm = engine_runs.engine_llm(args)
    per_task = [eval_problems(t, args.num_problems) for t in check_tasks(args.tasks)]
    problems = [prob for group in zip(*per_task) for prob in group]  # add, sort, ..., add, sort, ...
    options = dict(RECIPES["dinfer-full"], align_blocks=False)
    llm.generate([q for q, _ in problems[: args.batch]], batch_size=args.batch, **options)  # warm-up
    modes = [(1, False), (args.batch, True), (args.batch, False)]
    results = engine_runs.interleaved_medians(
        modes, lambda mode, i: measure_once(llm, problems, *mode, options), cli_options.repeats(args)
    )
    one, runs, cont = results
    for r in results:
        r["speedup_vs_batch1"] = round(r["tokens_per_second"] / one["tokens_per_second"], 2)
    columns = [
        ("mode", "mode", None),
        ("batch", "batch", None),
        ("accuracy", "accuracy", ".3f"),
        ("forwards", "forwards", None),
        ("sequence forwards", "sequence_forwards", None),
        ("TPS", "tokens_per_second", ".1f"),
        ("x batch 1", "speedup_vs_batch1", ".2f"),
    ]
    notes = [
        f"continuous / runs, tokens/s: {cont['tokens_per_second'] / runs['tokens_per_second']:.2f}",
        f"continuous / runs, forwards: {cont['forwards'] / runs['forwards']:.2f}",
        f"batch {args.batch} continuous / batch 1, tokens/s: {cont['speedup_vs_batch1']}",
    ]
    engine_runs.finish_engine(
        "batching", args, results, markdown_tables.markdown_table(results, columns), notes
    )


if __name__ == "__main__":
    main()
