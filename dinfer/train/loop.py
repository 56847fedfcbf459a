"""Training one embedded model with LLaDA's objective, on the synthetic task suite.

Each sequence is `<|bos|>` prompt `<|assistant|>` answer `<|endoftext|>`... : a canvas of the answer
followed by EOS up to a random length (so the model learns where answers end, for any gen_length up
to the preset's max_canvas). The prompt stays clean. The loss is LLaDA's bound in the paper's
lower-variance form: l ~ U{1..L} of a sequence's L canvas tokens are masked, drawn without
replacement, and the cross-entropy on them is weighted by L / l and divided by L. A fraction of the batches
(`soft_fraction`) also sees what iteration smoothing feeds a model at inference: each masked row's
input gets w * softmax(z) @ E added, z from a no-grad forward of the same input and w drawn from the
smoothing schedule's range (self-conditioning). A preset with a block_length trains with the
block-diffusion objective instead (block.py, `block_loss_fn`): the same prompts and answers on canvases
that end on a block boundary (the last block whole, as the engine decodes it), each block noised on
its own under block-causal attention, and with the preset's edit_fraction also LLaDA2.1's
token-to-token noise (random tokens among the visible ones, which the loss then reads too). Everything is drawn from
seeded generators, so a run is reproducible for a given seed, step count and torch build.
"""

import dataclasses
import functools
import json
import math
import os
import random
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from ..batch import blocks_end
from ..decoders import SMOOTHING_WEIGHT
from ..models.checkpoint import expected_shapes, save_checkpoint
from ..models.transformer import DiffusionLM, KVCache
from ..tasks import sample
from . import ops
from .block import corrupt_blocks, mask_blocks, two_copy_layout
from .presets import BLOCK_LENGTH, GEN_LENGTH, PRESETS, TrainPreset
from .tokenizer import ASSISTANT, BOS, EOS, save_tokenizer, special_ids, vocab_size

SOFT_WEIGHT = (SMOOTHING_WEIGHT[0], SMOOTHING_WEIGHT[2])  # the range of w_n at inference
# The token-to-token loss's weight on each visible candidate (corrupted or kept), against L / l on a
# masked one (both / L_seq): a block's visible candidates then weigh L - l in all, its masked ones L,
# so the edit loss is at most the [MASK] loss and about half of it on average (l ~ U{1..L}).
EDIT_WEIGHT = 1.0


def init_weights(preset: TrainPreset, gen: torch.Generator) -> Dict[str, torch.Tensor]:
    """torch's default init: norms at 1, embeddings N(0, 1), every other matrix N(0, 1 / (3 fan_in))
    (the variance of nn.Linear's uniform). At N(0, 0.02^2) the recall lookup did not form even with
    the position scaffold (docs/training.md, recall probes rounds 7-8). Expert biases start at 0 and
    take no gradient (they only choose experts; `_balance` moves them)."""
    weights = {}
    for name, shape in expected_shapes(preset.config).items():
        if name.endswith("expert_bias"):
            weights[name] = torch.zeros(shape)
            continue
        if name.endswith("norm"):
            w = torch.ones(shape)
        elif name == "embed":
            w = torch.randn(shape, generator=gen)
        else:
            w = torch.randn(shape, generator=gen) / math.sqrt(3 * shape[-1])  # [..., out, in]
        weights[name] = w.requires_grad_()
    return weights


