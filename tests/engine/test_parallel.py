"""Tensor and expert parallelism on the host: world sizes 2 and 4, processes spawned by the tests on
127.0.0.1 with gloo (fp32 collectives).

Each world size runs one spawned job (`equivalence_job`) that does every check's rank-side work, and
the tests compare its results with one-process runs made here: the logits of every family under TP
and each EP mode (precision-tied against a float64 run), the vocabulary-parallel decode step and soft
embedding against decode_step / soft_embedding on random blocks (credit, sampling, every rule, NaN
rows, ties across shard boundaries, an uneven split) with no tensor of V columns allocated on any
rank, the generated tokens of the embedded models for every decoder and cache mode (and LLaDA2's
paged cache), and the sliced loading's weights and bytes. Then a rank that dies or hangs, the
errors for sizes that do not divide, and the command line under torchrun and spawned.
"""

import dataclasses
import os
import subprocess
import sys
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import assert_precision
from helpers.block_diffusion import BL, Float64Ops, llada2_model
from helpers.hf_configs import tiny
from torch.utils._python_dispatch import TorchDispatchMode

import dinfer_kernels as dk
from dinfer.decoders import DecoderConfig
from dinfer.generate import GenerationConfig, generate
from dinfer.models import load_weights, random_weights, save_checkpoint
from dinfer.models.config import ModelConfig
from dinfer.models.embedded import model_dir
from dinfer.models.quantization import quantize_experts
from dinfer.models.transformer import DiffusionLM
from dinfer.parallel import (
    Comm,
    ParallelConfigError,
    ParallelError,
    ShardPlan,
    load_model,
    load_shard,
    shard_model,
    weight_bytes,
)
from dinfer.parallel.launch import free_port, join

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAMILIES = ("dense", "moe", "llada2")
EP_MODES = ("allreduce", "alltoall")

# ----------------------------------------------------------------------------- spawning the ranks


def _entry(rank, world, port, job, args, out, timeout_s, backend="gloo"):
    torch.set_num_threads(1)  # 2-4 ranks share this machine's cores
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=__import__("datetime").timedelta(seconds=timeout_s),
        )
        result = job(Comm(None, timeout_s), *args)
    except BaseException:
        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(out, f"{rank}.pt"))
    if dist.is_initialized():
        dist.destroy_process_group()


