"""The `dinfer` command.

    dinfer generate [--model M] --prompt TEXT [options]     text for one or more prompts
    dinfer eval [--model M] [--tasks add,sort] [options]    accuracy / TPF / TPS on the task suite
    dinfer serve [--model M] [--port 8000] [options]        an OpenAI-compatible server (dinfer.serve)

--model is a checkpoint folder or an embedded model's name (default: tiny-llada-moe, shipped in the
package). Options left out keep the GenerationConfig / DecoderConfig defaults, or the checkpoint's
generation_config.json (every option's argparse default is None, which dinfer.llm reads as "not
given"; `-h` shows the effective defaults, for the model given with --model).

generate reads its prompts from --prompt (repeatable), --prompts-file (one per line, `-`: stdin) or,
without either, stdin, one prompt per non-empty line. Each answer is printed as soon as it and every
prompt before it are finished, so the output stays in prompt order; --output FILE also writes one JSON
line per prompt as it finishes ({"index", "prompt", "text"}, in finishing order); --json prints one
object with every text, token ids and the stats when all are done.

Errors print one line on stderr and exit with status 2; Ctrl-C prints one line and exits with 130,
keeping what finished (printed answers, --output lines, eval's --output after each task).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
from typing import Dict, List, Optional

from .decoders import DECODERS
from .evaluate import Progress
from .generate import CACHE_MODES
from .kv import CLEAN_KV
from .llm import LLM, _device, _dtype, checkpoint_defaults, generation_config
from .models.embedded import DEFAULT, EMBEDDED, model_dir
from .models.quantization import QUANTIZE_CHOICES
from .parallel.plan import EP_MODES
from .tasks import TASKS


def _defaults(model: Optional[str]) -> Dict[str, object]:
    """The effective default of every generation option for `model`: the config classes' defaults
    under its generation_config.json (the configs' own when the checkpoint cannot be read: the
    command then fails on it with a proper message)."""
    try:
        cfg = generation_config(**checkpoint_defaults(model_dir(model)))
    except (OSError, ValueError):
        cfg = generation_config()
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    values.update({f.name: getattr(cfg.decoder, f.name) for f in dataclasses.fields(cfg.decoder)})
    values["decoder"] = cfg.decoder.name
    return values


def _model_options(p: argparse.ArgumentParser, batch_default: Optional[str]) -> None:
    device = _device(None)
    p.add_argument(
        "--model",
        help=f"checkpoint folder, or an embedded model ({', '.join(EMBEDDED)}) (default: {DEFAULT})",
    )
    p.add_argument("--device", help=f"cuda, cuda:1, cpu (default: cuda when available: {device} here)")
    p.add_argument(
        "--dtype",
        help=f"bf16, fp16 or fp32 (default: bf16 on a GPU, fp32 on the host: "
        f"{str(_dtype(None, device)).replace('torch.', '')} here)",
    )
    p.add_argument(
        "--quantize",
        choices=QUANTIZE_CHOICES,
        help="fp8: the expert weights converted to FP8 (e4m3, 128x128 block scales) at load; an FP8 "
        "checkpoint loads as FP8 without it (default: none)",
    )
    if batch_default is None:  # dinfer serve: one process (its engine is not wired to tensor parallelism)
        return
    p.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        help="ranks of a tensor-parallel group: under torchrun --nproc-per-node N, or spawned on this "
        "machine (default: 1)",
    )
    p.add_argument(
        "--expert-parallel",
        choices=EP_MODES,
        default="allreduce",
        help="MoE layers under tensor parallelism: experts split across the ranks, combined by one "
        "all-reduce or by all-to-all dispatch (default: allreduce)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        help=f"most prompts decoded at once; a finished one's place goes to the next "
        f"(default: {batch_default})",
    )


def _generation_options(parser: argparse.ArgumentParser, d: Dict[str, object]) -> None:
    """The options of the run itself (GenerationConfig / DecoderConfig fields), in one group whose
    destinations the command hands to LLM.generate / evaluate (`_options`)."""
    group, dests = parser.add_argument_group("generation options"), []

    def add(*flags, **kw):
        dests.append(group.add_argument(*flags, **kw).dest)

    def opt(*flags, help, **kw):
        dest = flags[0].lstrip("-").replace("-", "_")
        shown = "off" if d[dest] is None else d[dest]  # edit_threshold: None turns editing off
        add(*flags, dest=dest, help=f"{help} (default: {shown})", **kw)

    opt("--gen-length", "--max-new-tokens", type=int, help="tokens generated per prompt")
    opt("--block-length", type=int, help="tokens per block (capped to --gen-length)")
    opt("--decoder", choices=DECODERS, help="decoding strategy")
    opt("--threshold", type=float, help="commit threshold in [0, 1] (tau_high for hierarchical)")
    opt("--low-threshold", type=float, help="tau_low in [0, 1] for hierarchical")
    opt("--steps-per-block", type=int, help="fixed decoder: steps per block (0: one token per step)")
    opt(
        "--edit-threshold",
        type=float,
        help="joint decoder: rewrite a generated token whose prediction differs with confidence above "
        "this (None or <= 0: no editing)",
    )
    opt(
        "--max-post-edit-steps",
        type=int,
        help="joint decoder: forwards that only edit, after a block's last [MASK]",
    )
    opt("--temperature", type=float, help="sampling temperature (0: the most likely token)")
    opt("--seed", type=int, help="sampling seed, in [0, 2**32)")
    opt("--cache", choices=CACHE_MODES, help="KV cache mode")
    opt(
        "--clean-kv",
        choices=CLEAN_KV,
        help="paged cache: a finished block's clean K/V fused into the next block's first forward, or "
        "from an extra forward",
    )
    opt("--prefill-chunk", type=int, help="paged cache: prompt positions per prefill forward (whole blocks)")
    opt(
        "--kv-pages",
        type=int,
        help="paged cache: pages in the pool (0: every sequence in flight at its longest)",
    )
    opt("--warmup-steps", type=int, help="first N iterations are full refreshes")
    opt("--unroll", type=int, help="iterations per host check")
    opt(
        "--smoothing-threshold-start",
        type=float,
        help="smoothing's threshold warm-up tau_n = max(start - decay * n, tau): start (<= --threshold: no warm-up)",
    )
    opt("--smoothing-threshold-decay", type=float, help="... and its decay per iteration")
    on_off = lambda name: "on" if d[name] else "off"
    add(
        "--no-write-back",
        dest="write_back",
        action="store_false",
        default=None,
        help="window steps leave the KV cache as it was, dInfer's vicinity step "
        f"(default: write-back {on_off('write_back')})",
    )
    add(
        "--smoothing",
        action="store_true",
        default=None,
        help=f"iteration smoothing (default: {on_off('smoothing')})",
    )
    add(
        "--no-early-stop",
        dest="early_stop",
        action="store_false",
        default=None,
        help=f"decode every block even after EOS (default: early stop {on_off('early_stop')})",
    )
    add(
        "--no-compact",
        dest="compact",
        action="store_false",
        default=None,
        help="sequences whose block is done keep running its forwards, dInfer's batches "
        f"(default: compaction {on_off('compact')})",
    )
    add(
        "--no-align-blocks",
        dest="align_blocks",
        action="store_false",
        default=None,
        help="block 0 starts right after the prompt (LLaDA's sampler), not at a block boundary "
        f"(default: aligned {on_off('align_blocks')})",
    )
    parser.set_defaults(run_options=tuple(dests))


def _parser(argv: Optional[List[str]] = None) -> argparse.ArgumentParser:
    # The defaults -h shows depend on the model (its generation_config.json): find --model first.
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model")
    d = _defaults(pre.parse_known_args(argv)[0].model)
    parser = argparse.ArgumentParser(prog="dinfer", description="Inference for diffusion language models.")
    commands = parser.add_subparsers(dest="command", required=True)
    g = commands.add_parser(
        "generate",
        help="generate text for one or more prompts",
        description="Prompts from --prompt, --prompts-file, or stdin (one per non-empty line).",
    )
    g.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    g.add_argument("--prompts-file", help="a file of prompts, one per non-empty line ('-': stdin)")
    g.add_argument(
        "--stop",
        action="append",
        help="cut each answer before the first occurrence of this string (repeatable)",
    )
    g.add_argument(
        "--json",
        action="store_true",
        help='print {"texts", "token_ids", "stats"} as JSON at the end '
        '(interrupted: {"texts": the finished ones, null for the rest, "interrupted": true})',
    )
    g.add_argument(
        "--output", help='also write one JSON line {"index", "prompt", "text"} per prompt as it finishes'
    )
    g.add_argument(
        "--no-chat",
        dest="chat",
        action="store_false",
        help="do not apply the checkpoint's chat template (default: applied)",
    )
    g.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: with several prompts when stderr is a terminal)",
    )
    _model_options(g, "all")
    _generation_options(g, d)
    e = commands.add_parser(
        "eval", help="exact-match accuracy, tokens/forward and tokens/s on the task suite"
    )
    e.add_argument(
        "--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)} (default: all)"
    )
    e.add_argument("--num-problems", type=int, default=100, help="held-out problems per task (default: 100)")
    e.add_argument("--problem-seed", type=int, default=0, help="which held-out problems (default: 0)")
    e.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    e.add_argument(
        "--output",
        help="also write the JSON result to this file (and the table to FILE.md), rewritten after each task",
    )
    e.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal, so no bar lands in a log file)",
    )
    _model_options(e, "1")
    _generation_options(e, d)
    s = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (needs the serve extra)",
        description="Serves /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics and "
        "/openapi.json; requests join the running batch at block boundaries. The generation options "
        "are the defaults of every request (which may set max_tokens, temperature, seed, stop, "
        "block_length, threshold, decoder and cache).",
    )
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    s.add_argument("--max-batch", type=int, default=8, help="requests decoded at once per lane (default: 8)")
    s.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests waiting for a slot; past it a request gets 429 with Retry-After (default: 64)",
    )
    s.add_argument(
        "--max-len",
        type=int,
        help="positions of the longest sequence, prompt + answer (default: the model's)",
    )
    s.add_argument(
        "--max-lanes",
        type=int,
        default=4,
        help="request configurations (block length, decoder, cache, sampling) decoded side by side, "
        "each with its own slots and KV cache (default: 4)",
    )
    s.add_argument("--served-model-name", help="the model id clients send (default: --model as given)")
    s.add_argument("--log-level", default="info", help="uvicorn's log level (default: info)")
    _model_options(s, None)
    _generation_options(s, d)
    return parser


def _options(args: argparse.Namespace) -> dict:
    """The generation options given on the command line (None: not given)."""
    return {k: getattr(args, k) for k in args.run_options}


def _writable(path: str, option: str) -> None:
    """ValueError naming the option unless `path` can be written: checked before any work, so that a
    long run does not end in a lost result."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{option}: {path!r} is a directory")
    if not os.path.isdir(folder):
        raise ValueError(f"{option}: directory {folder!r} does not exist")
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        raise ValueError(f"{option}: {path!r} is not writable")


