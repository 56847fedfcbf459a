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

A block-causal model (LLaDA2, e.g. --model tiny-llada2) decodes by block diffusion on the paged cache,
blocks on the grid from position 0, with its own recipes (BLOCK_RECIPES; speedups over one-token):
  one-token      one token per step (the fixed decoder), early stop
  threshold      threshold 0.9, early stop
  threshold-fwd  the same with the previous block's clean K/V from an extra forward, not fused
  joint-quality  LLaDA2.1's JointThreshold, diffusers' Quality mode: tau 0.7, edits above 0.5,
                 up to 16 post-edit forwards
  joint-no-edit  the same tau 0.7 with editing off: what the edits alone change
  joint-speed    Speed mode: tau 0.5, no edits
and the threshold recipe at batch 8.
Each row is timed --repeats times, in passes over all rows (so the host's drift lands on every row
alike); its tokens/s is the median run's, and the JSON keeps every run's ("tps_runs").

--synthetic MODEL (llada-moe-7b | llada2-mini) times generation at a released model's shape instead:
the random-weight model of bench_kernels/synthetic_model.py (every layer, or --layers N; --tiny for
tests; bf16 unless --dtype), synthetic prompts of --prompt-len random token ids, --gen-length tokens
each, blocks of 32, through the continuous-batching engine (dinfer.generate.Generator: open, submit,
step, as the server runs it) with the fixed decoder at --tpf k tokens per step (32 / k steps per
block, rounded), so tokens per forward is set, not a property of the weights; early stop off, so
every request generates its whole gen_length. LLaDA-MoE decodes with the vicinity cache (dInfer's:
no write-back), LLaDA2 by block diffusion on the paged cache. Rows: 1 request at batch 1, and
--concurrent (default 32) requests at once, each with CUDA graphs on and off (the host has none).
Columns: the TPF set and the one measured (generated tokens per sequence-forward: lower when a
prompt's tail shares its first block), tokens/s (generated tokens over the run's wall time, the
median of --repeats runs), time to the first committed block (the engine's on_block callback),
forwards, CUDA graph captures; the JSON keeps the run's whole Stats. Each row opens one Generator
and runs its prompts through it once untimed (the eager warm-up of every shape, the graph captures,
Triton's compiles), then times --repeats more passes on the same Generator (submit, step until idle,
no re-open: open resets the graphs), so a graphs-on row times the replays; each pass counts into its
own Stats, so the timed pass's graph_captures is 0 and the warm-up's are warm_graph_captures /
warm_capture_seconds.
On real weights a threshold decoder's tokens per forward depends on the model and the prompt: these
tokens/s are the engine's speed at the stated TPF, not a model's.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkout  # noqa: F401  (puts the checkout's dinfer and dinfer_kernels on sys.path)
import cli_options
import engine_runs
import environment
import markdown_tables
import results_json
import synthetic_model
import timing
import torch

import dinfer_kernels as dk
from dinfer.batch import span
from dinfer.decoders import DecoderConfig
from dinfer.evaluate import evaluate
from dinfer.generate import GenerationConfig, Generator
from dinfer.stats import Stats
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


BLOCK_RECIPES = {
    "one-token": dict(decoder="fixed", steps_per_block=0, unroll=1),
    "threshold": dict(decoder="threshold", threshold=0.9, unroll=4),
    "threshold-fwd": dict(decoder="threshold", threshold=0.9, clean_kv="forward", unroll=4),
    "joint-quality": dict(
        decoder="joint", threshold=0.7, edit_threshold=0.5, max_post_edit_steps=16, unroll=4
    ),
    "joint-no-edit": dict(decoder="joint", threshold=0.7, unroll=4),
    "joint-speed": dict(decoder="joint", threshold=0.5, unroll=4),
}


def recipes(llm):
    """The model's recipes, and the options every one of them shares."""
    if llm.model.config.block_causal:
        return BLOCK_RECIPES, dict(cache="paged", align_blocks=True)
    return RECIPES, dict(align_blocks=False)


def run_once(llm, row, args, first):
    """One timed evaluation of row (recipe, backend, batch); first: with evaluate's warm-up."""
    recipe, backend, batch = row
    table, shared = recipes(llm)
    options = dict(table[recipe], **shared)
    with dk.prefer_backend(backend), timing.nvtx_range(f"{recipe}/{backend}/b{batch}"):
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
    p = cli_options.engine_parser(__doc__.splitlines()[0], ",".join(TASKS), 40)
    p.add_argument("--plot", default=None, help="PNG of accuracy against tokens/s (needs matplotlib)")
    p.add_argument(
        "--synthetic",
        choices=sorted(synthetic_model.RELEASED),
        default=None,
        help="time generation on a random-weight model of this released shape (see the docstring)",
    )
    p.add_argument("--layers", type=int, default=None, help="--synthetic: the first N layers (default all)")
    p.add_argument("--tiny", action="store_true", help="--synthetic: the model's tiny variant (tests)")
    p.add_argument("--tpf", type=int, default=5, help="--synthetic: tokens per step of the fixed decoder")
    p.add_argument("--prompt-len", type=int, default=512, help="--synthetic: prompt tokens per request")
    p.add_argument("--gen-length", type=int, default=256, help="--synthetic: generated tokens per request")
    p.add_argument("--concurrent", type=int, default=32, help="--synthetic: requests in flight at once")
    args = p.parse_args(argv)
    if args.synthetic:
        return synthetic(args)
    if args.quick:
        args.num_problems = min(args.num_problems, 4)
    llm = engine_runs.engine_llm(args)
    table, _ = recipes(llm)
    rows = [(recipe, backend, 1) for recipe in table for backend in ("auto", "torch")]
    rows.append(("threshold" if llm.model.config.block_causal else "dinfer-full", "auto", 8))

    def once(row, i):
        r = run_once(llm, row, args, first=i == 0)
        print(f"pass {i + 1}  " + _row(r), flush=True)
        return r

    results = engine_runs.interleaved_medians(rows, once, cli_options.repeats(args))
    get = {(r["recipe"], r["backend"], r["batch"]): r for r in results}
    if llm.model.config.block_causal:
        return finish_block_diffusion(llm, args, results, get)
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
    speedups = [("x vanilla", "speedup_vs_vanilla", ".2f"), ("x fast-dllm", "speedup_vs_fast_dllm", ".2f")]
    columns = table_columns(speedups)
    notes = [f"{k}: {v}" for k, v in checks.items()]
    engine_runs.finish_engine("e2e", args, results, markdown_tables.markdown_table(results, columns), notes)
    if args.plot:
        plot(results, args.plot, os.path.basename(llm.path))


def table_columns(speedups):
    """The results table's columns: the run, its accuracy and speed, `speedups`, its forwards."""
    return [
        ("recipe", "recipe", None),
        ("backend", "backend", None),
        ("batch", "batch", None),
        ("accuracy", "accuracy", ".3f"),
        ("TPF", "tokens_per_forward", ".2f"),
        ("TPS", "tokens_per_second", ".1f"),
        *speedups,
        ("forwards", "forwards", None),
    ]


def finish_block_diffusion(llm, args, results, get):
    """The block-diffusion recipes' table: speedups over one token per step, what editing and the
    fused clean K/V buy."""
    base = get["one-token", "auto", 1]
    for r in results:
        r["speedup_vs_one_token"] = round(r["tokens_per_second"] / base["tokens_per_second"], 2)
    thr, fwd = get["threshold", "auto", 1], get["threshold-fwd", "auto", 1]
    quality, plain = get["joint-quality", "auto", 1], get["joint-no-edit", "auto", 1]
    speed = get["joint-speed", "auto", 1]
    points = lambda a, b: round(100 * (a["accuracy"] - b["accuracy"]), 1)
    notes = [
        f"threshold TPS / one-token: {thr['speedup_vs_one_token']}",
        f"joint-quality accuracy - joint-no-edit, points (what editing buys): {points(quality, plain)}",
        f"joint-quality TPF / joint-no-edit TPF (what editing costs): "
        f"{round(quality['tokens_per_forward'] / plain['tokens_per_forward'], 2)}",
        f"joint-speed accuracy - one-token, points: {points(speed, base)}; TPF "
        f"{speed['tokens_per_forward']:.2f}",
        f"threshold forwards saved by the fused clean K/V: {fwd['forwards'] - thr['forwards']} of "
        f"{fwd['forwards']}",
        f"batch 8 TPS / batch 1 TPS, threshold: "
        f"{round(get['threshold', 'auto', 8]['tokens_per_second'] / thr['tokens_per_second'], 2)}",
    ]
    columns = table_columns([("x one-token", "speedup_vs_one_token", ".2f")])
    engine_runs.finish_engine("e2e", args, results, markdown_tables.markdown_table(results, columns), notes)
    if args.plot:
        plot(results, args.plot, os.path.basename(llm.path), BLOCK_RECIPES)


def _row(r):
    return (
        f"{r['recipe']:<12} {r['backend']:<6} b{r['batch']}  acc {100 * r['accuracy']:5.1f}%  "
        f"TPF {r['tokens_per_forward']:5.2f}  TPS {r['tokens_per_second']:8.1f}"
    )


SYNTHETIC_BLOCK = 32  # LLaDA2's trained block; LLaDA-MoE's dInfer default too


def synthetic_config(model, args, cuda_graphs):
    """The generation config of a --synthetic row: the fixed decoder at args.tpf tokens per step."""
    steps = max(1, round(SYNTHETIC_BLOCK / args.tpf))
    cache = dict(cache="paged") if model.config.block_causal else dict(cache="vicinity", write_back=False)
    decoder = DecoderConfig("fixed", steps_per_block=steps)
    return GenerationConfig(
        gen_length=args.gen_length,
        block_length=SYNTHETIC_BLOCK,
        decoder=decoder,
        early_stop=False,  # random weights: every request generates its whole gen_length
        cuda_graphs=cuda_graphs,
        **cache,
    )


def generation_passes(model, cfg, prompts):
    """Opens one Generator for `prompts` (Generator.open, as a server does) and returns a function
    that runs them through it once more: submit each, step until idle, never re-opening (open resets
    the CUDA graphs), so a later pass replays what an earlier one captured and compiled. Each call
    returns (its pass's Stats as a dict, seconds to its first committed block): the counters are the
    pass's own (a fresh Stats), so a warm pass shows graph_captures 0."""
    gen = Generator(model, cfg)
    state = {}
    width = max(
        span(len(p), cfg.gen_length, cfg.block_length, cfg.align_blocks, cfg.after_look + 1) for p in prompts
    )

    def on_block(i, tokens):
        if state["first"] is None:
            state["first"] = time.perf_counter() - state["t0"]

    on_finish = lambda i, tokens, forwards: state["outputs"].__setitem__(i, tokens)
    gen.open(len(prompts), width, max(len(p) for p in prompts) + cfg.gen_length, on_finish, on_block)

    def run_pass():
        gen.stats = Stats(timed=gen.stats.timed)
        state.update(outputs={}, first=None, t0=time.perf_counter())
        for p in prompts:
            gen.submit(p)
        while gen.step():
            pass
        gen.stats.seconds = time.perf_counter() - state["t0"]
        gen.stats.tokens = sum(int((o != model.config.eos_id).sum()) for o in state["outputs"].values())
        return gen.stats.as_dict(), state["first"]

    return run_pass


def synthetic(args):
    """--synthetic: tokens/s of the engine on a random-weight model at a released shape."""
    args.dtype = args.dtype or "bf16"  # the released weights' (the page's header names it)
    dtype = getattr(torch, cli_options.DTYPES.get(args.dtype, args.dtype))
    if args.threads:
        torch.set_num_threads(args.threads)
    model = synthetic_model.build(args.synthetic, args.device, dtype, args.layers, args.tiny)
    c = model.config
    gen = torch.Generator().manual_seed(0)
    prompt = lambda: torch.randint(0, c.eos_id, (args.prompt_len,), generator=gen).tolist()
    graph_modes = (True, False) if args.device == "cuda" else (False,)
    rows = [(batch, graphs) for batch in dict.fromkeys((1, args.concurrent)) for graphs in graph_modes]
    results = []
    for batch, graphs in rows:
        cfg = synthetic_config(model, args, graphs)
        prompts = [prompt() for _ in range(batch)]
        run_pass = generation_passes(model, cfg, prompts)
        label = f"e2e.synthetic.b{batch}.{'graphs' if graphs else 'eager'}"
        with timing.nvtx_range(f"{label}.warm"):
            warm, _ = run_pass()  # untimed: eager warm-up of every shape, the captures, the compiles
        runs = []
        for i in range(cli_options.repeats(args)):
            with timing.nvtx_range(f"{label}.run{i}"):
                stats, first_block = run_pass()
            runs.append(dict(stats, first_block_s=first_block))
        best = sorted(runs, key=lambda r: r["tokens_per_second"])[(len(runs) - 1) // 2]
        r = dict(
            model=args.synthetic,
            layers=c.num_layers,
            batch=batch,
            graphs=graphs,
            tpf_set=SYNTHETIC_BLOCK / cfg.decoder.steps_per_block,
            prompt_len=args.prompt_len,
            gen_length=args.gen_length,
            cache=cfg.cache,
            **best,
            tps_runs=[x["tokens_per_second"] for x in runs],
            first_block_runs=[x["first_block_s"] for x in runs],
            graph_captures_runs=[x["graph_captures"] for x in runs],
            warm_graph_captures=warm["graph_captures"],
            warm_capture_seconds=warm["capture_seconds"],
            warm_seconds=warm["seconds"],
        )
        results_json.record(f"e2e.synthetic.{args.synthetic}.b{batch}.{'graphs' if graphs else 'eager'}", r)
        print(
            f"b{batch:<3} graphs {'on ' if graphs else 'off'}  TPS {r['tokens_per_second']:9.1f}  "
            f"first block {r['first_block_s']:.3f} s  forwards {r['forwards']}  tokens {r['tokens']}  "
            f"captures {r['graph_captures']} (warm-up pass {r['warm_graph_captures']}, "
            f"{r['warm_capture_seconds']:.2f} s)"
        )
        results.append(r)
    columns = [
        ("model", "model", None),
        ("layers", "layers", None),
        ("requests", "batch", None),
        ("graphs", "graphs", None),
        ("TPF set", "tpf_set", ".2f"),
        ("TPF", "tokens_per_sequence_forward", ".2f"),
        ("tokens/s", "tokens_per_second", ".1f"),
        ("first block s", "first_block_s", ".3f"),
        ("forwards", "forwards", None),
        ("tokens", "tokens", None),
        ("seconds", "seconds", ".2f"),
        ("captures", "graph_captures", None),
        ("warm-up captures", "warm_graph_captures", None),
    ]
    table = markdown_tables.markdown_table(results, columns)
    print(table)
    tpf = results[0]["tpf_set"]
    notes = [
        f"tokens per forward is set, not measured: the fixed decoder commits {tpf:.2f} of a block's "
        f"{SYNTHETIC_BLOCK} tokens per forward (--tpf {args.tpf}); on real weights the TPF of a threshold "
        "decoder depends on the model and the prompt, so these tokens/s are the engine's speed at this TPF",
        f"random weights ({'tiny variant' if args.tiny else f'{c.num_layers} layers'}), prompts of "
        f"{args.prompt_len} random tokens, {args.gen_length} generated tokens each, early stop off",
        "each row's Generator first runs its prompts once untimed (eager warm-up, CUDA graph captures, "
        "Triton compiles), then the timed passes on the same Generator: 'captures' is the timed pass's "
        "(0 when every shape was captured in the warm-up), 'warm-up captures' the untimed pass's",
    ]
    env = environment.environment(args.device)
    env["model"] = f"synthetic {args.synthetic}" + (" (tiny)" if args.tiny else f" ({c.num_layers} layers)")
    return results_json.finish("e2e", env, args, None, results, [table], notes)


def plot(results, path, model, recipes=RECIPES):
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
    colours = {recipe: f"C{i}" for i, recipe in enumerate(recipes)}
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
