"""The diffusion generation loop: blocks, cache refreshes, window steps, decoding, smoothing.

    until every prompt is finished (dinfer.scheduler: the queue, refills, early stop, the answers):
        schedule: up to `batch_size` sequences in flight; a finished one's slot goes to the next prompt
        run the round: every sequence in flight decodes its own next block
            repeat until the block holds no [MASK] (one host check per chunk of <= `unroll` iterations):
                compact: sequences whose block is done leave the block's remaining iterations
                iteration: forward (a full refresh at the block's start, else the cache mode's window)
                           + decode_step on the block's rows (+ soft embeddings for the next forward)
        postprocess: a sequence whose block holds EOS is finished (early stop), the rest of it EOS;
        so is one whose last block is done

Every iteration is one model forward and one decode_step. Commits, thresholds, schedules and the
stop test stay on the device, so a chunk's iterations run back to back (one CUDA graph on a GPU).
All state an iteration writes is updated in place, which is what lets a captured chunk replay.

Every generation ends: decode_step commits at least one [MASK] of every block that holds one, whatever
the logits (its step 5), so a block takes at most block_length forwards -- checked at each chunk's
host sync as an internal invariant. The same sync reads the forward at which a request's logits first
held a NaN or +-inf (decode_step flags them; the flags accumulate on the device) and stops the run
with NonFiniteLogitsError, at most `unroll` forwards after it happened.

Sampling (temperature > 0) keys each row's noise on its request (a hash of the prompt), its absolute
position and that request's own iteration count, never on its slot in the batch: a seeded prompt
samples the same tokens alone, anywhere in a batch, with any batch_size. Copies of one prompt in a run
are told apart by their rank among the copies (the first samples as it would alone), so n copies
give n samples.
"""

import copy
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

import dinfer_kernels as dk
from dinfer_kernels.reference import rng

from .batch import CACHE_MODES, Batch, make_batch, window
from .decoders import Decoder, DecoderConfig
from .graphs import StepGraphs
from .params import Bool, Instance, Int, OneOf, Real, Tuple, check, check_memory
from .scheduler import Round, Scheduler
from .stats import Stats

SMOOTHING_WEIGHT = (0.15, 0.02, 0.3)  # dInfer's w_n = min(w0 + dw * n, w_max)


class NonFiniteLogitsError(RuntimeError):
    """The model produced NaN or +-inf logits: broken weights, or activations that overflow their
    dtype. Nothing decoded from them means anything, so generation stops."""


@dataclass(frozen=True)
class GenerationConfig:
    gen_length: int = 1024
    block_length: int = 64  # capped to gen_length
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    cache: str = "vicinity"  # none | prefix | dual | vicinity
    prefix_look: int = 16  # vicinity window: [block - prefix_look, block + after_look)
    after_look: int = 16
    warmup_steps: int = 0  # the request's first N iterations are full refreshes (dInfer: 4)
    refresh_every: int = 0  # also refresh every k iterations of a block (0: at block starts)
    write_back: bool = True  # window steps write their fresh K/V into the cache (dInfer: no)
    smoothing: bool = False  # iteration smoothing: soft embeddings of the block's masked rows
    smoothing_weight: tuple = SMOOTHING_WEIGHT
    # The threshold warm-up that comes with smoothing: tau_n = max(start - decay * n, tau). dInfer's
    # (1.0, 0.02) spends a request's first ~5 forwards above tau = 0.9, most of a short request;
    # start <= tau turns the warm-up off.
    smoothing_threshold_start: float = 1.0
    smoothing_threshold_decay: float = 0.02
    unroll: int = 4  # iterations per host check
    expected_tpf: int = 8  # chunk size = clamp(masked // expected_tpf, 1, unroll), as dInfer
    early_stop: bool = True
    compact: bool = True  # a sequence whose block is done skips the block's remaining forwards
    align_blocks: bool = True  # dInfer's start_block_align; False: block 0 starts after the prompt
    cuda_graphs: bool = True
    time_phases: bool = False  # synchronise around phases to time them (always on the host)

    def __post_init__(self):  # the rules of every field (dinfer.params)
        n, count, unit, flag = Int(1), Int(0), Real(0.0, 1.0), Bool()
        check(
            self,
            dict(
                gen_length=n,
                block_length=n,
                decoder=Instance(DecoderConfig, "a DecoderConfig"),
                cache=OneOf(CACHE_MODES),
                prefix_look=count,
                after_look=count,
                warmup_steps=count,
                refresh_every=count,
                write_back=flag,
                smoothing=flag,
                # w_n = min(w0 + dw * n, w_max) mixes hard and soft embeddings: a weight in [0, 1]
                smoothing_weight=Tuple((unit, Real(0.0), unit)),
                smoothing_threshold_start=unit,
                smoothing_threshold_decay=Real(0.0),
                unroll=n,
                expected_tpf=n,
                early_stop=flag,
                compact=flag,
                align_blocks=flag,
                cuda_graphs=flag,
                time_phases=flag,
            ),
        )
        # A block longer than the answer would only decode padding rows (8x slower at 1000 for 32
        # tokens): one block then covers the answer, as dInfer's block_length = gen_length runs do.
        object.__setattr__(self, "block_length", min(self.block_length, self.gen_length))


