"""Block diffusion (LLaDA2) on the append-only paged cache, against a plain block-diffusion loop
written here from the model description (models.md §3.3's mask): blocks on the grid from position 0,
the first one holding the prompt tail; every step one full forward over [0, end of block) under the
dense block-causal mask, no cache; the block's rows decoded until no [MASK] is left, and for the
joint decoder (LLaDA2.1's JointThreshold) until its post-edit steps are over: after the last [MASK],
forwards that only rewrite generated tokens, ending at the first that changes nothing or after
max_post_edit_steps. The loop under test prefills prompts in chunks, appends each block's K/V once
(the previous block's clean K/V fused into the block's first forward, or from an extra forward),
batches, compacts and refills slots as pages free up."""

import dataclasses

import pytest
import torch
from conftest import assert_precision
from helpers.block_diffusion import BL, DECODERS, MIXING, Float64Ops, llada2_model
from helpers.hf_configs import tiny

import dinfer_kernels as dk
from dinfer import LLM
from dinfer.decoders import JOINT_QUALITY, JOINT_SPEED, Decoder, DecoderConfig
from dinfer.generate import GenerationConfig, Generator, generate
from dinfer.kv.paged import PagePool
from dinfer.models.checkpoint import random_weights, save_checkpoint
from dinfer.models.transformer import DiffusionLM
from dinfer.tasks import TASKS, eval_problems


def block_causal_mask(L, bl=BL):
    blocks = torch.arange(L) // bl
    return (blocks[None, :] <= blocks[:, None])[None]  # [1, L, L]: key block <= query block


def plain_forward(model, x, e, s, bl=BL):
    """Logits of rows [s, e) from one no-cache forward over [0, e) under the block-causal mask."""
    return model.forward(
        model.embed(x[None, :e]),
        torch.arange(e)[None],
        model.new_cache(1, e),
        torch.tensor([e], dtype=torch.int32),
        attn_mask=block_causal_mask(e, bl),
        logits_rows=torch.arange(s, e),
    )


