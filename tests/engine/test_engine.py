"""The engine: the transformer against an independent HF-style forward, window/cache consistency,
and the generation loop's invariants (LLaDA's sampler reproduced, cache modes, unrolling, batch
invariance, early stop, progress guarantee, bad input)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_precision
from helpers.engine_models import DENSE, MOE, ScriptedModel, model_of, run

from dinfer.batch import fill, slots, span
from dinfer.decoders import DecoderConfig
from dinfer.generate import GenerationConfig, generate
from dinfer.models.checkpoint import random_weights
from dinfer.models.transformer import DiffusionLM


def naive_forward(cfg, w, tokens, dtype=torch.float64):
    """The released models' forward, written out plainly (no cache, all rows), in `dtype`
    (float64: the truth; float32: the same-precision run)."""
    w = {k: v.to(dtype) for k, v in w.items()}
    T = tokens.shape[0]
    h = w["embed"][tokens]

    def norm(x, g):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_eps) * g

    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
    ang = (torch.arange(T)[:, None].double() * inv.double()).to(dtype)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]

    def rope(x):
        half = cfg.head_dim // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        a = norm(h, w[p + "attn_norm"])
        q = (a @ w[p + "q"].t()).view(T, cfg.num_heads, cfg.head_dim)
        k = (a @ w[p + "k"].t()).view(T, cfg.num_kv_heads, cfg.head_dim)
        v = (a @ w[p + "v"].t()).view(T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = norm(q, w[p + "q_norm"]), norm(k, w[p + "k_norm"])
        q, k = rope(q), rope(k)
        att = torch.softmax(torch.einsum("thd,shd->hts", q, k) / cfg.head_dim**0.5, -1)
        h = h + torch.einsum("hts,shd->thd", att, v).reshape(T, -1) @ w[p + "o"].t()
        m = norm(h, w[p + "mlp_norm"])
        if cfg.family == "llada":
            h = h + (F.silu(m @ w[p + "gate"].t()) * (m @ w[p + "up"].t())) @ w[p + "down"].t()
            continue
        probs = torch.softmax(m @ w[p + "router"].t(), -1)
        top_w, top_e = probs.topk(cfg.top_k, -1)
        inter = cfg.expert_intermediate_size
        for t in range(T):
            for wt, e in zip(top_w[t], top_e[t]):
                gu = w[p + "w13"][e] @ m[t]
                h[t] = h[t] + wt * (w[p + "w2"][e] @ (F.silu(gu[:inter]) * gu[inter:]))
    return norm(h, w["final_norm"]) @ w["lm_head"].t()


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.usefixtures("host_isa")
def test_transformer_matches_the_released_forward(cfg):
    model = model_of(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (13,))
    cache = model.new_cache(1, 13)
    got = model.forward(
        model.embed(tokens[None]), torch.arange(13)[None], cache, torch.tensor([13], dtype=torch.int32)
    )
    assert_precision(
        got, naive_forward(cfg, model.w, tokens, torch.float32), naive_forward(cfg, model.w, tokens), "logits"
    )


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_fused_qkv_projection_is_the_released_forward(cfg):
    """The GPU default: each layer's q, k and v as one GEMM; the host keeps the three."""
    model = model_of(cfg)
    assert "layers.0.q" in model.w  # the host default
    fused = DiffusionLM(cfg, model.w, fuse_qkv=True)
    assert "layers.0.q" not in fused.w and "layers.0.q" in model.w  # the caller's dict untouched
    assert fused.w["layers.0.qkv"].shape[0] == (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    tokens = torch.randint(0, cfg.vocab_size, (13,))
    got = fused.forward(
        fused.embed(tokens[None]),
        torch.arange(13)[None],
        fused.new_cache(1, 13),
        torch.tensor([13], dtype=torch.int32),
    )
    assert_precision(
        got, naive_forward(cfg, model.w, tokens, torch.float32), naive_forward(cfg, model.w, tokens), "logits"
    )


@pytest.mark.parametrize("cfg", [MOE, DENSE], ids=["moe", "dense"])
def test_window_forward_over_a_filled_cache_equals_the_full_forward(cfg):
    model = model_of(cfg)
    S = 20
    tokens = torch.randint(0, cfg.vocab_size, (2, S))
    lens = torch.tensor([S, 17], dtype=torch.int32)
    cache = model.new_cache(2, S)
    pos = torch.arange(S).expand(2, S).contiguous()
    full = model.forward(model.embed(tokens), pos, cache, lens).view(2, S, -1)
    keys0 = [k.clone() for k in cache.keys]
    win = torch.tensor([[4, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15]])
    part = model.forward(model.embed(tokens.gather(1, win)), win, cache, lens, write_back=False)
    # the fp64 truth: each sequence's forward over its own valid length, at the window's rows
    truth = torch.stack([naive_forward(cfg, model.w, tokens[b, : int(lens[b])])[win[b]] for b in range(2)])
    assert_precision(
        part.view(2, 6, -1),
        full.gather(1, win[..., None].expand(-1, -1, full.shape[-1])),
        truth,
        "window logits",
    )
    assert all(torch.equal(a, b) for a, b in zip(cache.keys, keys0))
    # logits only for the rows the decoder needs (the last layer's projection and MLP run on them
    # only), repeated ones included
    rows = torch.tensor([1, 7, 7, 11])
    some = model.forward(
        model.embed(tokens.gather(1, win)), win, cache, lens, write_back=False, logits_rows=rows
    )
    torch.testing.assert_close(some, part[rows])
    refill = model.new_cache(2, S)  # ... and a refresh still writes every row's K/V
    model.forward(model.embed(tokens), pos, refill, lens, logits_rows=rows)
    assert all(torch.equal(a, b) for a, b in zip(refill.keys + refill.values, cache.keys + cache.values))


def llada_reference(model, prompt, gen_length, block_length, steps):
    """LLaDA's published sampler (low-confidence remasking, temperature 0, no cache), written from
    the algorithm: blocks after the prompt, steps/num_blocks steps per block, step k commits the
    floor(m/S) + [k < m mod S] most confident masked positions. One deviation, shared with our spec:
    the mask token is never a candidate."""
    cfg = model.config
    x = torch.tensor(prompt + [cfg.mask_id] * gen_length)
    L, lp = x.numel(), len(prompt)
    nb = gen_length // block_length
    per_block = steps // nb
    for b in range(nb):
        lo, hi = lp + b * block_length, lp + (b + 1) * block_length
        m = int((x[lo:hi] == cfg.mask_id).sum())
        counts = [m // per_block + (1 if k < m % per_block else 0) for k in range(per_block)]
        for n in counts:
            logits = model.forward(
                model.embed(x[None]),
                torch.arange(L)[None],
                model.new_cache(1, L),
                torch.tensor([L], dtype=torch.int32),
            )
            logits[:, cfg.mask_id] = float("-inf")
            p = torch.softmax(logits.double(), -1)
            x0 = p.argmax(-1)
            conf = torch.where(
                x == cfg.mask_id, p.gather(1, x0[:, None])[:, 0], torch.tensor(-1.0, dtype=torch.float64)
            )
            conf[:lo] = -1
            conf[hi:] = -1
            for i in torch.topk(conf, n).indices.tolist():
                x[i] = x0[i]
    return x[lp:]


def test_fixed_steps_reproduces_llada_sampler():
    model = model_of(MOE, seed=3)
    prompt = [5, 9, 2, 7, 11]
    want = llada_reference(model, prompt, 16, 8, steps=16).tolist()
    got, stats = run(
        model, [prompt], decoder=DecoderConfig(name="fixed"), align_blocks=False, early_stop=False, unroll=1
    )
    assert got[0] == want
    assert stats.forwards == 16


def test_dual_refreshed_every_iteration_equals_no_cache():
    model = model_of(MOE, seed=1, scale=20)
    prompts = [[3, 4, 5, 6, 7, 8], [9, 10]]
    a, _ = run(model, prompts, cache="none")
    b, _ = run(model, prompts, cache="dual", refresh_every=1)
    assert a == b


@pytest.mark.parametrize("cache", ["none", "dual", "vicinity", "prefix"])
@pytest.mark.parametrize("decoder", ["threshold", "credit", "hierarchical", "fixed"])
def test_unroll_does_not_change_tokens(cache, decoder):
    model = model_of(MOE, seed=2, scale=20)
    prompts = [[3, 4, 5, 6, 7, 8, 9], [9, 10, 11]]
    dec = DecoderConfig(name=decoder, threshold=0.5)
    a, _ = run(model, prompts, cache=cache, decoder=dec, unroll=1)
    b, _ = run(model, prompts, cache=cache, decoder=dec, unroll=4, smoothing=True)
    c, _ = run(model, prompts, cache=cache, decoder=dec, unroll=4)
    assert a == c
    assert all(len(t) == 16 for t in b)


@pytest.mark.parametrize("cache", ["none", "vicinity"])
def test_smoothing_threshold_warmup(cache):
    """Smoothing with a zero weight is threshold decoding plus the warm-up tau_n = max(start - decay n,
    tau): with start <= tau it is threshold decoding exactly; dInfer's start 1.0 holds commits back."""
    model = model_of(MOE, seed=2, scale=20)
    prompts = [[3, 4, 5, 6, 7, 8, 9]]
    kw = dict(cache=cache, decoder=DecoderConfig(threshold=0.5), gen_length=24)
    zero = dict(smoothing=True, smoothing_weight=(0.0, 0.0, 0.0))
    plain, plain_stats = run(model, prompts, **kw)
    off, off_stats = run(model, prompts, **kw, **zero, smoothing_threshold_start=0.5)
    warm, warm_stats = run(model, prompts, **kw, **zero)
    assert off == plain and off_stats.forwards == plain_stats.forwards
    assert warm_stats.forwards > plain_stats.forwards


@pytest.mark.parametrize("cache", ["none", "dual", "vicinity"])
def test_batch_invariance(cache):
    model = model_of(MOE, seed=4, scale=20)
    torch.manual_seed(0)
    others = [torch.randint(0, 58, (int(n),)).tolist() for n in torch.randint(1, 20, (7,))]
    target = [7, 3, 9, 1, 4, 4, 2]
    dec = DecoderConfig(name="credit", threshold=0.6)
    alone, _ = run(model, [target], cache=cache, decoder=dec, smoothing=True, gen_length=24)
    batch, _ = run(
        model, others[:3] + [target] + others[3:], cache=cache, decoder=dec, smoothing=True, gen_length=24
    )
    assert batch[3] == alone[0]


@pytest.mark.parametrize("cache", ["none", "prefix", "dual", "vicinity"])
def test_continuous_batching_decodes_each_prompt_as_alone(cache):
    """Prompts of mixed lengths through 3 slots (refills beside sequences on later blocks, rounds
    trimmed to their own columns, compaction inside rounds): each prompt's tokens as decoded alone."""
    model = model_of(MOE, seed=6, scale=20)
    torch.manual_seed(2)
    prompts = [torch.randint(0, 58, (int(n),)).tolist() for n in torch.randint(1, 40, (7,))]
    dec = DecoderConfig(name="credit", threshold=0.6)
    kw = dict(cache=cache, decoder=dec, smoothing=True, gen_length=24)
    cfg = GenerationConfig(**{"block_length": 8, **kw})
    streamed, stats = generate(model, prompts, cfg, batch_size=3)
    assert [o.tolist() for o in streamed] == [run(model, [p], **kw)[0][0] for p in prompts]
    assert stats.sequence_forwards <= 3 * stats.forwards


@pytest.mark.parametrize("cache", ["none", "vicinity"])
@pytest.mark.parametrize("decoder", ["threshold", "credit", "fixed"])
def test_compaction_skips_finished_blocks_without_changing_tokens(cache, decoder):
    """Sequences whose block is done leave its remaining iterations: the same tokens (credit slots,
    fixed schedules and soft embeddings follow their sequences), fewer sequence-forwards."""
    model = model_of(MOE, seed=5, scale=20)
    torch.manual_seed(1)
    prompts = [torch.randint(0, 58, (int(n),)).tolist() for n in torch.randint(1, 20, (6,))]
    dec = DecoderConfig(name=decoder, threshold=0.7, steps_per_block=3)
    kw = dict(cache=cache, decoder=dec, smoothing=True, gen_length=24, unroll=2)
    compact, on = run(model, prompts, **kw)
    lockstep, off = run(model, prompts, compact=False, **kw)
    alone = [run(model, [p], **kw)[0][0] for p in prompts]
    assert compact == lockstep == alone
    assert on.forwards == off.forwards and on.sequence_forwards < off.sequence_forwards


def test_early_stop_ends_a_sequence_and_its_compute():
    # EOS is predicted from position 12 on: the short prompt reaches it in its first block.
    model = ScriptedModel(lambda p: torch.where(p >= 12, MOE.eos_id, 5))
    out, stats = run(model, [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2]], gen_length=32, cache="dual")
    assert out[0][:2] == [5, 5] and set(out[0][2:]) == {MOE.eos_id}
    assert out[1][:10] == [5] * 10 and set(out[1][10:]) == {MOE.eos_id}
    assert stats.tokens == 12
    assert model.batch_sizes[0] == 2 and model.batch_sizes[-1] == 1  # the finished one left the batch
    no_stop = ScriptedModel(model.favourite)
    _, full_stats = run(
        no_stop, [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2]], gen_length=32, cache="dual", early_stop=False
    )
    assert full_stats.forwards > stats.forwards


