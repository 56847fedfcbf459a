"""The block-diffusion objective's layout (BD3-LM, LLaDA2): how a batch of sequences becomes one
forward that trains every block of every canvas.

A block-causal model (LLaDA2) decodes in blocks of `block_length` on the grid from position 0: the
block being decoded sees itself and the blocks before it, whose tokens are final; it never sees the
blocks after it. Training each block alone would take one forward per block. The two-copy layout
takes one: each row of the batch is

    [ noisy copy of the canvas blocks | clean copy of the sequence | padding ]

The noisy copy starts at the first canvas block (on the grid, so it may begin with the prompt's tail,
which stays unmasked) and runs to the sequence's end; the clean copy is the sequence from position 0
up to its last block, which no noisy block sees (a noisy block sees the clean blocks before its own),
so its columns would change no loss (they were ~8% of a batch's columns).
Every column keeps its absolute position (RoPE, the position scaffold). Under `attention_mask` a noisy
token of block k sees the noisy tokens of block k and the clean tokens of blocks < k (what decoding
block k sees: the block as it is being denoised, the committed blocks before it), and a clean token
sees the clean tokens of blocks <= its own (the committed blocks, as decoding computes them). No clean
token sees a noisy one, and no noisy block sees another, so each noisy block's loss is that block's
alone, conditioned on the clean blocks before it.

Each block is noised on its own: of its L canvas tokens (the prompt's tail excluded) l ~ U{1..L}
are masked, drawn without replacement, and their cross-entropy is weighted L / l: the lower-variance
form of the block's t ~ U(0, 1), 1/t bound (LLaDA's per-token 1/t weights kept recall's lookup from
forming at all: docs/training.md, recall probes round 9). The loss reads the masked noisy tokens.

With LLaDA2.1's token-to-token objective (`corrupt_blocks`, a preset's edit_fraction > 0) each block
also gets a share of its visible (unmasked) candidates replaced by random tokens, and the loss also
reads every visible candidate, target its true token: the model learns to rewrite a wrong token and to
keep a right one, which is what an editing decoder (JointThreshold) asks of it at committed tokens.
"""

from dataclasses import dataclass

import torch


@dataclass
class TwoCopyLayout:
    tokens: torch.Tensor  # [B, W] int64: the token of each column (padding: the batch's pad token)
    positions: torch.Tensor  # [B, W] int64: each column's absolute position in its sequence
    noisy: torch.Tensor  # [B, W] bool: columns of the noisy copy
    valid: torch.Tensor  # [B, W] bool: columns of either copy (the rest is padding)
    candidates: torch.Tensor  # [B, W] bool: noisy columns of the canvas, which the noise may mask
    widths: torch.Tensor  # [B] int32: valid columns (they come first)
    mask: torch.Tensor  # [B, W, W] bool: attention_mask of the layout


def attention_mask(
    positions: torch.Tensor, noisy: torch.Tensor, valid: torch.Tensor, block_length: int
) -> torch.Tensor:
    """[B, W, W] bool, True where query column q may attend key column k: both valid, and a noisy
    query of block i sees the noisy keys of block i and the clean keys of blocks < i; a clean query
    of block i the clean keys of blocks <= i. Padding columns see nothing."""
    block = positions // block_length
    bq, bk = block[:, :, None], block[:, None, :]
    nq, nk = noisy[:, :, None], noisy[:, None, :]
    sees = torch.where(nq, (nk & (bk == bq)) | (~nk & (bk < bq)), ~nk & (bk <= bq))
    return sees & valid[:, :, None] & valid[:, None, :]


