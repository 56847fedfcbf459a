"""Tensor / expert parallelism: per-forward time, tokens/s and bytes communicated at TP 1/2/4, and the
vocabulary-parallel decode step against gather-then-decode, side by side.

    python bench_kernels/bench_parallel.py [--device cpu|cuda] [--world 1,2,4] [--model tiny-llada-moe]
        [--ep allreduce,alltoall] [--rows 64] [--vocab 157184] [--quick] [--json out.json]

Each world size runs in its own group of spawned processes on 127.0.0.1 (gloo on the host, NCCL with
one GPU per rank, as many as are visible); every number is rank 0's. Per model forward: the median
time of a full forward over --batch x --seq tokens (window rows = logits rows, as a refresh) and the
bytes this rank put on the wire (dinfer.parallel.Comm.sent: the ring all-reduce's 2 (n-1)/n of the
tensor, all-to-all's rows sent away). Generation: tokens/s of `dinfer generate`'s loop on a few task
prompts. Weights: the bytes each rank holds (sliced loading) and its resident set after loading.
Decode: `decode_step_vocab_parallel` on the rank's [rows, V / n] shard (one all_gather of small
records) against all_gather of the [rows, V] logits then `decode_step` — the time and the bytes
each sends. On this 2-core host the ranks share two cores, so the TP times measure communication
and overhead, not a speedup.
"""