def _read_prompts(args: argparse.Namespace) -> List[str]:
    prompts = list(args.prompt or [])
    for i, p in enumerate(prompts):
        try:
            p.encode("utf-8")  # argv's undecodable bytes arrive as lone surrogates
        except UnicodeEncodeError as e:
            raise ValueError(
                f"prompt: --prompt {i + 1} is not UTF-8 text (at character {e.start + 1})"
            ) from None
    if args.prompts_file is not None or args.prompt is None:
        name = args.prompts_file or "-"
        if name == "-":
            if sys.stdin.isatty():
                print("dinfer: reading prompts from stdin, one per line (Ctrl-D to end)", file=sys.stderr)
            raw = getattr(sys.stdin, "buffer", None)  # None: a text stream put in its place
            text = _utf8_text(raw.read(), "stdin") if raw is not None else sys.stdin.read()
        else:
            try:
                with open(name, "rb") as f:
                    data = f.read()
            except OSError as e:
                raise ValueError(f"prompts-file: cannot read {name!r} ({e.strerror})") from e
            text = _utf8_text(data, f"prompts-file {name!r}")
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError("prompts: none given (--prompt, --prompts-file, or one per line on stdin)")
    return prompts


def _utf8_text(data: bytes, source: str) -> str:
    """`data` decoded as UTF-8, or a ValueError naming `source` and the line of the first bad byte
    (stdin's own decoding would pass it on as a lone surrogate the tokenizer cannot take)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(
            f"{source}: line {line} is not UTF-8 text (byte 0x{data[e.start]:02x} at byte {column} of the line)"
        ) from None


class _Printer:
    """Prints answers in prompt order as soon as each and all before it are finished; writes
    --output's JSON lines in finishing order."""

    def __init__(self, prompts: List[str], show: bool, output, bar: Progress):
        self.prompts, self.show, self.output, self.bar = prompts, show, output, bar
        self.ready: Dict[int, str] = {}
        self.finished: Dict[int, str] = {}  # every answer so far (what --json prints if interrupted)
        self.printed = 0

    def __call__(self, i: int, text: str) -> None:
        self.finished[i] = text
        if self.output is not None:
            self.output.write(
                json.dumps({"index": i, "prompt": self.prompts[i], "text": text}, ensure_ascii=False) + "\n"
            )
            self.output.flush()
        self.ready[i] = text
        while self.printed in self.ready:
            text = self.ready.pop(self.printed)
            if self.show:
                self.bar.write(text)
                sys.stdout.flush()
            self.printed += 1
        self.bar.update(1, "generate")