class Batches:
    """Token batches of training problems over a run of `steps` steps: recall alone for the first
    steps of its curriculum, then tasks drawn by the preset's task_weights; recall's problems are
    drawn by its curriculum."""

    def __init__(self, preset: TrainPreset, tokenizer, seed: int, steps: int = None):
        self.preset, self.tok = preset, tokenizer
        self.steps = preset.steps if steps is None else steps
        self.rng = random.Random(f"train/{seed}")
        ids = special_ids()
        self.bos, self.sep = ids[BOS], ids[ASSISTANT]
        self.eos = preset.config.eos_id

    def prompt_ids(self, prompt: str) -> List[int]:
        """What the chat template + tokenizer give for `prompt` (tests check they agree)."""
        return [self.bos] + self.tok.encode(prompt).ids + [self.sep]

    def __call__(self, step: int = None):
        """(tokens [B, T], canvas [B, T] bool, lengths [B] int32, canvas length [B]) at `step` of the
        run (None: past its end). Sequences are padded to T with EOS that nothing attends to and no
        loss reads. Also sets `tasks` (each row's task), `answer` ([B, T], the answer tokens) and
        `scaffold` ([B], the weight of the position table in each row's inputs)."""
        step = self.steps if step is None else step
        curriculum = self.preset.recall_curriculum
        recall_draw, recall_scaffold = curriculum.draw(step), curriculum.scaffold_weight(step)
        rows, starts, answer_lens, scaffold = [], [], [], []
        tasks, weights = zip(*self.preset.task_weights)
        if step < curriculum.alone:
            self.tasks = ["recall"] * self.preset.batch_size
        else:
            self.tasks = self.rng.choices(tasks, weights, k=self.preset.batch_size)
        for task in self.tasks:
            recall = task == "recall"
            prompt, answer = sample(task, self.rng, heldout=False, draw=recall_draw if recall else None)
            p, a = self.prompt_ids(prompt), self.tok.encode(answer).ids
            if self.preset.block_length:
                if recall and step < curriculum.fill_start():
                    # short fills while recall's lookup forms, as under LLaDA's objective: with the
                    # block fills from step 0 it had not formed by the scaffold's end (docs/training.md)
                    fill = self.rng.randint(1, 4)
                else:
                    fill = self.rng.choice(self.block_fills(len(p), len(a)))
            else:
                fill_step = step - curriculum.fill_start() if recall else step
                fill = self.rng.randint(1, self.max_fill(len(a), fill_step / self.steps))
            rows.append(p + a + [self.eos] * fill)
            starts.append(len(p))
            answer_lens.append(len(a))
            scaffold.append(recall_scaffold if recall else 0.0)
        T = max(len(r) for r in rows)
        tokens = torch.tensor([r + [self.eos] * (T - len(r)) for r in rows])
        start, length = torch.tensor(starts), torch.tensor([len(r) for r in rows])
        pos = torch.arange(T)[None, :]
        canvas = (pos >= start[:, None]) & (pos < length[:, None])
        self.answer = (pos >= start[:, None]) & (pos < (start + torch.tensor(answer_lens))[:, None])
        self.scaffold = torch.tensor(scaffold)
        return tokens, canvas, length.to(torch.int32), (length - start).float()

    def max_fill(self, answer_len: int, progress: float) -> int:
        """EOS after the answer: up to the full canvas (max_canvas) from `fill_ramp` of the run on,
        fewer before. Long runs of [MASK] slow down learning to read the prompt several-fold, so
        the model first learns the tasks on short canvases, then where answers end on long ones."""
        full = max(self.preset.max_canvas - answer_len, 1)
        ramp = min(max(progress, 0.0) / self.preset.fill_ramp, 1.0) if self.preset.fill_ramp > 0 else 1.0
        return max(1, round(min(4, full) + ramp * (full - min(4, full))))

    def block_fills(self, prompt_len: int, answer_len: int) -> List[int]:
        """The EOS fills after the answer under the block-diffusion objective, one of which a row
        draws: each ends the sequence on a block boundary (on the grid from position 0) past the
        first EOS and at most at the end of the canvas the engine decodes for GEN_LENGTH
        (dinfer.batch.blocks_end, aligned blocks): the canvases of every gen_length up to the
        default that hold the answer and its EOS, last block whole, its tail EOS (the reference
        canvas's [MASK] tail, decoded). A block sees only itself and the blocks before it, so the
        fills teach the EOS that ends an answer and, when the canvas reaches past the answer's
        block, a block of EOS after it."""
        bl = self.preset.block_length
        first_eos = prompt_len + answer_len
        first_end = first_eos // bl * bl + bl  # the first boundary past the first EOS
        last_end = max(blocks_end(prompt_len, GEN_LENGTH, bl, True), first_end)
        return [end - first_eos for end in range(first_end, last_end + 1, bl)]


