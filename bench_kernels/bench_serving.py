"""Serving: `dinfer serve` under concurrent streaming clients against the same prompts through
LLM.generate in-process, at several concurrencies.

    python bench_kernels/bench_serving.py [--model tiny-llada-moe] [--concurrency 1,8,32]
                                          [--num-problems 20] [--block-length 4] [--max-batch 32]
                                          [--device cpu] [--repeats 3] [--quick] [--json out.json]

The server runs in a subprocess on 127.0.0.1 (`--max-batch` slots); `c` clients (asyncio + httpx,
one connection each) stream chat completions of the held-out prompts of every task, each taking the
next prompt when its answer is done. Per concurrency c:
  server      requests/s and output tokens/s over the whole run; time to first block (the first
              chunk, sent with the first committed block) and the per-block interval (between
              chunks that carry text), p50 / p99 over the requests / intervals
  in-process  LLM.generate(prompts, batch_size=c) on the same prompts and options in this process:
              requests/s and output tokens/s
  ratio       server / in-process, requests/s: what the HTTP layer, the engine thread and the client
              cost (the clients share the host's cores with the server)
`--block-length` (default 4: the embedded models' answers then span several blocks) applies to both,
and so does `--threads` (torch's CPU threads; default 1 here: on a busy shared host, OpenMP's
2-thread regions on the main thread, where LLM.generate runs, were measured ~30x slower than the
same calls on a spawned thread, where the server's engine runs them -- one thread each keeps the
comparison about the serving path, not about OpenMP under contention).
The answers are compared (`same_answers`; T = 0: the server decodes each prompt as alone). Each row
is timed --repeats times, round-robin over the rows; the median run by server requests/s is reported
(every run's in `rps_runs`).
"""

import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkout
import cli_options
import engine_runs
import markdown_tables
import results_json

from dinfer.tasks import TASKS, check_tasks, eval_problems

MODEL_ID = "bench"


def _ms(seconds):
    return None if seconds is None else round(1000 * seconds, 1)


def percentile(values, q):
    """The q-quantile (0..1) of values by linear interpolation, None when there are none."""
    if not values:
        return None
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(pos)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (pos - lo)


async def _clients(url, prompts, concurrency, options):
    """Per request (text, completion tokens, time to first chunk, intervals between text chunks)."""
    import httpx

    todo = list(enumerate(prompts))
    out = [None] * len(prompts)

    async def client():
        async with httpx.AsyncClient(timeout=600) as c:
            while todo:
                i, prompt = todo.pop(0)
                body = dict(
                    model=MODEL_ID, messages=[{"role": "user", "content": prompt}], stream=True, **options
                )
                t0 = time.perf_counter()
                first, stamps, pieces, usage = None, [], [], None
                async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        raise RuntimeError(f"request {i}: HTTP {r.status_code}: {(await r.aread()).decode()}")
                    async for line in r.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        now = time.perf_counter()
                        first = now if first is None else first
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                        if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                            pieces.append(chunk["choices"][0]["delta"]["content"])
                            stamps.append(now)
                gaps = [b - a for a, b in zip(stamps, stamps[1:])]
                out[i] = ("".join(pieces), usage["completion_tokens"], first - t0, gaps)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return out


def measure_once(server_url, llm, prompts, concurrency, options):
    t0 = time.perf_counter()
    got = asyncio.run(_clients(server_url, prompts, concurrency, options))
    served = round(time.perf_counter() - t0, 4)  # every rate below from the seconds reported
    t0 = time.perf_counter()
    local = llm.generate(prompts, batch_size=concurrency, **options)
    alone = round(time.perf_counter() - t0, 4)
    tokens = sum(n for _, n, _, _ in got)
    local_tokens = sum(len(ids) for ids in local.token_ids)
    first = [f for _, _, f, _ in got]
    gaps = [g for *_, gs in got for g in gs]
    return {
        "concurrency": concurrency,
        "requests": len(prompts),
        "same_answers": [t for t, _, _, _ in got] == local.texts,
        "tokens": tokens,
        "seconds": served,
        "requests_per_second": round(len(prompts) / served, 2),
        "tokens_per_second": round(tokens / served, 1),
        "first_block_p50_ms": _ms(percentile(first, 0.5)),
        "first_block_p99_ms": _ms(percentile(first, 0.99)),
        "block_interval_p50_ms": _ms(percentile(gaps, 0.5)),
        "block_interval_p99_ms": _ms(percentile(gaps, 0.99)),
        "intervals": len(gaps),
        "inprocess_seconds": alone,
        "inprocess_requests_per_second": round(len(prompts) / alone, 2),
        "inprocess_tokens_per_second": round(local_tokens / alone, 1),
        "ratio": round(alone / served, 3),
    }


