"""The host path on a busy machine: LLM().generate, decode_step and torch's max(-1), idle and with a
CPU hog beside them, at the default thread count (target: generate within 1.3x of its idle time).

    python bench_kernels/bench_contention.py [--model tiny-llada-moe] [--prompts 8] [--rounds 3]
                                             [--hog-procs N] [--rows 32] [--vocab 157184]
                                             [--quick] [--json out.json]

Cases (each timed as bench_kernels/timing.py times a host case: the median of single calls):
  generate      LLM(model).generate of --prompts held-out task prompts (interleaved across the tasks)
  decode_step   dk.decode_step(backend="cpu"), threshold rule, --rows x --vocab bf16 logits
  torch max     logits.max(-1) on the same logits: torch's own host op, for comparison
Conditions: idle (whatever else the machine runs: the 1-min load average is recorded with each
measurement), and hog: --hog-procs processes (default: one per core this process may run on) spinning
in a busy loop in their own session, as another terminal's or user's job runs. The conditions
alternate --rounds times (idle, hog, idle, hog, ...) so that the machine's drift lands on both; a
case's time in a condition is the median over the rounds. Per case: idle ms, hog ms, hog / idle, and
the CPU time this process's threads used during the hog rounds' generate calls (main thread apart
from the others: the OpenMP workers), which shows who spins.

The cause this measures (docs/notes/results-log.md, 2026-12 "host path under contention"): torch's
host ops (MKL's sgemm, TensorIterator loops, ...) and our host kernels (csrc/*_cpu.cpp, `#pragma omp
parallel`) share one OpenMP runtime, the libgomp torch loads, and one team per calling thread (the
engine's: the main thread, or the server's engine thread). One 8-prompt generate of the tiny model
opens ~550 parallel regions (~450 torch's, ~100 ours), counted by interposing GOMP_parallel. With
OpenMP's default wait policy every waiting thread of the team spins ~300,000 iterations before it
sleeps; beside a hog the spinning thread holds a core while the one it waits for is queued, so every
region costs time slices: the team's worker thread burned as much CPU as the main thread (5.2 s each
for 3 generates taking 21.7 s, against 0.4 s each without the hog). dinfer_kernels sets OMP_WAIT_POLICY=PASSIVE
before torch loads the runtime (dinfer_kernels/_openmp_wait.py) unless the user set a policy; the
JSON's first note records which (set, user or late). To measure OpenMP's spinning default, run
with GOMP_SPINCOUNT=300000 (libgomp's default value, given explicitly, so dinfer leaves it).
"""

import contextlib
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkout  # noqa: F401  (puts the checkout's dinfer and dinfer_kernels on sys.path)
import cli_options
import engine_runs
import markdown_tables
import timing

# dinfer before torch: importing it sets the OpenMP wait policy the benchmark measures.
import dinfer_kernels as dk
from dinfer.tasks import TASKS, check_tasks, eval_problems

CONDITIONS = ("idle", "hog")


class Hog:
    """`procs` busy-loop processes in their own session, for the duration of a with block."""

    def __init__(self, procs):
        self.procs, self.running = procs, []

    def __enter__(self):
        spin = "while True: pass"
        self.running = [
            subprocess.Popen([sys.executable, "-c", spin], start_new_session=True) for _ in range(self.procs)
        ]
        time.sleep(0.3)  # started and spinning before the first timed call
        return self

    def __exit__(self, *exc):
        for p in self.running:
            p.kill()
        for p in self.running:
            p.wait()
        self.running = []


def thread_cpu_seconds():
    """CPU seconds (user + system) of this process's threads: {tid: seconds}; {} where /proc is absent."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def cpu_split(before, after):
    """The CPU seconds between two thread_cpu_seconds() snapshots: (main thread, all others)."""
    used = {t: s - before.get(t, 0.0) for t, s in after.items()}
    main = used.pop(os.getpid(), 0.0)
    return main, sum(used.values())


def host_cases(args):
    """decode_step on the host kernel and torch's max(-1), on the same bf16 logits."""
    import torch
    from bench_decode import make_inputs

    logits, tok0, mask_id = make_inputs(args.rows, args.vocab, torch.bfloat16, "cpu")
    tokens = tok0.clone()
    offsets = torch.tensor([0, args.rows], dtype=torch.int32)
    label = f"N {args.rows} V {args.vocab} bf16"
    return [
        timing.Case(
            f"decode_step cpu {label}",
            lambda i: dk.decode_step(logits, tokens, offsets, mask_id, backend="cpu"),
            restore=lambda: tokens.copy_(tok0),
        ),
        timing.Case(f"torch max(-1) {label}", lambda i: logits.max(-1)),
    ]