def loss_fn(
    model: DiffusionLM,
    tokens,
    canvas,
    lengths,
    canvas_len,
    gen: torch.Generator,
    soft: bool = False,
    hits: dict = None,
    scaffold: torch.Tensor = None,
    loads: list = None,
    bf16: bool = True,
):
    """LLaDA's SFT loss of one batch; `hits`, if given, gets the flat indices of the masked rows
    ("rows") and whether each one's argmax is right ("hit"); `scaffold` ([B, T, H]), if given, is
    added to the input embeddings (the curriculum's position table); `loads`, if given, gets the
    loss forward's expert load of each MoE layer (ops.expert_loads); `bf16`: the forwards under bf16
    autocast (`_mixed`)."""
    B, T = tokens.shape
    c = model.config
    # The per-token form (mask each token with p ~ U(0, 1), weight 1/p) estimates the same bound, but
    # a sequence masked at small p weighs up to 1000x the rest, and on recall that noise kept the
    # key lookup from forming at all (docs/training.md, recall probes round 9). Here no weight exceeds L.
    # l is stratified over the batch (one uniform shifted by b / B), as t was.
    L = canvas_len.long()
    u = (torch.rand(1, generator=gen) + torch.arange(B) / B) % 1
    l = torch.minimum((u * L).long() + 1, L)
    score = torch.rand(B, T, generator=gen).masked_fill(~canvas, 2.0)  # non-canvas rows sort last
    masked = canvas & (score.argsort(1).argsort(1) < l[:, None])
    inputs = torch.where(masked, torch.full_like(tokens, c.mask_id), tokens)
    positions = torch.arange(T).expand(B, T)
    rows = masked.flatten().nonzero().flatten()
    valid = (positions < lengths[:, None]).flatten().nonzero().flatten()
    no_cache = KVCache([None] * c.num_layers, [None] * c.num_layers)
    emb = model.embed(inputs)
    if scaffold is not None:
        emb = emb + scaffold
    if soft:
        emb = emb + _smoothing_inputs(model, emb, positions, lengths, rows, no_cache, gen, valid, bf16=bf16)
    with _mixed(bf16), ops.expert_loads(loads):
        logits = model.forward(emb, positions, no_cache, lengths, logits_rows=rows, ffn_rows=valid)
    ce = F.cross_entropy(logits.float(), tokens.flatten()[rows], reduction="none")
    if hits is not None:
        hits.update(rows=rows, hit=logits.argmax(-1) == tokens.flatten()[rows])
    weight = (1 / l.float())[:, None].expand(B, T).flatten()[rows]  # (L / l) / L
    return (ce * weight).sum() / B


