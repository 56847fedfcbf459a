"""Block-causal (LLaDA2) generation: the loop's cached, windowed, batched run against a plain
block-diffusion loop written here from the model description (models.md §3.3's mask): blocks on the
grid from position 0, the first one holding the prompt tail; every step one full forward over
[0, end of block) under the dense block-causal mask, no cache; the block's rows decoded until no
[MASK] is left."""

import dataclasses

import pytest
import torch
from test_checkpoint import tiny

from dinfer import LLM
from dinfer.decoders import Decoder, DecoderConfig
from dinfer.generate import GenerationConfig, generate
from dinfer.models.checkpoint import random_weights, save_checkpoint
from dinfer.models.transformer import DiffusionLM

BL = 4


MIXING = ("qkv", "o", "gate", "up", "down", "w13", "w2", "shared_w13", "shared_w2", "router")


def llada2_model(seed=0):
    cfg = dataclasses.replace(tiny("llada2"), block_length=BL)
    w = random_weights(cfg, seed=seed)
    for name in w:  # ~1/sqrt(fan-in) weights: rows depend on their context, so answers vary
        if name.split(".")[-1] in MIXING:
            w[name] = w[name] * 10
    w["lm_head"] = w["lm_head"] * 3  # confident enough that thresholds commit several tokens
    return DiffusionLM(cfg, w)


def block_causal_mask(L):
    blocks = torch.arange(L) // BL
    return (blocks[None, :] <= blocks[:, None])[None]  # [1, L, L]: key block <= query block


def plain_block_diffusion(model, prompt, gen_length, decoder, early_stop):
    """One prompt, no cache: the answer's tokens."""
    c = model.config
    P, total = len(prompt), len(prompt) + gen_length
    x = torch.tensor(prompt + [c.mask_id] * gen_length)
    for s in range(P // BL * BL, total, BL):
        e = min(s + BL, total)
        dec = Decoder(decoder, 1, BL, c.mask_id, "cpu")
        pad = torch.full((BL - (e - s),), c.eos_id)  # rows past the end: not [MASK], never decoded
        dec.start_block(torch.cat([x[s:e], pad])[None])
        iters = torch.zeros(1, dtype=torch.int32)
        while (x[s:e] == c.mask_id).any():
            logits = model.forward(
                model.embed(x[None, :e]),
                torch.arange(e)[None],
                model.new_cache(1, e),
                torch.tensor([e], dtype=torch.int32),
                attn_mask=block_causal_mask(e),
                logits_rows=torch.arange(s, e),
            )
            logits = torch.cat([logits, logits.new_zeros(BL - (e - s), logits.shape[1])])
            tokens = torch.cat([x[s:e], pad])
            dec(logits, tokens, iters)
            x[s:e] = tokens[: e - s]
            iters += 1
        if early_stop and (x[P:e] == c.eos_id).any():
            x[e:] = c.eos_id
            break
    return x[P:].tolist()


PROMPTS = [[3, 1, 4], [1, 5, 9, 2, 6, 5], [3, 5, 8, 9, 7, 9, 3, 2, 3], [2, 7]]
DECODERS = {
    "threshold": DecoderConfig(threshold=0.5),
    "fixed": DecoderConfig(name="fixed", steps_per_block=2),
    "hierarchical": DecoderConfig(name="hierarchical", threshold=0.7, low_threshold=0.4),
}


@pytest.mark.parametrize("decoder", list(DECODERS))
@pytest.mark.parametrize("cache", ["none", "prefix", "dual", "vicinity"])
@pytest.mark.parametrize("batch_size", [None, 3])
def test_loop_equals_plain_block_diffusion(cache, decoder, batch_size):
    model = llada2_model()
    g = GenerationConfig(
        gen_length=10,
        block_length=BL,
        cache=cache,
        prefix_look=BL,
        decoder=DECODERS[decoder],
        early_stop=False,
    )
    out, _ = generate(model, PROMPTS, g, batch_size)
    want = [plain_block_diffusion(model, p, 10, DECODERS[decoder], False) for p in PROMPTS]
    assert [o.tolist() for o in out] == want
    assert len({t for o in want for t in o}) > 3  # the check sees varied answers, not one token


def test_early_stop_equals_plain_block_diffusion():
    model = llada2_model(seed=1)
    eos = model.config.eos_id
    model.w["lm_head"][eos] *= 2  # the end token wins now and then: answers stop at different blocks
    g = GenerationConfig(gen_length=14, block_length=BL, cache="dual", decoder=DECODERS["threshold"])
    out, _ = generate(model, PROMPTS, g, 2)
    want = [plain_block_diffusion(model, p, 14, DECODERS["threshold"], True) for p in PROMPTS]
    assert [o.tolist() for o in out] == want
    tails = {next(i for i in range(14, 0, -1) if a[i - 1] != eos) for a in want}  # where the EOS run starts
    assert len(tails) > 1


def test_a_prompt_alone_equals_it_in_a_batch_of_8():
    model = llada2_model()
    g = GenerationConfig(gen_length=9, block_length=BL, cache="dual", decoder=DECODERS["threshold"])
    prompts = [PROMPTS[i % 4] + [i] for i in range(8)]
    batched, _ = generate(model, prompts, g)
    for i in (0, 5):
        alone, _ = generate(model, [prompts[i]], g)
        assert alone[0].tolist() == batched[i].tolist()


@pytest.mark.parametrize(
    "change, name",
    [(dict(align_blocks=False), "align_blocks"), (dict(cache="vicinity", prefix_look=3), "prefix_look")],
)
def test_settings_a_block_causal_model_cannot_decode_under(change, name):
    model = llada2_model()
    g = GenerationConfig(gen_length=8, block_length=BL, **change)
    with pytest.raises(ValueError, match=name):
        generate(model, PROMPTS[:1], g)


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager_on_gpu():
    cpu = llada2_model()
    model = DiffusionLM(cpu.config, {k: v.cuda() for k, v in cpu.w.items()})
    runs = {}
    for graphs in (False, True):
        g = GenerationConfig(
            gen_length=10, block_length=BL, cache="dual", decoder=DECODERS["threshold"], cuda_graphs=graphs
        )
        runs[graphs] = [o.tolist() for o in generate(model, PROMPTS, g, 2)[0]]
    assert runs[True] == runs[False]


@pytest.fixture(scope="module")
def llada2_checkpoint(tmp_path_factory):
    """A tiny LLaDA2 folder in the released layout, with test_llm_cli's word-level tokenizer."""
    from test_llm_cli import EOS, MASK, VOCAB, write_tokenizer

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
    from test_llm_cli import cli

    llm = LLM(llada2_checkpoint, device="cpu", gen_length=12)
    assert llm.model.config.block_causal
    ids = [1, 2, 10, 11, 12]
    res = llm.generate([ids], chat=False)
    # The model's own block length and the block window are the defaults for a block-causal model.
    want = GenerationConfig(gen_length=12, block_length=32, cache="dual")
    tokens = generate(llm.model, [ids], want)[0][0].tolist()
    eos = llm.model.config.eos_id
    assert res.token_ids[0] == (tokens[: tokens.index(eos)] if eos in tokens else tokens)
    args = ("generate", "--model", llada2_checkpoint, "--prompt", "hello world", "--gen-length", "12")
    rc, out, err = cli(capsys, monkeypatch, *args)
    assert rc == 0, err
    assert out.strip() == llm.generate("hello world").texts[0].strip()