def spawn(world, job, *args, deadline=420, timeout_s=60, may_die=(), backend="gloo"):
    """Every rank's job(comm, *args) result, in rank order (None for ranks in may_die that left none)."""
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.get_context("spawn")
        port = free_port()
        procs = [
            ctx.Process(target=_entry, args=(r, world, port, job, args, out, timeout_s, backend))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        end = time.monotonic() + deadline
        for r, p in enumerate(procs):
            p.join(timeout=max(0.0, end - time.monotonic()) if r not in may_die else 0.0)
        results = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
                assert r in may_die, f"rank {r} of {world} did not finish within {deadline} s"
            path = os.path.join(out, f"{r}.pt")
            if not os.path.exists(path):
                assert r in may_die, f"rank {r} of {world} died (exit code {p.exitcode}) without a result"
                results.append(None)
                continue
            res = torch.load(path, weights_only=False)
            assert not (isinstance(res, dict) and "error" in res), f"rank {r}:\n{res['error']}"
            results.append(res)
        return results


# ----------------------------------------------------------------------------- the cases (both sides)


def family_model(family, seed=0):
    """(config, fp32 weights) of a tiny model of the family (awkward sizes: vocabularies 101 / 97,
    LLaDA2's 2 KV heads, replicated at world 4)."""
    cfg = tiny(family)
    w = random_weights(cfg, seed=seed)
    for name in w:  # larger mixing weights: rows depend on their context
        if name.split(".")[-1] in ("q", "k", "v", "qkv", "o", "w13", "w2", "router", "gate", "up", "down"):
            w[name] = w[name] * 8
    return cfg, w


def forward_case(model):
    """Logits of a full forward that fills the cache (two sequences of different lengths), then of
    a window forward over part of it without write-back, on chosen rows."""
    gen = torch.Generator().manual_seed(1)
    c = model.config
    B, S = 2, 19
    tokens = torch.randint(0, c.vocab_size, (B, S), generator=gen)
    seq_lens = torch.tensor([S, 13], dtype=torch.int32)
    pos = torch.arange(S)[None].expand(B, S)
    cache = model.new_cache(B, S)
    full = model.forward(model.embed(tokens), pos, cache, seq_lens)
    win = pos[:, 5:12]
    rows = torch.tensor([0, 3, 6, 8, 13])
    step = model.forward(
        model.embed(tokens[:, 5:12]), win, cache, seq_lens, write_back=False, logits_rows=rows
    )
    return full, step


DECODE_V = 1009  # prime: no other size of the cases, so a tensor with a dim of V is a [*, V] one


def decode_cases():
    """(logits [N, V], tokens, offsets, mask_id, credit slots or None, decode_step kwargs)."""
    gen = torch.Generator().manual_seed(2)
    cases = []
    for i, (rule, T, K) in enumerate(
        [
            ("threshold", 0.0, 0),
            ("threshold", 0.0, 6),
            ("hierarchical", 0.0, 0),
            ("fixed", 0.0, 3),
            ("joint", 0.0, 0),
            ("threshold", 0.9, 4),
            ("hierarchical", 1.3, 0),
            ("fixed", 0.5, 0),
        ]
    ):
        N, V = 23, DECODE_V
        logits = torch.randn(N, V, generator=gen) * 3
        if i % 2:  # equal maxima at both sides of every shard boundary of worlds 2 and 4
            logits = logits.round()
            for b in (252, 504, 505, 756):
                logits[:, b - 1 : b + 1] = logits.max() + 1
        logits[0, 7] = float("nan")
        logits[1] = float("-inf")
        mask_id = 400 + i
        tokens = torch.randint(0, V, (N,), generator=gen)
        tokens[torch.rand(N, generator=gen) < 0.7] = mask_id
        offsets = torch.tensor([0, 5, 5, 14, N], dtype=torch.int32)
        credit = None
        if K:
            ids = torch.stack([torch.randperm(V, generator=gen)[:K] for _ in range(N)]).int()
            ids[torch.rand(N, K, generator=gen) < 0.4] = -1
            credit = (ids, torch.where(ids >= 0, torch.rand(N, K, generator=gen), torch.zeros(())))
        kw = dict(
            rule=rule,
            threshold=torch.rand(4, generator=gen),
            num_commit=torch.randint(0, 4, (4,), dtype=torch.int32, generator=gen),
            temperature=T,
            seed=9,
            offset=i,
            row_keys=torch.randint(0, 2**40, (N,), generator=gen) if T > 0 else None,
        )
        if rule == "joint":
            kw.update(edit_threshold=0.2, editable=torch.rand(N, generator=gen) < 0.6)
        else:
            kw.pop("num_commit" if rule != "fixed" else "threshold")
        cases.append((logits, tokens, offsets, mask_id, credit, kw))
    return cases


def soft_case():
    gen = torch.Generator().manual_seed(3)
    M, V, H = 11, DECODE_V, 24
    logits = torch.randn(M, V, generator=gen) * 2
    logits[1] = float("-inf")
    E = torch.randn(V, H, generator=gen)
    tokens = torch.randint(0, V, (M,), generator=gen)
    tokens[::2] = 5
    return logits, E, tokens, 5, torch.rand(M, generator=gen)


def _runs(world):
    """The generation runs compared token for token: (model name, options)."""
    decoders = ("threshold", "credit", "hierarchical", "fixed", "joint")
    caches = ("none", "prefix", "dual", "vicinity")
    runs = []
    if world == 2:
        runs += [("tiny-llada-moe", dict(decoder=d, cache=c)) for d in decoders for c in caches]
        runs += [("tiny-llada", dict(decoder=d, cache="vicinity")) for d in decoders]
        runs += [("tiny-llada", dict(decoder="threshold", cache=c)) for c in caches[:3]]
    else:
        runs += [("tiny-llada-moe", dict(decoder=d, cache="vicinity")) for d in decoders]
        runs += [("tiny-llada-moe", dict(decoder="threshold", cache=c)) for c in caches[:3]]
        runs += [("tiny-llada", dict(decoder="credit", cache="dual"))]
    runs += [
        ("tiny-llada-moe", dict(decoder="threshold", cache="vicinity", smoothing=True)),
        ("tiny-llada-moe", dict(decoder="credit", cache="vicinity", ep="alltoall")),
        ("tiny-llada", dict(decoder="threshold", cache="prefix", smoothing=True)),
        ("llada2", dict(decoder="threshold", cache="paged")),
        ("llada2", dict(decoder="joint", cache="paged", ep="alltoall")),
    ]
    return runs


PROMPT_TEXT = ("add:17+25", "sort:5,2,9,1", "reverse:abcdef")


def generation(name, opts):
    """(GenerationConfig, prompts) of a run."""
    opts = dict(opts)
    opts.pop("ep", None)
    decoder = opts.pop("decoder")
    dec = DecoderConfig(name=decoder, edit_threshold=0.5 if decoder == "joint" else None, credit_slots=4)
    if name == "llada2":
        cfg = GenerationConfig(gen_length=2 * BL, block_length=BL, decoder=dec, align_blocks=True, **opts)
        return cfg, [[3, 4, 5, 6, 7, 8], [9, 10, 11]]
    from dinfer.models.tokenizer import Tokenizer

    tok = Tokenizer(model_dir(name))
    prompts = [tok.encode(tok.apply_chat_template(p)) for p in PROMPT_TEXT]
    return GenerationConfig(gen_length=24, block_length=8, decoder=dec, **opts), prompts


def llada2_weights():
    model = llada2_model(seed=1)
    return model.config, model.w


class ForbidVocabColumns(TorchDispatchMode):
    """Records every op output with a dimension of V (a [N, V] or [V, *] tensor)."""

    def __init__(self, V):
        super().__init__()
        self.V, self.seen = V, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and self.V in t.shape:
                self.seen.append((str(func), list(t.shape)))
        return out


def equivalence_job(comm, ckpt_dirs):
    rank, world = comm.rank, comm.world
    res = {"logits": {}, "decode": [], "tokens": {}, "loading": {}}
    for family in FAMILIES:
        cfg, w = family_model(family)
        for mode in EP_MODES if family != "dense" else EP_MODES[:1]:
            res["logits"][family, mode] = forward_case(shard_model(cfg, w, comm, mode))
    lo, hi = ShardPlan(dataclasses.replace(tiny("moe"), vocab_size=DECODE_V), world, rank).vocab
    for logits, tokens, offsets, mask_id, credit, kw in decode_cases():
        cred = None if credit is None else dk.CreditState(credit[0].clone(), credit[1].clone())
        tok = tokens.clone()
        forbid = ForbidVocabColumns(DECODE_V)
        shard = logits[:, lo:hi].contiguous()
        with forbid:
            out = dk.decode_step_vocab_parallel(
                shard, tok, offsets, mask_id, vocab_start=lo, vocab_size=DECODE_V, credit=cred, **kw
            )
        res["decode"].append((out, tok, cred, forbid.seen))
    logits, E, tokens, mask_id, weight = soft_case()
    forbid = ForbidVocabColumns(DECODE_V)
    with forbid:
        z, e = logits[:, lo:hi].contiguous(), E[lo:hi].contiguous()
        soft = dk.soft_embedding_vocab_parallel(
            z, e, tokens, mask_id, weight, 0.7, vocab_start=lo, vocab_size=DECODE_V
        )
        out = dk.decode_step_vocab_parallel(
            z,
            tokens.clone(),
            torch.tensor([0, len(tokens)], dtype=torch.int32),
            mask_id,
            vocab_start=lo,
            vocab_size=DECODE_V,
        )
        soft1 = dk.soft_embedding_vocab_parallel(
            z,
            e,
            tokens,
            mask_id,
            weight,
            vocab_start=lo,
            vocab_size=DECODE_V,
            row_max=out.row_max,
            row_sum=out.row_sum,
        )
    res["soft"] = (soft, soft1, forbid.seen)
    models = {}
    for name, opts in _runs(world):
        key = (name, opts.get("ep", "allreduce"))
        if key not in models:
            if name == "llada2":
                models[key] = shard_model(*llada2_weights(), comm, key[1])
            else:
                models[key] = load_model(model_dir(name), comm, key[1], dtype=torch.float32)
        cfg, prompts = generation(name, opts)
        out, _ = generate(models[key], prompts, cfg, batch_size=2)
        res["tokens"][name, tuple(sorted(opts.items()))] = [o.tolist() for o in out]
    for label, path in ckpt_dirs.items():
        config = ModelConfig.from_dir(path)
        plan = ShardPlan(config, world, rank)
        got = load_shard(path, config, plan, dtype=torch.float32)
        want = plan.shard_weights(load_weights(path, config, dtype=torch.float32))
        same = sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
        res["loading"][label] = (same, weight_bytes(got))
    return res


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel_ckpts")
    dirs = {}
    for family, layout in (("moe", "hf"), ("moe", "fused"), ("llada2", "hf"), ("dense", "hf")):
        cfg, w = family_model(family)
        dirs[f"{family}-{layout}"] = str(root / f"{family}-{layout}")
        save_checkpoint(dirs[family + "-" + layout], cfg, w, layout=layout, shards=2)
    return dirs


# World size 4 repeats world 2's checks on more ranks; its spawned job is the costliest setup of the
# quick run (~90 s of 320 on a busy 2-core host), so it runs with the slow tests.
@pytest.fixture(
    scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=lambda w: f"world{w}"
)
def ranks(request, checkpoints):
    return request.param, spawn(request.param, equivalence_job, checkpoints)


# ----------------------------------------------------------------------------- the checks


@pytest.fixture(autouse=True)
def one_thread():
    """The one-process runs here on one thread, as each rank: the ranks and other work share the
    machine's cores, where OpenMP's spinning threads slow everything down several times."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_one_process_within_precision(ranks, family):
    world, results = ranks
    cfg, w = family_model(family)
    same = forward_case(DiffusionLM(cfg, w))
    truth = forward_case(DiffusionLM(cfg, {n: t.double() for n, t in w.items()}, ops=Float64Ops))
    for mode in EP_MODES if family != "dense" else EP_MODES[:1]:
        for j, part in enumerate(("full forward", "window forward")):
            shards = [r["logits"][family, mode][j] for r in results]
            assert [s.shape[1] for s in shards] == [
                b - a for a, b in (ShardPlan(cfg, world, r).vocab for r in range(world))
            ]
            got = torch.cat(shards, dim=1)  # gathered here, by the test only
            assert_precision(got, same[j], truth[j], f"{family} {mode} world {world}: {part}")


def test_vocab_parallel_decode_equals_decode_step(ranks):
    world, results = ranks
    for i, (logits, tokens, offsets, mask_id, credit, kw) in enumerate(decode_cases()):
        outs = []
        for backend, dtype in (("auto", None), ("torch", None), ("torch", torch.float64)):
            tok = tokens.clone()
            cred = None if credit is None else dk.CreditState(credit[0].clone(), credit[1].clone())
            if dtype is None:
                out = dk.decode_step(logits, tok, offsets, mask_id, credit=cred, backend=backend, **kw)
            else:
                args = {k: v for k, v in kw.items() if k not in ("threshold", "num_commit")}
                out = dk.reference.decode_step_reference(
                    logits,
                    tok,
                    offsets,
                    dk.reference.decode_params(
                        mask_id, threshold=kw.get("threshold"), num_commit=kw.get("num_commit"), **args
                    ),
                    credit_ids=None if cred is None else cred.ids,
                    credit_vals=None if cred is None else cred.vals,
                    compute_dtype=dtype,
                )
            outs.append((out, tok, cred))
        (want, want_tok, want_cred), (same, _, same_cred), (truth, _, truth_cred) = outs
        for r, res in enumerate(results):
            got, tok, cred, seen = res["decode"][i]
            where = f"case {i} ({kw['rule']}, T={kw['temperature']}), rank {r} of {world}"
            assert not seen, f"{where}: tensors with V = {DECODE_V} columns allocated: {seen[:3]}"
            assert torch.equal(got.candidate, want.candidate), where
            assert torch.equal(got.commit, want.commit), where
            assert torch.equal(got.nonfinite, want.nonfinite), where
            assert torch.equal(tok, want_tok), where
            assert_precision(got.confidence, same.confidence, truth.confidence.double(), where)
            if credit is not None:
                assert torch.equal(cred.ids, want_cred.ids), where
                assert_precision(cred.vals, same_cred.vals, truth_cred.vals.double(), where)
            if r:  # every rank holds the same results
                assert torch.equal(got.confidence, results[0]["decode"][i][0].confidence)


def test_vocab_parallel_soft_embedding_equals_soft_embedding(ranks):
    world, results = ranks
    logits, E, tokens, mask_id, weight = soft_case()
    for tau, j in ((0.7, 0), (1.0, 1)):
        same = dk.soft_embedding(logits, E, tokens, mask_id, weight, tau, backend="torch")
        truth = dk.reference.soft_embedding_reference(
            logits, E, tokens, mask_id, weight, tau, compute_dtype=torch.float64
        )
        for r, res in enumerate(results):
            assert not res["soft"][2], f"rank {r}: [*, V] tensors allocated: {res['soft'][2][:3]}"
            assert_precision(res["soft"][j], same, truth, f"tau {tau}, rank {r} of {world}")


def test_generated_tokens_equal_one_process(ranks):
    world, results = ranks
    models = {}
    for name, opts in _runs(world):
        if name not in models:
            if name == "llada2":
                models[name] = DiffusionLM(*llada2_weights())
            else:
                cfg = ModelConfig.from_dir(model_dir(name))
                models[name] = DiffusionLM(cfg, load_weights(model_dir(name), cfg, dtype=torch.float32))
        cfg, prompts = generation(name, opts)
        want = [o.tolist() for o in generate(models[name], prompts, cfg, batch_size=2)[0]]
        for r, res in enumerate(results):
            got = res["tokens"][name, tuple(sorted(opts.items()))]
            assert got == want, f"{name} {opts}: rank {r} of {world} generated other tokens"


def test_sliced_loading_and_weight_bytes(ranks, checkpoints):
    world, results = ranks
    for label, path in checkpoints.items():
        config = ModelConfig.from_dir(path)
        full = load_weights(path, config, dtype=torch.float32)
        plans = [ShardPlan(config, world, r) for r in range(world)]
        replicated = weight_bytes({n: t for n, t in full.items() if plans[0].ranges(n) is None})
        sharded = weight_bytes(full) - replicated
        kv = config.num_layers * 2 * config.num_kv_heads * config.head_dim * config.hidden_size * 4
        copies = max(1, world // config.num_kv_heads)  # KV heads replicated when world exceeds them
        held = []
        for r, res in enumerate(results):
            same, nbytes = res["loading"][label]
            assert same, f"{label}: rank {r} of {world} loaded other slices than the plan's"
            held.append(nbytes - replicated)
        # The ranks' sharded bytes partition the sharded tensors (the KV heads counted per copy) ...
        assert sum(held) == sharded + (copies - 1) * kv, label
        # ... each rank holding ~1/N of them (the vocabulary split is uneven by at most a row)
        row = 2 * config.hidden_size * 4
        assert max(held) <= (sharded + (copies - 1) * kv) / world + row, (label, held)


# ----------------------------------------------------------------------------- FP8 experts


def fp8_job(comm, paths):
    """Each rank's expert weights and forward_case logits, in both EP modes: of the FP8 checkpoint,
    and of the bf16 one with quantize="fp8"."""
    res = {}
    for label, quantize in (("fp8", None), ("plain", "fp8")):
        for mode in EP_MODES:
            model = load_model(paths[label], comm, mode, dtype=torch.float32, quantize=quantize)
            experts = {n: t for n, t in model.w.items() if n.endswith(("w13", "w2", "_scale"))}
            res[label, mode] = experts, forward_case(model)
    return res


def dequantised(weights):
    """`weights` with every FP8 tensor dequantised to fp32 (its scales dropped)."""
    out = {}
    for n, t in weights.items():
        if t.dtype == torch.float8_e4m3fn:
            t = dk.fp8_block_dequantize(
                t, weights[n + "_scale"], torch.float32, halves=2 if n.endswith("w13") else 1
            )
        if not n.endswith("_scale"):
            out[n] = t
    return out


def test_fp8_experts_under_expert_parallelism(tmp_path):
    """The routed FP8 experts and their block scales are sliced with the experts; the shared expert is
    dequantised (its column slices need not fall on blocks) or, quantising at load, left as it is;
    the logits equal one process's within precision."""
    plain = model_dir("tiny-llada2")
    config = ModelConfig.from_dir(plain)
    original = load_weights(plain, config, dtype=torch.float32)
    save_checkpoint(tmp_path, config, quantize_experts(original, config))
    results = spawn(2, fp8_job, {"fp8": str(tmp_path), "plain": plain})
    fp8 = load_weights(tmp_path, ModelConfig.from_dir(tmp_path), dtype=torch.float32)
    one_process = {"fp8": fp8, "plain": quantize_experts(original, config, shared=False)}
    for label, full in one_process.items():
        held = dequantised(full)  # what the ranks hold of the shared expert
        # one process on the FP8 model (the op takes the shared expert in the routed experts' dtype:
        # with it unquantised, on the dequantised routed experts, the same fp32 computation)
        same = forward_case(DiffusionLM(config, full if label == "fp8" else held))
        truth = forward_case(DiffusionLM(config, {n: t.double() for n, t in held.items()}, ops=Float64Ops))
        for mode in EP_MODES:
            for r, res in enumerate(results):
                experts, _ = res[label, mode]
                plan = ShardPlan(config, 2, r)
                assert experts["layers.1.w13"].dtype == torch.float8_e4m3fn
                assert {n for n in experts if n.endswith("_scale")} == {
                    f"layers.{i}.{w}_scale" for i in range(1, config.num_layers) for w in ("w13", "w2")
                }
                for n, t in experts.items():
                    want = plan.take(n, held[n] if ".shared_" in n else full[n])
                    assert t.dtype == want.dtype, (label, mode, n)
                    assert torch.equal(t.view(torch.uint8), want.view(torch.uint8)), (label, mode, n)
            for j, part in enumerate(("full forward", "window forward")):
                got = torch.cat([res[label, mode][1][j] for res in results], dim=1)
                assert_precision(got, same[j], truth[j], f"{label} {mode}: {part}")


# ----------------------------------------------------------------------------- failures


def failing_job(comm, how, timeout_s):
    """Rank 1 dies (or hangs) on its third forward; rank 0 reports how generation ended."""
    path = model_dir("tiny-llada-moe")
    model = load_model(path, comm, dtype=torch.float32)
    if comm.rank == 1:
        forward, calls = model.forward, [0]

        def broken(*a, **kw):
            calls[0] += 1
            if calls[0] == 3:
                if how == "dies":
                    os._exit(3)
                time.sleep(10 * timeout_s)
            return forward(*a, **kw)

        model.forward = broken
    cfg, prompts = generation("tiny-llada-moe", dict(decoder="threshold", cache="vicinity"))
    t0 = time.monotonic()
    try:
        generate(model, prompts, cfg)
    except ParallelError as e:
        return {"error_message": str(e), "seconds": time.monotonic() - t0}
    return {"error_message": None, "seconds": time.monotonic() - t0}


@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_a_failed_rank_is_an_error_on_the_others_within_the_timeout(how):
    timeout_s = 8
    res = spawn(2, failing_job, how, timeout_s, deadline=120, timeout_s=timeout_s, may_die=(1,))[0]
    assert res["error_message"] is not None, "rank 0 finished although rank 1 stopped"
    assert "rank 0 of 2" in res["error_message"] and "died or did not reach it" in res["error_message"]
    assert res["seconds"] < 2 * timeout_s + 5, res  # a bounded wait, never a hang


def test_sizes_that_do_not_divide_are_refused():
    with pytest.raises(
        ParallelConfigError, match=r"tensor_parallel_size 3 does not divide the 4 attention heads \(n_heads\)"
    ):
        ShardPlan(tiny("dense"), 3, 0)
    with pytest.raises(ParallelConfigError, match=r"8 experts \(num_experts\)"):
        ShardPlan(dataclasses.replace(tiny("moe"), num_heads=12, num_kv_heads=12), 3, 0)
    with pytest.raises(ParallelConfigError, match=r"neither divides nor is a multiple of the 2 KV heads"):
        ShardPlan(dataclasses.replace(tiny("llada2"), num_heads=12, num_experts=6), 3, 0)
    with pytest.raises(ParallelConfigError, match=r"exceeds the vocabulary of 97"):
        ShardPlan(dataclasses.replace(tiny("moe"), num_heads=128, num_kv_heads=128, num_experts=128), 128, 0)
    with pytest.raises(ParallelConfigError, match=r"expert_parallel"):
        ShardPlan(tiny("moe"), 2, 0, "scatter")
    from dinfer.llm import LLM

    with pytest.raises(ParallelConfigError, match="does not divide the 8 attention heads"):
        LLM("tiny-llada-moe", tensor_parallel_size=3)  # before any process starts


def test_mismatched_world_sizes_are_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ParallelError, match="tensor_parallel_size is 2 but torchrun started 3 processes"):
        join(2, "cpu")


