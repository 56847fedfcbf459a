"""Token state of a ragged batch and its blocks.

Sequence b holds its prompt (length Lp_b) and gen_length [MASK] tokens, and for a block-causal model
(whole_blocks) [MASK]s on to the end of its last block, as the reference block-diffusion loops lay
the canvas out (dInfer's, LLaDA2's generate(): a model trained on whole noisy blocks reads the last
block's tail, so its real rows' logits depend on it): total_b positions, the canvas. Positions
>= total_b are padding, never attended (seq_lens) and never decoded; the tail past Lp_b + gen_length
is attended and decoded like any row and cut from the answer (dinfer.scheduler). Blocks are aligned as
dInfer's benchmarks do: the first block starts at floor(Lp_b / bl) * bl (so it may overlap the
prompt's tail, whose tokens are not masked) and, without whole_blocks, the last block may be partial. Each sequence has its own number of blocks and, in a batch, may be on another
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


def check_prompt(i, prompt, gen_length: int, max_positions: int) -> None:
    """ValueError naming prompts[i] when it is empty or does not fit the model's positions."""
    if len(prompt) == 0:
        raise ValueError(f"prompts[{i}]: empty prompt")
    if len(prompt) + gen_length > max_positions:
        raise ValueError(
            f"prompts[{i}]: {len(prompt)} prompt tokens + gen_length {gen_length} exceed the "
            f"model's {max_positions} positions"
        )


def first_block(prompt_len: int, block_length: int, align_blocks: bool) -> int:
    """Where block 0 starts: dInfer's start_block_align (floor(Lp / bl) * bl), or right after the
    prompt (LLaDA's original sampler)."""
    return prompt_len // block_length * block_length if align_blocks else prompt_len


def blocks_end(prompt_len: int, gen_length: int, block_length: int, align_blocks: bool) -> int:
    """The end of a sequence's last block (whole) on the host."""
    first = first_block(prompt_len, block_length, align_blocks)
    blocks = -(-(prompt_len + gen_length - first) // block_length)
    return first + blocks * block_length


def span(prompt_len: int, gen_length: int, block_length: int, align_blocks: bool, room: int) -> int:
    """Columns a sequence uses (Batch.span for one sequence, on the host)."""
    return blocks_end(prompt_len, gen_length, block_length, align_blocks) + room


def slots(rows: int, width: int, block_length: int, room: int, pad_id: int, device) -> Batch:
    """Empty storage for `rows` sequences of up to `width` columns each (Batch.fill writes one)."""
    zeros = lambda dtype: torch.zeros(rows, dtype=dtype, device=device)
    x = torch.full((rows, width), pad_id, dtype=torch.int64, device=device)
    return Batch(x, zeros(torch.int32), zeros(torch.int64), zeros(torch.int64), block_length, room)


def fill(
    batch: Batch,
    row: int,
    prompt,
    gen_length: int,
    mask_id: int,
    pad_id: int,
    align_blocks: bool,
    whole_blocks: bool = False,
):
    """Row `row` of `batch` holds `prompt` and gen_length [MASK]s now, and with whole_blocks
    [MASK]s on to the end of the last block (padding after them)."""
    lp, total = len(prompt), len(prompt) + gen_length
    if whole_blocks:
        total = blocks_end(lp, gen_length, batch.block_length, align_blocks)
    if span(lp, gen_length, batch.block_length, align_blocks, batch.room) > batch.max_len:
        raise ValueError(
            f"internal error: a sequence of {total} positions does not fit a row of {batch.max_len}"
        )
    dev = batch.x.device
    row_x = torch.full((batch.max_len,), pad_id, dtype=torch.int64)
    row_x[:lp] = torch.tensor(prompt, dtype=torch.int64)
    row_x[lp:total] = mask_id
    batch.x[row] = row_x.to(dev)
    batch.total_len[row] = total
    batch.first_block[row] = first_block(lp, batch.block_length, align_blocks)
    batch.prompt_len[row] = lp