def test_continuous_batching_refills_a_finished_slot():
    """With 2 slots, a prompt that waits takes the place of one that finished, next to a sequence on
    its second block; tokens are those of each prompt alone."""
    eos_from_12 = lambda p: torch.where(p >= 12, MOE.eos_id, 5)
    long, short = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2]  # EOS in block 0 / in block 1
    prompts = [long, short, [3, 1], long[::-1]]
    finished, cfg = [], GenerationConfig(gen_length=32, block_length=8, cache="dual")
    model = ScriptedModel(eos_from_12)
    out, stats = generate(
        model, prompts, cfg, batch_size=2, on_finish=lambda i, t: finished.append((i, t.tolist()))
    )
    alone = [generate(ScriptedModel(eos_from_12), [p], cfg)[0][0].tolist() for p in prompts]
    assert [o.tolist() for o in out] == alone
    # Rounds: {long, short} -> {short on block 1, [3, 1] on block 0} -> {[3, 1] on block 1, long[::-1]}.
    # Two runs of two prompts each would take four forwards, of batch sizes 2, 1, 2, 1.
    assert model.batch_sizes == [2, 2, 2] and stats.forwards == 3
    assert finished == [(i, alone[i]) for i in range(4)]  # rounds end with prompts 0 | 1 | 2, 3


