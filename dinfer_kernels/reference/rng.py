"""Counter-based RNG shared by every backend (the spec for sampling noise).

One uniform number per (seed, offset, row, vocab index), with no state: a rerun with the same
(seed, offset) reproduces, and every backend (torch, C++, CUDA, Triton) draws the same noise.
All arithmetic is on 32-bit unsigned integers; seed and offset are in [0, 2**32).

    h  = mix(mix(mix(mix(seed ^ GOLDEN) ^ offset) ^ row) ^ v)
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


def uniform(seed: int, offset: int, num_rows: int, vocab: int, device=None) -> torch.Tensor:
    """[num_rows, vocab] fp32 uniforms in (0, 1)."""
    keys = row_keys(seed, offset, torch.arange(num_rows, device=device))
    v = torch.arange(vocab, device=device, dtype=torch.int64)
    h = mix32(keys[:, None] ^ v[None, :])
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def gumbel(seed: int, offset: int, num_rows: int, vocab: int, device=None) -> torch.Tensor:
    """[num_rows, vocab] fp32 Gumbel noise -log(-log(u))."""
    u = uniform(seed, offset, num_rows, vocab, device)
    return -torch.log(-torch.log(u))
