"""The command-line options the bench scripts share: the kernel benchmarks' (base_parser) and the
end-to-end ones' (engine_parser, repeats), and the parsing of their values."""

import argparse

from results_json import json_path

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def base_parser(description):
    import torch

    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="logits dtype")
    p.add_argument("--quick", action="store_true", help="fewer rows and repeats (GPU check script)")
    p.add_argument(
        "--json",
        default=None,
        type=json_path,
        help="write the results to this JSON file (case by case as they finish)",
    )
    p.add_argument("--reps", type=int, default=None, help="timed repeats (default: by device / --quick)")
    return p


def engine_parser(description, tasks, num_problems, timed=True):
    """The options of the benchmarks that run an embedded model end to end (bench_e2e and friends);
    timed: the benchmark reports tokens/s (and takes --repeats)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--model", default=None, help="embedded model name or checkpoint folder (default: tiny-llada-moe)"
    )
    p.add_argument("--tasks", default=tasks, help=f"comma-separated tasks of dinfer.tasks (default: {tasks})")
    p.add_argument("--num-problems", type=int, default=num_problems, help="held-out problems per task")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--dtype", default=None, help="model dtype (default: bf16 on a GPU, fp32 on the host)")
    p.add_argument(
        "--quick", action="store_true", help="a few problems per task, one timed run (the GPU check script)"
    )
    if timed:
        p.add_argument(
            "--repeats",
            type=int,
            default=3,
            help="timed runs per row; tokens/s is over the median run (default 3; --quick: 1)",
        )
    p.add_argument(
        "--json",
        default=None,
        type=json_path,
        help="write the results to this JSON file (run by run as they finish)",
    )
    return p


def repeats(args):
    """How many timed runs an engine benchmark makes per row (ValueError naming --repeats if < 1)."""
    if args.repeats < 1:
        raise ValueError(f"--repeats: must be >= 1, got {args.repeats}")
    return 1 if args.quick else args.repeats


def torch_dtype(name):
    import torch

    return getattr(torch, DTYPES[name])


def parse_ints(text):
    return [int(x) for x in str(text).split(",") if x.strip()]
