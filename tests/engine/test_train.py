"""dinfer.train: the differentiable ops equal the kernels, the tokenizer equals the chat template,
LLaDA's objective on well-formed batches, and a reproducible run that writes a loadable checkpoint."""

import dataclasses
import filecmp
import json
import random

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer as HFTokenizer

from dinfer import LLM
from dinfer.models.checkpoint import expected_shapes, random_weights, save_checkpoint
from dinfer.models.tokenizer import Tokenizer
from dinfer.models.transformer import DiffusionLM, KVCache
from dinfer.tasks import TASKS, sample
from dinfer.train import PRESETS, ops, train
from dinfer.train.loop import SOFT_WEIGHT, Batches, _smoothing_inputs, _tally, init_weights, loss_fn
from dinfer.train.tokenizer import UNK, save_tokenizer, special_ids


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    save_tokenizer(path)
    return path


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_training_ops_match_kernel_ops(name):
    """Training's forward (references + SDPA, no cache) is the inference forward (kernels + cache)."""
    config = PRESETS[name].config
    weights = random_weights(config, seed=1)
    for w in weights.values():
        w.mul_(3)  # lively enough that attention and routing are not uniform
    B, T = 3, 29
    tokens = torch.randint(0, config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(T).expand(B, T)
    lengths = torch.tensor([T, 17, 1], dtype=torch.int32)  # ragged: rows past a length are padding
    valid = (torch.arange(T)[None, :] < lengths[:, None]).flatten()
    infer = DiffusionLM(config, weights)
    expected = infer.forward(infer.embed(tokens), positions, infer.new_cache(B, T), lengths)[valid]
    trainable = DiffusionLM(config, weights, ops=ops)
    no_cache = KVCache([None] * config.num_layers, [None] * config.num_layers)
    got = trainable.forward(trainable.embed(tokens), positions, no_cache, lengths)[valid]
    # fp32 both ways, summed in different orders through 4 layers of amplifying weights: ~1e-5 of the
    # logits' scale. A real difference (here: causal instead of bidirectional attention) is ~1e-1.
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4 * scale)
    # The MLP / MoE on the valid rows only (training's ffn_rows): the valid rows' logits do not change.
    skipped = trainable.forward(
        trainable.embed(tokens), positions, no_cache, lengths, ffn_rows=valid.nonzero().flatten()
    )
    torch.testing.assert_close(skipped[valid], expected, rtol=0, atol=1e-4 * scale)
    rows = valid.nonzero().flatten()[::3]  # training's call: logits of some valid rows, MLPs on all valid
    some = trainable.forward(
        trainable.embed(tokens),
        positions,
        no_cache,
        lengths,
        logits_rows=rows,
        ffn_rows=valid.nonzero().flatten(),
    )
    torch.testing.assert_close(some, expected[::3], rtol=0, atol=1e-4 * scale)
    padding = trainable.forward(trainable.embed(tokens), positions, no_cache, lengths)[~valid]
    assert (skipped[~valid] - padding).abs().max() > 1e-2 * scale  # ... and padding rows were skipped
    full = DiffusionLM(config, weights, ops=ops).forward(trainable.embed(tokens), positions, no_cache, None)
    assert (full[valid] - expected).abs().max() > 1e-2 * scale  # padding keys do matter when attended

    class Causal:
        rms_norm, qk_rope, moe = ops.rms_norm, ops.qk_rope, ops.moe

        @staticmethod
        def attention(q, k, v, *args, **kwargs):
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
            )
            return o.transpose(1, 2)

    wrong = DiffusionLM(config, weights, ops=Causal).forward(
        trainable.embed(tokens), positions, no_cache, lengths
    )
    assert (wrong[valid] - expected).abs().max() > 1e-2 * scale


def test_tokenizer_is_the_chat_template(tok_dir):
    tok = Tokenizer(tok_dir)
    batches = Batches(PRESETS["tiny-llada"], HFTokenizer.from_file(str(tok_dir / "tokenizer.json")), 0)
    rng = random.Random(0)
    for task in TASKS:
        prompt, answer = sample(task, rng, heldout=False)
        ids = tok.encode(tok.apply_chat_template(prompt))
        assert ids == batches.prompt_ids(prompt)
        assert tok.decode(ids) == prompt  # special tokens dropped, characters fused
        assert tok.decode(tok.encode(answer) + [tok.eos_id] + tok.encode("junk")) == answer
    assert tok.encode("ADD") == tok.encode("add")
    assert HFTokenizer.from_file(str(tok_dir / "tokenizer.json")).encode("~").ids == [special_ids()[UNK]]
    with pytest.raises(ValueError, match=r"position 0: '~'"):  # the checkpoint loader names it
        tok.encode("~")