# ----------------------------------------------------------------------------- CUDA graphs


def graph_job(comm):
    """A TP forward of the dense family (NCCL all-reduces only: no host sync) captured in a CUDA
    graph and replayed on new inputs, against eager forwards."""
    cfg, w = family_model("dense")
    model = shard_model(cfg, {n: t.cuda() for n, t in w.items()}, comm)
    B, S = 2, 16
    tokens = torch.randint(0, cfg.vocab_size, (B, S), device="cuda", generator=None)
    pos = torch.arange(S, device="cuda")[None].expand(B, S).contiguous()
    seq_lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    cache = model.new_cache(B, S)
    run = lambda: model.forward(model.embed(tokens), pos, cache, seq_lens)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()  # warm-up outside the capture (NCCL communicators, workspaces)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    results = []
    for seed in range(3):
        tokens.copy_(torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        results.append((out.cpu().clone(), run().cpu()))
    return results


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_graph_captures_the_nccl_collectives():
    for rank_results in spawn(2, graph_job, backend="nccl"):
        for replayed, eager in rank_results:
            assert torch.equal(replayed, eager)


# ----------------------------------------------------------------------------- the command line


def _cli(*args, torchrun=0):
    env = dict(os.environ, PYTHONPATH=REPO)
    cmd = [sys.executable, "-m", "dinfer", *args]
    if torchrun:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={torchrun}",
            "-m",
            "dinfer",
            *args,
        ]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)


def test_command_line_prints_the_one_process_text():
    args = ["generate", "--prompt", "add:17+25", "--prompt", "sort:5,2,9,1", "--gen-length", "24"]
    one = _cli(*args)
    assert one.returncode == 0, one.stderr
    assert one.stdout.strip(), "nothing generated"
    tp = _cli(*args, "--tensor-parallel", "2", torchrun=2)
    assert tp.returncode == 0, tp.stderr
    assert tp.stdout == one.stdout  # only rank 0 prints
    spawned = _cli(*args, "--tensor-parallel", "2", "--expert-parallel", "alltoall")
    assert spawned.returncode == 0, spawned.stderr
    assert spawned.stdout == one.stdout
    bad = _cli(*args, "--tensor-parallel", "4", torchrun=2)
    assert bad.returncode != 0
    assert "tensor_parallel_size is 4 but torchrun started 2 processes" in bad.stderr