class BlockState:
    """What the iterations of one block read and write. Tensors keep their addresses all block long."""

    def __init__(self, sched: Scheduler, rnd: Round, cfg: GenerationConfig, model, cache, request_keys):
        """The round `rnd` of `sched`: its sequences' tokens and counters, taken from the run's."""
        c = model.config
        dev = sched.batch.x.device
        self.prompts, self.rows = rnd.prompts, rnd.prompts.to(dev)  # host and device indices
        self.batch = batch = sched.batch.select(self.rows, trim=True)
        B, bl, S = batch.size, batch.block_length, batch.max_len
        k = rnd.blocks.to(dev)
        # The round's cache: the head of each slot buffer seen as [B, S, Hkv, D], contiguous. What a
        # block leaves there is never read again (every block starts with a refresh).
        self.cache = type(cache)([_head(t, B, S) for t in cache.keys], [_head(t, B, S) for t in cache.values])
        pos = batch.block_positions(k)
        # Rows past a sequence's end are padding: they read a non-mask token and are never written.
        self.valid = pos < batch.total_len[:, None].to(torch.int64)
        self.block_pos = pos.clamp(max=S - 1)
        # A block-causal model's rows see keys up to the end of the block being decoded, never the
        # masked blocks after it; a bidirectional model's see the whole sequence.
        ends = (pos[:, -1] + 1).clamp(max=batch.total_len.to(torch.int64)).to(torch.int32)
        self.seq_lens = ends if c.block_causal else batch.total_len
        self.pad_token = torch.full((B, bl), c.eos_id, dtype=torch.int64, device=dev)
        self.window_lo, self.window_len = window(batch, k, cfg.cache, cfg.prefix_look, cfg.after_look)
        self.iters = sched.iters[self.rows]  # [B] iterations each sequence was active (schedules)
        self.request_keys = request_keys[self.rows]  # [B] sampling keys (rng.sequence_key)
        # [B] the request's forward (its own count, from 1) whose logits first held a NaN or +-inf
        # in a valid row of this block; -1: none yet.
        self.nonfinite_at = torch.full((B,), -1, dtype=torch.int64, device=dev)
        warmup = (cfg.smoothing_threshold_start, cfg.smoothing_threshold_decay) if cfg.smoothing else None
        self.decoder = Decoder(cfg.decoder, B, bl, c.mask_id, dev, warmup)
        self.decoder.start_block(self.block_tokens().view(B, bl))
        self.soft = model.embed(self.block_tokens())  # hard embeddings until the block has logits

    def block_tokens(self) -> torch.Tensor:
        return torch.where(self.valid, self.batch.x.gather(1, self.block_pos), self.pad_token).flatten()

    def store_block_tokens(self, tokens: torch.Tensor):
        cur = self.batch.x.gather(1, self.block_pos)
        self.batch.x.scatter_(1, self.block_pos, torch.where(self.valid, tokens.view(cur.shape), cur))

    def poll(self, mask_id):
        """([B] [MASK] tokens left in each sequence's block, [B] nonfinite_at) on the host: one
        sync, once per chunk."""
        left = (self.block_tokens().view(self.batch.size, -1) == mask_id).sum(1)
        both = torch.stack([left, self.nonfinite_at]).cpu()
        return both[0], both[1]

    def select(self, keep: torch.Tensor) -> "BlockState":
        """The state of sequences `keep` (host indices) only. Their cache rows are copied: nothing a
        block's iterations write into the cache is read after the block, whose successor starts with
        a refresh."""
        new = copy.copy(self)
        bl = self.batch.block_length
        new.prompts, keep = self.prompts[keep], keep.to(self.rows.device)
        new.rows, new.batch = self.rows[keep], self.batch.select(keep)
        new.cache = type(self.cache)([t[keep] for t in self.cache.keys], [t[keep] for t in self.cache.values])
        new.valid, new.block_pos, new.pad_token = self.valid[keep], self.block_pos[keep], self.pad_token[keep]
        new.window_lo, new.iters, new.seq_lens = self.window_lo[keep], self.iters[keep], self.seq_lens[keep]
        new.request_keys, new.nonfinite_at = self.request_keys[keep], self.nonfinite_at[keep]
        new.decoder = self.decoder.select(keep)
        new.soft = self.soft.view(self.batch.size, bl, -1)[keep].flatten(0, 1)
        return new