def block_loss_fn(
    model: DiffusionLM,
    tokens,
    canvas,
    lengths,
    canvas_len,
    gen: torch.Generator,
    block_length: int,
    soft: bool = False,
    hits: dict = None,
    scaffold: Callable[[torch.Tensor], torch.Tensor] = None,
    loads: list = None,
    edit_fraction: float = 0.0,
    noise_ids: torch.Tensor = None,
    bf16: bool = True,
):
    """The block-diffusion loss of one batch (block.py): every canvas block noised on its own (l of
    its L canvas tokens masked, weight L / l), all blocks in one forward of the two-copy layout under
    its block-causal mask, cross-entropy on the masked noisy tokens; each sequence's sum is divided by
    its canvas length L_seq and the batch's by B, so a token's weight is (L / l) / L_seq, as in
    `loss_fn`. With edit_fraction > 0, LLaDA2.1's token-to-token objective too (block.corrupt_blocks:
    a share p ~ U(0, edit_fraction) of each block's visible candidates replaced by random tokens from
    `noise_ids`), and the loss also reads every visible candidate, corrupted or kept, target its true
    token, at weight EDIT_WEIGHT / L_seq. `hits`, if given, gets the masked rows as flat indices into
    the batch's [B, T] tokens and whether each one's argmax is right, and under the edit noise
    "corrupted" and "kept", the same for the visible candidates; `scaffold`, if given, maps the
    layout's positions [B, W] to what is added to its input embeddings [B, W, H] (the curriculum's
    position table); `loads`, if given, gets the loss forward's expert load of each MoE layer
    (ops.expert_loads); `bf16` as in `loss_fn`."""
    B, T = tokens.shape
    c = model.config
    layout = two_copy_layout(tokens, canvas, lengths, block_length, c.pad_id)
    masked, block_weight = mask_blocks(layout, block_length, gen)
    W = layout.tokens.shape[1]
    inputs = torch.where(masked, torch.full_like(layout.tokens, c.mask_id), layout.tokens)
    read, weight = masked, block_weight  # the columns the loss reads, and their weights
    if edit_fraction > 0:
        corrupted, inputs = corrupt_blocks(layout, masked, block_length, edit_fraction, noise_ids, gen)
        inputs = torch.where(masked, c.mask_id, inputs)
        visible = layout.candidates & ~masked
        read = masked | visible
        weight = torch.where(visible, EDIT_WEIGHT, block_weight)
    rows = masked.flatten().nonzero().flatten()  # what iteration smoothing adds to: the [MASK] rows
    loss_rows = read.flatten().nonzero().flatten()
    valid = layout.valid.flatten().nonzero().flatten()
    no_cache = KVCache([None] * c.num_layers, [None] * c.num_layers)
    emb = model.embed(inputs)
    if scaffold is not None:
        emb = emb + scaffold(layout.positions)
    forward = dict(attn_mask=layout.mask)
    if soft:
        emb = emb + _smoothing_inputs(
            model, emb, layout.positions, layout.widths, rows, no_cache, gen, valid, bf16=bf16, **forward
        )
    with _mixed(bf16), ops.expert_loads(loads):
        logits = model.forward(
            emb, layout.positions, no_cache, layout.widths, logits_rows=loss_rows, ffn_rows=valid, **forward
        )
    target = layout.tokens.flatten()[loss_rows]
    ce = F.cross_entropy(logits.float(), target, reduction="none")
    if hits is not None:
        batch_rows = (loss_rows // W) * T + layout.positions.flatten()[loss_rows]  # into [B, T]
        hit = logits.argmax(-1) == target

        def found(columns):
            pick = columns.flatten()[loss_rows]
            return dict(rows=batch_rows[pick], hit=hit[pick])

        hits.update(found(masked))
        if edit_fraction > 0:
            hits.update(corrupted=found(corrupted), kept=found(visible & ~corrupted))
    w = (weight / canvas_len[:, None]).flatten()[loss_rows]
    return (ce * w).sum() / B


def _smoothing_inputs(
    model: DiffusionLM, emb, positions, lengths, rows, cache, gen, ffn_rows=None, attn_mask=None, bf16=True
) -> torch.Tensor:
    """[B, T, H]: w * softmax(z) @ E on the masked rows `rows` (zero elsewhere), the term iteration
    smoothing adds to the [MASK] embedding, from a no-grad forward of the same input (MLPs on
    `ffn_rows` only and attention under `attn_mask`, as in the loss's forward)."""
    B, T, H = emb.shape
    with torch.no_grad(), _mixed(bf16):
        z = model.forward(
            emb, positions, cache, lengths, logits_rows=rows, ffn_rows=ffn_rows, attn_mask=attn_mask
        )
    lo, hi = SOFT_WEIGHT
    w = (lo + (hi - lo) * torch.rand(B, generator=gen)).repeat_interleave(T)[rows]
    expected = torch.softmax(z.float(), -1) @ model.embedding.detach().float()
    add = torch.zeros(B * T, H, dtype=emb.dtype)
    add[rows] = (w[:, None] * expected).to(emb.dtype)
    return add.view(B, T, H)


def train(
    name: str,
    out,
    steps: int = None,
    seed: int = 0,
    save_every: int = 250,
    log: Callable[[str], None] = functools.partial(print, flush=True),
    bf16: bool = True,
) -> dict:
    """Train preset `name` and write its checkpoint folder `out`; returns the training record.
    `bf16`: the forwards under bf16 autocast (`_mixed`), as the shipped models were trained."""
    if name not in PRESETS:
        raise ValueError(f"model: expected one of {', '.join(PRESETS)}, got {name!r}")
    preset = PRESETS[name]
    steps = preset.steps if steps is None else steps
    if steps < 1:
        raise ValueError(f"steps: must be >= 1, got {steps}")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    out = os.fspath(out)
    save_tokenizer(out)
    batches = Batches(preset, Tokenizer.from_file(os.path.join(out, "tokenizer.json")), seed, steps)
    weights = init_weights(preset, gen)
    model = DiffusionLM(preset.config, weights, ops=ops)
    # recall's training-only position table (curriculum.py), at the embeddings' scale; never saved
    table = torch.randn(
        preset.config.max_positions, preset.config.hidden_size, generator=gen
    ).requires_grad_()
    trained = {n: w for n, w in weights.items() if w.requires_grad}  # not the expert biases
    decay = [w for n, w in trained.items() if w.dim() >= 2 and n != "embed"]
    rest = [w for n, w in trained.items() if not (w.dim() >= 2 and n != "embed")] + [table]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": preset.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=preset.lr,
        betas=(0.9, 0.98),
    )
    lr_sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, steps, preset.warmup))
    t0, running = time.perf_counter(), None
    tally = {task: [0, 0] for task, _ in preset.task_weights}  # masked answer tokens: right, seen
    # under the token-to-token noise, the visible answer tokens: corrupted ones rewritten right, kept ones kept
    kinds = ("corrupted", "kept") if preset.edit_fraction > 0 else ()
    edit_tally = {kind: {task: [0, 0] for task in tally} for kind in kinds}
    noise_ids = torch.tensor(_noise_ids())
    biases = [weights[n] for n in weights if n.endswith("expert_bias")]  # one per MoE layer, in order
    load_sum = torch.zeros(len(biases), preset.config.num_experts)  # expert load since the last log
    for step in range(steps):
        soft = preset.soft_fraction > 0 and torch.rand(1, generator=gen).item() < preset.soft_fraction
        hits = {}
        batch = batches(step)
        scaffold = None  # the position table's share of each row's inputs, while any row has one
        loads = [] if biases else None  # the expert load of the step's forward, for the balancing
        if preset.block_length:
            if batches.scaffold.any():  # the layout's columns at their absolute positions
                scaffold = functools.partial(_position_table, table, batches.scaffold)
            loss = block_loss_fn(
                model,
                *batch,
                gen,
                preset.block_length,
                soft=soft,
                hits=hits,
                scaffold=scaffold,
                loads=loads,
                edit_fraction=preset.edit_fraction,
                noise_ids=noise_ids,
                bf16=bf16,
            )
        else:
            if batches.scaffold.any():
                scaffold = batches.scaffold[:, None, None] * table[None, : batch[0].shape[1]]
            loss = loss_fn(
                model, *batch, gen, soft=soft, hits=hits, scaffold=scaffold, loads=loads, bf16=bf16
            )
        _tally(tally, batches, hits)
        for kind in edit_tally:
            _tally(edit_tally[kind], batches, hits[kind])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(weights.values()) + [table], 1.0)
        opt.step()
        lr_sched.step()
        if loads is not None:
            load = torch.stack(loads).float()  # [MoE layers, E], this step's main forward
            load_sum += load
            _balance(biases, load, preset.expert_bias_update)
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if (step + 1) % 100 == 0 or step + 1 == steps:
            accuracy = _accuracy(tally)
            for kind, counts in edit_tally.items():
                accuracy += f" | {kind} answer tokens right: {_accuracy(counts)}"
            balance = ""
            if biases:  # per MoE layer: the busiest expert's load over the mean
                peak = load_sum.max(1).values / load_sum.mean(1).clamp(min=1)
                balance = " | expert load max/mean: " + " ".join(f"{p:.2f}" for p in peak.tolist())
                load_sum.zero_()
            log(
                f"{name} step {step + 1}/{steps} loss {running:.4f} | masked answer tokens right: {accuracy}"
                f"{balance} ({time.perf_counter() - t0:.0f} s)"
            )
            tally = {task: [0, 0] for task in tally}
            edit_tally = {kind: {task: [0, 0] for task in tally} for kind in edit_tally}
        if (step + 1) % save_every == 0 or step + 1 == steps:  # a usable checkpoint while training runs
            record = {
                "model": name,
                "seed": seed,
                "steps": step + 1,
                "of_steps": steps,
                "batch_size": preset.batch_size,
                "lr": preset.lr,
                "soft_fraction": preset.soft_fraction,
                "task_weights": dict(preset.task_weights),
                "recall_curriculum": dataclasses.asdict(preset.recall_curriculum),
                "final_loss": round(running, 4),
                "train_seconds": round(time.perf_counter() - t0, 1),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "precision": "bf16 autocast" if bf16 else "fp32",
            }
            if preset.block_length:
                record.update(
                    objective="block diffusion",
                    block_length=preset.block_length,
                    expert_bias_update=preset.expert_bias_update,
                    last_block="whole",
                    edit_fraction=preset.edit_fraction,
                    edit_weight=EDIT_WEIGHT,
                )
            _save(out, preset, weights, record)
    return record


