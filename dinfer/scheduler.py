"""The host-side schedule of a generation run: which prompts are in flight, on which block, and when
each is finished. Schedule, run and postprocess stay apart (as in nano-vllm):

    schedule()     refill the free slots from the queue and name the round: the prompts in flight
                   and the block each decodes next
    (Generator)    runs the round: every sequence decodes its block, store() writes it back
    postprocess()  early stop, next blocks, done flags, and the one write-back of finished answers

Slots are refilled only between rounds, at block boundaries, where the KV-cache manager starts each
round (a bidirectional model's blocks start with a full refresh that builds a newcomer's cache rows
along with everyone's; a block-causal model's newcomers get their prompt prefilled). A manager with
a bounded cache admits a prompt only when its cache fits (`admit`) and takes back a finished one's
(`release`); the queue waits, in order, until it does.
"""

from collections import deque
from typing import Callable, List, NamedTuple, Optional

import torch

from .batch import Batch


class Round(NamedTuple):
    prompts: torch.Tensor  # [B] int64 on the host: the prompt each sequence in flight decodes
    blocks: torch.Tensor  # [B] int64 on the host: the block it decodes


class Scheduler:
    """The schedule of the prompts of `batch` through at most `slots` sequences in flight (default:
    all). on_finish(i, tokens) is called for prompt i as soon as it is finished; admit(i) says
    whether prompt i may start now (reserving what it needs), release(i) that it is finished."""

    def __init__(
        self,
        batch: Batch,
        slots: Optional[int],
        eos_id: int,
        early_stop: bool,
        on_finish: Optional[Callable[[int, torch.Tensor], None]] = None,
        admit: Optional[Callable[[int], bool]] = None,
        release: Optional[Callable[[int], None]] = None,
    ):
        n = batch.size
        self.slots = self.slots_for(slots, n)
        self.admit, self.release = admit, release
        self.batch = batch  # every prompt's tokens, as the rounds leave them
        self.eos_id, self.early_stop, self.on_finish = eos_id, early_stop, on_finish
        self.next_block = torch.zeros(n, dtype=torch.int64)
        self.num_blocks = batch.num_blocks().cpu()
        self.forwards = torch.zeros(n, dtype=torch.int64)  # forwards each prompt ran (its warm-up)
        # Iterations each prompt was active (the threshold and smoothing schedules): on the device,
        # where the iterations count them.
        self.iters = torch.zeros(n, dtype=torch.int64, device=batch.x.device)
        self.done = torch.zeros(n, dtype=torch.bool)
        self.queue, self.flight = deque(range(n)), []
        self.outputs: List[torch.Tensor] = [None] * n  # filled as prompts finish; all do

    @staticmethod
    def slots_for(batch_size: Optional[int], prompts: int) -> int:
        """Sequences in flight: batch_size (all prompts when None), at most the prompts."""
        slots = prompts if batch_size is None else min(batch_size, prompts)
        if slots < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        return slots

    def schedule(self) -> Optional[Round]:
        """The next round, or None when every prompt is finished."""
        self.flight = [i for i in self.flight if not self.done[i]]
        while len(self.flight) < self.slots and self.queue:
            if self.admit is not None and not self.admit(self.queue[0]):
                break  # the queue's head waits for a finished sequence's cache
            self.flight.append(self.queue.popleft())
        if not self.flight:
            if self.queue:
                raise RuntimeError(
                    f"internal error: prompt {self.queue[0]} cannot start with nothing in flight"
                )
            return None
        prompts = torch.tensor(self.flight)
        return Round(prompts, self.next_block[prompts])

    def store(self, rows: torch.Tensor, x: torch.Tensor, iters: torch.Tensor):
        """Writes back the tokens x [B, S'] (a round's leading columns) and iteration counts of the
        prompts `rows` (device indices)."""
        self.batch.x[rows, : x.shape[1]], self.iters[rows] = x, iters

    def postprocess(self, rnd: Round):
        """After the round: early stop, each prompt's next block, and the finished ones handed over."""
        if self.early_stop:
            self._early_stop(rnd)
        p = rnd.prompts
        self.next_block[p] += 1
        self.done[p] |= self.next_block[p] >= self.num_blocks[p]
        b = self.batch
        for i in p[self.done[p]].tolist():  # a finished prompt's tokens are final: read them once
            self.outputs[i] = b.x[i, int(b.prompt_len[i]) : int(b.total_len[i])].cpu()
            if self.release is not None:
                self.release(i)
            if self.on_finish is not None:
                self.on_finish(i, self.outputs[i])

    def _early_stop(self, rnd: Round):
        """dInfer's rule: EOS anywhere in a finished block ends the sequence; the rest becomes EOS."""
        full, dev = self.batch, self.batch.x.device
        part = full.select(rnd.prompts.to(dev))
        pos = part.block_positions(rnd.blocks.to(dev))
        valid = pos < part.total_len[:, None].to(torch.int64)
        tokens = part.x.gather(1, pos.clamp(max=full.max_len - 1))
        hit = ((tokens == self.eos_id) & valid).any(1).cpu()
        for b in torch.nonzero(hit).flatten().tolist():
            i = int(rnd.prompts[b])
            full.x[i, int(pos[b, -1]) + 1 : int(full.total_len[i])] = self.eos_id
            self.done[i] = True