@pytest.mark.parametrize("step", [0, None])
def test_batches_are_prompt_then_answer_then_eos(tok_dir, step):
    """At the start of a run (step 0: recall alone) and past its end (None: every task): prompt,
    answer, EOS fill, with recall's problems from its curriculum and the position scaffold weighted on
    recall rows only."""
    preset = PRESETS["tiny-llada-moe"]
    batches = Batches(preset, HFTokenizer.from_file(str(tok_dir / "tokenizer.json")), seed=5)
    tok = Tokenizer(tok_dir, eos_id=preset.config.eos_id)
    replay = random.Random("train/5")  # the problems the batch drew, drawn again
    tokens, canvas, lengths, canvas_len = batches(step)
    at = preset.steps if step is None else step
    curriculum = preset.recall_curriculum
    assert tokens.shape[0] == preset.batch_size
    fills = []
    names, weights = zip(*preset.task_weights)
    alone = at < curriculum.alone  # the curriculum's first steps train recall only
    drawn = ["recall"] * preset.batch_size if alone else replay.choices(names, weights, k=preset.batch_size)
    assert batches.tasks == drawn and alone == (step == 0)
    for b, task in enumerate(drawn):
        recall = task == "recall"
        prompt, answer = sample(task, replay, heldout=False, draw=curriculum.draw(at) if recall else None)
        fill_step = at - curriculum.fill_start() if recall else at
        fill = replay.randint(1, batches.max_fill(len(answer), fill_step / preset.steps))
        start, end = len(batches.prompt_ids(prompt)), int(lengths[b])
        assert end == start + len(answer) + fill and canvas_len[b] == end - start
        assert not canvas[b, :start].any() and canvas[b, start:end].all() and not canvas[b, end:].any()
        assert tokens[b, :start].tolist() == batches.prompt_ids(prompt)
        body = tokens[b, start:end].tolist()
        assert tok.decode(body) == answer and body[len(answer) :] == [tok.eos_id] * fill
        assert batches.scaffold[b] == (curriculum.scaffold_weight(at) if recall else 0.0)
        fills.append(fill)
    # Short EOS fills at the start of a run, up to the whole canvas once the ramp is over.
    assert max(fills) <= 4 if step == 0 else max(fills) > 4
    assert batches.scaffold.max() == (1.0 if step == 0 else 0.0)
    assert batches.max_fill(10, 1.0) == preset.max_canvas - 10 and batches.max_fill(40, 1.0) == 1


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_task_weights_cover_the_suite(tok_dir, name):
    """Every task is trained (a task added to the suite without a weight fails here), at the share the
    preset gives it."""
    preset = PRESETS[name]
    weights = dict(preset.task_weights)
    assert sorted(weights) == sorted(TASKS) and len(weights) == len(preset.task_weights)
    assert all(w > 0 for w in weights.values())
    batches = Batches(preset, HFTokenizer.from_file(str(tok_dir / "tokenizer.json")), seed=1)
    tok = Tokenizer(tok_dir, eos_id=preset.config.eos_id)
    drawn = [tok.decode(row.tolist()[1:]).split(":")[0] for _ in range(8) for row in batches()[0]]
    for task, w in weights.items():
        share = w / sum(weights.values())
        n = len(drawn)  # 512 rows: the share within 4 binomial standard deviations
        assert abs(drawn.count(task) / n - share) <= 4 * (share * (1 - share) / n) ** 0.5, task