def _tally(tally: dict, batches: Batches, hits: dict) -> None:
    """Adds one batch's masked answer tokens (right, seen) to each task's count in `tally`: which
    tasks are learning, read from the forward the step runs anyway."""
    answer = batches.answer.flatten()[hits["rows"]]
    seq = (hits["rows"] // batches.answer.shape[1])[answer].tolist()
    for b, hit in zip(seq, hits["hit"][answer].tolist()):
        tally[batches.tasks[b]][0] += hit
        tally[batches.tasks[b]][1] += 1


def _mixed(bf16: bool):
    """The training forwards' precision: bf16 autocast (master weights and the loss stay fp32), where
    the host's bf16 GEMMs are ~4x its fp32 ones (the shipped models' hosts); fp32 where the CPU has no
    bf16 instructions (AVX2 only: bf16 GEMMs ~30x slower than fp32 ones)."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)


def _accuracy(tally: dict) -> str:
    return " ".join(f"{t} {right / max(seen, 1):.2f}" for t, (right, seen) in tally.items())


def _noise_ids() -> List[int]:
    """The tokens the token-to-token noise writes: every token a decoder may commit (EOS and the
    tasks' tokens), not [MASK] nor the chat template's markers."""
    ids = special_ids()
    special = set(ids.values()) - {ids[EOS]}
    return [i for i in range(vocab_size()) if i not in special]


def _position_table(table: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B, W, H]: the position table's rows at `positions` [B, W], times each row's weight [B]."""
    return weight[:, None, None] * table[positions]


def _balance(biases: List[torch.Tensor], load: torch.Tensor, rate: float) -> None:
    """Aux-loss-free load balancing (DeepSeek-V3's, LLaDA2's expert bias): each MoE layer's bias
    [E] moves by `rate` towards balanced load, bias_e += rate * sign(mean load - load_e); `load`
    [layers, E] counts the tokens that chose each expert in the step's forward."""
    with torch.no_grad():
        for bias, n in zip(biases, load):
            bias += rate * torch.sign(n.mean() - n)


def _lr_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warm-up, then a cosine from 1 down to 0.1 at the last step."""
    return min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))


def _save(out: str, preset: TrainPreset, weights, record: dict) -> None:
    c = preset.config
    # bf16 weights; the expert bias in fp32, as the LLaDA2 release stores it (a bf16 bias would move
    # near-ties of the routing away from what training chose)
    tensors = {
        n: w.detach().to(torch.float32 if n.endswith("expert_bias") else torch.bfloat16)
        for n, w in weights.items()
    }
    save_checkpoint(out, c, tensors)
    with open(os.path.join(out, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(
            {
                "max_new_tokens": GEN_LENGTH,
                "block_length": preset.block_length or BLOCK_LENGTH,
                "eos_token_id": c.eos_id,
                "pad_token_id": c.pad_id,
                "mask_token_id": c.mask_id,
            },
            f,
            indent=2,
        )
    with open(os.path.join(out, "training.json"), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
