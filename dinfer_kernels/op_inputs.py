"""One input factory per op: the arguments of a valid call at given sizes, built in this one place for
the tests, the fuzz suite, the selftest and the benchmarks.

Each factory returns a dict of the op's arguments by name (the op's and its reference's names), so
`dk.<op>(**inputs, backend=b)` and `<op>_reference(**inputs)` run the same call. Values come from
`generator` (a torch.Generator, drawn on its device; None: torch's global generator, on `device`). The
keyword options pick the distribution a caller needs (how many rows are masked, how confident the
logits are, how large the weights); the defaults are those of the selftest. INPUTS maps each op
(dinfer_kernels.ops.OPS) to its factory.
"""

import functools
from typing import Optional, Sequence

import torch

from .fp8 import fp8_block_quantize
from .ops import OPS
from .ops.rope import rope_table

F32 = torch.float32


def _factory(build):
    """A factory that draws its values on its generator's device (benchmarks seed a CPU generator for
    inputs on any device) and returns them on `device`."""

    @functools.wraps(build)
    def factory(*args, device="cpu", generator=None, **kw):
        drawn_on = generator.device if generator is not None else torch.device(device)
        inputs = build(*args, device=drawn_on, generator=generator, **kw)
        return {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in inputs.items()}

    return factory


def _randn(shape, generator, device, scale=1.0):
    return torch.randn(*shape, generator=generator, device=device) * scale


def _mask_rows(tokens, masked_frac, mask_id, generator):
    """Sets a share masked_frac (on average) of the rows of tokens to mask_id."""
    masked = torch.rand(tokens.shape, generator=generator, device=tokens.device) < masked_frac
    tokens[masked] = mask_id
    return tokens


@_factory
def decode_step_inputs(
    N: int,
    V: int,
    *,
    dtype=F32,
    device="cpu",
    generator=None,
    seq_offsets: Optional[Sequence[int]] = None,
    mask_id: Optional[int] = None,
    masked_frac: float = 0.7,
    scale: float = 3.0,
    peak_rows: float = 0.0,
    peak: tuple = (20.0, 20.0),
) -> dict:
    """logits [N, V] (scale * randn; a share peak_rows of the rows, every 1 / peak_rows-th, gets a peak
    of a height in [peak[0], peak[1]] at a random token, so that it clears a threshold), tokens [N]
    (random, a share masked_frac masked), seq_offsets (default one sequence [0, N]) and mask_id
    (default V // 2)."""
    z = _randn((N, V), generator, device, scale)
    if peak_rows:
        rows = torch.arange(N, device=device) % round(1 / peak_rows) == 0
        at = torch.randint(0, V, (int(rows.sum()),), generator=generator, device=device)
        lo, hi = peak
        z[rows, at] += lo + (hi - lo) * torch.rand(at.shape, generator=generator, device=device)
    mask_id = V // 2 if mask_id is None else mask_id
    tokens = torch.randint(0, V, (N,), generator=generator, device=device)
    offsets = [0, N] if seq_offsets is None else list(seq_offsets)
    return dict(
        logits=z.to(dtype),
        tokens=_mask_rows(tokens, masked_frac, mask_id, generator),
        seq_offsets=torch.tensor(offsets, dtype=torch.int32, device=device),
        mask_id=mask_id,
    )


@_factory
def soft_embedding_inputs(
    M: int,
    V: int,
    d: int,
    *,
    dtype=F32,
    device="cpu",
    generator=None,
    logits_dtype=None,
    masked_frac: float = 0.5,
    scale: float = 3.0,
    embedding_scale: float = 1.0,
    mask_id: Optional[int] = None,
    weight=0.3,
) -> dict:
    """logits [M, V] (scale * randn, in logits_dtype, default dtype), embedding [V, d]
    (embedding_scale * randn), tokens [M] (a share masked_frac masked), mask_id (default V // 2) and
    weight."""
    mask_id = V // 2 if mask_id is None else mask_id
    logits = _randn((M, V), generator, device, scale).to(logits_dtype or dtype)
    embedding = _randn((V, d), generator, device, embedding_scale).to(dtype)
    tokens = torch.randint(0, V, (M,), generator=generator, device=device)
    return dict(
        logits=logits,
        embedding=embedding,
        tokens=_mask_rows(tokens, masked_frac, mask_id, generator),
        mask_id=mask_id,
        weight=weight,
    )


