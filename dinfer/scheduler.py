"""The host-side schedule of generation: which requests are in flight, in which slot, on which block,
and when each is finished. Schedule, run and postprocess stay apart (as in nano-vllm):

    add() / cancel()  requests join the queue at any time; a cancelled one leaves it, or its slot at
                      the next block boundary (the next schedule(): it decodes no further block)
    schedule()        retire the cancelled requests in flight, refill the free slots from the queue
                      and name the round (a Round: the slots in flight, the block each decodes next,
                      a copy of their tokens and counters)
    (Generator)       runs the round: every sequence decodes its block, store() hands each one's
                      tokens, iterations and forwards back once its block is settled
    postprocess()     early stop, next blocks, done flags; each block's tokens handed over (on_block),
                      each finished answer too (on_finish), its slot and cache freed

Slots are rows of a fixed token storage (dinfer.batch.slots), refilled only between rounds, at block
boundaries, where the KV-cache manager starts each round (a bidirectional model's blocks start with a
full refresh that builds a newcomer's cache rows along with everyone's; a block-causal model's
newcomers get their prompt prefilled). A manager with a bounded cache admits a request only when its
cache fits (`admit`) and takes back a finished one's (`release`); the queue waits, in order, until it
does. Per-slot counters start afresh with each request; the scheduler alone writes them.
"""

from collections import deque
from typing import Callable, List, NamedTuple, Optional

import torch

from .batch import Batch, fill


class Request(NamedTuple):
    id: int
    prompt: List[int]
    gen_length: int
    key: int  # its sampling key (dinfer_kernels.sequence_key)
    threshold: float  # its commit threshold (tau)


class Round(NamedTuple):
    """A round as the scheduler names it. Its tensors are the round's own (copies): the Generator
    works on them and hands them back through Scheduler.store."""

    slots: torch.Tensor  # [B] int64 on the host: the storage rows in flight
    requests: torch.Tensor  # [B] int64 on the host: the request each decodes
    blocks: torch.Tensor  # [B] int64 on the host: the block it decodes
    forwards: torch.Tensor  # [B] int64 on the host: forwards each request ran before the round
    rows: torch.Tensor  # [B] the slots on the device
    batch: Batch  # the sequences' tokens, the columns they use (Batch.select(trim=True))
    iters: torch.Tensor  # [B] on the device: iterations each request was active (its schedules)
    keys: torch.Tensor  # [B] on the device: sampling keys (dinfer_kernels.sequence_key)
    tau: torch.Tensor  # [B] float32 on the device: commit thresholds


