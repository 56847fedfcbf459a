"""The GPU check's hero kernel cases: the shapes that decide a real forward (MoE at batch 1 and at 2048
rows for both released MoE layers, bf16 and FP8 expert weights: the GPU check's MoE step; window
attention at 8k keys dense and half-sparse, the 8k full refresh (ours, ours+sdpa, sdpa), the paged block
step after 2k keys, 32 sequences' window steps over 8k keys each (contiguous and paged),
the decode step, the soft embedding), timed in ONE process (one CUDA context, one Triton cache, no
interpreter start per benchmark) under one time limit.

    python bench_kernels/hero_cases.py --out OUT_DIR [--device cuda|cpu] [--gpu SLUG]
        [--time-limit SECONDS] [--tiny]

Each case runs its benchmark's own main() with the options below (and --quick), as
`bench_kernels/bench_<bench>.py` would, and writes OUT_DIR/<label>_<gpu>.json case by case (the GPU's
short name, environment.gpu_slug). Cases run in the order below, most valuable first; each gets a
share of the time left in proportion to its weight, and one past its share is stopped (its JSON keeps
what it finished) so that the next still runs. --tiny: the same cases at tiny shapes (the dry run on
a CPU).
"""

import argparse
import importlib
import shlex
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout  # noqa: F401  (puts the checkout's dinfer and dinfer_kernels on sys.path)
import environment

# The MoE step's rows: the torch loop, torch._grouped_mm alone and in its pipeline, ours on the CUDA
# backend (the default on a GPU). Triton's rows (ours[triton], ours with the GEMMs by _grouped_mm, the
# plain Triton GEMM) are left to --more's bench_moe: their compiles would not fit the step's share.
MOE_METHODS = "--methods torch_loop,grouped_mm,grouped_mm_alone,ours"
# Tiny: ours on the host kernel only (the interpreter's Triton rows, ~0.5 s a call, would not fit the dry
# run's shares; tests/bench/test_bench_moe.py runs them).
MOE_TINY = f"--tokens 4 --top-k 2 --hidden 64 --weights fp32,fp8 {MOE_METHODS} --backends cpu --reps 2"

# (label, benchmark, weight of the time limit, options on a GPU, options with --tiny)
HERO = (
    # Both released MoE layers (bench_moe --shape), bf16 and FP8 expert weights, batch 1 and 2048 rows
    (
        "moe_llada-moe",
        "moe",
        25,
        f"--shape llada-moe --tokens 32,2048 --weights bf16,fp8 {MOE_METHODS} --backends cuda",
        f"--shape llada-moe --experts 8 --inter 32 {MOE_TINY}",
    ),
    (
        "moe_llada2-mini",
        "moe",
        25,
        f"--shape llada2-mini --tokens 32,2048 --weights bf16,fp8 {MOE_METHODS} --backends cuda",
        f"--shape llada2-mini --experts 16 --inter 16 --shared 16 {MOE_TINY}",
    ),
    (
        "attention_hero",
        "attention",
        35,
        "--windows 8192 --window-rows 96 --densities 1,0.5 --refresh 8192 --paged-prefixes 2048 --no-flex"
        " --batches 32 --batched-keys 8192",
        "--dtype fp32 --windows 128 --refresh 64 --window-rows 16 --densities 1,0.5 --heads 2 --head-dim 64"
        " --no-flex --reps 2 --paged-prefixes 64 --paged-heads 2 --paged-kv-heads 1 --paged-head-dim 64"
        " --batches 2 --batched-keys 64 --batched-rows 16",
    ),
    (
        "decode_hero",
        "decode",
        15,
        "--rows 32,512 --shapes 16x32 --no-compile",
        "--dtype fp32 --rows 4 --shapes 2x3 --vocab 1000 --no-compile --reps 2",
    ),
    (
        "soft_embedding_hero",
        "soft_embedding",
        10,
        "--rows 64,1024",  # each side of the Triton backend's shape rule (one pass / GEMM route)
        "--dtype fp32 --rows 4 --vocab 1000 --dim 64 --reps 2",
    ),
)


class TimeUp(BaseException):
    """A case past its share of the time (a BaseException: the benches catch Exception per case)."""


def _time_up(signum, frame):
    raise TimeUp()


def run_case(label, bench, argv, seconds):
    """Runs bench_<bench>.main(argv) for at most `seconds`; returns how it ended."""
    module = importlib.import_module(f"bench_{bench}")
    own_argv = sys.argv
    sys.argv = [f"bench_kernels/bench_{bench}.py", *argv]  # what its JSON records as the command
    print(f"\n=== hero {label}: {shlex.join(sys.argv)} (at most {seconds:.0f}s)", flush=True)
    signal.signal(signal.SIGALRM, _time_up)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        module.main(argv)
        return "ok"
    except TimeUp:
        return f"stopped at its share of {seconds:.0f}s"
    except SystemExit as e:  # a benchmark refusing its options or device: the next case still runs
        return f"exited: {e.code}"
    except Exception as e:  # one broken case must not cost the others
        return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        sys.argv = own_argv


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder of the JSON files")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--gpu", default=None, help="short GPU name in the file names (default: this device's)")
    p.add_argument("--time-limit", type=float, default=110.0, help="seconds for all cases together")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (the dry run on a CPU)")
    args = p.parse_args(argv)
    if args.time_limit <= 0:
        raise SystemExit(f"--time-limit: must be > 0, got {args.time_limit}")
    if args.gpu is None:
        import timing

        args.gpu = environment.gpu_slug(timing.gpu_name(args.device))
    deadline = time.monotonic() + args.time_limit
    ended = []
    for i, (label, bench, weight, gpu_opts, tiny_opts) in enumerate(HERO):
        left = deadline - time.monotonic()
        share = left * weight / sum(w for _, _, w, _, _ in HERO[i:])
        if share < 1:
            ended.append((label, "not run: the time limit is used up"))
            continue
        json_path = str(Path(args.out) / f"{label}_{args.gpu}.json")
        opts = shlex.split(tiny_opts if args.tiny else gpu_opts)
        ended.append(
            (
                label,
                run_case(
                    label, bench, [*opts, "--quick", "--device", args.device, "--json", json_path], share
                ),
            )
        )
    print("\nhero cases:")
    for label, how in ended:
        print(f"  {label}: {how}")
    return 0 if all(how == "ok" for _, how in ended) else 1


if __name__ == "__main__":
    sys.exit(main())