def _llm(args: argparse.Namespace) -> LLM:
    return LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        tensor_parallel_size=args.tensor_parallel,
        expert_parallel=args.expert_parallel,
        quantize=args.quantize,
    )


def _main_rank() -> bool:
    """Whether this process prints: rank 0 of torchrun's processes, or the only one."""
    return os.environ.get("RANK", "0") == "0"


def _generate(args: argparse.Namespace, state: dict) -> None:
    main = _main_rank()
    if args.output and main:
        _writable(args.output, "output")
    # Under torchrun only rank 0 reads stdin; the others get its prompts from it.
    stdin = args.prompts_file == "-" or (args.prompt is None and args.prompts_file is None)
    prompts = _read_prompts(args) if main or not stdin else None
    llm = _llm(args)
    prompts = llm.broadcast(prompts)
    progress = len(prompts) > 1 and sys.stderr.isatty() if args.progress is None else args.progress
    bar = Progress(len(prompts), progress and main)
    output = open(args.output, "w", encoding="utf-8") if args.output and main else None
    try:
        printer = state["printer"] = _Printer(prompts, not args.json and main, output, bar)
        result = llm.generate(
            prompts,
            chat=args.chat,
            batch_size=args.batch_size,
            stop=args.stop,
            on_finish=printer,
            **_options(args),
        )
    except BaseException:
        llm.close(wait=False)  # failing or interrupted: the other ranks are too, or gone
        raise
    finally:
        bar.close()
        if output is not None:
            output.close()
    llm.close()
    if not main:
        return
    if args.json:
        print(
            json.dumps(
                {"texts": result.texts, "token_ids": result.token_ids, "stats": result.stats},
                ensure_ascii=False,
            )
        )
    s = result.stats
    print(
        f"{len(result.texts)} prompt(s): {s['tokens']} tokens, {s['forwards']} forwards "
        f"({s['refreshes']} refreshes), {s['seconds']:.3f} s, {s['tokens_per_forward']} tokens/forward, "
        f"{s['tokens_per_second']} tokens/s",
        file=sys.stderr,
    )
    empty = [i for i, ids in enumerate(result.token_ids) if not ids]
    if empty and not args.chat and not args.stop and llm.tokenizer.chat_template:
        # Models trained on chat-templated prompts only (the embedded ones are) see a raw prompt as
        # a finished turn and answer EOS at once: the answer is empty, not wrong.
        print(
            f"dinfer: note: {len(empty)} answer(s) empty (prompt {empty[0]} first): the model ended them "
            f"at once; it was trained on prompts in its chat template, which --no-chat leaves out",
            file=sys.stderr,
        )


