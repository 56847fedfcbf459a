"""Counter-based RNG shared by every backend (the spec for sampling noise).

One uniform number per (seed, offset, row key, vocab index), with no state: a rerun with the same
(seed, offset, row keys) reproduces, and every backend (torch, C++, CUDA, Triton) draws the same
noise. All arithmetic is on 32-bit unsigned integers; seed and offset are in [0, 2**32). A row's key
is its row index n unless the caller gives per-row keys (only their low 32 bits count): the engine
keys a row on its request, position and iteration, so that where a request sits in a batch never
changes its samples (dinfer/generate.py).

    h  = mix(mix(mix(mix(seed ^ GOLDEN) ^ offset) ^ row_key) ^ v)
    u  = ((h >> 9) + 0.5) / 2**23            # 24 significant bits: exact in fp32, inside (0, 1)
    g  = -log(-log(u))                        # standard Gumbel noise

mix is a 32-bit avalanche hash (xorshift-multiply, two rounds).
"""

import torch

GOLDEN = 0x9E3779B9
MIX_MUL1 = 0x7FEB352D
MIX_MUL2 = 0x846CA68B
_U32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Avalanche hash of uint32 values held in an int64 tensor (wrapping multiply, low 32 bits kept)."""
    x = x ^ (x >> 16)
    x = (x * MIX_MUL1) & _U32
    x = x ^ (x >> 15)
    x = (x * MIX_MUL2) & _U32
    return x ^ (x >> 16)


def row_keys(seed: int, offset: int, rows: torch.Tensor) -> torch.Tensor:
    """Per-row key mix(mix(mix(seed ^ GOLDEN) ^ offset) ^ row) for int64 row indices."""
    k = mix32(torch.tensor(seed ^ GOLDEN, dtype=torch.int64))
    k = mix32(k ^ offset)
    return mix32(k ^ rows.to(torch.int64))


def _row_counters(num_rows: int, device, rows) -> torch.Tensor:
    return torch.arange(num_rows, device=device) if rows is None else rows.to(torch.int64) & _U32


def _uniform_of(keys: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The uniforms of row keys `keys` [N, 1] at vocabulary ids `v` (broadcast against keys)."""
    h = mix32(keys ^ v)
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def uniform(
    seed: int, offset: int, num_rows: int, vocab: int, device=None, rows=None, vocab_start: int = 0
) -> torch.Tensor:
    """[num_rows, vocab] fp32 uniforms in (0, 1) of the ids [vocab_start, vocab_start + vocab) (a
    vocabulary shard draws the same noise as the whole row: the hash is keyed on the global id).
    rows: [num_rows] integer row keys (default: the row indices), of which the low 32 bits are used."""
    keys = row_keys(seed, offset, _row_counters(num_rows, device, rows))
    v = torch.arange(vocab_start, vocab_start + vocab, device=device, dtype=torch.int64)
    return _uniform_of(keys[:, None], v[None, :])


def gumbel(
    seed: int, offset: int, num_rows: int, vocab: int, device=None, rows=None, vocab_start: int = 0
) -> torch.Tensor:
    """[num_rows, vocab] fp32 Gumbel noise -log(-log(u)); rows and vocab_start as in uniform()."""
    u = uniform(seed, offset, num_rows, vocab, device, rows, vocab_start)
    return -torch.log(-torch.log(u))


def gumbel_at(seed: int, offset: int, ids: torch.Tensor, rows=None) -> torch.Tensor:
    """[N, K] fp32 Gumbel noise of row n at token ids[n, k] (any int dtype, values taken mod 2**32):
    gumbel()'s value at those ids, without the [N, V] table. rows as in uniform()."""
    keys = row_keys(seed, offset, _row_counters(ids.shape[0], ids.device, rows))
    u = _uniform_of(keys[:, None], ids.to(torch.int64) & _U32)
    return -torch.log(-torch.log(u))


def sequence_key(tokens, repeat: int = 0) -> int:
    """A uint32 key of a token sequence (its ids and length), for keying sampling on a request's
    content: every token mixed with its position, summed mod 2**32, mixed with the length, then
    with `repeat` (the how-manieth copy of this prompt in the run, so that copies sample apart)."""
    t = torch.as_tensor(tokens, dtype=torch.int64).flatten() & _U32
    spread = mix32(t ^ mix32(torch.arange(t.numel(), dtype=torch.int64) ^ GOLDEN))
    key = mix32(torch.tensor((int(spread.sum()) & _U32) ^ t.numel(), dtype=torch.int64))
    return int(mix32(key ^ mix32(torch.tensor(repeat, dtype=torch.int64) & _U32)))


def request_row_keys(
    request_keys: torch.Tensor, positions: torch.Tensor, iterations: torch.Tensor
) -> torch.Tensor:
    """[B, L] row keys mix(mix(mix(request) ^ position) ^ iteration) for B requests (keys [B]),
    their absolute positions [B, L] and their own iteration counts [B]: what a request samples then
    depends on nothing but itself, not on the batch it runs in."""
    k = mix32(request_keys.to(torch.int64) & _U32)
    k = mix32(k[:, None] ^ (positions.to(torch.int64) & _U32))
    return mix32(k ^ (iterations.to(torch.int64) & _U32)[:, None])