def prompts_of(args):
    per_task = [eval_problems(t, args.num_problems) for t in check_tasks(args.tasks)]
    return [q for group in zip(*per_task) for q, _ in group][: args.prompts]


def run(args):
    llm = engine_runs.engine_llm(args)
    prompts = prompts_of(args)
    cases = [timing.Case(f"generate {len(prompts)} prompts", lambda i: llm.generate(prompts))]
    cases += host_cases(args)
    reps = 2 if args.quick else 5  # per round; timing.measure adds calls up to its 1 s for the fast cases
    times = {(c.name, cond): [] for c in cases for cond in CONDITIONS}
    loads = {cond: [] for cond in CONDITIONS}
    cpu = {cond: [0.0, 0.0, 0.0] for cond in CONDITIONS}  # main thread s, other threads s, calls
    for r in range(args.rounds):
        for cond in CONDITIONS:
            with Hog(args.hog_procs) if cond == "hog" else contextlib.nullcontext():
                loads[cond].append(round(os.getloadavg()[0], 2))
                for case in cases:
                    before = thread_cpu_seconds()
                    res = timing.measure(case, "cpu", quick=args.quick, reps=reps)
                    if case is cases[0]:
                        main, others = cpu_split(before, thread_cpu_seconds())
                        # timing.measure's calls: its warm-up ones (1 quick, else 2) and the timed
                        cpu[cond] = [
                            cpu[cond][0] + main,
                            cpu[cond][1] + others,
                            cpu[cond][2] + res["n"] + 2 - args.quick,
                        ]
                    times[(case.name, cond)].append(res["median_s"])
                    timing.record(
                        f"{case.name} {cond} round {r}", {"median_s": res["median_s"], "n": res["n"]}
                    )
    results = []
    for case in cases:
        idle, busy = (statistics.median(times[(case.name, c)]) for c in CONDITIONS)
        row = {
            "case": case.name,
            "idle_ms": round(idle * 1e3, 3),
            "hog_ms": round(busy * 1e3, 3),
            "ratio": round(busy / idle, 3),
            "idle_runs_ms": [round(t * 1e3, 3) for t in times[(case.name, "idle")]],
            "hog_runs_ms": [round(t * 1e3, 3) for t in times[(case.name, "hog")]],
        }
        if case is cases[0]:  # CPU time per generate call
            for cond in CONDITIONS:
                main, others, calls = cpu[cond]
                row[f"{cond}_cpu_ms_main"] = round(1e3 * main / calls, 1)
                row[f"{cond}_cpu_ms_other_threads"] = round(1e3 * others / calls, 1)
                row[f"{cond}_cpu"] = (
                    f"{row[f'{cond}_cpu_ms_main']:.0f} / {row[f'{cond}_cpu_ms_other_threads']:.0f}"
                )
        results.append(row)
    return results, loads


def main(argv=None):
    p = cli_options.engine_parser(__doc__.splitlines()[0], ",".join(TASKS), 2, timed=False)
    p.add_argument("--prompts", type=int, default=8, help="generate's prompts (at most tasks x problems)")
    p.add_argument("--rounds", type=int, default=3, help="idle / hog alternations (default 3; --quick: 1)")
    p.add_argument("--hog-procs", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--rows", type=int, default=32, help="decode_step's logit rows")
    p.add_argument("--vocab", type=int, default=157184, help="decode_step's vocabulary (LLaDA-MoE's)")
    args = p.parse_args(argv)
    for name in ("prompts", "rounds", "hog_procs", "rows", "vocab"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.quick:
        args.rounds = 1
    results, loads = run(args)
    table = markdown_tables.markdown_table(
        results,
        [
            ("case", "case", None),
            ("idle ms", "idle_ms", ".4g"),
            ("hog ms", "hog_ms", ".4g"),
            ("hog / idle", "ratio", ".2f"),
            ("idle CPU ms/call: main / others", "idle_cpu", None),
            ("hog CPU ms/call: main / others", "hog_cpu", None),
        ],
    )
    notes = [
        f"OpenMP wait policy: {dk._openmp_wait.STATE} (OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
        f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}); {args.hog_procs} hog processes",
        f"1-min load average at each measurement: idle {loads['idle']}, hog {loads['hog']}",
    ]
    return engine_runs.finish_engine("contention", args, results, table, notes)


if __name__ == "__main__":
    main()