def plain_block_diffusion(model, prompt, gen_length, decoder, early_stop, block_length=BL):
    """One prompt, no cache: the answer's tokens. The canvas is laid out as the reference loops do
    (dInfer's BlockDiffusionLLM, LLaDA2's generate()): [MASK] from the prompt's end to the end of the
    last block, ceil((P + gen_length) / bl) * bl positions; the last block's tail past gen_length is
    attended and decoded like any row, and cut from the answer. Non-editing decoders go through the
    engine's Decoder (its rules are decode_step's, tested in tests/kernels); the joint decoder's loop
    -- which rows are editable, the post-edit steps, their end -- is written out here on
    decode_step."""
    c, bl = model.config, block_length
    P = len(prompt)
    total = -(-(P + gen_length) // bl) * bl
    x = torch.tensor(prompt + [c.mask_id] * (total - P))
    for s in range(P // bl * bl, total, bl):
        e = s + bl
        editable = torch.arange(s, e) >= P  # not the prompt's tail
        dec = Decoder(decoder, 1, bl, c.mask_id, "cpu")
        dec.start_block(x[None, s:e])
        iters, post = torch.zeros(1, dtype=torch.int32), 0
        while True:
            masked_before = bool((x[s:e] == c.mask_id).any())
            if not masked_before and decoder.name != "joint":
                break
            logits = plain_forward(model, x, e, s, bl)
            tokens = x[s:e].clone()
            if decoder.name == "joint":
                out = dk.decode_step(
                    logits,
                    tokens,
                    torch.tensor([0, bl], dtype=torch.int32),
                    c.mask_id,
                    rule="joint",
                    threshold=decoder.threshold,
                    editable=editable,
                    edit_threshold=decoder.edit_threshold,
                )
            else:
                out = dec(logits, tokens, iters)
            x[s:e] = tokens
            iters += 1
            if decoder.name == "joint" and not (x[s:e] == c.mask_id).any():
                if not decoder.edits or decoder.max_post_edit_steps == 0:
                    break
                if not masked_before:  # a post-edit step
                    post += 1
                    if not out.commit.any() or post >= decoder.max_post_edit_steps:
                        break
        if early_stop and (x[P:e] == c.eos_id).any():
            x[e:] = c.eos_id
            break
    return x[P : P + gen_length].tolist()


PROMPTS = [[3, 1, 4], [1, 5, 9, 2, 6, 5], [3, 5, 8, 9, 7, 9, 3, 2, 3], [2, 7], [4] * 13]


def config(**kw):
    return GenerationConfig(
        **dict(dict(gen_length=10, block_length=BL, cache="paged", early_stop=False), **kw)
    )


@pytest.mark.parametrize("decoder", list(DECODERS))
@pytest.mark.parametrize("clean_kv", ["fused", "forward"])
@pytest.mark.parametrize("batch_size, prefill_chunk", [(None, 512), (3, BL)])
def test_loop_equals_plain_block_diffusion(decoder, clean_kv, batch_size, prefill_chunk):
    model = llada2_model()
    g = config(decoder=DECODERS[decoder], clean_kv=clean_kv, prefill_chunk=prefill_chunk)
    out, stats = generate(model, PROMPTS, g, batch_size)
    want = [plain_block_diffusion(model, p, 10, DECODERS[decoder], False) for p in PROMPTS]
    assert [o.tolist() for o in out] == want
    assert len({t for o in want for t in o}) > 3  # the check sees varied answers, not one token


REPRO = "reverse:efoayay3a1ydl"  # 23 tokens in the chat template: 55 positions, a canvas of 64
TINY_DECODERS = {
    "threshold": DecoderConfig(threshold=0.9),
    "credit": DecoderConfig(name="credit", threshold=0.9),
    "fixed": DecoderConfig(name="fixed", steps_per_block=8),
    "hierarchical": DecoderConfig(name="hierarchical", threshold=0.9, low_threshold=0.6),
    "joint-quality": JOINT_QUALITY,
    "joint-speed": JOINT_SPEED,
}


@pytest.fixture(scope="module")
def tiny_llada2():
    return LLM("tiny-llada2", device="cpu")


def test_the_last_blocks_tail_is_decoded_as_the_reference_loops_do(tiny_llada2):
    """Issue 42's repro: the reference loops (LLaDA2's generate(), dInfer's BlockDiffusionLLM) lay
    the last block out whole and answer ldy1a3yyyooff at tau 0.9; with the tail as unattended padding
    the block's real rows read other logits and the answer was ldy1a3yyyaoff."""
    llm = tiny_llada2
    assert len(llm.encode(REPRO)) == 23 and llm.model.config.block_length == 32
    assert llm.generate(REPRO, gen_length=32, threshold=0.9).texts[0] == "ldy1a3yyyooff"


@pytest.mark.parametrize("decoder", list(TINY_DECODERS))
@pytest.mark.parametrize("clean_kv", ["fused", "forward"])
def test_tiny_llada2_equals_plain_block_diffusion(tiny_llada2, decoder, clean_kv):
    """The trained block-causal model, whose logits do depend on the last block's tail, on task
    prompts whose canvases end 1 to 31 positions past their answers (answers in the last block),
    batched with slots refilled mid-run: the plain loop's tokens."""
    llm, dec = tiny_llada2, TINY_DECODERS[decoder]
    texts = [REPRO] + [p for t in TASKS for p, _ in eval_problems(t, 2, seed=3)]
    prompts = [llm.encode(t) for t in texts]
    assert len({len(p) % 32 for p in prompts}) > 4  # tails of several lengths
    g = GenerationConfig(gen_length=32, block_length=32, cache="paged", decoder=dec, clean_kv=clean_kv)
    out, _ = generate(llm.model, prompts, g, batch_size=3)
    want = [plain_block_diffusion(llm.model, p, 32, dec, True, block_length=32) for p in prompts]
    assert [o.tolist() for o in out] == want


@pytest.mark.parametrize("chunk, forwards", [(BL, 3), (2 * BL, 2), (3 * BL, 1), (5, 3), (512, 1)])
def test_prompt_prefill_in_chunks_of_whole_blocks(chunk, forwards):
    """A 13-token prompt has 3 whole blocks before the one holding its tail: prefilled in chunks of
    prefill_chunk positions rounded down to whole blocks, with the same answer whatever the chunk."""
    model = llada2_model()
    prompt = [4, 8, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
    out, stats = generate(model, [prompt], config(prefill_chunk=chunk, decoder=DECODERS["threshold"]))
    assert stats.prefills == forwards
    assert out[0].tolist() == plain_block_diffusion(model, prompt, 10, DECODERS["threshold"], False)


def test_the_joint_decoder_edits_and_runs_post_edit_steps():
    """The random model above does rewrite committed tokens: joint with edits differs from joint
    without (same threshold), and spends forwards after the blocks' last [MASK]."""
    model = llada2_model()
    runs = {}
    for name, dec in (
        ("edits", DECODERS["joint"]),
        ("none", dataclasses.replace(DECODERS["joint"], edit_threshold=None)),
    ):
        out, stats = generate(model, PROMPTS, config(decoder=dec))
        runs[name] = ([o.tolist() for o in out], stats.forwards)
    assert runs["edits"][0] != runs["none"][0]
    assert runs["edits"][1] > runs["none"][1]


class FlipModel(DiffusionLM):
    """A block-causal model that runs its real forward (the cache is written as always), then predicts
    at every position token 10 + (n % 2) with certainty at its n-th forward that reads logits: each
    disagrees with the one before, so an editing decoder rewrites every generated token of the
    block. It keeps the tokens and positions of every forward (`seen`)."""

    calls = 0

    def embed(self, tokens):
        self.tokens = tokens
        return super().embed(tokens)

    def forward(self, emb, pos, *args, **kw):
        self.seen = getattr(self, "seen", []) + [(self.tokens, pos)]
        logits = super().forward(emb, pos, *args, **kw)
        if logits.shape[0] == 0:  # a prefill or clean-K/V forward
            return logits
        self.calls += 1
        out = torch.full_like(logits, -30.0)
        out[:, 10 + self.calls % 2] = 30.0
        return out


@pytest.mark.parametrize("clean_kv", ["fused", "forward"])
@pytest.mark.parametrize("max_post", [0, 1, 3])
def test_post_edit_budget_and_the_prompt_tail(max_post, clean_kv):
    base = llada2_model()
    model = FlipModel(base.config, base.w)
    prompt = [1, 2, 3, 4, 5, 6]  # block 1 holds the prompt's tail (5, 6) and two generated rows
    dec = DecoderConfig(name="joint", threshold=0.5, edit_threshold=0.9, max_post_edit_steps=max_post)
    gen = Generator(model, config(gen_length=6, decoder=dec, clean_kv=clean_kv))
    out = gen.run([prompt])[0].tolist()
    # two blocks to decode; each fills its [MASK]s in one forward, then edits on every post-edit step
    # (the predictions flip each forward), so the budget always runs out
    assert gen.stats.forwards == 2 * (1 + max_post) + (clean_kv == "forward")
    first = 10 + (1 + max_post) % 2  # the first block's rows as its last forward predicted them
    assert out == [first, first, 10, 10, 10, 10]
    assert out == plain_block_diffusion(FlipModel(base.config, base.w), prompt, 6, dec, False)
    # every forward read the prompt's tail as the prompt has it: never rewritten, though predicted
    # otherwise with certainty
    for tokens, pos in model.seen:
        assert tokens[pos == 4].eq(5).all() and tokens[pos == 5].eq(6).all()
    assert any((pos == 5).any() for _, pos in model.seen[1:])


class MaskPeakModel(DiffusionLM):
    """A block-causal model whose every forward that reads logits puts a certain [MASK] prediction
    (logit +30) on a fresh random 30 % of its rows, the model's own logits on the rest: the case
    where LLaDA2.1's generate() re-masks filled rows and can loop forever, and SGLang returns
    [MASK]s."""

    calls = 0

    def forward(self, emb, pos, *args, **kw):
        logits = super().forward(emb, pos, *args, **kw)
        if logits.shape[0] == 0:  # a prefill or clean-K/V forward
            return logits
        self.calls += 1
        rows = torch.rand(logits.shape[0], generator=torch.Generator().manual_seed(self.calls)) < 0.3
        logits = logits.clone()
        logits[rows, self.config.mask_id] = 30.0
        return logits


@pytest.mark.parametrize("clean_kv", ["fused", "forward"])
def test_joint_decoding_settles_when_the_model_predicts_mask(clean_kv):
    """The joint decoder never writes [MASK] (a difference from LLaDA2.1's JointThreshold, stated in
    the README and docs/architecture.md): with [MASK] peaks above the edit threshold on 30 % of the
    rows of every forward, each block still settles within its bound (block_length forwards plus
    the post-edit steps; the engine raises past it) and no answer holds a [MASK]."""
    base = llada2_model()
    model = MaskPeakModel(base.config, base.w)
    dec = dataclasses.replace(DECODERS["joint"], edit_threshold=0.5)
    gen = Generator(model, config(decoder=dec, clean_kv=clean_kv))
    out = [o.tolist() for o in gen.run(PROMPTS)]
    mask = model.config.mask_id
    assert all(mask not in o for o in out)
    blocks = sum(-(-(len(p) + 10) // BL) - len(p) // BL for p in PROMPTS)
    assert model.calls <= blocks * (BL + dec.max_post_edit_steps)
    assert model.calls > blocks  # the peaks did cost forwards: masked rows that could not commit


def test_fused_and_forward_variants_write_the_same_clean_cache(monkeypatch):
    """The committed blocks' K/V in the pages, with the clean K/V fused into each block's first
    forward and with an extra forward: equal to each other and to the K/V a no-cache forward over the
    final tokens computes, within the precision tie to an fp64 run; the extra forward costs each
    sequence one forward per block after its first."""
    model = llada2_model()
    truth_model = DiffusionLM(model.config, {k: v.double() for k, v in model.w.items()}, ops=Float64Ops)
    kept = {}

    def release(pool, seq):  # the pages' contents as the sequence ends
        kept[seq] = [
            (torch.cat([k[p] for p in pool._pages[seq]]), torch.cat([v[p] for p in pool._pages[seq]]))
            for k, v in zip(pool.keys, pool.values)
        ]
        real_release(pool, seq)

    real_release = PagePool.release
    monkeypatch.setattr(PagePool, "release", release)
    caches, forwards, outs = {}, {}, {}
    for variant in ("fused", "forward"):
        kept.clear()
        out, stats = generate(model, PROMPTS, config(clean_kv=variant, decoder=DECODERS["threshold"]))
        caches[variant], forwards[variant], outs[variant] = (
            dict(kept),
            stats.sequence_forwards,
            [o.tolist() for o in out],
        )
    assert outs["fused"] == outs["forward"]
    blocks_after_first = sum((len(p) + 10 - 1) // BL - len(p) // BL for p in PROMPTS)
    assert forwards["forward"] - forwards["fused"] == blocks_after_first
    for i, p in enumerate(PROMPTS):
        x = torch.tensor(p + outs["fused"][i])
        clean = (len(p) + 10 - 1) // BL * BL  # every block before the last is clean
        for m, dtype in ((model, torch.float32), (truth_model, torch.float64)):
            cache = m.new_cache(1, clean)
            m.forward(
                m.embed(x[None, :clean]),
                torch.arange(clean)[None],
                cache,
                torch.tensor([clean], dtype=torch.int32),
                attn_mask=block_causal_mask(clean),
            )
            if dtype == torch.float32:
                same = cache
            else:
                truth = cache
        for layer in range(model.config.num_layers):
            for j in range(2):  # K, V
                t = (truth.keys, truth.values)[j][layer][0]
                s = (same.keys, same.values)[j][layer][0]
                for variant in ("fused", "forward"):
                    got = caches[variant][i][layer][j][:clean]
                    assert_precision(got, s, t, f"prompt {i} layer {layer} {'KV'[j]} {variant}")


def test_early_stop_equals_plain_block_diffusion():
    model = llada2_model(seed=1)
    eos = model.config.eos_id
    model.w["lm_head"][eos] *= 2  # the end token wins now and then: answers stop at different blocks
    g = config(gen_length=14, decoder=DECODERS["threshold"], early_stop=True)
    out, _ = generate(model, PROMPTS, g, 2)
    want = [plain_block_diffusion(model, p, 14, DECODERS["threshold"], True) for p in PROMPTS]
    assert [o.tolist() for o in out] == want
    tails = {
        next((i for i in range(14, 0, -1) if a[i - 1] != eos), 0) for a in want
    }  # where the EOS run starts
    assert len(tails) > 1


@pytest.mark.parametrize("decoder", ["threshold", "joint"])
def test_a_prompt_alone_equals_it_in_a_batch_of_8(decoder):
    model = llada2_model()
    g = config(gen_length=9, decoder=DECODERS[decoder])
    prompts = [PROMPTS[i % 5] + [i] for i in range(8)]
    batched, _ = generate(model, prompts, g)
    for i in (0, 5):
        alone, _ = generate(model, [prompts[i]], g)
        assert alone[0].tolist() == batched[i].tolist()


def test_a_small_page_pool_makes_prompts_wait_and_returns_every_page():
    """A pool that holds two sequences at a time: prompts are admitted as pages free up (whatever
    batch_size allows), decode as they would alone, and every page is back at the end."""
    model = llada2_model()
    longest = max(-(-(len(p) + 10) // BL) for p in PROMPTS)
    g = config(decoder=DECODERS["threshold"], kv_pages=2 * longest)
    gen = Generator(model, g)
    out = gen.run(PROMPTS)
    want = [plain_block_diffusion(model, p, 10, DECODERS["threshold"], False) for p in PROMPTS]
    assert [o.tolist() for o in out] == want
    assert gen.kv.pool.free_pages == 2 * longest
    with pytest.raises(
        MemoryError, match="kv_pages: a sequence of 23 positions needs 6 pages of 4, the pool has 5"
    ):
        generate(model, PROMPTS, config(kv_pages=5))


@pytest.mark.parametrize(
    "change, name",
    [
        (dict(align_blocks=False), "align_blocks"),
        (dict(cache="vicinity"), "cache"),
        (dict(cache="none"), "cache"),
    ],
)
def test_settings_a_block_causal_model_cannot_decode_under(change, name):
    model = llada2_model()
    with pytest.raises(ValueError, match=name):
        generate(model, PROMPTS[:1], config(gen_length=8, **change))


def test_a_bidirectional_model_refuses_the_paged_cache():
    cfg = tiny("moe")
    model = DiffusionLM(cfg, random_weights(cfg, seed=0))
    with pytest.raises(ValueError, match="cache: a bidirectional model"):
        generate(model, [[1, 2, 3]], GenerationConfig(gen_length=8, block_length=4, cache="paged"))


@pytest.mark.gpu
@pytest.mark.parametrize("decoder", ["threshold", "joint"])
def test_cuda_graph_replay_equals_eager_on_gpu(decoder):
    cpu = llada2_model()
    model = DiffusionLM(cpu.config, {k: v.cuda() for k, v in cpu.w.items()})
    runs = {}
    for graphs in (False, True):
        g = config(decoder=DECODERS[decoder], cuda_graphs=graphs)
        runs[graphs] = [o.tolist() for o in generate(model, PROMPTS, g, 2)[0]]
    assert runs[True] == runs[False]


@pytest.fixture(scope="module")
def llada2_checkpoint(tmp_path_factory):
    """A tiny LLaDA2 folder in the released layout, with test_llm_cli's word-level tokenizer."""
    from helpers.cli import EOS, MASK, VOCAB, write_tokenizer

    path = tmp_path_factory.mktemp("tiny-llada2")
    cfg = tiny("llada2", vocab_size=VOCAB, mask_token_id=MASK, eos_token_id=EOS, pad_token_id=EOS)
    w = random_weights(cfg, seed=4)
    for name in w:
        if name.split(".")[-1] in MIXING:
            w[name] = w[name] * 10
    save_checkpoint(path, cfg, w)
    write_tokenizer(path)
    return str(path)


def test_llm_and_cli_on_a_llada2_checkpoint(llada2_checkpoint, capsys, monkeypatch):
    from helpers.cli import cli

    llm = LLM(llada2_checkpoint, device="cpu", gen_length=12)
    assert llm.model.config.block_causal
    ids = [1, 2, 10, 11, 12]
    res = llm.generate([ids], chat=False)
    # The model's own block length and the paged cache are the defaults for a block-causal model.
    want = GenerationConfig(gen_length=12, block_length=32, cache="paged")
    tokens = generate(llm.model, [ids], want)[0][0].tolist()
    eos = llm.model.config.eos_id
    assert res.token_ids[0] == (tokens[: tokens.index(eos)] if eos in tokens else tokens)
    args = ("generate", "--model", llada2_checkpoint, "--prompt", "hello world", "--gen-length", "12")
    rc, out, err = cli(capsys, monkeypatch, *args)
    assert rc == 0, err
    assert out.strip() == llm.generate("hello world").texts[0].strip()