def test_a_round_computes_over_its_own_sequences_length():
    """In one stream, a short prompt's forwards span its own columns, not the longest prompt's."""
    model = ScriptedModel(lambda p: torch.full_like(p, 5))
    cfg = GenerationConfig(gen_length=16, block_length=8, cache="none", early_stop=False)
    out, _ = generate(model, [[1] * 40, [1, 2]], cfg, batch_size=1)
    # Every block + the 16-row after-look + 1 padding row: 40 + 16 + 17 = 73, and 0 + 24 + 17 = 41.
    assert model.widths == [73, 73, 41, 41, 41]
    assert [o.tolist() for o in out] == [[5] * 16, [5] * 16]


def test_batch_size_must_be_positive():
    with pytest.raises(ValueError, match="batch_size"):
        generate(model_of(MOE), [[1, 2]], GenerationConfig(gen_length=8, block_length=8), batch_size=0)


def test_progress_guarantee_when_everything_predicts_mask():
    model = ScriptedModel(lambda p: torch.full_like(p, MOE.mask_id))
    out, stats = run(model, [[1, 2, 3]], gen_length=16, cache="dual", early_stop=False)
    assert MOE.mask_id not in out[0]
    assert stats.forwards <= 16 + 4


@pytest.mark.parametrize(
    "prompts,kw,match",
    [
        ([[]], {}, "prompts"),
        ([[1] * 250], {}, "prompts"),
        ([[1]], {"gen_length": 0}, "gen_length"),
        ([[1]], {"cache": "paged"}, "cache"),
        ([], {}, "prompts"),
        ([[1]], {"smoothing_threshold_start": 1.5}, "smoothing_threshold_start"),
        ([[1]], {"smoothing_threshold_decay": -0.1}, "smoothing_threshold_decay"),
    ],
)
def test_bad_generation_input(prompts, kw, match):
    with pytest.raises(ValueError, match=match):
        run(model_of(MOE), prompts, **kw)


