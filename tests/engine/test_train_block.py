"""dinfer.train's block-diffusion objective (tiny-llada2): the two-copy layout and its mask, each block
noised on its own, a noisy block's loss independent of later blocks and of the other noisy blocks, the
training forward equal to what block-causal decoding computes, the expert bias's balancing, and a
short run that writes a LLaDA2 checkpoint the engine decodes."""

import dataclasses
import json
import random

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer as HFTokenizer

import dinfer_kernels as dk
from dinfer import LLM
from dinfer.batch import blocks_end
from dinfer.models import llada2
from dinfer.models.checkpoint import random_weights
from dinfer.models.transformer import DiffusionLM, KVCache
from dinfer.tasks import sample
from dinfer.train import PRESETS, ops, train
from dinfer.train.block import attention_mask, corrupt_blocks, mask_blocks, two_copy_layout
from dinfer.train.loop import EDIT_WEIGHT, Batches, _balance, _noise_ids, _tally, block_loss_fn, init_weights
from dinfer.train.presets import GEN_LENGTH
from dinfer.train.tokenizer import save_tokenizer
from dinfer_kernels.reference.moe import route

PRESET = PRESETS["tiny-llada2"]
PAD = PRESET.config.pad_id


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    save_tokenizer(path)
    return path


def ragged_batch(prompts, canvases, seed=0):
    """tokens [B, T] (distinct ids per column, so a gather shows where each came from), canvas and
    lengths as Batches gives them: row b is prompts[b] tokens, then canvases[b] canvas tokens."""
    B, T = len(prompts), max(p + c for p, c in zip(prompts, canvases)) + 2
    tokens = torch.randint(10, 40, (B, T), generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(T)[None, :]
    start, lengths = torch.tensor(prompts), torch.tensor([p + c for p, c in zip(prompts, canvases)])
    canvas = (pos >= start[:, None]) & (pos < lengths[:, None])
    tokens = torch.where(pos < lengths[:, None], tokens, PAD)
    return tokens, canvas, lengths.to(torch.int32), (lengths - start).float()


def test_two_copy_layout_by_hand():
    """Row 0: prompt 5, canvas 6, blocks of 4: noisy copy = positions 4..10 (the first block holds the
    prompt's last token), clean copy = positions 0..7 (up to the last block, 8..10, which no noisy
    block sees). Row 1: prompt 8 (a block boundary), canvas 3; row 2: prompt 2, canvas 9."""
    tokens, canvas, lengths, _ = ragged_batch([5, 8, 2], [6, 3, 9])
    lay = two_copy_layout(tokens, canvas, lengths, 4, PAD)
    assert lay.widths.tolist() == [7 + 8, 3 + 8, 11 + 8]
    W = lay.tokens.shape[1]
    assert W == 19
    assert lay.positions[0, :15].tolist() == list(range(4, 11)) + list(range(8))
    assert lay.positions[1, :11].tolist() == [8, 9, 10] + list(range(8))
    assert lay.positions[2].tolist() == list(range(11)) + list(range(8))
    assert lay.noisy[0].tolist() == [True] * 7 + [False] * 12
    assert lay.noisy[1].tolist() == [True] * 3 + [False] * 16
    assert lay.valid[1].tolist() == [True] * 11 + [False] * 8
    assert torch.equal(lay.tokens[2], tokens[2].gather(0, lay.positions[2]))
    assert torch.equal(lay.tokens[0, :15], tokens[0].gather(0, lay.positions[0, :15]))
    assert lay.tokens[1, 11:].tolist() == [PAD] * 8
    # the prompt's tail (position 4; 0 and 1) is in the noisy copy but never a candidate for the noise
    assert lay.candidates[0].tolist() == [False] + [True] * 6 + [False] * 12
    assert lay.candidates[1].tolist() == [True] * 3 + [False] * 16
    assert lay.candidates[2].tolist() == [False] * 2 + [True] * 9 + [False] * 8
    m = lay.mask[0]
    noisy_cols = {p: c for c, p in enumerate(range(4, 11))}
    clean_cols = {p: 7 + p for p in range(8)}
    sees = lambda col: set(m[col].nonzero().flatten().tolist())
    # noisy position 5 (block 1): noisy 4..7 and clean 0..3
    assert sees(noisy_cols[5]) == {noisy_cols[p] for p in range(4, 8)} | {clean_cols[p] for p in range(4)}
    # noisy position 9 (block 2, partial: 8..10): noisy 8..10 and clean 0..7
    assert sees(noisy_cols[9]) == {noisy_cols[p] for p in (8, 9, 10)} | {clean_cols[p] for p in range(8)}
    # clean position 5 (block 1): clean 0..7; clean position 2 (block 0): clean 0..3
    assert sees(clean_cols[5]) == {clean_cols[p] for p in range(8)}
    assert sees(clean_cols[2]) == {clean_cols[p] for p in range(4)}
    # padding sees and is seen by nothing
    assert not lay.mask[1, 11:].any() and not lay.mask[1, :, 11:].any()


@pytest.mark.parametrize("bl", [1, 3, 8])
def test_attention_mask_is_the_rule(bl):
    """Every (query, key) pair of random ragged layouts, against the rule written out per pair."""
    rng = random.Random(bl)
    prompts = [rng.randint(1, 20) for _ in range(4)]
    canvases = [rng.randint(1, 20) for _ in range(4)]
    tokens, canvas, lengths, _ = ragged_batch(prompts, canvases, seed=bl)
    lay = two_copy_layout(tokens, canvas, lengths, bl, PAD)
    B, W = lay.tokens.shape
    for b in range(B):
        P, N = prompts[b], prompts[b] + canvases[b]
        first = P // bl * bl
        cols = [("noisy", p) for p in range(first, N)] + [("clean", p) for p in range((N - 1) // bl * bl)]
        assert [int(x) for x in lay.positions[b, : len(cols)]] == [p for _, p in cols]
        assert [bool(x) for x in lay.noisy[b, : len(cols)]] == [k == "noisy" for k, _ in cols]
        expected = torch.zeros(W, W, dtype=torch.bool)
        for q, (kq, pq) in enumerate(cols):
            for k, (kk, pk) in enumerate(cols):
                if kq == "noisy":
                    expected[q, k] = pk // bl == pq // bl if kk == "noisy" else pk // bl < pq // bl
                else:
                    expected[q, k] = kk == "clean" and pk // bl <= pq // bl
        assert torch.equal(lay.mask[b], expected), b
        # the clean copy never sees a noisy token
        assert not (lay.mask[b] & ~lay.noisy[b][:, None] & lay.noisy[b][None, :]).any()
    assert torch.equal(lay.mask, attention_mask(lay.positions, lay.noisy, lay.valid, bl))


def test_each_block_is_noised_on_its_own():
    """In every noisy block of L candidates, l in 1..L are masked, only candidates (never the prompt's
    tail, the clean copy or padding), all columns of the block weighted L / l; (l - 1) / (L - 1) is
    uniform over the batch's blocks and draws."""
    tokens, canvas, lengths, _ = ragged_batch([5, 8, 13, 2, 30], [6, 3, 20, 34, 1])
    bl = 8
    lay = two_copy_layout(tokens, canvas, lengths, bl, PAD)
    fractions = []
    for seed in range(60):
        masked, weight = mask_blocks(lay, bl, torch.Generator().manual_seed(seed))
        assert not (masked & ~lay.candidates).any()
        for b in range(tokens.shape[0]):
            for start in range(0, int(lay.noisy[b].sum()), bl):
                block = slice(start, start + bl)
                L, l = int(lay.candidates[b, block].sum()), int(masked[b, block].sum())
                if L == 0:
                    assert l == 0
                    continue
                assert 1 <= l <= L
                cand = lay.candidates[b, block]
                assert torch.allclose(weight[b, block][cand], torch.tensor(L / l))
                if L > 1:
                    fractions.append((l - 1) / (L - 1))
    n = len(fractions)
    assert abs(sum(fractions) / n - 0.5) < 4 * (1 / 12 / n) ** 0.5
    assert min(fractions) == 0.0 and max(fractions) == 1.0


def lively_model():
    weights = random_weights(PRESET.config, seed=1)
    for name, w in weights.items():
        if name.endswith("expert_bias"):
            w.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
        else:
            w.mul_(3)  # lively enough that attention and routing are not uniform
    return weights


def layout_logits(model, lay, tokens=None):
    """fp32 logits [B, W, V] of every column of the layout (its tokens, or `tokens`)."""
    c = model.config
    x = lay.tokens if tokens is None else tokens
    cache = KVCache([None] * c.num_layers, [None] * c.num_layers)
    logits = model.forward(model.embed(x), lay.positions, cache, lay.widths, attn_mask=lay.mask)
    return logits.view(*x.shape, -1)


def test_noisy_block_sees_only_its_block_and_the_clean_blocks_before():
    """Changing the tokens of later blocks (either copy) or of another noisy block leaves a noisy block's
    logits as they were; changing the noisy copy leaves every clean column's logits as they were; and
    changing a clean block before it does change them (the test can fail)."""
    model = DiffusionLM(PRESET.config, lively_model(), ops=ops)
    bl = 8
    tokens, canvas, lengths, _ = ragged_batch([19, 30, 7], [30, 20, 40], seed=3)
    lay = two_copy_layout(tokens, canvas, lengths, bl, PAD)
    gen = torch.Generator().manual_seed(4)
    masked, _ = mask_blocks(lay, bl, gen)
    x = torch.where(masked, PRESET.config.mask_id, lay.tokens)
    base = layout_logits(model, lay, x)
    scale = base.abs().max().item()
    block = lay.positions // bl
    for b in range(x.shape[0]):
        for k in block[b][lay.noisy[b]].unique().tolist():
            rows = lay.noisy[b] & (block[b] == k)
            later = lay.valid[b] & (block[b] > k)
            other_noisy = lay.noisy[b] & (block[b] != k)
            earlier_clean = lay.valid[b] & ~lay.noisy[b] & (block[b] < k)
            for change, moves in ((later, False), (other_noisy, False), (earlier_clean, True)):
                if not change.any():
                    continue
                y = x.clone()
                y[b, change] = torch.randint(10, 40, (int(change.sum()),), generator=gen)
                got = layout_logits(model, lay, y)[b, rows]
                diff = (got - base[b, rows]).abs().max().item()
                if moves:
                    assert diff > 1e-3 * scale, (b, k)
                else:
                    assert diff <= 1e-5 * scale, (b, k)
    y = x.clone()
    y[lay.noisy] = torch.randint(10, 40, (int(lay.noisy.sum()),), generator=gen)
    clean = lay.valid & ~lay.noisy
    torch.testing.assert_close(layout_logits(model, lay, y)[clean], base[clean], rtol=0, atol=1e-5 * scale)


def test_training_forward_is_block_causal_decoding():
    """The logits of each noisy block in the two-copy forward (training's stand-in ops) equal those of
    the inference forward (dinfer_kernels ops) over the sequence as decoding holds it at that block:
    the blocks before it final, the block as noised, nothing after it, under BlockMask.block_causal."""
    weights = lively_model()
    train_model, infer = DiffusionLM(PRESET.config, weights, ops=ops), DiffusionLM(PRESET.config, weights)
    bl, c = 8, PRESET.config
    tokens, canvas, lengths, _ = ragged_batch([19, 26], [30, 11], seed=5)
    lay = two_copy_layout(tokens, canvas, lengths, bl, PAD)
    masked, _ = mask_blocks(lay, bl, torch.Generator().manual_seed(6))
    x = torch.where(masked, c.mask_id, lay.tokens)
    got = layout_logits(train_model, lay, x)
    scale = got.abs().max().item()
    for b in range(x.shape[0]):
        S = int(lengths[b])
        for start in range(0, int(lay.noisy[b].sum()), bl):
            cols = torch.arange(start, min(start + bl, int(lay.noisy[b].sum())))
            pos = lay.positions[b, cols]
            seq = tokens[b, :S].clone()
            seq[pos] = x[b, cols]  # the block as noised; the blocks before it are the clean tokens
            end = torch.tensor([int(pos[-1]) + 1], dtype=torch.int32)
            mask = dk.BlockMask.block_causal(1, c.num_kv_heads, S, S, bl, bl, bl)
            logits = infer.forward(
                infer.embed(seq[None]),
                torch.arange(S)[None],
                infer.new_cache(1, S),
                end,
                block_mask=mask,
                logits_rows=pos,
            )
            torch.testing.assert_close(got[b, cols], logits, rtol=0, atol=1e-4 * scale)


@pytest.mark.slow  # measured 30-110 s each on a 2-core CPU (.ci/run --durations)
def test_block_loss_is_the_weighted_mean_of_masked_tokens(tok_dir):
    """block_loss_fn = sum over masked noisy tokens of CE * (L / l) / L_seq, / B (recomputed here from
    the layout); the tally's rows point at the same tokens in the [B, T] batch; the loss learns."""
    preset = dataclasses.replace(PRESET, batch_size=8)
    batches = Batches(preset, HFTokenizer.from_file(str(tok_dir / "tokenizer.json")), seed=2)
    tokens, canvas, lengths, canvas_len = batch = batches()
    weights = {n: w.requires_grad_(not n.endswith("expert_bias")) for n, w in lively_model().items()}
    model = DiffusionLM(preset.config, weights, ops=ops)
    hits, loads = {}, []
    loss = block_loss_fn(model, *batch, torch.Generator().manual_seed(1), 8, hits=hits, loads=loads)
    lay = two_copy_layout(tokens, canvas, lengths, 8, preset.config.pad_id)
    masked, weight = mask_blocks(lay, 8, torch.Generator().manual_seed(1))
    x = torch.where(masked, preset.config.mask_id, lay.tokens)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = layout_logits(model, lay, x)[masked]
    ce = torch.nn.functional.cross_entropy(logits.float(), lay.tokens[masked], reduction="none")
    B, T = tokens.shape
    w = (weight / canvas_len[:, None])[masked]
    torch.testing.assert_close(loss, (ce * w).sum() / B, rtol=1e-3, atol=0)
    seq = masked.nonzero()[:, 0]
    assert hits["rows"].tolist() == (seq * T + lay.positions[masked]).tolist()
    assert torch.equal(tokens.flatten()[hits["rows"]], lay.tokens[masked])
    tally = {task: [0, 0] for task, _ in preset.task_weights}
    _tally(tally, batches, hits)
    assert sum(seen for _, seen in tally.values()) == int((batches.answer.flatten()[hits["rows"]]).sum())
    # one [E] load per MoE layer of the loss's forward, counting top_k choices of every column it
    # runs on: the valid ones, and in the last layer the masked ones (only their logits are read)
    moe_layers = preset.config.num_layers - preset.config.first_k_dense
    assert len(loads) == moe_layers
    ran = [int(lay.valid.sum())] * (moe_layers - 1) + [int(masked.sum())]
    assert [int(n.sum()) for n in loads] == [r * preset.config.top_k for r in ran]
    first = loss.item()
    opt = torch.optim.Adam([w for w in weights.values() if w.requires_grad], lr=3e-3)
    for step in range(30):
        loss = block_loss_fn(model, *batch, torch.Generator().manual_seed(step), 8, soft=step % 2 == 1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first
    assert all(weights[n].grad is None for n in weights if n.endswith("expert_bias"))


@pytest.mark.parametrize("bl", [8, 32])
def test_block_fills_end_on_a_block_boundary_within_the_decoded_canvas(tok_dir, bl):
    """Past recall's curriculum every row ends on a block boundary (its last block whole, as the
    engine lays a block-causal canvas out) past its first EOS and at most where the decoded canvas
    of GEN_LENGTH ends; the fills are every such boundary."""
    preset = dataclasses.replace(PRESET, block_length=bl)
    batches = Batches(preset, HFTokenizer.from_file(str(tok_dir / "tokenizer.json")), seed=3)
    tokens, canvas, lengths, _ = batches()
    start = canvas.long().argmax(1)
    eos = start + batches.answer.sum(1)  # the first EOS
    assert (lengths % bl == 0).all() and (lengths > eos).all()
    decoded = torch.tensor([blocks_end(int(p), GEN_LENGTH, bl, True) for p in start])
    assert (lengths <= decoded).all()
    assert (lengths > eos // bl * bl + bl).any()  # a block of EOS after the answer's block
    assert (lengths == eos // bl * bl + bl).any()  # and canvases that end with the answer's block
    assert batches.block_fills(19, 7) == (
        [32 - 26, 40 - 26, 48 - 26, 56 - 26] if bl == 8 else [32 - 26, 64 - 26]
    )
    if bl == 32:
        assert batches.block_fills(50, 4) == [64 - 54, 96 - 54]  # the canvas of 50 + 32 ends at 96
        assert batches.block_fills(30, 5) == [64 - 35]  # the answer's block is the canvas's last
        assert batches.block_fills(31, 1) == [32 - 32 + 32]  # an answer that ends on a boundary
    # recall's curriculum stage (recall rows only): short fills, up to 4 EOS, while its lookup forms
    tokens, canvas, lengths, _ = batches(0)
    assert batches.tasks == ["recall"] * preset.batch_size
    fill = lengths - canvas.long().argmax(1) - batches.answer.sum(1)
    assert fill.min() == 1 and fill.max() == 4


def test_corrupt_blocks_shares_positions_and_tokens():
    """The token-to-token noise: only visible candidates (never a masked one, the prompt's tail, the
    clean copy or padding) are corrupted, each block at p ~ U(0, edit_fraction) (its corrupted share of
    the visible tokens averages edit_fraction / 2 and spans 0 to near edit_fraction), always to a
    token of noise_ids other than the true one, every such token drawn; the rest of `noise` is the
    layout's tokens; the same generator gives the same noise."""
    tokens, canvas, lengths, _ = ragged_batch([5, 8, 13, 2, 30], [27, 24, 51, 62, 34], seed=3)
    bl, fraction = 8, 0.4
    noise_ids = torch.tensor([0] + list(range(10, 40)))
    lay = two_copy_layout(tokens, canvas, lengths, bl, PAD)
    shares, drawn = [], torch.zeros(64, dtype=torch.long)
    for seed in range(40):
        gen = torch.Generator().manual_seed(seed)
        masked, _ = mask_blocks(lay, bl, gen)
        corrupted, noise = corrupt_blocks(lay, masked, bl, fraction, noise_ids, gen)
        visible = lay.candidates & ~masked
        assert not (corrupted & ~visible).any()
        assert torch.equal(noise[~corrupted], lay.tokens[~corrupted])
        assert (noise[corrupted] != lay.tokens[corrupted]).all()
        assert torch.isin(noise[corrupted], noise_ids).all()
        drawn += torch.bincount(noise[corrupted], minlength=64)
        for b in range(tokens.shape[0]):
            for start in range(0, int(lay.noisy[b].sum()), bl):
                block = slice(start, start + bl)
                n = int(visible[b, block].sum())
                if n >= 4:
                    shares.append(int(corrupted[b, block].sum()) / n)
        again = torch.Generator().manual_seed(seed)
        assert torch.equal(
            corrupt_blocks(lay, mask_blocks(lay, bl, again)[0], bl, fraction, noise_ids, again)[1], noise
        )
    n = len(shares)
    # a block's share has mean fraction / 2; its variance is at most that of p (fraction^2 / 12) plus
    # the binomial term (<= 1/16 for blocks of >= 4 visible tokens)
    assert abs(sum(shares) / n - fraction / 2) < 4 * ((fraction**2 / 12 + 1 / 16) / n) ** 0.5
    assert min(shares) == 0.0 and max(shares) > 0.6 * fraction
    assert (drawn[noise_ids] > 0).all() and drawn.sum() == drawn[noise_ids].sum()
    with pytest.raises(ValueError, match="edit_fraction"):
        corrupt_blocks(lay, masked, bl, 0.0, noise_ids, torch.Generator())
    with pytest.raises(ValueError, match="noise_ids"):
        corrupt_blocks(lay, masked, bl, 0.2, torch.tensor([5]), torch.Generator())


def test_block_loss_with_edits_reads_masked_and_visible_tokens(tok_dir):
    """Under the token-to-token objective the forward's input is the layout with masked columns
    [MASK] and corrupted ones their random token, and the loss is CE * (L / l) / L_seq on masked
    tokens plus CE * EDIT_WEIGHT / L_seq on every visible candidate (corrupted or kept), / B; the
    hits split masked, corrupted and kept; with the edit noise on, corrupted tokens get rewritten."""
    preset = dataclasses.replace(PRESET, batch_size=8)
    batches = Batches(preset, HFTokenizer.from_file(str(tok_dir / "tokenizer.json")), seed=2)
    tokens, canvas, lengths, canvas_len = batch = batches()
    weights = {n: w.requires_grad_(not n.endswith("expert_bias")) for n, w in lively_model().items()}
    model = DiffusionLM(preset.config, weights, ops=ops)
    noise_ids = torch.tensor(_noise_ids())
    assert preset.config.mask_id not in noise_ids and preset.config.eos_id in noise_ids
    edits = dict(edit_fraction=0.5, noise_ids=noise_ids)
    hits = {}
    loss = block_loss_fn(model, *batch, torch.Generator().manual_seed(1), 32, hits=hits, **edits)
    lay = two_copy_layout(tokens, canvas, lengths, 32, preset.config.pad_id)
    gen = torch.Generator().manual_seed(1)
    masked, weight = mask_blocks(lay, 32, gen)
    corrupted, noise = corrupt_blocks(lay, masked, 32, 0.5, noise_ids, gen)
    visible = lay.candidates & ~masked
    assert corrupted.any() and (visible & ~corrupted).any()
    x = torch.where(masked, preset.config.mask_id, noise)
    read = masked | visible
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = layout_logits(model, lay, x)[read]
    ce = torch.nn.functional.cross_entropy(logits.float(), lay.tokens[read], reduction="none")
    w = (torch.where(visible, EDIT_WEIGHT, weight) / canvas_len[:, None])[read]
    torch.testing.assert_close(loss, (ce * w).sum() / tokens.shape[0], rtol=1e-3, atol=0)
    T = tokens.shape[1]
    for kind, columns in (("masked", masked), ("corrupted", corrupted), ("kept", visible & ~corrupted)):
        found = hits if kind == "masked" else hits[kind]
        seq = columns.nonzero()[:, 0]
        assert found["rows"].tolist() == (seq * T + lay.positions[columns]).tolist(), kind
        assert found["hit"].tolist() == (logits.argmax(-1) == lay.tokens[read])[columns[read]].tolist()
    opt = torch.optim.Adam([w for w in weights.values() if w.requires_grad], lr=3e-3)
    for step in range(40):
        hits = {}
        loss = block_loss_fn(
            model, *batch, torch.Generator().manual_seed(step), 32, hits=hits, bf16=False, **edits
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    rewritten = hits["corrupted"]["hit"].float().mean().item()
    assert rewritten > 0.5, rewritten  # a model that copied its input would get none right


def test_attention_mask_in_training_attention():
    """ops.attention with a dense mask: each row a softmax over its allowed keys (before seq_lens);
    a row with none gets 0 and no NaN, forward or backward."""
    g = torch.Generator().manual_seed(0)
    B, T, Hq, Hkv, D = 2, 7, 4, 2, 8
    q, k, v = (torch.randn(B, T, h, D, generator=g).requires_grad_() for h in (Hq, Hkv, Hkv))
    mask = torch.rand(B, T, T, generator=g) < 0.5
    mask[0, 3] = False  # a row that sees nothing
    seq_lens = torch.tensor([7, 5], dtype=torch.int32)
    out = ops.attention(q, k, v, None, None, None, seq_lens, attn_mask=mask)
    out.sum().backward()
    assert all(t.grad.isfinite().all() for t in (q, k, v))
    for b in range(B):
        for i in range(T):
            keys = [j for j in range(T) if mask[b, i, j] and j < int(seq_lens[b])]
            for h in range(Hq):
                if not keys:
                    assert out[b, i, h].abs().max() == 0
                    continue
                kk, vv = k[b, keys, h // 2], v[b, keys, h // 2]
                p = torch.softmax(q[b, i, h] @ kk.t() / D**0.5, -1)
                torch.testing.assert_close(out[b, i, h], p @ vv)


def test_expert_bias_balancing():
    """ops.expert_loads counts each MoE call's expert choices (the router's, bias included), and
    _balance moves each bias by `rate` towards the experts chosen less than the mean."""
    c = PRESET.config
    w = lively_model()
    hidden = torch.randn(50, c.hidden_size, generator=torch.Generator().manual_seed(0))
    layer = f"layers.{c.first_k_dense}."
    routing = dict(scoring="sigmoid", num_groups=c.num_groups, topk_groups=c.topk_groups)
    args = (hidden, w[layer + "router"], w[layer + "w13"], w[layer + "w2"], c.top_k)
    kw = dict(
        routing, renormalize=True, expert_bias=w[layer + "expert_bias"], routed_scaling=c.routed_scaling
    )
    loads: list = []
    with ops.expert_loads(loads):
        out = ops.moe(*args, **kw)
    ops.moe(*args, **kw)  # outside the block: not recorded
    _, experts = route(hidden, w[layer + "router"], c.top_k, **kw)
    assert len(loads) == 1
    assert torch.equal(loads[0], torch.bincount(experts.flatten(), minlength=c.num_experts))
    expected = dk.moe(*args, **kw)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-4 * expected.abs().max().item())
    biases = [torch.zeros(4), torch.zeros(4)]
    _balance(biases, torch.tensor([[1.0, 2.0, 3.0, 6.0], [3.0, 3.0, 3.0, 3.0]]), 0.5)
    assert biases[0].tolist() == [0.5, 0.5, 0.0, -0.5] and biases[1].tolist() == [0.0] * 4


def test_init_expert_bias_is_zero_and_untrained():
    weights = init_weights(PRESET, torch.Generator().manual_seed(0))
    biases = [n for n in weights if n.endswith("expert_bias")]
    assert len(biases) == PRESET.config.num_layers - PRESET.config.first_k_dense
    assert all(not weights[n].requires_grad and not weights[n].any() for n in biases)


@pytest.mark.slow  # measured 30-110 s each on a 2-core CPU (.ci/run --durations)
def test_train_llada2_writes_a_block_causal_checkpoint(tmp_path):
    """A few steps: the released LLaDA2 layout (fused QKV, fp32 expert bias, moved by the balancing),
    the training block length as the decoding one, reproducible, and decoded by the engine."""
    records = [train("tiny-llada2", tmp_path / run, steps=3, seed=1, log=lambda _: None) for run in "ab"]
    assert records[0]["block_length"] == PRESET.block_length == 32  # the release's block
    assert records[0]["objective"] == "block diffusion" and records[0]["last_block"] == "whole"
    assert records[0]["edit_fraction"] == PRESET.edit_fraction > 0  # the token-to-token objective
    assert records[0]["precision"] == "bf16 autocast"  # the default; --fp32 for hosts without bf16
    a, b = tmp_path / "a", tmp_path / "b"
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    config = json.loads((a / "config.json").read_text())
    assert config["architectures"] == ["LLaDA2MoeModelLM"] and config["first_k_dense_replace"] == 1
    assert json.loads((a / "generation_config.json").read_text())["block_length"] == 32
    with safe_open(a / "model.safetensors", "pt") as f:
        assert "model.layers.0.attention.query_key_value.weight" in f.keys()
        bias = f.get_tensor("model.layers.1.mlp.gate.expert_bias")
        assert bias.dtype == torch.float32 and bias.abs().max() > 0  # 3 steps of 1e-3 each
        assert f.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.bfloat16
    llm = LLM(a, device="cpu")
    assert llm.model.config.family == llada2.NAME and llm.model.config.block_causal
    assert llm.defaults["block_length"] == 32  # the trained block length, from generation_config.json
    out = llm.generate(["add:12+34"], decoder="fixed", steps_per_block=0)  # its paged cache
    assert len(out.token_ids) == 1 and out.stats["forwards"] >= 1


def test_batches_prompt_ids_for_every_task(tok_dir):
    """The block preset's batches are the same prompt / answer / EOS rows (only the fill differs)."""
    batches = Batches(PRESET, HFTokenizer.from_file(str(tok_dir / "tokenizer.json")), seed=5)
    tokens, canvas, lengths, canvas_len = batches(None)
    replay = random.Random("train/5")
    names, weights = zip(*PRESET.task_weights)
    drawn = replay.choices(names, weights, k=PRESET.batch_size)
    assert batches.tasks == drawn
    for b, task in enumerate(drawn):
        prompt, answer = sample(
            task,
            replay,
            heldout=False,
            draw=PRESET.recall_curriculum.draw(PRESET.steps) if task == "recall" else None,
        )
        p = batches.prompt_ids(prompt)
        fill = replay.choice(batches.block_fills(len(p), len(answer)))
        assert tokens[b, : len(p)].tolist() == p and int(lengths[b]) == len(p) + len(answer) + fill
        assert canvas_len[b] == len(answer) + fill