@pytest.mark.slow  # measured 30-110 s each on a 2-core CPU (.ci/run --durations)
def test_loss_is_llada_objective_and_learns(tok_dir):
    preset = dataclasses.replace(PRESETS["tiny-llada"], batch_size=8)
    batches = Batches(preset, HFTokenizer.from_file(str(tok_dir / "tokenizer.json")), seed=0)
    weights = {n: w.requires_grad_() for n, w in random_weights(preset.config, seed=0).items()}
    model = DiffusionLM(preset.config, weights, ops=ops)
    batch = batches()
    gen = torch.Generator().manual_seed(0)
    first = loss_fn(model, *batch, gen).item()
    assert first > 1.0  # random weights: about ln(vocab), the mean over each sequence's masked tokens
    opt = torch.optim.Adam(weights.values(), lr=3e-3)
    for _ in range(40):
        loss = loss_fn(model, *batch, gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        last = sum(loss_fn(model, *batch, torch.Generator().manual_seed(s)).item() for s in range(4)) / 4
    assert last < 0.5 * first


def test_loss_masks_l_of_L_canvas_tokens_weighted_L_over_l(tok_dir):
    """Each sequence gets l in 1..L of its L canvas tokens masked (nothing outside the canvas), l
    uniform over 1..L across draws, and the loss is sum over sequences of the mean cross-entropy of
    its masked tokens, / B: (L / l) / L per token (recomputed here from the masked rows)."""
    preset = dataclasses.replace(PRESETS["tiny-llada"], batch_size=16)
    batches = Batches(preset, HFTokenizer.from_file(str(tok_dir / "tokenizer.json")), seed=5)
    tokens, canvas, lengths, canvas_len = batches()
    B, T = tokens.shape
    model = DiffusionLM(preset.config, random_weights(preset.config, seed=5), ops=ops)
    L = canvas.sum(1)
    assert torch.equal(L, canvas_len.long())
    fractions = []
    for seed in range(40):
        hits = {}
        loss = loss_fn(
            model, tokens, canvas, lengths, canvas_len, torch.Generator().manual_seed(seed), hits=hits
        )
        masked = torch.zeros(B * T, dtype=torch.bool)
        masked[hits["rows"]] = True
        masked = masked.view(B, T)
        l = masked.sum(1)
        assert not (masked & ~canvas).any() and (l >= 1).all() and (l <= L).all()
        fractions += ((l - 1).float() / (L - 1).clamp(min=1).float())[L > 1].tolist()
        if seed < 2:
            inputs = torch.where(masked, torch.full_like(tokens, preset.config.mask_id), tokens)
            cache = KVCache([None] * preset.config.num_layers, [None] * preset.config.num_layers)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model.forward(
                    model.embed(inputs),
                    torch.arange(T).expand(B, T),
                    cache,
                    lengths,
                    logits_rows=hits["rows"],
                )
            ce = torch.nn.functional.cross_entropy(
                logits.float(), tokens.flatten()[hits["rows"]], reduction="none"
            )
            seq = hits["rows"] // T
            expected = sum(ce[seq == b].sum() / l[b] for b in range(B)) / B
            torch.testing.assert_close(loss, expected)
    # (l - 1) / (L - 1) is uniform on a grid over [0, 1]: mean 1/2, and both ends are drawn
    n = len(fractions)
    assert abs(sum(fractions) / n - 0.5) < 4 * (1 / 12 / n) ** 0.5
    assert min(fractions) == 0.0 and max(fractions) == 1.0


def test_training_log_counts_masked_answer_tokens_per_task(tok_dir):
    """The log's per-task tally: every masked answer token of the batch, under its own task, and
    right where the forward's argmax is the target (checked against an independent recount)."""
    preset = dataclasses.replace(PRESETS["tiny-llada-moe"], batch_size=16)
    batches = Batches(preset, HFTokenizer.from_file(str(tok_dir / "tokenizer.json")), seed=3)
    tokens, canvas, lengths, canvas_len = batches()
    model = DiffusionLM(preset.config, random_weights(preset.config, seed=3), ops=ops)
    hits, tally = {}, {task: [0, 0] for task, _ in preset.task_weights}
    loss_fn(model, tokens, canvas, lengths, canvas_len, torch.Generator().manual_seed(6), hits=hits)
    _tally(tally, batches, hits)
    B, T = tokens.shape
    masked = torch.zeros(B * T, dtype=torch.bool)
    masked[hits["rows"]] = True
    right = torch.zeros(B * T, dtype=torch.bool)
    right[hits["rows"]] = hits["hit"]
    answer = batches.answer
    assert not (answer & ~canvas).any() and (canvas & ~answer).any()  # the canvas = answer + EOS fill
    expected = {task: [0, 0] for task in tally}
    for b, task in enumerate(batches.tasks):
        rows = answer[b] & masked.view(B, T)[b]
        expected[task][0] += int((rows & right.view(B, T)[b]).sum())
        expected[task][1] += int(rows.sum())
    assert tally == expected and sum(seen for _, seen in tally.values()) > 0


def test_smoothing_inputs_are_what_inference_adds(tok_dir):
    """Self-conditioning batches: masked rows get w * softmax(z) @ E with z the logits of the same
    input and w in the smoothing schedule's range (one w per sequence); other rows get nothing."""
    preset = dataclasses.replace(PRESETS["tiny-llada-moe"], batch_size=4)
    tokens, canvas, lengths, canvas_len = Batches(
        preset, HFTokenizer.from_file(str(tok_dir / "tokenizer.json")), 1
    )()
    model = DiffusionLM(preset.config, random_weights(preset.config, seed=1), ops=ops)
    B, T = tokens.shape
    masked = canvas & (torch.rand(B, T, generator=torch.Generator().manual_seed(2)) < 0.5)
    inputs = torch.where(masked, torch.full_like(tokens, preset.config.mask_id), tokens)
    emb, positions = model.embed(inputs), torch.arange(T).expand(B, T)
    rows = masked.flatten().nonzero().flatten()
    cache = KVCache([None] * preset.config.num_layers, [None] * preset.config.num_layers)
    add = _smoothing_inputs(model, emb, positions, lengths, rows, cache, torch.Generator().manual_seed(3))
    assert add.view(B * T, -1)[~masked.flatten()].abs().max() == 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = model.forward(emb, positions, cache, lengths, logits_rows=rows)
    expected = (torch.softmax(z.float(), -1) @ model.embedding.float()).view(-1)
    got = add.view(B * T, -1)[rows].view(-1)
    seq = rows.repeat_interleave(add.shape[-1]) // T
    for b in masked.any(1).nonzero().flatten().tolist():
        w = (got[seq == b] @ expected[seq == b]) / (expected[seq == b] @ expected[seq == b])
        assert SOFT_WEIGHT[0] <= w <= SOFT_WEIGHT[1]
        torch.testing.assert_close(got[seq == b], w * expected[seq == b], rtol=1e-4, atol=1e-6)
    weights = {n: t.requires_grad_() for n, t in model.w.items()}
    hard = loss_fn(model, tokens, canvas, lengths, canvas_len, torch.Generator().manual_seed(4))
    soft = loss_fn(model, tokens, canvas, lengths, canvas_len, torch.Generator().manual_seed(4), soft=True)
    soft.backward()
    assert soft.item() != hard.item() and weights["embed"].grad.abs().sum() > 0


def test_init_is_torchs_default():
    """Embeddings N(0, 1), matrices N(0, 1 / (3 fan_in)), norms at 1."""
    preset = PRESETS["tiny-llada-moe"]
    weights = init_weights(preset, torch.Generator().manual_seed(0))
    assert weights.keys() == expected_shapes(preset.config).keys()
    for name, w in weights.items():
        if name.endswith("norm"):
            assert torch.equal(w, torch.ones_like(w)), name
        else:
            std = 1.0 if name == "embed" else (3 * w.shape[-1]) ** -0.5
            assert abs(w.std().item() / std - 1) < 0.1 and abs(w.mean().item()) < 0.1 * std, name


@pytest.mark.slow  # measured 30-110 s each on a 2-core CPU (.ci/run --durations)
def test_train_is_reproducible_and_loadable(tmp_path):
    records = [train("tiny-llada", tmp_path / run, steps=2, seed=7, log=lambda _: None) for run in "ab"]
    assert records[0]["steps"] == 2 and records[0]["model"] == "tiny-llada"
    assert (
        records[0]["recall_curriculum"]["scaffold_gone"]
        == PRESETS["tiny-llada"].recall_curriculum.scaffold_gone
    )
    # the position scaffold is training-only: the checkpoint holds exactly the released layout's tensors
    save_checkpoint(
        tmp_path / "layout", PRESETS["tiny-llada"].config, random_weights(PRESETS["tiny-llada"].config)
    )
    with (
        safe_open(tmp_path / "a" / "model.safetensors", "pt") as got,
        safe_open(tmp_path / "layout" / "model.safetensors", "pt") as layout,
    ):
        assert set(got.keys()) == set(layout.keys())
    assert filecmp.cmp(
        tmp_path / "a" / "model.safetensors", tmp_path / "b" / "model.safetensors", shallow=False
    )
    assert json.loads((tmp_path / "a" / "training.json").read_text())["seed"] == 7
    llm = LLM(tmp_path / "a", device="cpu")
    assert llm.defaults == {"gen_length": 32, "block_length": 8}  # from generation_config.json
    out = llm.generate(["add:12+34"])
    assert len(out.token_ids) == 1 and out.stats["forwards"] >= 1


def test_train_errors(tmp_path):
    with pytest.raises(ValueError, match="model"):
        train("big-llada", tmp_path)
    with pytest.raises(ValueError, match="steps"):
        train("tiny-llada", tmp_path, steps=0)
