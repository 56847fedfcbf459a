"""Token state of a ragged batch and its blocks.

Sequence b holds its prompt (length Lp_b) and gen_length [MASK] tokens: total_b = Lp_b + gen_length
positions. Nothing is padded into the sequence: positions >= total_b are padding, never attended
(seq_lens) and never decoded. Blocks are aligned as dInfer's benchmarks do: the first block starts at
floor(Lp_b / bl) * bl (so it may overlap the prompt's tail, whose tokens are not masked) and the last
block may be partial. Each sequence has its own number of blocks and, in a batch, may be on another
block than its neighbours (a slot refilled with a new prompt starts at block 0): block indices are
per sequence everywhere.
"""

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    x: torch.Tensor  # [B, S] int64 tokens (pad_id beyond each sequence)
    total_len: torch.Tensor  # [B] int32: attended keys per sequence
    first_block: torch.Tensor  # [B] int64: start of block 0
    prompt_len: torch.Tensor  # [B] int64
    block_length: int
    room: int  # columns kept after the last block: the after-look window + 1 padding row

    @property
    def size(self) -> int:
        return self.x.shape[0]

    @property
    def max_len(self) -> int:
        return self.x.shape[1]

    def num_blocks(self) -> torch.Tensor:
        """[B] int64 blocks of each sequence (the last may be partial)."""
        span = self.total_len.to(torch.int64) - self.first_block
        return (span + self.block_length - 1) // self.block_length

    def block_start(self, k: torch.Tensor) -> torch.Tensor:
        """[B] first position of each sequence's block k[b]."""
        return self.first_block + k * self.block_length

    def block_positions(self, k: torch.Tensor) -> torch.Tensor:
        """[B, bl] positions of each sequence's block k[b] (rows past a sequence's end are padding)."""
        ar = torch.arange(self.block_length, device=self.x.device)
        return self.block_start(k)[:, None] + ar

    def span(self) -> int:
        """Columns the sequences use: every block, its after-look window and one padding row that
        clamped window rows can point at (a sync: the host needs the number)."""
        return int((self.first_block + self.num_blocks() * self.block_length).max()) + self.room

    def select(self, rows: torch.Tensor, trim: bool = False) -> "Batch":
        """Sequences `rows`; trim: only the columns they use (a round of short prompts in a stream
        that also holds long ones computes its refreshes over its own length)."""
        part = Batch(
            self.x[rows],
            self.total_len[rows],
            self.first_block[rows],
            self.prompt_len[rows],
            self.block_length,
            self.room,
        )
        if trim:
            part.x = part.x[:, : part.span()]
        return part


def make_batch(
    prompts,
    gen_length: int,
    block_length: int,
    mask_id: int,
    pad_id: int,
    device,
    max_positions: int,
    align_blocks: bool = True,
    after_look: int = 0,
) -> Batch:
    """align_blocks: dInfer's start_block_align (block 0 starts at floor(Lp / bl) * bl); False
    starts it right after the prompt, as LLaDA's original sampler does."""
    if not prompts:
        raise ValueError("prompts: expected at least one prompt")
    if gen_length < 1 or block_length < 1:
        raise ValueError(f"gen_length and block_length must be >= 1, got {gen_length}, {block_length}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompts[{i}]: empty prompt")
        if len(p) + gen_length > max_positions:
            raise ValueError(
                f"prompts[{i}]: {len(p)} prompt tokens + gen_length {gen_length} exceed the "
                f"model's {max_positions} positions"
            )
    lp = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
    first = lp // block_length * block_length if align_blocks else lp.clone()
    total = lp + gen_length
    # Room for every block and its after-look window, plus one padding row: windows then depend on
    # a sequence's own positions only, never on the batch.
    batch = Batch(
        torch.empty(len(prompts), 0, dtype=torch.int64),
        total.to(torch.int32),
        first,
        lp,
        block_length,
        after_look + 1,
    )
    x = torch.full((len(prompts), batch.span()), pad_id, dtype=torch.int64)
    for b, p in enumerate(prompts):
        x[b, : len(p)] = torch.tensor(p, dtype=torch.int64)
        x[b, len(p) : int(total[b])] = mask_id
    return Batch(
        x.to(device), batch.total_len.to(device), first.to(device), lp.to(device), block_length, batch.room
    )