def main(argv=None):
    p = cli_options.engine_parser(__doc__.splitlines()[0], ",".join(TASKS), 20)
    p.add_argument("--concurrency", default="1,8,32", help="concurrent clients per row (default: 1,8,32)")
    p.add_argument("--block-length", type=int, default=4, help="block_length of every request (default: 4)")
    p.add_argument("--max-batch", type=int, default=32, help="the server's slots (default: 32)")
    p.set_defaults(threads=1)
    args = p.parse_args(argv)
    levels = cli_options.parse_ints(args.concurrency)
    if args.quick:
        args.num_problems, levels = min(args.num_problems, 2), [c for c in levels if c <= 4] or [1]
    runs = cli_options.repeats(args)
    sys.path.insert(0, str(checkout.ROOT / "tests"))
    from helpers.serving import ServerProcess

    llm = engine_runs.engine_llm(args)
    per_task = [eval_problems(t, args.num_problems) for t in check_tasks(args.tasks)]
    prompts = [q for group in zip(*per_task) for q, _ in group]
    options = dict(block_length=args.block_length)
    serve = ["-m", "dinfer", "serve", "--max-batch", str(args.max_batch), "--served-model-name", MODEL_ID]
    serve += ["--device", args.device, "--log-level", "warning"] + (
        ["--model", args.model] if args.model else []
    )
    server = ServerProcess(serve, env={"OMP_NUM_THREADS": str(args.threads)})
    try:
        asyncio.run(_clients(server.url, prompts[: max(levels)], max(levels), options))  # warm-up
        llm.generate(prompts[: max(levels)], batch_size=max(levels), **options)
        timed = {c: [] for c in levels}
        for i in range(runs):  # round-robin: the host's drift lands on every row alike
            for c in levels:
                timed[c].append(measure_once(server.url, llm, prompts, c, options))
                results_json.record(f"{c} clients run {i}", timed[c][-1])
    finally:
        server.stop()
    results = []
    for c in levels:
        ordered = sorted(timed[c], key=lambda r: r["requests_per_second"])
        median = ordered[(len(ordered) - 1) // 2]
        median["rps_runs"] = [r["requests_per_second"] for r in timed[c]]
        median["same_answers"] = all(r["same_answers"] for r in timed[c])
        results.append(median)
    columns = [
        ("clients", "concurrency", None),
        ("requests", "requests", None),
        ("req/s", "requests_per_second", ".2f"),
        ("tokens/s", "tokens_per_second", ".1f"),
        ("first block p50 ms", "first_block_p50_ms", ".1f"),
        ("p99", "first_block_p99_ms", ".1f"),
        ("block interval p50 ms", "block_interval_p50_ms", ".1f"),
        ("p99", "block_interval_p99_ms", ".1f"),
        ("in-process req/s", "inprocess_requests_per_second", ".2f"),
        ("in-process tokens/s", "inprocess_tokens_per_second", ".1f"),
        ("server / in-process", "ratio", ".3f"),
    ]
    notes = [
        f"{r['concurrency']} client(s): server / in-process requests/s {r['ratio']}"
        + ("" if r["same_answers"] else " -- ANSWERS DIFFER")
        for r in results
    ]
    return engine_runs.finish_engine(
        "serving", args, results, markdown_tables.markdown_table(results, columns), notes
    )


if __name__ == "__main__":
    main()