@_factory
def rms_norm_inputs(
    shape: Sequence[int], *, dtype=F32, device="cpu", generator=None, scale: float = 3.0, eps: float = 1e-6
) -> dict:
    """x of `shape` (scale * randn), weight [shape[-1]] in [0.5, 1.5) and eps."""
    return dict(
        x=_randn(shape, generator, device, scale).to(dtype),
        weight=(torch.rand(shape[-1], generator=generator, device=device) + 0.5).to(dtype),
        eps=eps,
    )


@_factory
def rope_inputs(
    B: int,
    T: int,
    H: int,
    D: int,
    *,
    dtype=F32,
    device="cpu",
    generator=None,
    max_position: int = 32768,
    theta: float = 500000.0,
) -> dict:
    """x [B, T, H, D] (randn), positions [B, T] int64 in [0, max_position) and theta."""
    return dict(
        x=_randn((B, T, H, D), generator, device).to(dtype),
        positions=torch.randint(0, max_position, (B, T), generator=generator, device=device),
        theta=theta,
    )


@_factory
def qk_rope_inputs(
    B: int,
    T: int,
    Hq: int,
    Hk: int,
    D: int,
    *,
    rotary_dim: Optional[int] = None,
    norm: bool = True,
    dtype=F32,
    device="cpu",
    generator=None,
    max_position: int = 32768,
    theta: float = 500000.0,
    scale: float = 3.0,
    eps: float = 1e-6,
) -> dict:
    """q [B, T, Hq, D] and k [B, T, Hk, D] (scale * randn), positions [B, T] int64 in
    [0, max_position), the table of those positions (rope_table(theta, rotary_dim (default D),
    max_position)) and, with `norm`, QK-norm weights q_norm, k_norm [D] in [0.5, 1.5) and eps."""
    inputs = dict(
        q=_randn((B, T, Hq, D), generator, device, scale).to(dtype),
        k=_randn((B, T, Hk, D), generator, device, scale).to(dtype),
        positions=torch.randint(0, max_position, (B, T), generator=generator, device=device),
        table=rope_table(theta, D if rotary_dim is None else rotary_dim, max_position, device),
    )
    if norm:
        for name in ("q_norm", "k_norm"):
            inputs[name] = (torch.rand(D, generator=generator, device=device) + 0.5).to(dtype)
        inputs["eps"] = eps
    return inputs