def two_copy_layout(
    tokens: torch.Tensor, canvas: torch.Tensor, lengths: torch.Tensor, block_length: int, pad_id: int
) -> TwoCopyLayout:
    """The layout of a training batch: tokens [B, T] (prompt, then the canvas, then padding),
    canvas [B, T] bool (the canvas columns, which follow each prompt), lengths [B] (the sequence
    ends). The noisy copy of row b covers positions [floor(P_b / bl) * bl, lengths[b]), P_b its prompt
    length; its last block may be partial, as a sequence's last block is when decoding. The clean
    copy covers [0, floor((lengths[b] - 1) / bl) * bl)."""
    B, T = tokens.shape
    n_tokens = lengths.long()
    prompt = canvas.long().argmax(1)  # the first canvas column
    first = prompt // block_length * block_length
    n_noisy = n_tokens - first
    n_clean = (n_tokens - 1) // block_length * block_length  # up to the last block
    widths = n_noisy + n_clean
    # At least the noisy copy's whole blocks wide, so its blocks can be viewed as [B, NB, bl].
    blocks = -(-int(n_noisy.max()) // block_length)
    W = max(int(widths.max()), blocks * block_length)
    col = torch.arange(W)[None, :]
    noisy = col < n_noisy[:, None]
    valid = col < widths[:, None]
    positions = torch.where(noisy, first[:, None] + col, col - n_noisy[:, None])
    positions = torch.where(valid, positions, 0)
    layout_tokens = torch.where(valid, tokens.gather(1, positions.clamp(max=T - 1)), pad_id)
    candidates = noisy & (positions >= prompt[:, None])
    return TwoCopyLayout(
        layout_tokens,
        positions,
        noisy,
        valid,
        candidates,
        widths.to(torch.int32),
        attention_mask(positions, noisy, valid, block_length),
    )


def mask_blocks(layout: TwoCopyLayout, block_length: int, gen: torch.Generator):
    """(masked [B, W] bool, weight [B, W] float): each noisy block's L candidate columns get l of them
    masked (l uniform over 1..L, stratified over the batch's blocks: one uniform shifted by g / G for
    the g-th of its G blocks), and every column of the block the weight L / l (read on masked ones)."""
    B, W = layout.tokens.shape
    blocks = -(-int(layout.noisy.sum(1).max()) // block_length)
    width = blocks * block_length  # the noisy copy starts at column 0, on a block boundary
    cand = layout.candidates[:, :width].view(B, blocks, block_length)
    L = cand.sum(-1)  # [B, NB] candidates per block (0: no block there, or prompt only)
    trained = L > 0
    G = int(trained.sum())
    u = torch.zeros(B, blocks)
    u[trained] = (torch.rand(1, generator=gen) + torch.arange(G) / G) % 1
    l = torch.minimum((u * L).long() + 1, L)
    score = torch.rand(B, blocks, block_length, generator=gen).masked_fill(~cand, 2.0)  # non-candidates last
    masked = cand & (score.argsort(-1).argsort(-1) < l[..., None])
    weight = torch.where(trained, L / l.clamp(min=1), 0.0)[..., None].expand(B, blocks, block_length)
    out_masked = torch.zeros(B, W, dtype=torch.bool)
    out_weight = torch.zeros(B, W)
    out_masked[:, :width] = masked.reshape(B, width)
    out_weight[:, :width] = weight.reshape(B, width)
    return out_masked, out_weight


def corrupt_blocks(
    layout: TwoCopyLayout,
    masked: torch.Tensor,
    block_length: int,
    edit_fraction: float,
    noise_ids: torch.Tensor,
    gen: torch.Generator,
):
    """(corrupted [B, W] bool, noise [B, W] int64): LLaDA2.1's token-to-token noise on the blocks
    `mask_blocks` masked. Each noisy block draws p ~ U(0, edit_fraction) and replaces each of its
    visible candidates (candidates not `masked`) with probability p by a token drawn uniformly from
    `noise_ids` (1-D: the tokens a decoder may write) other than the true one, so a corrupted token is
    always wrong; `noise` holds that token on corrupted columns and the layout's token elsewhere."""
    if not 0 < edit_fraction <= 1:
        raise ValueError(f"edit_fraction: expected in (0, 1], got {edit_fraction}")
    if noise_ids.dim() != 1 or noise_ids.numel() < 2:
        raise ValueError(
            f"noise_ids: expected a 1-D tensor of at least 2 token ids, got {tuple(noise_ids.shape)}"
        )
    B, W = layout.tokens.shape
    blocks = -(-W // block_length)
    p = edit_fraction * torch.rand(B, blocks, generator=gen)
    p = p.repeat_interleave(block_length, 1)[:, :W]  # each column its block's p
    visible = layout.candidates & ~masked
    corrupted = visible & (torch.rand(B, W, generator=gen) < p)
    # uniform over noise_ids without the true token: draw among the first n - 1, and where that is
    # the true token take the last one instead
    n = noise_ids.numel()
    draw = noise_ids[torch.randint(0, n - 1, (B, W), generator=gen)]
    draw = torch.where(draw == layout.tokens, noise_ids[-1], draw)
    return corrupted, torch.where(corrupted, draw, layout.tokens)
