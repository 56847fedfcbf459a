"""The `dinfer` command: `dinfer generate --model PATH --prompt TEXT [options]`.

Options left out keep the GenerationConfig / DecoderConfig defaults (every option defaults to None,
which dinfer.llm reads as "not given"). Errors print one line on stderr and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from .batch import CACHE_MODES
from .decoders import DECODERS
from .llm import LLM


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dinfer", description="Inference for diffusion language models.")
    commands = parser.add_subparsers(dest="command", required=True)
    g = commands.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("--model", required=True, help="checkpoint folder (config.json, safetensors, tokenizer.json)")
    g.add_argument("--prompt", action="append", help="a prompt (repeat for a batch; default: read stdin)")
    g.add_argument("--json", action="store_true", help='print {"texts", "token_ids", "stats"} as JSON')
    g.add_argument("--no-chat", dest="chat", action="store_false", help="do not apply the chat template")
    g.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda when available)")
    g.add_argument("--dtype", help="bf16, fp16 or fp32 (default: bf16 on a GPU, fp32 on the host)")
    g.add_argument("--batch-size", type=int, help="prompts per generation run (default: all)")
    g.add_argument("--gen-length", type=int)
    g.add_argument("--block-length", type=int)
    g.add_argument("--decoder", choices=DECODERS)
    g.add_argument("--threshold", type=float, help="commit threshold (tau_high for hierarchy)")
    g.add_argument("--low-threshold", type=float, help="tau_low for hierarchy")
    g.add_argument("--temperature", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--cache", choices=CACHE_MODES)
    g.add_argument("--warmup-steps", type=int, help="first N iterations are full refreshes")
    g.add_argument("--no-write-back", dest="write_back", action="store_false", default=None,
                   help="window steps leave the KV cache as it was (dInfer's vicinity step)")
    g.add_argument("--smoothing", action="store_true", default=None, help="iteration smoothing")
    g.add_argument("--unroll", type=int, help="iterations per host check")
    return parser


# Command-line settings that are not generation options.
_RUN_ARGS = ("command", "model", "prompt", "json", "chat", "device", "dtype", "batch_size")


def _generate(args: argparse.Namespace) -> None:
    prompts = args.prompt if args.prompt is not None else [sys.stdin.read().rstrip("\n")]
    options = {k: v for k, v in vars(args).items() if k not in _RUN_ARGS}
    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    result = llm.generate(prompts, chat=args.chat, batch_size=args.batch_size, **options)
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


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)  # argparse itself exits 2 on a bad command line
    try:
        _generate(args)
    except Exception as e:  # a user-facing command: the message, not a traceback
        print(f"dinfer: error: {e}", file=sys.stderr)
        return 2
    return 0