import argparse
import datetime
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout  # noqa: F401  (puts the checkout's dinfer and dinfer_kernels on sys.path)
import cli_options
import environment
import markdown_tables
import results_json
import timing
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _median_time(fn, reps, device):
    times = []
    for _ in range(reps + 2):
        timing.sync(device)
        t0 = time.perf_counter()
        fn()
        timing.sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times[2:])[len(times[2:]) // 2]


def _rank(rank, world, port, args, out):
    torch.set_num_threads(1)  # the same per rank at every world size (and no OpenMP spinning on shared cores)
    import dinfer_kernels as dk
    from dinfer.generate import GenerationConfig, generate
    from dinfer.models import load_weights
    from dinfer.models.config import ModelConfig
    from dinfer.models.embedded import model_dir
    from dinfer.models.tokenizer import Tokenizer
    from dinfer.models.transformer import DiffusionLM
    from dinfer.parallel import Comm, backend_for, load_model, weight_bytes
    from dinfer_kernels.reference.vocab_parallel import RECORD_FIELDS

    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    comm = Comm()
    path = model_dir(args.model)
    config = ModelConfig.from_dir(path)
    dtype = cli_options.torch_dtype(args.dtype)
    results = []
    for ep in args.ep if config.is_moe and world > 1 else ["-"]:
        if world == 1:
            model = DiffusionLM(config, load_weights(path, config, dtype=dtype, device=device))
        else:
            model = load_model(path, comm, ep, dtype=dtype, device=device)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        B, S = args.batch, args.seq
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, config.vocab_size, (B, S), generator=gen).to(device)
        pos = torch.arange(S, device=device)[None].expand(B, S)
        seq_lens = torch.full((B,), S, dtype=torch.int32, device=device)
        cache = model.new_cache(B, S)
        forward = lambda: model.forward(model.embed(tokens), pos, cache, seq_lens)
        before = comm.sent
        forward()
        sent = comm.sent - before
        t = _median_time(forward, args.reps, device)
        tok = Tokenizer(path)
        prompts = [
            tok.encode(tok.apply_chat_template(p)) for p in ("add:17+25", "sort:5,2,9,1", "reverse:abc")
        ]
        cfg = GenerationConfig(gen_length=32, block_length=8)
        generate(model, prompts, cfg)  # warm-up
        runs = [generate(model, prompts, cfg)[1] for _ in range(max(1, args.reps // 4))]
        tps = sorted(r.tokens / r.seconds for r in runs)[len(runs) // 2]
        results.append(
            dict(
                case="model",
                world=world,
                ep=ep,
                forward_ms=1e3 * t,
                forward_bytes_sent=sent,
                tokens_per_second=tps,
                weight_bytes=weight_bytes(model.w),
                max_rss_bytes=rss,
            )
        )
    # The decode step on the real vocabulary: vocab-parallel against gather-then-decode.
    N, V = args.rows, args.vocab
    lo, hi = rank * V // world, (rank + 1) * V // world
    logits = (torch.randn(N, V, generator=torch.Generator().manual_seed(1)) * 3)[:, lo:hi]
    logits = logits.to(device=device, dtype=dtype).contiguous()
    tokens0 = torch.full((N,), 5, dtype=torch.int64, device=device)
    offsets = torch.arange(0, N + 1, 32 if N >= 32 else N, dtype=torch.int32, device=device)
    if int(offsets[-1]) != N:
        offsets = torch.cat([offsets, torch.tensor([N], dtype=torch.int32, device=device)])

    def vocab_parallel():
        dk.decode_step_vocab_parallel(
            logits, tokens0.clone(), offsets, 5, vocab_start=lo, vocab_size=V, validate=False
        )

    def gather_then_decode():
        full = comm.all_gather(logits.t().contiguous()).t()  # [N, V]: every rank's columns
        dk.decode_step(full.contiguous(), tokens0.clone(), offsets, 5, validate=False)

    for name, fn in (("vocab_parallel", vocab_parallel), ("gather_then_decode", gather_then_decode)):
        if name == "vocab_parallel":
            # one all_gather of the [N + 1, RECORD_FIELDS] fp32 records (K = 0 credit slots)
            sent = (world - 1) * (N + 1) * RECORD_FIELDS * 4
        else:
            before = comm.sent
            fn()
            sent = comm.sent - before
        results.append(
            dict(
                case="decode",
                world=world,
                method=name,
                rows=N,
                vocab=V,
                ms=1e3 * _median_time(fn, args.reps, device),
                bytes_sent=sent,
            )
        )
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--world", default="1,2,4")
    p.add_argument("--model", default="tiny-llada-moe")
    p.add_argument("--ep", default="allreduce,alltoall")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--vocab", type=int, default=157184)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.ep = args.ep.split(",")
    if args.quick:
        args.reps, args.rows = 5, 32
    requested = worlds = cli_options.parse_ints(args.world)
    if args.device == "cuda":
        worlds = [w for w in worlds if w <= torch.cuda.device_count()]
    from dinfer.parallel.launch import free_port

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            out = os.path.join(tmp, f"{world}.pt")
            mp.start_processes(
                _rank, args=(world, free_port(), args, out), nprocs=world, start_method="spawn"
            )
            rows += torch.load(out, weights_only=False)
    model = [r for r in rows if r["case"] == "model"]
    decode = [r for r in rows if r["case"] == "decode"]
    model_table = markdown_tables.markdown_table(
        model,
        [
            ("TP", "world", None),
            ("EP", "ep", None),
            ("forward ms", "forward_ms", ".3g"),
            ("bytes sent / forward", "forward_bytes_sent", None),
            ("tokens/s", "tokens_per_second", ".3g"),
            ("weight bytes / rank", "weight_bytes", None),
            ("max RSS", "max_rss_bytes", None),
        ],
    )
    columns = [("TP", "world", None), ("method", "method", None), ("ms", "ms", ".3g")]
    decode_table = markdown_tables.markdown_table(decode, columns + [("bytes sent", "bytes_sent", None)])
    print(f"model {args.model} ({args.device}, {args.dtype}), forward over {args.batch}x{args.seq} tokens")
    print(model_table)
    print(f"\ndecode step, {args.rows} rows, vocabulary {args.vocab}")
    print(decode_table)
    by = {(r["world"], r["method"]): r["ms"] for r in decode}
    notes = [
        f"TP {w}: gather-then-decode ms / vocab-parallel ms "
        f"{by[w, 'gather_then_decode'] / by[w, 'vocab_parallel']:.2f}"
        for w in worlds
        if w > 1
    ]
    if len(worlds) < len(requested):
        notes.append(f"world sizes {requested} asked, {worlds} run ({torch.cuda.device_count()} GPUs)")
    env = environment.environment(args.device)
    env["model"] = args.model
    results_json.finish("parallel", env, args, None, rows, [model_table, decode_table], notes)


if __name__ == "__main__":
    main()
