"""The diffusion iteration manager: blocks, forwards, decoding, smoothing.

    until every prompt is finished (dinfer.scheduler: the queue, refills, early stop, the answers):
        schedule: up to `batch_size` sequences in flight; a finished one's slot goes to the next prompt;
                  the scheduler names the round (a Round: its sequences, blocks, tokens and counters)
        start the round (the KV-cache manager, dinfer.kv): its own round state (tables, windows)
        run the round (its owner: the Generator, which passes the round state explicitly):
            repeat until every block is settled (one host check per chunk of <= `unroll` iterations):
                compact: sequences whose block is settled leave the block's remaining iterations
                iteration: forward over the window the KV-cache manager names for the iteration's kind
                           + decode_step on the block's rows (+ soft embeddings for the next forward)
        postprocess: a sequence whose block holds EOS is finished (early stop), the rest of it EOS;
        so is one whose last block is done

The KV-cache manager is the model's: a bidirectional model (LLaDA, LLaDA-MoE) sees the whole sequence,
so its cache goes stale and is refreshed (dinfer.kv.refresh: full refreshes at block starts, window
steps per cache mode); a block-causal one (LLaDA2) never sees later blocks, so the committed blocks'
K/V are exact and appended once to a paged cache (dinfer.kv.paged: chunked prompt prefill, the
previous block's clean K/V fused into the block's first forward). A block is settled when it holds no
[MASK] and, for an editing decoder (joint), its post-edit steps are over (dinfer.decoders).

Who owns what: the scheduler its queue, slots and per-request counters (written back once per block:
Scheduler.store); the Generator a round's tokens, decoder and counters (BlockState); the KV-cache
manager its cache and its round state (held beside the BlockState, read only by the manager).

Every iteration is one model forward and one decode_step. Commits, thresholds, schedules and the
stop test stay on the device, so a chunk's iterations run back to back (one CUDA graph on a GPU,
dinfer.graphs: captured once per batch size, shape and kinds of forward, replayed for every later
block and request from static buffers: a round's state is loaded into them, and the run goes on with
the state the graphs ran on). All state an iteration writes is updated in place, which is what lets
a captured chunk replay.

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
from typing import Callable, List, NamedTuple, Optional

import torch

import dinfer_kernels as dk

from .batch import check_prompt, span
from .batch import slots as slots_storage
from .decoders import SMOOTHING_WEIGHT, Decoder, DecoderConfig
from .graphs import StepGraphs
from .graphs import enabled_for as graphs_enabled_for
from .kv import CACHE_MODES, CLEAN_KV, manager_for
from .params import Bool, Instance, Int, OneOf, Real, Tuple, check
from .scheduler import Request, Round, Scheduler
from .stats import Stats


class NonFiniteLogitsError(RuntimeError):
    """The model produced NaN or +-inf logits: broken weights, or activations that overflow their
    dtype. Nothing decoded from them means anything, so generation stops."""


@dataclass(frozen=True)
class GenerationConfig:
    gen_length: int = 1024
    block_length: int = 64  # capped to gen_length
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    cache: str = "vicinity"  # none | prefix | dual | vicinity (bidirectional) | paged (block-causal)
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
    # Block-causal (paged) only: where the previous block's clean K/V come from (kv.paged): "fused"
    # into the block's first forward, or an extra "forward"; the prompt prefill's positions per
    # forward (whole blocks); the page pool's size (0: every sequence in flight at its longest).
    clean_kv: str = "fused"
    prefill_chunk: int = 512
    kv_pages: int = 0

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
                clean_kv=OneOf(CLEAN_KV),
                prefill_chunk=n,
                kv_pages=count,
            ),
        )
        # A block longer than the answer would only decode padding rows (8x slower at 1000 for 32
        # tokens): one block then covers the answer, as dInfer's block_length = gen_length runs do.
        object.__setattr__(self, "block_length", min(self.block_length, self.gen_length))


class BlockState:
    """What the iterations of one block read and write: the Generator's part of a round. Every
    write is in place (CUDA graphs replay on a static BlockState's tensors: dinfer.graphs)."""

    def __init__(self, rnd: Round, cfg: GenerationConfig, model):
        """The round `rnd` (the scheduler's: its sequences' tokens and counters)."""
        c = model.config
        self.batch = batch = rnd.batch
        dev = batch.x.device
        # slots and their requests, blocks and forwards before the round (host), the slots on the device
        self.slots, self.requests, self.blocks, self.ran_before, self.rows = (
            rnd.slots,
            rnd.requests,
            rnd.blocks,
            rnd.forwards,
            rnd.rows,
        )
        B, bl, S = batch.size, batch.block_length, batch.max_len
        pos = batch.block_positions(rnd.blocks.to(dev))
        # Rows past a sequence's end (its canvas: dinfer.batch) are padding: they read a non-mask
        # token and are never written.
        self.valid = pos < batch.total_len[:, None].to(torch.int64)
        self.block_pos = pos.clamp(max=S - 1)
        # The rows an editing decoder may rewrite: generated ones (a block may hold the prompt's tail)
        self.editable = (self.valid & (pos >= batch.prompt_len[:, None])).flatten()
        self.pad_token = torch.full((B, bl), c.eos_id, dtype=torch.int64, device=dev)
        self.iters = rnd.iters  # [B] iterations each sequence was active (schedules)
        self.request_keys = rnd.keys  # [B] sampling keys (dk.sequence_key)
        # [B] the request's forward (its own count, from 1) whose logits first held a NaN or +-inf
        # in a valid row of this block; -1: none yet.
        self.nonfinite_at = torch.full((B,), -1, dtype=torch.int64, device=dev)
        warmup = (cfg.smoothing_threshold_start, cfg.smoothing_threshold_decay) if cfg.smoothing else None
        self.decoder = Decoder(cfg.decoder, B, bl, c.mask_id, dev, warmup, rnd.tau, parallel_of(model))
        self.decoder.start_block(self.block_tokens().view(B, bl))
        self.soft = model.embed(self.block_tokens())  # hard embeddings until the block has logits

    def block_tokens(self) -> torch.Tensor:
        return torch.where(self.valid, self.batch.x.gather(1, self.block_pos), self.pad_token).flatten()

    def store_block_tokens(self, tokens: torch.Tensor):
        cur = self.batch.x.gather(1, self.block_pos)
        self.batch.x.scatter_(1, self.block_pos, torch.where(self.valid, tokens.view(cur.shape), cur))

    def poll(self):
        """([B] work left in each sequence's block (Decoder.remaining), [B] nonfinite_at) on the
        host: one sync, once per chunk."""
        left = self.decoder.remaining(self.block_tokens().view(self.batch.size, -1))
        both = torch.stack([left, self.nonfinite_at]).cpu()
        return both[0], both[1]

    def select(self, keep: torch.Tensor) -> "BlockState":
        """The state of sequences `keep` (host indices) only."""
        new = copy.copy(self)
        bl = self.batch.block_length
        new.slots, new.requests, new.blocks = self.slots[keep], self.requests[keep], self.blocks[keep]
        new.ran_before = self.ran_before[keep]
        keep = keep.to(self.rows.device)
        new.rows, new.batch = self.rows[keep], self.batch.select(keep)
        new.valid, new.block_pos, new.pad_token = self.valid[keep], self.block_pos[keep], self.pad_token[keep]
        new.editable = self.editable.view(-1, bl)[keep].flatten()
        new.iters, new.request_keys, new.nonfinite_at = (
            self.iters[keep],
            self.request_keys[keep],
            self.nonfinite_at[keep],
        )
        new.decoder = self.decoder.select(keep)
        new.soft = self.soft.view(self.batch.size, bl, -1)[keep].flatten(0, 1)
        return new


class RoundState(NamedTuple):
    """A round as its iterations see it: the Generator's part and the KV-cache manager's, each
    written by its owner only. One object per block (and per compaction); CUDA graphs key on its
    signature (its tensors' shapes and host values: dinfer.graphs) and may hand back, in its place,
    their static state of that signature holding its values."""

    block: BlockState
    kv: object  # the KV-cache manager's round state (its start_round / select)


def request_keys_of(prompts: List[List[int]]) -> List[int]:
    """The sampling key of each prompt: its content (dk.sequence_key) and its rank among the earlier
    copies of the same prompt in the run."""
    seen: dict = {}
    keys = []
    for p in prompts:
        ids = tuple(int(t) for t in p)
        keys.append(dk.sequence_key(ids, seen.get(ids, 0)))
        seen[ids] = seen.get(ids, 0) + 1
    return keys


class Generator:
    """Runs a GenerationConfig on a model (dinfer.models.DiffusionLM): `run` for a list of prompts, or
    `open`, then `submit` requests at any time, `step` rounds and `cancel` requests (a server's
    engine, which reads `idle`, `in_flight` and `queued` and hears of admissions through open's
    on_admit)."""

    def __init__(self, model, cfg: GenerationConfig):
        check_for_model(model, cfg)
        self.model, self.cfg = model, cfg
        self.mask_id, self.eos_id = model.config.mask_id, model.config.eos_id
        self.graphs = StepGraphs(enabled=graphs_enabled_for(model, cfg))
        self.stats = Stats(timed=cfg.time_phases or model.device.type == "cpu")
        self.sched = None
        self._next_id = 0

    def run(
        self,
        prompts: List[List[int]],
        batch_size: Optional[int] = None,
        on_finish: Optional[Callable[[int, torch.Tensor], None]] = None,
    ) -> List[torch.Tensor]:
        """Each prompt's generated tokens. batch_size: the most sequences in flight (default: all);
        on_finish(i, tokens) is called for prompt i as soon as it is finished (at a block boundary),
        with its generated tokens. Raises NonFiniteLogitsError when the model's logits hold a NaN or
        +-inf."""
        t0 = time.perf_counter()
        cfg = self.cfg
        if not prompts:
            raise ValueError("prompts: expected at least one prompt")
        for i, p in enumerate(prompts):
            check_prompt(i, p, cfg.gen_length, self.model.config.max_positions)
        slots = len(prompts) if batch_size is None else min(batch_size, len(prompts))
        if slots < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        outputs: List[torch.Tensor] = [None] * len(prompts)

        def finished(i: int, tokens: torch.Tensor, forwards: int) -> None:
            outputs[i] = tokens
            if on_finish is not None:
                on_finish(i, tokens)

        width = max(self._span(len(p), cfg.gen_length) for p in prompts)
        self.open(slots, width, max(len(p) for p in prompts) + cfg.gen_length, finished)
        sampling = cfg.decoder.temperature > 0
        keys = request_keys_of(prompts) if sampling else [0] * len(prompts)  # no hashing to pay
        for p, key in zip(prompts, keys):
            self.submit(p, key=key)
        while self.step():
            pass
        self.stats.seconds = time.perf_counter() - t0
        self.stats.tokens = sum(int((o != self.eos_id).sum()) for o in outputs)
        return outputs

    def _span(self, prompt_len: int, gen_length: int) -> int:
        c = self.cfg
        return span(prompt_len, gen_length, c.block_length, c.align_blocks, c.after_look + 1)

    def open(
        self,
        slots: int,
        width: int,
        max_total: int,
        on_finish: Optional[Callable[[int, torch.Tensor, int], None]] = None,
        on_block: Optional[Callable[[int, torch.Tensor], None]] = None,
        on_admit: Optional[Callable[[int], None]] = None,
    ) -> None:
        """Storage and a KV cache for `slots` sequences in flight, of up to `max_total` positions
        and `width` columns (Generator._span) each: a run that cannot fit is refused here, before
        anything large is allocated. on_finish(id, tokens, forwards) / on_block(id, tokens) /
        on_admit(id) (request id left the queue for a slot: its cache is reserved) as the Scheduler
        calls them."""
        cfg = self.cfg
        storage = slots_storage(
            slots, width, cfg.block_length, cfg.after_look + 1, self.eos_id, self.model.device
        )
        self.kv = manager_for(self.model)(self.model, cfg, storage, max_total)
        self.graphs.reset()  # graphs captured on the previous cache would read and write it
        self.max_total = max_total
        self.sched = Scheduler(
            storage,
            self.eos_id,
            self.mask_id,
            cfg.early_stop,
            cfg.align_blocks,
            on_finish,
            on_block,
            self.kv.admit,
            self.kv.release,
            on_admit,
            whole_blocks=self.model.config.block_causal,
        )

    def submit(
        self,
        prompt: List[int],
        gen_length: Optional[int] = None,
        key: int = 0,
        threshold: Optional[float] = None,
    ) -> int:
        """Queues a request (after open): prompt token ids, its gen_length (default: the config's),
        sampling key and threshold (default: the decoder's). Returns its id (0, 1, ... in order)."""
        gen_length = self.cfg.gen_length if gen_length is None else gen_length
        rid = self._next_id
        check_prompt(rid, prompt, gen_length, min(self.model.config.max_positions, self.max_total))
        if self._span(len(prompt), gen_length) > self.sched.batch.max_len:
            raise ValueError(
                f"prompts[{rid}]: {len(prompt)} + {gen_length} positions do not fit the engine's rows"
            )
        tau = self.cfg.decoder.threshold if threshold is None else threshold
        self.sched.add(Request(rid, list(prompt), gen_length, key, tau))
        self._next_id += 1
        return rid

    def cancel(self, request_id: int) -> Optional[str]:
        """Request `request_id` leaves: "queued" (it had not started: gone at once), "in flight"
        (at its next block boundary, reported to on_finish as it stands), None (unknown or
        finished)."""
        return self.sched.cancel(request_id)

    @property
    def idle(self) -> bool:
        """Nothing queued or in flight (also before open)."""
        return self.sched is None or self.sched.idle

    @property
    def in_flight(self) -> int:
        """Requests holding a slot."""
        return 0 if self.sched is None else len(self.sched.flight)

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return 0 if self.sched is None else len(self.sched.queue)

    def step(self) -> bool:
        """One round: every request in flight decodes its next block (newcomers admitted first).
        False when nothing was queued or in flight."""
        rnd = self.sched.schedule()
        if rnd is None:
            return False
        st = BlockState(rnd, self.cfg, self.model)
        kv = self.kv.start_round(rnd.batch, rnd.requests, rnd.blocks, self.stats)
        self.run_round(RoundState(st, kv))
        self.sched.postprocess(rnd)
        return True

    def run_round(self, rs: RoundState):
        """Every sequence of the round decodes its block, in chunks of iterations with one host
        check each; each sequence's tokens and counters go back to the scheduler once its block is
        settled (Scheduler.store)."""
        cfg, st = self.cfg, rs.block
        left, step = st.poll()[0], 0
        while left.any():
            if cfg.compact and not left.all():  # sequences whose block is settled leave it
                done, keep = (left == 0).nonzero().flatten(), left.nonzero().flatten()
                self._store(st, done, step)
                st, left = st.select(keep), left[keep]
                rs = RoundState(st, self.kv.select(rs.kv, keep.to(st.rows.device)))
            # The slowest sequence sets the chunk: a chunk never outruns the last block to finish.
            chunk = max(1, min(int(left.max()) // cfg.expected_tpf, cfg.unroll))
            kinds = self.kv.kinds(step, int(st.ran_before.min()) + step, chunk)
            rs = self.graphs.run(self.iteration, rs, kinds, self.stats)  # maybe a static state
            st = rs.block
            self.stats.count_chunk(kinds, st.batch.size)
            step += chunk
            left, nonfinite_at = st.poll()
            limit = st.batch.block_length + (cfg.decoder.max_post_edit_steps if cfg.decoder.edits else 0)
            _check_chunk(left, nonfinite_at, st.requests, st.blocks, step, limit)
        self.sched.store(st.slots, st.batch.x, st.iters, step)

    def _store(self, st: BlockState, which: torch.Tensor, forwards: int) -> None:
        """Sequences `which` (host indices into st) settled after `forwards` forwards of the round."""
        rows = which.to(st.rows.device)
        self.sched.store(st.slots[which], st.batch.x[rows], st.iters[rows], forwards)

    def iteration(self, rs: RoundState, kind: str):
        """One forward and one decode of the block; every state update is in place."""
        cfg, model, dev = self.cfg, self.model, self.model.device
        st = rs.block
        B, bl = st.batch.size, st.batch.block_length
        w = self.kv.window(rs.kv, st.block_pos, kind)
        W = w.pos.shape[1]
        with self.stats.phase("forward", dev):
            emb = model.embed(st.batch.x.gather(1, w.pos.clamp(max=st.batch.max_len - 1)))
            if cfg.smoothing:  # padding rows' soft inputs go to a spare row B * W
                spare = torch.cat([emb.view(B * W, -1), emb.new_zeros(1, emb.shape[-1])])
                spare[torch.where(st.valid.flatten(), w.rows, B * W)] = st.soft
                emb = spare[:-1].view(B, W, -1)
            logits = model.forward(
                emb,
                w.pos,
                w.cache,
                w.seq_lens,
                write_back=w.write_back,
                logits_rows=w.rows,
                block_mask=w.block_mask,
                block_table=w.block_table,
            )
        with self.stats.phase("decode", dev):
            tokens = st.block_tokens()
            active = ~st.decoder.settled
            keys = None
            if cfg.decoder.temperature > 0:
                keys = dk.request_row_keys(st.request_keys, st.block_pos, st.iters).flatten()
            out = st.decoder(logits, tokens, st.iters, keys, st.editable)
            bad = (out.nonfinite.view(B, bl) & st.valid).any(1)
            st.nonfinite_at.copy_(torch.where(bad & (st.nonfinite_at < 0), st.iters + 1, st.nonfinite_at))
            st.store_block_tokens(tokens)
        if cfg.smoothing:
            with self.stats.phase("smoothing", dev):
                # The next forward's inputs of the rows still masked: w_n of each sequence.
                w0, dw, wmax = cfg.smoothing_weight
                weight = torch.clamp(w0 + dw * st.iters.float(), max=wmax).repeat_interleave(bl)
                p = parallel_of(model)
                if p is None:
                    soft = dk.soft_embedding(logits, model.embedding, tokens, self.mask_id, weight)
                else:  # the rank's vocabulary range; the decode's row statistics save a collective
                    soft = dk.soft_embedding_vocab_parallel(
                        logits,
                        model.embedding,
                        tokens,
                        self.mask_id,
                        weight,
                        vocab_start=p.vocab_start,
                        vocab_size=p.vocab_size,
                        group=p.comm.group,
                        row_max=out.row_max,
                        row_sum=out.row_sum,
                    )
                st.soft.copy_(soft)
        st.iters += active.to(st.iters.dtype)


def check_for_model(model, cfg: GenerationConfig) -> None:
    """What `cfg` must agree with in `model`, checked before anything is allocated (a server checks a
    request's configuration with it): a block-causal model's aligned blocks, the cache mode of the
    model's KV-cache manager. ValueError naming the option."""
    if model.config.block_causal:
        _check_block_causal(cfg)
    manager_for(model).check(model, cfg)


def parallel_of(model):
    """The model's TensorParallel (dinfer.parallel), None for a one-process model."""
    return getattr(model, "parallel", None)


def _check_block_causal(cfg: GenerationConfig):
    """A block-causal model decodes blocks on the grid from position 0, as it was trained."""
    if not cfg.align_blocks:
        raise ValueError("align_blocks: a block-causal model decodes blocks aligned at position 0 (True)")


def _check_chunk(left, nonfinite_at, requests, blocks, step: int, limit: int):
    """After a chunk (host values): no logits held a NaN or +-inf, and no block outlived its bound
    in forwards (`limit`: its length, plus the post-edit steps of an editing decoder). requests [B],
    blocks [B]: each sequence's request (its prompt's index in a run) and block."""
    bad = (nonfinite_at >= 0).nonzero().flatten().tolist()
    if bad:
        i, f = int(requests[bad[0]]), int(nonfinite_at[bad[0]])
        more = f" (and {len(bad) - 1} more prompts)" if len(bad) > 1 else ""
        raise NonFiniteLogitsError(
            f"non-finite logits (NaN or inf) from the model at forward {f} of prompt {i}, block "
            f"{int(blocks[bad[0]])}{more}: its weights are broken or its activations overflow their dtype"
        )
    if step >= limit and left.any():
        b = int(left.nonzero()[0])
        raise RuntimeError(
            f"internal error: block {int(blocks[b])} of prompt {int(requests[b])} is not "
            f"settled ({int(left[b])} left) after {step} forwards, more than its bound {limit} (its length "
            "and post-edit steps: decode_step commits at least one [MASK] per forward)"
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