def _eval(args: argparse.Namespace, state: dict) -> None:
    from .evaluate import evaluate, markdown_table

    main = _main_rank()
    if args.output and main:
        for path in (args.output, args.output + ".md"):
            _writable(path, "output")
    llm = _llm(args)
    batch_size = 1 if args.batch_size is None else args.batch_size
    options = _options(args)
    title = f"{llm.path} {json.dumps({k: v for k, v in options.items() if v is not None})}"

    def save(result: dict) -> None:  # after every task: an interrupted run keeps the tasks done
        result["model"] = llm.path
        if args.output and main:
            with open(args.output, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=2)
            with open(args.output + ".md", "w", encoding="utf-8") as f:
                f.write(markdown_table(result, title=title) + "\n")
            state["saved"] = len(result["tasks"])

    try:
        result = evaluate(
            llm,
            args.tasks,
            num_problems=args.num_problems,
            batch_size=batch_size,
            problem_seed=args.problem_seed,
            progress=(sys.stderr.isatty() if args.progress is None else args.progress) and main,
            on_task=save,
            **options,
        )
    except BaseException:
        llm.close(wait=False)
        raise
    llm.close()
    if main:
        print(json.dumps(result, indent=2) if args.json else markdown_table(result, title=title))


def _interrupted(args: argparse.Namespace, state: dict) -> str:
    if args.command == "serve":
        return "dinfer: server stopped"
    if args.command == "eval":
        kept = (
            f"{state['saved']} finished task(s) are in {args.output}"
            if state.get("saved")
            else "nothing kept"
        )
    else:
        printer = state.get("printer")
        done = len(printer.finished) if printer else 0
        if args.json and printer:  # the finished answers, null for the others
            print(
                json.dumps(
                    {
                        "texts": [printer.finished.get(i) for i in range(len(printer.prompts))],
                        "interrupted": True,
                    },
                    ensure_ascii=False,
                )
            )
        shown = done if args.json else printer.printed if printer else 0
        kept = f"{shown} answer(s) printed" + (f", {done} in {args.output}" if args.output else "")
    return f"dinfer: interrupted; {kept}"