def request_keys_of(prompts: List[List[int]]) -> List[int]:
    """The sampling key of each prompt: its content (rng.sequence_key) and its rank among the earlier
    copies of the same prompt in the run."""
    seen: dict = {}
    keys = []
    for p in prompts:
        ids = tuple(int(t) for t in p)
        keys.append(rng.sequence_key(ids, seen.get(ids, 0)))
        seen[ids] = seen.get(ids, 0) + 1
    return keys


def _head(buffer: torch.Tensor, B: int, S: int) -> torch.Tensor:
    return buffer.view(-1)[: B * S * buffer[0, 0].numel()].view(B, S, *buffer.shape[2:])


class Generator:
    """Runs a GenerationConfig on a model (dinfer.models.DiffusionLM) for a batch of prompts."""

    def __init__(self, model, cfg: GenerationConfig):
        if model.config.block_causal:
            _check_block_causal(cfg)
        self.model, self.cfg = model, cfg
        self.mask_id, self.eos_id = model.config.mask_id, model.config.eos_id
        use_graphs = cfg.cuda_graphs and model.device.type == "cuda" and cfg.decoder.temperature == 0
        self.graphs = StepGraphs(enabled=use_graphs and not cfg.time_phases)
        self.stats = Stats(timed=cfg.time_phases or model.device.type == "cpu")

    def run(
        self,
        prompts: List[List[int]],
        batch_size: Optional[int] = None,
        on_finish: Optional[Callable[[int, torch.Tensor], None]] = None,
    ) -> List[torch.Tensor]:
        """batch_size: the most sequences in flight (default: all); on_finish(i, tokens) is called
        for prompt i as soon as it is finished (at a block boundary), with its generated tokens.
        Raises NonFiniteLogitsError when the model's logits hold a NaN or +-inf."""
        t0 = time.perf_counter()
        sched = Scheduler(self._batch(prompts), batch_size, self.eos_id, self.cfg.early_stop, on_finish)
        max_len = sched.batch.max_len
        check_memory(self.model, sched.slots, max_len, self.cfg.block_length)  # a refusal, not an OOM
        cache = self.model.new_cache(sched.slots, max_len)
        request_keys = self._request_keys(prompts)
        while (rnd := sched.schedule()) is not None:
            self.run_round(BlockState(sched, rnd, self.cfg, self.model, cache, request_keys), sched)
            sched.postprocess(rnd)
        self.stats.seconds = time.perf_counter() - t0
        self.stats.tokens = sum(int((o != self.eos_id).sum()) for o in sched.outputs)
        return sched.outputs

    def _batch(self, prompts: List[List[int]]) -> Batch:
        cfg, model = self.cfg, self.model
        return make_batch(
            prompts,
            cfg.gen_length,
            cfg.block_length,
            self.mask_id,
            self.eos_id,
            model.device,
            model.config.max_positions,
            cfg.align_blocks,
            cfg.after_look,
        )

    def _request_keys(self, prompts: List[List[int]]) -> torch.Tensor:
        """[P] sampling keys of the prompts (zeros when nothing is sampled: no hashing to pay)."""
        sampling = self.cfg.decoder.temperature > 0
        keys = request_keys_of(prompts) if sampling else [0] * len(prompts)
        return torch.tensor(keys, dtype=torch.int64, device=self.model.device)

    def run_round(self, st: BlockState, sched: Scheduler):
        """Every sequence of the round decodes its block, in chunks of iterations with one host
        check each; the tokens and counters go back to `sched`."""
        cfg = self.cfg
        left, step = st.poll(self.mask_id)[0], 0
        while left.any():
            if cfg.compact and not left.all():  # sequences whose block is done leave it
                sched.store(st.rows, st.batch.x, st.iters)
                keep = left.nonzero().flatten()
                st, left = st.select(keep), left[keep]
            # The slowest sequence sets the chunk: a chunk never outruns the last block to finish.
            chunk = max(1, min(int(left.max()) // cfg.expected_tpf, cfg.unroll))
            first = int(sched.forwards[st.prompts].min())
            kinds = tuple(self._is_refresh(step + j, first + j) for j in range(chunk))
            self.graphs.run(self.iteration, st, kinds)
            self.stats.count_chunk(kinds, st.batch.size)
            sched.forwards[st.prompts] += chunk
            step += chunk
            left, nonfinite_at = st.poll(self.mask_id)
            _check_chunk(left, nonfinite_at, st.prompts, sched.next_block, step, st.batch.block_length)
        sched.store(st.rows, st.batch.x, st.iters)

    def _is_refresh(self, step: int, ran: int) -> bool:
        """Whether the block's iteration `step` is a full refresh; `ran`: the fewest forwards any
        sequence in it has run before (the warm-up is per sequence: a newcomer gets its own)."""
        c = self.cfg
        return (
            step == 0
            or c.cache == "none"
            or ran < c.warmup_steps
            or (c.refresh_every > 0 and step % c.refresh_every == 0)
        )

    def iteration(self, st: BlockState, refresh: bool):
        """One forward and one decode of the block; every state update is in place."""
        cfg, model, dev = self.cfg, self.model, self.model.device
        B, bl = st.batch.size, st.batch.block_length
        lo = torch.zeros_like(st.window_lo) if refresh else st.window_lo
        W = st.batch.max_len if refresh else st.window_len
        pos = (lo[:, None] + torch.arange(W, device=dev)).clamp(max=st.batch.max_len - 1)  # [B, W]
        # The block's rows inside the window (flat over B * W). Padding rows may fall outside the
        # window: they read any row's logits, and their soft inputs go to a spare row B * W.
        rows = (
            (st.block_pos - lo[:, None]).clamp(0, W - 1) + W * torch.arange(B, device=dev)[:, None]
        ).flatten()
        with self.stats.phase("forward", dev):
            emb = model.embed(st.batch.x.gather(1, pos))
            if cfg.smoothing:
                spare = torch.cat([emb.view(B * W, -1), emb.new_zeros(1, emb.shape[-1])])
                spare[torch.where(st.valid.flatten(), rows, B * W)] = st.soft
                emb = spare[:-1].view(B, W, -1)
            block_mask = None
            if model.config.block_causal:  # windows start on a block boundary (_check_block_causal)
                c, S = model.config, st.batch.max_len
                block_mask = dk.BlockMask.block_causal(B, c.num_kv_heads, W, S, bl, bl, bl, lo, device=dev)
            logits = model.forward(
                emb,
                pos,
                st.cache,
                st.seq_lens,
                write_back=refresh or cfg.write_back,
                logits_rows=rows,
                block_mask=block_mask,
            )
        with self.stats.phase("decode", dev):
            tokens = st.block_tokens()
            active = (tokens.view(B, bl) == self.mask_id).any(1)
            keys = None
            if cfg.decoder.temperature > 0:
                keys = rng.request_row_keys(st.request_keys, st.block_pos, st.iters).flatten()
            out = st.decoder(logits, tokens, st.iters, keys)
            bad = (out.nonfinite.view(B, bl) & st.valid).any(1)
            st.nonfinite_at.copy_(torch.where(bad & (st.nonfinite_at < 0), st.iters + 1, st.nonfinite_at))
            st.store_block_tokens(tokens)
        if cfg.smoothing:
            with self.stats.phase("smoothing", dev):
                # The next forward's inputs of the rows still masked: w_n of each sequence.
                w0, dw, wmax = cfg.smoothing_weight
                w = torch.clamp(w0 + dw * st.iters.float(), max=wmax).repeat_interleave(bl)
                st.soft.copy_(dk.soft_embedding(logits, model.embedding, tokens, self.mask_id, w))
        st.iters += active.to(st.iters.dtype)


def _check_block_causal(cfg: GenerationConfig):
    """The settings a block-causal model (LLaDA2) decodes under: blocks on the grid from position 0,
    as it was trained, and windows that start on a block boundary (where its block mask is exact).
    A block's first forward is a full refresh, whose rows before the block recompute the committed
    blocks' K/V from their final tokens while being unable to see the block: the clean K/V of the
    block before comes with that forward, not with an extra one."""
    if not cfg.align_blocks:
        raise ValueError("align_blocks: a block-causal model decodes blocks aligned at position 0 (True)")
    if cfg.cache == "vicinity" and cfg.prefix_look % cfg.block_length:
        raise ValueError(
            f"prefix_look: a block-causal model's vicinity window must start on a block boundary: "
            f"a multiple of block_length ({cfg.block_length}), got {cfg.prefix_look}"
        )


def _check_chunk(left, nonfinite_at, prompts, blocks, step: int, block_length: int):
    """After a chunk (host values): no logits held a NaN or +-inf, and no block outlived its length
    in forwards. prompts [B]: the prompt index of each sequence; blocks: each prompt's block."""
    bad = (nonfinite_at >= 0).nonzero().flatten().tolist()
    if bad:
        i, f = int(prompts[bad[0]]), int(nonfinite_at[bad[0]])
        more = f" (and {len(bad) - 1} more prompts)" if len(bad) > 1 else ""
        raise NonFiniteLogitsError(
            f"non-finite logits (NaN or inf) from the model at forward {f} of prompt {i}, block "
            f"{int(blocks[i])}{more}: its weights are broken or its activations overflow their dtype"
        )
    if step >= block_length and left.any():
        b = int(left.nonzero()[0])
        raise RuntimeError(
            f"internal error: block {int(blocks[int(prompts[b])])} of prompt {int(prompts[b])} still holds "
            f"{int(left[b])} [MASK] tokens after {step} forwards, more than its length {block_length} "
            "(decode_step commits at least one per forward)"
        )


def generate(
    model,
    prompts: List[List[int]],
    cfg: GenerationConfig,
    batch_size: Optional[int] = None,
    on_finish: Optional[Callable[[int, torch.Tensor], None]] = None,
):
    """Token ids of each prompt's generated region, and the run's Stats. batch_size: the most
    sequences in flight (continuous batching: a finished sequence's slot goes to the next prompt);
    on_finish(i, tokens): prompt i is finished, before the rest are (Generator.run)."""
    gen = Generator(model, cfg)
    return gen.run(prompts, batch_size, on_finish), gen.stats
