"""python -m dinfer.train --model {tiny-llada-moe,tiny-llada,tiny-llada2} --out DIR [--steps N] [--seed S]
[--threads N] [--fp32]"""

import argparse

import torch

from .loop import train
from .presets import PRESETS


def main():
    parser = argparse.ArgumentParser(
        prog="python -m dinfer.train", description="Train an embedded model on the synthetic task suite."
    )
    parser.add_argument("--model", required=True, choices=sorted(PRESETS))
    parser.add_argument("--out", required=True, help="checkpoint folder to write")
    parser.add_argument(
        "--steps",
        type=int,
        help="optimizer steps (default: the preset's; recall's curriculum is in "
        "steps and trains recall alone for the first 600)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument(
        "--fp32",
        action="store_true",
        help="fp32 forwards instead of bf16 autocast (for CPUs without bf16 instructions, whose bf16 "
        "GEMMs are ~30x slower than fp32 ones; the shipped models were trained with bf16 autocast)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(train(args.model, args.out, steps=args.steps, seed=args.seed, bf16=not args.fp32))


main()