class Scheduler:
    """The schedule of requests through the rows of `batch` (one request per row at a time).

    on_block(id, tokens): request id's next block is committed (its generated tokens in it);
    on_finish(id, tokens, forwards): it is finished (all its generated tokens, EOS after an early
    stop; the forwards it ran); on_admit(id): it left the queue for a slot. admit(request) says
    whether it may start now (reserving what it needs: the KV-cache manager's), release(id) that it
    is finished. whole_blocks (a block-causal model): each sequence's last block is laid out whole,
    [MASK] past its gen_length to the block's end (dinfer.batch.fill), decoded, and cut from what
    on_block and on_finish hand over."""

    def __init__(
        self,
        batch: Batch,
        eos_id: int,
        mask_id: int,
        early_stop: bool,
        align_blocks: bool,
        on_finish: Optional[Callable[[int, torch.Tensor, int], None]] = None,
        on_block: Optional[Callable[[int, torch.Tensor], None]] = None,
        admit: Optional[Callable[[Request], bool]] = None,
        release: Optional[Callable[[int], None]] = None,
        on_admit: Optional[Callable[[int], None]] = None,
        whole_blocks: bool = False,
    ):
        n, dev = batch.size, batch.x.device
        self.batch = batch  # the requests' tokens, as the rounds leave them
        self.eos_id, self.mask_id, self.early_stop, self.align_blocks = (
            eos_id,
            mask_id,
            early_stop,
            align_blocks,
        )
        self.on_finish, self.on_block, self.on_admit = on_finish, on_block, on_admit
        self.admit, self.release = admit, release
        self.whole_blocks = whole_blocks  # a block-causal model's canvas (dinfer.batch.fill)
        self.request: List[Optional[Request]] = [None] * n  # the request in each slot
        self.next_block = torch.zeros(n, dtype=torch.int64)
        self.num_blocks = torch.zeros(n, dtype=torch.int64)
        self.forwards = torch.zeros(n, dtype=torch.int64)  # forwards each slot's request ran (its warm-up)
        # Iterations each request was active (the threshold and smoothing schedules), its sampling key
        # and threshold: on the device, where the iterations use them.
        self.iters = torch.zeros(n, dtype=torch.int64, device=dev)
        self.keys = torch.zeros(n, dtype=torch.int64, device=dev)
        self.tau = torch.zeros(n, dtype=torch.float32, device=dev)
        self.done = torch.zeros(n, dtype=torch.bool)
        self.free, self.queue, self.flight = deque(range(n)), deque(), []
        self.cancelled: set = set()

    def add(self, request: Request) -> None:
        self.queue.append(request)

    def cancel(self, request_id: int) -> Optional[str]:
        """Request `request_id` leaves: now if it is queued ("queued"), at the next block boundary
        if it is in flight ("in flight": the next schedule() hands it to on_finish as it stands,
        [MASK] where nothing was committed, and its slot to the next request). None when it is
        neither."""
        for r in self.queue:
            if r.id == request_id:
                self.queue.remove(r)
                return "queued"
        if any(self.request[s].id == request_id for s in self.flight):
            self.cancelled.add(request_id)
            return "in flight"
        return None

    @property
    def idle(self) -> bool:
        return not self.queue and not self.flight

    def schedule(self) -> Optional[Round]:
        """The next round, or None when nothing is queued or in flight."""
        for slot in [s for s in self.flight if self.request[s].id in self.cancelled]:
            self.cancelled.discard(self.request[slot].id)
            self._finish(slot)  # before the refill: its slot takes a queued request in this round
        while self.free and self.queue:
            if self.admit is not None and not self.admit(self.queue[0]):
                break  # the queue's head waits for a finished request's cache
            self._start(self.queue.popleft(), self.free.popleft())
        if not self.flight:
            if self.queue:
                raise RuntimeError(
                    f"internal error: request {self.queue[0].id} cannot start with nothing in flight"
                )
            return None
        slots = torch.tensor(self.flight)
        rows = slots.to(self.batch.x.device)
        return Round(
            slots,
            torch.tensor([self.request[s].id for s in self.flight]),
            self.next_block[slots],
            self.forwards[slots],
            rows,
            self.batch.select(rows, trim=True),
            self.iters[rows],
            self.keys[rows],
            self.tau[rows],
        )

    def _start(self, r: Request, slot: int) -> None:
        b = self.batch
        fill(b, slot, r.prompt, r.gen_length, self.mask_id, self.eos_id, self.align_blocks, self.whole_blocks)
        self.request[slot] = r
        self.next_block[slot], self.forwards[slot], self.done[slot] = 0, 0, False
        self.num_blocks[slot] = -(
            -(len(r.prompt) + r.gen_length - int(b.first_block[slot])) // b.block_length
        )
        self.iters[slot], self.keys[slot], self.tau[slot] = 0, r.key, r.threshold
        self.flight.append(slot)
        if self.on_admit is not None:
            self.on_admit(r.id)

    def store(self, slots: torch.Tensor, x: torch.Tensor, iters: torch.Tensor, forwards: int):
        """The round is over for `slots` (host indices; once each per round): their tokens x [B, S']
        (the round's leading columns), iteration counts [B] and the `forwards` the round ran for
        them."""
        rows = slots.to(self.batch.x.device)
        self.batch.x[rows, : x.shape[1]], self.iters[rows] = x, iters
        self.forwards[slots] += forwards

    def postprocess(self, rnd: Round):
        """After the round: early stop, each request's next block and committed tokens, and the
        finished ones handed over, their slots freed."""
        if self.early_stop:
            self._early_stop(rnd)
        s, b = rnd.slots, self.batch
        if self.on_block is not None:
            for slot, k in zip(s.tolist(), rnd.blocks.tolist()):
                r = self.request[slot]  # its answer: the canvas's tail past it is cut
                lo = max(int(b.first_block[slot]) + k * b.block_length, len(r.prompt))
                hi = min(int(b.first_block[slot]) + (k + 1) * b.block_length, len(r.prompt) + r.gen_length)
                self.on_block(self.request[slot].id, b.x[slot, lo:hi].to("cpu", copy=True))
        self.next_block[s] += 1
        self.done[s] |= self.next_block[s] >= self.num_blocks[s]
        for slot in s.tolist():
            if self.done[slot]:
                self.cancelled.discard(self.request[slot].id)  # finished before its cancel took effect
                self._finish(slot)

    def _finish(self, slot: int) -> None:
        """The request in `slot` leaves: its tokens handed over, its cache and slot freed."""
        r = self.request[slot]
        # final: read once, a copy (the row goes to the next request)
        tokens = self.batch.x[slot, len(r.prompt) : len(r.prompt) + r.gen_length].to("cpu", copy=True)
        if self.release is not None:
            self.release(r.id)
        self.request[slot] = None
        self.flight.remove(slot)
        self.free.append(slot)
        if self.on_finish is not None:
            self.on_finish(r.id, tokens, int(self.forwards[slot]))

    def _early_stop(self, rnd: Round):
        """dInfer's rule: EOS anywhere in a finished block ends the sequence; the rest becomes EOS."""
        full, dev = self.batch, self.batch.x.device
        part = full.select(rnd.rows)
        pos = part.block_positions(rnd.blocks.to(dev))
        valid = pos < part.total_len[:, None].to(torch.int64)
        tokens = part.x.gather(1, pos.clamp(max=full.max_len - 1))
        hit = ((tokens == self.eos_id) & valid).any(1).cpu()
        for b in torch.nonzero(hit).flatten().tolist():
            slot = int(rnd.slots[b])
            full.x[slot, int(pos[b, -1]) + 1 : int(full.total_len[slot])] = self.eos_id
            self.done[slot] = True