def paged_caches(caches, page_size, seq_lens=None, *, seed=0, extra_pages=2, shuffle=True, absent=False):
    """Contiguous attention caches [B, S, Hkv, D] laid out page by page in page pools (vLLM style):
    ([pool [P, page_size, Hkv, D] per cache], block_table [B, MP] int32) with MP = ceil(S / page_size)
    and P = B * MP + extra_pages, so that sequence b's position s holds caches[b, s]. Page ids are a
    random permutation of the pool (shuffle) or in order (the pool is then the caches' own memory
    when S divides into pages and extra_pages is 0: a view, no copy). Pool rows past S and the pages
    no sequence uses hold NaN (never read). absent (needs seq_lens): each page wholly at or past
    seq_lens[b] gets an id outside the pool (-1 or >= P) with probability 1/2."""
    B, S = caches[0].shape[:2]
    MP = -(-S // page_size)
    P = B * MP + extra_pages
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(P, generator=g) if shuffle else torch.arange(P)
    table = ids[: B * MP].view(B, MP).to(torch.int32)
    if not shuffle and extra_pages == 0 and S == MP * page_size:
        pools = [c.view(P, page_size, *c.shape[2:]) for c in caches]
    else:
        pools = []
        for c in caches:
            pool = torch.full((P, page_size, *c.shape[2:]), float("nan"), dtype=c.dtype, device=c.device)
            padded = torch.full(
                (B, MP * page_size, *c.shape[2:]), float("nan"), dtype=c.dtype, device=c.device
            )
            padded[:, :S] = c
            pool[table.flatten().long()] = padded.view(B * MP, page_size, *c.shape[2:])
            pools.append(pool)
    if absent:
        past = torch.arange(MP)[None, :] * page_size >= seq_lens[:, None].long()
        coin = torch.rand(B, MP, generator=g) < 0.5
        bad = torch.where(
            torch.rand(B, MP, generator=g) < 0.5, -1, P + int(torch.randint(4, (1,), generator=g))
        )
        table = torch.where(past & coin, bad.to(torch.int32), table)
    return pools, table.to(caches[0].device)


@_factory
def attention_inputs(
    B: int,
    W: int,
    S: int,
    Hq: int,
    Hkv: int,
    D: int,
    *,
    dtype=F32,
    device="cpu",
    generator=None,
    page_size: Optional[int] = None,
    spare_pages: int = 3,
    scattered: bool = False,
) -> dict:
    """A window of W rows refreshed in place, at a random start in each of B caches of S rows, with
    keys past the window too: q [B, W, Hq, D], k, v [B, W, Hkv, D], k_cache, v_cache [B, S, Hkv, D]
    (randn), positions [B, W] int64, seq_lens [B] int32. scattered: each row at its own random
    position of [0, S) and seq_lens anywhere in [0, S] (rows at or past it are padding). With
    page_size, the caches are page pools (paged_caches: pages in shuffled order, spare_pages more than
    the table names) and block_table [B, MP] int32."""
    r = lambda *s: _randn(s, generator, device).to(dtype)
    q, k, v, kc, vc = r(B, W, Hq, D), r(B, W, Hkv, D), r(B, W, Hkv, D), r(B, S, Hkv, D), r(B, S, Hkv, D)
    if scattered:
        perm = lambda: torch.randperm(S, generator=generator, device=device)[:W]
        positions = torch.stack([perm() for _ in range(B)])
        seq_lens = torch.randint(0, S + 1, (B,), generator=generator, device=device, dtype=torch.int32)
    else:
        u = lambda: torch.rand(B, generator=generator, device=device)
        start = (u() * (S - W + 1)).long()
        extra = (u() * (S - W - start + 1)).long()  # keys past the window
        positions = start[:, None] + torch.arange(W, device=device)
        seq_lens = (start + W + extra).to(torch.int32)
    args = dict(q=q, k=k, v=v, k_cache=kc, v_cache=vc, positions=positions, seq_lens=seq_lens)
    if page_size is None:
        return args
    (pools_k, pools_v), table = paged_caches((kc, vc), page_size, extra_pages=spare_pages)
    return dict(args, k_cache=pools_k, v_cache=pools_v, block_table=table)


@_factory
def moe_inputs(
    T: int,
    E: int,
    H: int,
    I: int,
    top_k: int = 2,
    *,
    dtype=F32,
    device="cpu",
    generator=None,
    weight_scale: float = 0.9,
    router_scale: float = 0.2,
    shared_inter: int = 0,
    bias_scale: float = 0.0,
    fp8: bool = False,
) -> dict:
    """hidden [T, H] (randn), router_weight [E, H] fp32 (router_scale * randn), w13 [E, 2I, H] and
    w2 [E, H, I] (weight_scale / sqrt(fan-in) * randn) and top_k. shared_inter S > 0: a shared expert
    too, shared_w13 [2S, H] and shared_w2 [H, S] (drawn as the experts are); bias_scale > 0:
    expert_bias [E] fp32 (bias_scale * randn). fp8: every expert weight (the shared ones too) as
    float8_e4m3fn with its 128 x 128 block scales (fp8_block_quantize of the drawn fp32 values, the
    gate/up stacks with halves=2): w13_scale, w2_scale (shared_w13_scale, shared_w2_scale). The
    options draw after the defaults, so a default call's values are the same with or without them."""
    inputs = dict(
        hidden=_randn((T, H), generator, device).to(dtype),
        router_weight=_randn((E, H), generator, device, router_scale),
        w13=_randn((E, 2 * I, H), generator, device, weight_scale / H**0.5),
        w2=_randn((E, H, I), generator, device, weight_scale / I**0.5),
        top_k=top_k,
    )
    gate_up = {"w13"}
    if shared_inter > 0:
        S = shared_inter
        inputs["shared_w13"] = _randn((2 * S, H), generator, device, weight_scale / H**0.5)
        inputs["shared_w2"] = _randn((H, S), generator, device, weight_scale / S**0.5)
        gate_up.add("shared_w13")
    if bias_scale > 0:
        inputs["expert_bias"] = _randn((E,), generator, device, bias_scale)
    for name in ("w13", "w2", "shared_w13", "shared_w2"):
        if name in inputs:
            if fp8:
                halves = 2 if name in gate_up else 1
                inputs[name], inputs[f"{name}_scale"] = fp8_block_quantize(inputs[name], halves=halves)
            else:
                inputs[name] = inputs[name].to(dtype)
    return inputs


# Every op's factory, by the op's name: <op>_inputs above (a missing one fails the import).
INPUTS = {op: globals()[f"{op}_inputs"] for op in OPS}
