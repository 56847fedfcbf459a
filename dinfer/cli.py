"""The `dinfer` command.

    dinfer generate [--model M] --prompt TEXT [options]     text for one or more prompts
    dinfer eval [--model M] [--tasks add,sort] [options]    accuracy / TPF / TPS on the task suite

--model is a checkpoint folder or an embedded model's name (default: tiny-llada-moe, shipped in the
package). Options left out keep the GenerationConfig / DecoderConfig defaults (every option defaults
to None, which dinfer.llm reads as "not given"). Errors print one line on stderr and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from .batch import CACHE_MODES
from .decoders import DECODERS
from .llm import LLM
from .models.embedded import DEFAULT, EMBEDDED
from .tasks import TASKS


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help=f"checkpoint folder, or an embedded model ({', '.join(EMBEDDED)}; "
                                   f"default {DEFAULT})")
    p.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda when available)")
    p.add_argument("--dtype", help="bf16, fp16 or fp32 (default: bf16 on a GPU, fp32 on the host)")
    p.add_argument("--batch-size", type=int,
                   help="most prompts decoded at once; a finished one's place goes to the next (default: all)")


def _generation_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gen-length", type=int)
    p.add_argument("--block-length", type=int)
    p.add_argument("--decoder", choices=DECODERS)
    p.add_argument("--threshold", type=float, help="commit threshold (tau_high for hierarchy)")
    p.add_argument("--low-threshold", type=float, help="tau_low for hierarchy")
    p.add_argument("--steps-per-block", type=int, help="fixed decoder: steps per block (0: one token per step)")
    p.add_argument("--temperature", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--cache", choices=CACHE_MODES)
    p.add_argument("--warmup-steps", type=int, help="first N iterations are full refreshes")
    p.add_argument("--no-write-back", dest="write_back", action="store_false", default=None,
                   help="window steps leave the KV cache as it was (dInfer's vicinity step)")
    p.add_argument("--smoothing", action="store_true", default=None, help="iteration smoothing")
    p.add_argument("--smoothing-threshold-start", type=float,
                   help="smoothing's threshold warm-up tau_n = max(start - decay * n, tau): start (default 1.0; "
                        "<= --threshold: no warm-up)")
    p.add_argument("--smoothing-threshold-decay", type=float, help="... and its decay per iteration (default 0.02)")
    p.add_argument("--unroll", type=int, help="iterations per host check")
    p.add_argument("--no-early-stop", dest="early_stop", action="store_false", default=None,
                   help="decode every block even after EOS")
    p.add_argument("--no-compact", dest="compact", action="store_false", default=None,
                   help="sequences whose block is done keep running its forwards (dInfer's batches)")
    p.add_argument("--no-align-blocks", dest="align_blocks", action="store_false", default=None,
                   help="block 0 starts right after the prompt (LLaDA's sampler), not at a block boundary")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dinfer", description="Inference for diffusion language models.")
    commands = parser.add_subparsers(dest="command", required=True)
    g = commands.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("--prompt", action="append", help="a prompt (repeat for a batch; default: read stdin)")
    g.add_argument("--json", action="store_true", help='print {"texts", "token_ids", "stats"} as JSON')
    g.add_argument("--no-chat", dest="chat", action="store_false", help="do not apply the chat template")
    _model_options(g)
    _generation_options(g)
    e = commands.add_parser("eval", help="exact-match accuracy, tokens/forward and tokens/s on the task suite")
    e.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)} (default: all)")
    e.add_argument("--num-problems", type=int, default=100, help="held-out problems per task (default 100)")
    e.add_argument("--problem-seed", type=int, default=0, help="which held-out problems (default 0)")
    e.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    e.add_argument("--output", help="also write the JSON result to this file (and the table to FILE.md)")
    e.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    _model_options(e)
    _generation_options(e)
    return parser


# Command-line settings that are not generation options.
_RUN_ARGS = ("command", "model", "prompt", "json", "chat", "device", "dtype", "batch_size", "tasks",
             "num_problems", "problem_seed", "output", "progress")


def _options(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if k not in _RUN_ARGS}


def _generate(args: argparse.Namespace) -> None:
    prompts = args.prompt if args.prompt is not None else [sys.stdin.read().rstrip("\n")]
    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    result = llm.generate(prompts, chat=args.chat, batch_size=args.batch_size, **_options(args))
    if args.json:
        print(json.dumps({"texts": result.texts, "token_ids": result.token_ids, "stats": result.stats},
                         ensure_ascii=False))
        return
    for text in result.texts:
        print(text)
    s = result.stats
    print(f"{len(result.texts)} prompt(s): {s['tokens']} tokens, {s['forwards']} forwards "
          f"({s['refreshes']} refreshes), {s['seconds']:.3f} s, {s['tokens_per_forward']} tokens/forward, "
          f"{s['tokens_per_second']} tokens/s", file=sys.stderr)


def _eval(args: argparse.Namespace) -> None:
    from .evaluate import evaluate, markdown_table

    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    batch_size = 1 if args.batch_size is None else args.batch_size
    result = evaluate(llm, args.tasks, num_problems=args.num_problems, batch_size=batch_size,
                      problem_seed=args.problem_seed, progress=args.progress, **_options(args))
    result["model"] = llm.path
    table = markdown_table(result, title=f"{llm.path} {json.dumps(result['options'])}")
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        with open(args.output + ".md", "w", encoding="utf-8") as f:
            f.write(table + "\n")
    print(json.dumps(result, indent=2) if args.json else table)


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)  # argparse itself exits 2 on a bad command line
    try:
        _generate(args) if args.command == "generate" else _eval(args)
    except Exception as e:  # a user-facing command: the message, not a traceback
        print(f"dinfer: error: {e}", file=sys.stderr)
        return 2
    return 0
