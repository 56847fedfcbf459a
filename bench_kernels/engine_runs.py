"""What the end-to-end benchmarks (an embedded model through the engine) share: the model they run,
rows timed round-robin with the median run of each, and their JSON payload."""

from environment import environment
from results_json import finish, record


def interleaved_medians(rows, run_once, repeats, key="tokens_per_second"):
    """Times every row `repeats` times, round-robin (row 1, row 2, ..., then again), so a drift of the
    host's speed over minutes lands on every row alike rather than on whichever rows ran then. Returns
    per row its median run (median_run) with every run's `key` in `tps_runs`. run_once(row, i) times
    row once; i is the pass (0: the first)."""
    runs = [[] for _ in rows]
    for i in range(repeats):
        for j, row in enumerate(rows):
            runs[j].append(run_once(row, i))
            record(f"{row} run {i}", runs[j][-1])
    out = []
    for row_runs in runs:
        best, rates = median_run(row_runs, key)
        out.append({**best, "tps_runs": rates})
    return out


def median_run(runs, key):
    """The run with the median `key` (the lower middle one for an even count) and every run's `key`.
    Decoding is deterministic, so the runs differ only in time: anything else differing is an error."""
    same = [{k: v for k, v in r.items() if k not in ("seconds", key)} for r in runs]
    if any(x != same[0] for x in same[1:]):
        raise RuntimeError(f"timed runs disagree beyond timing: {same}")
    ordered = sorted(runs, key=lambda r: r[key])
    return ordered[(len(ordered) - 1) // 2], [r[key] for r in runs]


def engine_llm(args):
    """The model an engine benchmark runs, on args.threads CPU threads when given."""
    import torch

    from dinfer.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    return LLM(args.model, device=args.device, dtype=args.dtype)


def finish_engine(bench, args, results, table, notes):
    """finish() for an engine benchmark: prints the table, records the model's name (not its path)."""
    from dinfer.models.embedded import DEFAULT

    print(table)
    env = environment(args.device)
    env["model"] = args.model or DEFAULT  # the name or path given, not this machine's install path
    return finish(bench, env, args, None, results, [table], notes)