def test_unknown_decoder_and_partial_last_block():
    with pytest.raises(ValueError, match="decoder"):
        DecoderConfig(name="greedy")
    model = model_of(MOE, scale=20)
    out, _ = run(model, [[1, 2, 3]], gen_length=13, block_length=8)  # 13 = 8 + a partial block of 5
    assert len(out[0]) == 13 and MOE.mask_id not in out[0]
    batch = slots(1, span(3, 13, 8, True, 1), 8, 1, MOE.eos_id, "cpu")
    fill(batch, 0, [1, 2, 3], 13, MOE.mask_id, MOE.eos_id, True)
    assert batch.num_blocks().tolist() == [2] and int(batch.first_block[0]) == 0


def test_loop_overhead_is_measured():
    model = model_of(MOE, scale=20)
    _, stats = run(model, [[1, 2, 3]] * 2, cache="vicinity", smoothing=True, gen_length=32)
    d = stats.as_dict()
    assert d["forwards"] >= 1 and d["tokens_per_forward"] > 0
    assert 0.0 <= d["loop_overhead_fraction"] < 1.0
    assert set(d["phase_seconds"]) == {"forward", "decode", "smoothing"}


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["dual", "vicinity"])
def test_cuda_graph_replay_equals_eager_on_gpu(cache):
    w = {k: v.cuda() for k, v in random_weights(MOE, seed=2).items()}
    w["lm_head"] = w["lm_head"] * 20
    model = DiffusionLM(MOE, w)
    prompts = [[3, 4, 5, 6, 7, 8, 9], [9, 10, 11]]
    eager, _ = run(model, prompts, cache=cache, cuda_graphs=False, smoothing=True, gen_length=32)
    graphs, _ = run(model, prompts, cache=cache, cuda_graphs=True, smoothing=True, gen_length=32)
    assert graphs == eager
    # Continuous batching under graphs: one slot, the second prompt takes it when the first is done.
    cfg = GenerationConfig(
        gen_length=32, block_length=8, cache=cache, smoothing=True, decoder=DecoderConfig(threshold=0.5)
    )
    streamed, _ = generate(model, prompts, cfg, batch_size=1)
    assert [o.tolist() for o in streamed] == eager