def _serve(args: argparse.Namespace, state: dict) -> None:
    from .serve import serve  # ImportError naming the extra when the web stack is missing

    if not 0 <= args.port <= 65535:
        raise ValueError(f"port: must be in [0, 65535], got {args.port}")
    serve(
        args.model,
        host=args.host,
        port=args.port,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        max_len=args.max_len,
        max_lanes=args.max_lanes,
        device=args.device,
        dtype=args.dtype,
        quantize=args.quantize,
        name=args.served_model_name,
        log_level=args.log_level,
        **{k: v for k, v in _options(args).items() if v is not None},
    )


def main(argv: Optional[List[str]] = None) -> int:
    # At most one KeyboardInterrupt, whatever arrives after it: torchrun sends its workers a second
    # SIGINT on top of the terminal's, which would otherwise land in the cleanup of the first (a
    # traceback per rank). Not where SIGINT is ignored (a background job) or off the main thread.
    previous = signal.getsignal(signal.SIGINT)
    handle = threading.current_thread() is threading.main_thread() and previous is not signal.SIG_IGN
    if handle:
        signal.signal(signal.SIGINT, _interrupt_once)
    state: dict = {}
    try:
        return _run(argv, state)
    except KeyboardInterrupt:
        args = state.get("args")
        if _main_rank():  # the other ranks stop with it, silently: their answers were rank 0's
            print("dinfer: interrupted" if args is None else _interrupted(args, state), file=sys.stderr)
        return 130
    finally:
        if handle:
            signal.signal(signal.SIGINT, previous)


def _interrupt_once(signum, frame) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _run(argv: Optional[List[str]], state: dict) -> int:
    args = state["args"] = _parser(argv).parse_args(argv)  # argparse itself exits 2 on a bad command line
    try:
        {"generate": _generate, "eval": _eval, "serve": _serve}[args.command](args, state)
    except Exception as e:  # a user-facing command: the message, not a traceback
        rank = "" if _main_rank() else f"rank {os.environ['RANK']}: "
        print(f"dinfer: {rank}error: {e}", file=sys.stderr)
        return 2
    return 0
