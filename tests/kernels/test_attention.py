"""dinfer_kernels.attention: every available backend against an fp64 reference (precision-tied
tolerance), the block-sparse masks and statistics outputs, the in-place refresh (poisoned cache rows
must stay untouched), poisoned outputs, the torch.library registration and clear errors.

Triton runs in the interpreter on the host (fp16/fp32 only: the interpreter's bf16 arithmetic is not
faithful); the large shapes and bf16 run only on a GPU."""

import importlib
import math

import pytest
import torch
from conftest import assert_precision, device_backends

import dinfer_kernels as dk
from dinfer_kernels import _backend
from dinfer_kernels.op_inputs import paged_caches
from dinfer_kernels.reference.attention import attention_reference, block_mask_dense

# The interpreter runs the kernels in numpy: -inf arithmetic and the NaN-poisoned padding rows raise
# numpy RuntimeWarnings there (the kernels mask those values; the GPU computes them silently).
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def attention_backends():
    """conftest's (backend, device) pairs, restricted to the backends that implement attention."""
    return [(b, d) for b, d in device_backends() if b in _backend.available_backends(d, "attention")]


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def make_case(B, W, S, Hq, Hkv, D, dtype, seed=0, aligned=None):
    """Random window rows over a poisoned cache: the cache rows at or past seq_len are NaN or 1e3
    (alternately: never attended, never overwritten), half the padding rows' q are NaN, their k/v 777
    (never written). aligned=block_len: window row w at position start + w (block-causal)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)
    q, k, v = r(B, W, Hq, D), r(B, W, Hkv, D), r(B, W, Hkv, D)
    kc, vc = r(B, S, Hkv, D), r(B, S, Hkv, D)
    pos = torch.empty(B, W, dtype=torch.int64)
    lens = torch.empty(B, dtype=torch.int32)
    for b in range(B):
        if aligned:
            starts = list(range(0, S - W + 1, aligned))
            start = starts[int(torch.randint(len(starts), (1,), generator=g))]
            pos[b] = start + torch.arange(W)
            lens[b] = S if b == 0 else start + 1 + int(torch.randint(W, (1,), generator=g))
            continue
        if b == 0 and W <= S:
            L, n_valid = S, W
        else:
            L = 0 if S == 1 else S - 1 - int(torch.randint(max(1, S // 3), (1,), generator=g))
            n_valid = min(W - max(1, W // 4), L) if W > 1 else 0
        start = int(torch.randint(L - n_valid + 1, (1,), generator=g))
        rows = torch.cat(
            [
                start + torch.arange(n_valid),
                torch.randint(L, S, (W - n_valid,), generator=g)
                if W > n_valid
                else torch.empty(0, dtype=torch.int64),
            ]
        )
        pos[b] = rows[torch.randperm(W, generator=g)]
        lens[b] = L
    pad_row = pos >= lens[:, None].long()
    q[pad_row & (torch.arange(W) % 2 == 0)] = float("nan")  # the other padding rows keep finite q
    k[pad_row] = 777.0
    v[pad_row] = 777.0
    past = torch.arange(S)[None, :] >= lens[:, None].long()
    for t in (kc, vc):
        t[past & (torch.arange(S) % 2 == 0)] = float("nan")
        t[past & (torch.arange(S) % 2 == 1)] = 1e3
    return q, k, v, kc, vc, pos, lens


def random_block_mask(B, Hkv, W, S, q_block, kv_block, seed=0, p=0.6, empty_lists=True):
    """Random lists in shuffled order, garbage past the counts, some lists empty."""
    g = torch.Generator().manual_seed(seed)
    nqb, nkb = -(-W // q_block), -(-S // kv_block)
    dense = torch.rand(B, Hkv, nqb, nkb, generator=g) < p
    if empty_lists:
        dense[0, 0, 0] = False
        dense[-1, -1, -1] = False
    bm = dk.BlockMask.from_dense(dense, q_block, kv_block)
    counts, idx = bm.kv_num_blocks, bm.kv_indices.clone()
    for b in range(B):
        for h in range(Hkv):
            for j in range(nqb):
                c = int(counts[b, h, j])
                idx[b, h, j, :c] = idx[b, h, j, :c][torch.randperm(c, generator=g)]
                idx[b, h, j, c:] = torch.randint(-3, nkb + 3, (nkb - c,), generator=g).to(torch.int32)
    return dk.BlockMask(counts, idx, q_block, kv_block), dense


def block_mask_for(kind, B, Hkv, W, S, seed=0, pos=None):
    if kind is None:
        return None
    if kind == "random":
        return random_block_mask(B, Hkv, W, S, q_block=5, kv_block=48, seed=seed)[0]
    if kind == "random64":
        return random_block_mask(B, Hkv, W, S, q_block=16, kv_block=64, seed=seed)[0]
    if kind == "random96":  # key blocks of two 64-key tiles, the second one partial
        return random_block_mask(B, Hkv, W, S, q_block=8, kv_block=96, seed=seed)[0]
    if kind == "causal":
        return dk.BlockMask.block_causal(B, Hkv, W, S, block_len=32, q_block=16, kv_block=32, start=pos[:, 0])
    if kind == "full":
        return dk.BlockMask.full(B, Hkv, W, S, q_block=8, kv_block=16)
    raise ValueError(kind)


def _to(bm, device):
    return (
        None
        if bm is None
        else dk.BlockMask(bm.kv_num_blocks.to(device), bm.kv_indices.to(device), bm.q_block, bm.kv_block)
    )


F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16
# (id, B, W, S, Hq, Hkv, D, dtype, mask kind, write_back, where): where = "all" or "gpu" (too big for
# the interpreter; the torch backend runs them too)
CASES = [
    ("w1_s1", 2, 1, 1, 2, 2, 64, F32, None, True, "all"),
    ("w1_s63_gqa4_random", 1, 1, 63, 4, 1, 128, F16, "random", False, "all"),
    ("w17_s63_causal", 2, 17, 63, 2, 2, 64, F16, "causal", True, "all"),
    ("w17_s1000_gqa4_random", 2, 17, 1000, 4, 1, 64, F16, "random96", False, "all"),
    ("w17_s1000_full_fp32", 1, 17, 1000, 2, 1, 128, F32, None, True, "all"),
    ("w96_s63_gqa4_padded", 1, 96, 63, 4, 1, 64, F16, "full", False, "all"),
    ("w96_s1000_random", 1, 96, 1000, 2, 2, 64, F16, "random", True, "all"),
    ("w96_s4096_gqa4_random", 2, 96, 4096, 16, 4, 128, BF16, "random64", True, "gpu"),
    ("w96_s4096_mha", 1, 96, 4096, 16, 16, 128, BF16, None, False, "gpu"),
    ("w96_s4096_causal", 2, 96, 4096, 8, 2, 64, F16, "causal", True, "gpu"),
    ("w1000_s1000_refresh", 1, 1000, 1000, 8, 2, 128, BF16, "random64", True, "gpu"),
    ("w1_s4096_gqa4", 3, 1, 4096, 8, 2, 64, BF16, None, False, "gpu"),
]


def _case_params():
    out = []
    for backend, device in attention_backends():
        for c in CASES:
            skip = backend == "triton" and device == "cpu" and (c[-1] == "gpu" or c[7] == BF16)
            if backend in ("torch", "cpu") and c[-1] == "gpu" and c[2] * c[3] > 10**5:
                skip = True  # the fp64 reference: too slow on the host
            marks = [pytest.mark.skip(reason="too big or bf16 for the interpreter")] if skip else []
            out.append(pytest.param(backend, device, c, id=f"{backend}-{device}-{c[0]}", marks=marks))
    return out


def dtype_for(backend, dtype):
    """The CUDA kernels take bf16/fp16 only: their fp32 cases run in fp16 (same shapes and masks)."""
    return F16 if backend == "cuda" and dtype == F32 else dtype


def _check_call(backend, device, case, want_lse=True, want_mass=True):
    name, B, W, S, Hq, Hkv, D, dtype, kind, write_back, _ = case
    dtype = dtype_for(backend, dtype)
    aligned = 32 if kind == "causal" else None
    q, k, v, kc, vc, pos, lens = make_case(B, W, S, Hq, Hkv, D, dtype, aligned=aligned)
    bm = block_mask_for(kind, B, Hkv, W, S, pos=pos)
    want_mass = want_mass and bm is not None
    dev = lambda t: t.to(device)
    kc_d, vc_d = kc.clone().to(device), vc.clone().to(device)
    res = dk.attention(
        dev(q),
        dev(k),
        dev(v),
        kc_d,
        vc_d,
        dev(pos),
        dev(lens),
        write_back=write_back,
        block_mask=_to(bm, device),
        return_lse=want_lse,
        return_block_mass=want_mass,
        backend=backend,
    )
    res = (res,) if not isinstance(res, tuple) else res
    res = [t.cpu() for t in res]
    kw = dict(block_mask=bm, return_lse=want_lse, return_block_mass=want_mass)
    truth = attention_reference(
        q, k, v, kc.clone(), vc.clone(), pos, lens, write_back, compute_dtype=torch.float64, **kw
    )
    same = attention_reference(q, k, v, kc.clone(), vc.clone(), pos, lens, write_back, **kw)
    truth = (truth,) if not isinstance(truth, tuple) else truth
    same = (same,) if not isinstance(same, tuple) else same
    assert len(res) == len(truth) == 1 + want_lse + want_mass
    assert res[0].dtype == dtype and res[0].shape == (B, W, Hq, D)
    names = ["out"] + (["lse"] if want_lse else []) + (["block_mass"] if want_mass else [])
    for nm, got, s, t in zip(names, res, same, truth):
        assert got.shape == t.shape, nm
        if nm != "out":
            assert got.dtype == torch.float32, nm
        assert_precision(got, s, t, f"{name}: {nm}")

    # padding rows: output exactly 0, lse -inf
    pad = pos >= lens[:, None].long()
    assert torch.equal(res[0][pad], torch.zeros_like(res[0][pad]))
    if want_lse:
        assert torch.isneginf(res[1][pad]).all()
    if want_mass:
        # summed over the key blocks: one per valid row that attends at least one key
        lse64 = attention_reference(
            q,
            k,
            v,
            kc.clone(),
            vc.clone(),
            pos,
            lens,
            write_back,
            compute_dtype=torch.float64,
            block_mask=bm,
            return_lse=True,
        )[1]
        rows_with_keys = torch.isfinite(lse64).sum(1)  # [B, Hq]
        torch.testing.assert_close(
            res[-1].sum(-1).double(), rows_with_keys.double(), rtol=0, atol=1e-4 * max(W, 1)
        )

    # the cache: valid window rows hold the fresh k/v with write_back, nothing else changed
    kc_after, vc_after = kc_d.cpu(), vc_d.cpu()
    want_k, want_v = kc.clone(), vc.clone()
    if write_back:
        for b in range(B):
            for w in range(W):
                if not pad[b, w]:
                    want_k[b, pos[b, w]] = k[b, w]
                    want_v[b, pos[b, w]] = v[b, w]
    assert torch.equal(_bits(kc_after), _bits(want_k)), "k_cache: rows outside the window changed"
    assert torch.equal(_bits(vc_after), _bits(want_v)), "v_cache: rows outside the window changed"


@pytest.mark.parametrize("backend,device,case", _case_params())
@pytest.mark.usefixtures("host_isa")
def test_matches_reference(backend, device, case):
    _check_call(backend, device, case)


@pytest.mark.parametrize("backend,device", attention_backends())
@pytest.mark.parametrize("extras", [(False, False), (True, False), (False, True)])
@pytest.mark.usefixtures("host_isa")
def test_extras_combinations(backend, device, extras):
    _check_call(backend, device, ("extras", 2, 9, 100, 4, 2, 64, F32, "random", True, "all"), *extras)


# ---- the kernel backends through their internal signature -----------------------------------------


def kernel_backends():
    return [(b, d) for b, d in attention_backends() if b != "torch"]


def _impl(backend):
    return importlib.import_module(f"dinfer_kernels.{backend}.attention").attention


@pytest.mark.parametrize("backend,device", kernel_backends())
@pytest.mark.parametrize("with_lse,with_mass", [(True, True), (False, True), (True, False), (False, False)])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.usefixtures("host_isa")
def test_internal_signature_poisoned_outputs(backend, device, with_lse, with_mass, paged):
    """Every element of out / lse / block_mass is written, whatever was in the buffers (contiguous
    caches, or page pools of 7-row pages with absent pages past seq_lens)."""
    B, W, S, Hq, Hkv, D = 2, 9, 70, 4, 2, 64
    q, k, v, kc, vc, pos, lens = make_case(B, W, S, Hq, Hkv, D, F16, seed=3)
    table = None
    if paged:
        (kc, vc), table = paged_caches((kc, vc), 7, lens, seed=3, absent=True)
    bm, _ = random_block_mask(B, Hkv, W, S, q_block=4, kv_block=16, seed=3)
    dev = lambda t: None if t is None else t.to(device)
    nkb = -(-S // 16)
    out = torch.full((B, W, Hq, D), float("nan"), dtype=F16, device=device)
    lse = torch.full((B, W, Hq), float("nan"), device=device) if with_lse else None
    mass = torch.full((B, Hq, nkb), float("nan"), device=device) if with_mass else None
    _impl(backend)(
        dev(q),
        dev(k),
        dev(v),
        kc.clone().to(device),
        vc.clone().to(device),
        dev(pos),
        dev(lens),
        dev(table),
        dev(bm.kv_num_blocks),
        dev(bm.kv_indices),
        out,
        lse,
        mass,
        write_back=True,
        q_block=4,
        kv_block=16,
        scale=0.125,
    )
    same, truth = (
        attention_reference(
            q,
            k,
            v,
            kc.clone(),
            vc.clone(),
            pos,
            lens,
            True,
            None,
            0.125,
            compute_dtype=cd,
            block_mask=bm,
            return_lse=True,
            return_block_mass=True,
            block_table=table,
        )
        for cd in (torch.float32, torch.float64)
    )
    assert_precision(out.cpu(), same[0], truth[0], "out")
    if with_lse:
        assert_precision(lse.cpu(), same[1], truth[1], "lse")
    if with_mass:
        assert_precision(mass.cpu(), same[2], truth[2], "block_mass")


@pytest.mark.parametrize("backend,device", kernel_backends())
@pytest.mark.usefixtures("host_isa")
def test_out_of_range_lists_are_skipped(backend, device):
    """Counts past MAXB and indices outside [0, NKB) (unvalidated, as under capture) never read out of
    bounds: such entries are skipped, counts clamped."""
    B, W, S, Hq, Hkv, D = 1, 8, 64, 2, 1, 64
    q, k, v, kc, vc, pos, lens = make_case(B, W, S, Hq, Hkv, D, F16, seed=5)
    counts = torch.tensor([[[7]]], dtype=torch.int32)  # > MAXB = 4
    idx = torch.tensor([[[[1, -2, 9, 3]]]], dtype=torch.int32)  # NKB = 4: -2 and 9 skipped
    bm = dk.BlockMask(counts, idx, 8, 16)
    got = dk.attention(
        q.to(device),
        k.to(device),
        v.to(device),
        kc.clone().to(device),
        vc.clone().to(device),
        pos.to(device),
        lens.to(device),
        block_mask=_to(bm, device),
        backend=backend,
        validate=False,
    ).cpu()
    ok = dk.BlockMask(
        torch.tensor([[[2]]], dtype=torch.int32), torch.tensor([[[[1, 3]]]], dtype=torch.int32), 8, 16
    )
    want = attention_reference(
        q, k, v, kc.clone(), vc.clone(), pos, lens, compute_dtype=torch.float64, block_mask=ok
    )
    same = attention_reference(q, k, v, kc.clone(), vc.clone(), pos, lens, block_mask=ok)
    assert_precision(got, same, want, "out")


# ---- the host kernel ------------------------------------------------------------------------------

host_kernel = pytest.mark.skipif(
    "cpu" not in _backend.available_backends("cpu", "attention"),
    reason="dinfer_kernels._C was built without the host attention kernel",
)


@host_kernel
@pytest.mark.parametrize("D", [1, 5, 32, 96])
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("write_back", [True, False])
@pytest.mark.usefixtures("host_isa")
def test_cpu_any_head_dim_and_dtype(D, dtype, write_back):
    """The host kernel takes any head dim (the embedded models' is 32) and bf16, which the generic
    cases keep for the GPU."""
    _check_call("cpu", "cpu", (f"cpu_d{D}", 2, 13, 71, 4, 2, D, dtype, "random", write_back, "all"))


@host_kernel
@pytest.mark.usefixtures("host_isa")
def test_cpu_thread_count_does_not_change_bits():
    """A task owns its rows and its block_mass row: 1, 2 or 3 threads give the same bits."""
    B, W, S, Hq, Hkv, D = 3, 11, 90, 4, 2, 32
    q, k, v, kc, vc, pos, lens = make_case(B, W, S, Hq, Hkv, D, F32, seed=11)
    bm, _ = random_block_mask(B, Hkv, W, S, q_block=4, kv_block=16, seed=11)
    results = []
    for threads in (1, 2, 3):
        out = torch.empty(B, W, Hq, D)
        lse, mass = torch.empty(B, W, Hq), torch.empty(B, Hq, -(-S // 16))
        _backend.compiled().attention(
            q,
            k,
            v,
            kc.clone(),
            vc.clone(),
            pos,
            lens,
            out,
            lse,
            mass,
            bm.kv_num_blocks,
            bm.kv_indices,
            write_back=False,
            q_block=4,
            kv_block=16,
            scale=D**-0.5,
            num_threads=threads,
        )
        results.append((out, lse, mass))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(_bits(a), _bits(b))


@host_kernel
@pytest.mark.usefixtures("host_isa")
def test_cpu_unchecked_values_never_read_out_of_bounds():
    """Unvalidated positions (negative, past S) and seq_lens (negative, past S), as a caller of the
    binding may pass: those rows are padding (output 0, lse -inf, nothing written), the length is
    clamped to S, and the call neither crashes nor touches memory outside the arrays."""
    B, W, S, Hq, Hkv, D = 2, 6, 40, 2, 1, 8
    q, k, v = torch.randn(B, W, Hq, D), torch.randn(B, W, Hkv, D), torch.randn(B, W, Hkv, D)
    kc, vc = torch.randn(B, S, Hkv, D), torch.randn(B, S, Hkv, D)
    pos = torch.tensor([[0, 1, -5, 3, S + 7, 1 << 40], [4, -1, 6, 7, S, 9]])
    for seq_lens in ([S + 100, S], [-3, S]):
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        kc_d, vc_d = kc.clone(), vc.clone()
        out, lse = dk.attention(
            q, k, v, kc_d, vc_d, pos, lens, return_lse=True, backend="cpu", validate=False
        )
        real = lens.clamp(0, S).long()
        bad = (pos < 0) | (pos >= real[:, None])
        assert torch.equal(out[bad], torch.zeros_like(out[bad]))
        assert torch.isneginf(lse[bad]).all()
        assert torch.isfinite(out[~bad]).all() and torch.isfinite(lse[~bad]).all()
        for b in range(B):  # only the valid rows were written into the cache
            for w in range(W):
                if bad[b, w]:
                    continue
                kc[b, pos[b, w]], vc[b, pos[b, w]] = k[b, w], v[b, w]
        assert torch.equal(_bits(kc_d), _bits(kc)) and torch.equal(_bits(vc_d), _bits(vc))


@host_kernel
def test_auto_picks_the_host_kernel_on_the_host(monkeypatch):
    import dinfer_kernels.cpu.attention as host

    calls = []
    real = host.attention
    monkeypatch.setattr(host, "attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    q, k, v, kc, vc, pos, lens = make_case(1, 3, 20, 2, 2, 32, F32, seed=2)
    dk.attention(q, k, v, kc.clone(), vc.clone(), pos, lens)  # auto
    expected = [1] if "attention" in _backend.cpu_fast_ops() else []  # where it beats the reference
    assert calls == expected
    dk.attention(q, k, v, kc.clone(), vc.clone(), pos, lens, attn_mask=torch.ones(1, 3, 20, dtype=torch.bool))
    assert calls == expected  # a dense mask: the torch backend only


@pytest.mark.parametrize("backend,device", kernel_backends())
@pytest.mark.usefixtures("host_isa")
def test_split_and_single_pass_agree(backend, device, monkeypatch):
    """The split-KV + combine path and the single-pass path give the same result (and the split is
    deterministic: two calls give the same bits)."""
    if backend != "triton":
        pytest.skip("the split count of the CUDA backend is internal to it")
    import dinfer_kernels.triton.attention as ta

    B, W, S, Hq, Hkv, D = 1, 6, 300, 2, 1, 64
    q, k, v, kc, vc, pos, lens = make_case(B, W, S, Hq, Hkv, D, F16, seed=7)
    # one kv head and one query block: the only list must not be the deliberately empty one
    bm = random_block_mask(B, Hkv, W, S, q_block=16, kv_block=64, seed=7, empty_lists=False)[0]

    def args():
        return (
            q.to(device),
            k.to(device),
            v.to(device),
            kc.clone().to(device),
            vc.clone().to(device),
            pos.to(device),
            lens.to(device),
        )

    kw = dict(block_mask=_to(bm, device), return_lse=True, return_block_mass=True, backend=backend)
    assert ta.plan(B, W, S, Hq, Hkv, D, F16, True, 16, 64, bm.kv_indices.shape[-1], True)["splits"] > 1
    split = dk.attention(*args(), **kw)
    again = dk.attention(*args(), **kw)
    for a, b in zip(split, again):
        assert torch.equal(a, b)
    monkeypatch.setattr(ta, "TARGET_PROGRAMS", 1)
    single = dk.attention(*args(), **kw)
    truth = attention_reference(
        q,
        k,
        v,
        kc.clone(),
        vc.clone(),
        pos,
        lens,
        compute_dtype=torch.float64,
        block_mask=bm,
        return_lse=True,
        return_block_mass=True,
    )
    assert torch.isfinite(truth[1]).all()  # every row attends keys
    for nm, a, b, t in zip(("out", "lse", "block_mass"), split, single, truth):
        assert_precision(a.cpu(), b.cpu(), t, f"split against single pass: {nm}")


@pytest.mark.parametrize("backend,device", attention_backends())
@pytest.mark.usefixtures("host_isa")
def test_block_causal_equals_dense_mask(backend, device):
    """BlockMask.block_causal on aligned windows == the dense LLaDA2 block-causal attn_mask."""
    B, W, S, Hq, Hkv, D, bl = 2, 32, 128, 2, 1, 64, 16
    dtype = dtype_for(backend, F32)
    q, k, v, kc, vc, pos, lens = make_case(B, W, S, Hq, Hkv, D, dtype, seed=11, aligned=bl)
    start = pos[:, 0]
    bm = dk.BlockMask.block_causal(B, Hkv, W, S, bl, q_block=8, kv_block=16, start=start)
    dense = torch.arange(S)[None, None, :] < ((pos[:, :, None] // bl) + 1) * bl  # [B, W, S]
    want = dk.attention(q, k, v, kc.clone(), vc.clone(), pos, lens, attn_mask=dense, backend="torch")
    got = dk.attention(
        q.to(device),
        k.to(device),
        v.to(device),
        kc.clone().to(device),
        vc.clone().to(device),
        pos.to(device),
        lens.to(device),
        block_mask=_to(bm, device),
        backend=backend,
    )
    truth = attention_reference(
        q, k, v, kc.clone(), vc.clone(), pos, lens, attn_mask=dense, compute_dtype=torch.float64
    )
    assert_precision(got.cpu(), want, truth, "block-causal against the dense mask")


# ---- the paged layout (block_table over page pools) ---------------------------------------------


def llada2_case(B, blocks, Hq, Hkv, D, dtype, seed=0, block_len=32):
    """LLaDA2's block diffusion: sequence b has committed n_b blocks of block_len positions and
    refreshes the window [previous block | current block] (W = 2 block_len rows at positions
    (n_b - 1) block_len + w) over keys [0, (n_b + 1) block_len); S = blocks * block_len. The cache rows
    past seq_lens are poisoned (NaN, 1e3), as in make_case."""
    g = torch.Generator().manual_seed(seed)
    W, S = 2 * block_len, blocks * block_len
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)
    q, k, v = r(B, W, Hq, D), r(B, W, Hkv, D), r(B, W, Hkv, D)
    kc, vc = r(B, S, Hkv, D), r(B, S, Hkv, D)
    n = torch.randint(1, blocks, (B,), generator=g)
    pos = (n[:, None] - 1) * block_len + torch.arange(W)
    lens = ((n + 1) * block_len).to(torch.int32)
    past = torch.arange(S)[None, :] >= lens[:, None].long()
    for t in (kc, vc):
        t[past & (torch.arange(S) % 2 == 0)] = float("nan")
        t[past & (torch.arange(S) % 2 == 1)] = 1e3
    return q, k, v, kc, vc, pos, lens


def share_prefix(table, pos, lens, page_size):
    """Sequences after the first share its leading pages where no window row of the call sits and
    both attend every row (prefix sharing); returns how many pages each shares."""
    table = table.clone()
    shared = []
    for b in range(1, table.shape[0]):
        # pages wholly before both sequences' first window rows and inside both lengths
        first = int(torch.minimum(pos[0].min(), pos[b].min()))
        limit = min(first, int(lens[0]), int(lens[b]))
        m = limit // page_size
        table[b, :m] = table[0, :m]
        shared.append(m)
    return table, shared


# (id, B, W, S, page_size, Hq, Hkv, D, dtype, mask kind, write_back, where); kind "llada2": W and S
# come from llada2_case (W = 64, S = the block count given as S times 32)
PAGED_CASES = [
    ("p1_gqa2_random", 2, 7, 53, 1, 4, 2, 64, F16, "random", True, "all"),
    ("p3_causal_ro", 2, 17, 63, 3, 2, 2, 64, F32, "causal", False, "all"),
    ("p16_full_fp32", 1, 9, 100, 16, 2, 1, 128, F32, "full", True, "all"),
    ("p32_random96_ro_gqa4", 2, 12, 300, 32, 4, 1, 64, F16, "random96", False, "all"),
    ("p32_dense_gqa4", 1, 5, 200, 32, 8, 2, 64, F16, None, True, "all"),
    ("llada2_p32", 2, 64, 6, 32, 4, 1, 64, F16, "llada2", True, "all"),
    ("llada2_p3_ro", 2, 64, 5, 3, 4, 2, 64, F32, "llada2", False, "all"),
    ("llada2_p1_gqa4", 1, 64, 4, 1, 4, 1, 64, F16, "llada2", True, "all"),
    ("llada2_p16_mini", 3, 64, 64, 16, 16, 4, 128, BF16, "llada2", True, "gpu"),
    ("llada2_p32_mini_ro", 2, 64, 128, 32, 16, 4, 128, BF16, "llada2", False, "gpu"),
    ("p32_s4096_random64_ro", 2, 96, 4096, 32, 16, 4, 128, BF16, "random64", False, "gpu"),
]


def _paged_params():
    out = []
    for backend, device in attention_backends():
        for c in PAGED_CASES:
            skip = backend == "triton" and device == "cpu" and (c[-1] == "gpu" or c[8] == BF16)
            marks = [pytest.mark.skip(reason="too big or bf16 for the interpreter")] if skip else []
            out.append(pytest.param(backend, device, c, id=f"{backend}-{device}-{c[0]}", marks=marks))
    return out


def make_paged_case(case, dtype, seed=0):
    """(q, k, v, pools (k, v), block_table, positions, seq_lens, block mask) of a PAGED_CASES row:
    shuffled page ids over a pool with spare pages, absent ids past seq_lens, and for LLaDA2 the
    sequences sharing the first one's prefix pages."""
    name, B, W, S, ps, Hq, Hkv, D, _, kind, _, _ = case
    if kind == "llada2":
        q, k, v, kc, vc, pos, lens = llada2_case(B, S, Hq, Hkv, D, dtype, seed=seed)
    else:
        q, k, v, kc, vc, pos, lens = make_case(
            B, W, S, Hq, Hkv, D, dtype, seed=seed, aligned=32 if kind == "causal" else None
        )
    pools, table = paged_caches((kc, vc), ps, lens, seed=seed, extra_pages=3, absent=True)
    if kind == "llada2" and B > 1:
        table, shared = share_prefix(table, pos, lens, ps)
        assert max(shared) > 0
    S_paged = table.shape[1] * ps
    if kind == "llada2":
        bm = dk.BlockMask.block_causal(
            B, Hkv, q.shape[1], S_paged, 32, q_block=16, kv_block=32, start=pos[:, 0]
        )
    else:
        bm = block_mask_for(kind, B, Hkv, W, S_paged, seed=seed, pos=pos)
    return q, k, v, pools, table, pos, lens, bm


def _check_paged_call(backend, device, case, validate=None):
    name, B, W, S, ps, Hq, Hkv, D, dtype, kind, write_back, _ = case
    dtype = dtype_for(backend, dtype)
    q, k, v, (pk, pv), table, pos, lens, bm = make_paged_case(case, dtype)
    dev = lambda t: t.to(device)
    pk_d, pv_d = pk.clone().to(device), pv.clone().to(device)
    want_mass = bm is not None
    res = dk.attention(
        dev(q),
        dev(k),
        dev(v),
        pk_d,
        pv_d,
        dev(pos),
        dev(lens),
        block_table=dev(table),
        write_back=write_back,
        block_mask=_to(bm, device),
        return_lse=True,
        return_block_mass=want_mass,
        backend=backend,
        validate=validate,
    )
    res = [t.cpu() for t in res]
    kw = dict(block_table=table, block_mask=bm, return_lse=True, return_block_mass=want_mass)
    same_k, same_v = pk.clone(), pv.clone()
    same = attention_reference(q, k, v, same_k, same_v, pos, lens, write_back, **kw)
    truth = attention_reference(
        q, k, v, pk.clone(), pv.clone(), pos, lens, write_back, compute_dtype=torch.float64, **kw
    )
    for nm, got, s, t in zip(("out", "lse", "block_mass"), res, same, truth):
        assert got.shape == t.shape, nm
        assert_precision(got, s, t, f"{name}: {nm}")
    pad = pos >= lens[:, None].long()
    assert torch.equal(res[0][pad], torch.zeros_like(res[0][pad]))
    assert torch.isneginf(res[1][pad]).all()
    # the pools: exactly the reference's (window rows written with write_back, nothing else changed)
    assert torch.equal(_bits(pk_d.cpu()), _bits(same_k)), "k pool differs from the reference's"
    assert torch.equal(_bits(pv_d.cpu()), _bits(same_v)), "v pool differs from the reference's"
    if not write_back:
        assert torch.equal(_bits(same_k), _bits(pk)) and torch.equal(_bits(same_v), _bits(pv))


@pytest.mark.parametrize("backend,device,case", _paged_params())
@pytest.mark.usefixtures("host_isa")
def test_paged_matches_reference(backend, device, case):
    """Every backend on page pools with shuffled ids, spare pages, absent ids past seq_lens, page
    sizes 1, 3 (dividing nothing), 16 and 32, GQA, random / full / block-causal masks and LLaDA2's
    [previous block | current block] windows over shared prefix pages: outputs against the
    reference, the pools after the call exactly the reference's."""
    _check_paged_call(backend, device, case)


@pytest.mark.parametrize("backend,device", attention_backends())
@pytest.mark.parametrize("page_size", [1, 3, 32])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("write_back", [True, False])
@pytest.mark.usefixtures("host_isa")
def test_paged_equals_contiguous(backend, device, page_size, shuffle, write_back):
    """A page table that lays the contiguous cache out page by page (in order: the pool is the
    cache's own memory; or shuffled over a larger pool) gives the contiguous call's bits: out, lse,
    block_mass and the cache after the call."""
    B, W, S, Hq, Hkv, D = 2, 9, 96, 4, 2, 64
    dtype = dtype_for(backend, F32)
    q, k, v, kc, vc, pos, lens = make_case(B, W, S, Hq, Hkv, D, dtype, seed=21)
    bm = random_block_mask(B, Hkv, W, S, q_block=4, kv_block=16, seed=21)[0]
    dev = lambda t: t.to(device)
    kw = dict(write_back=write_back, block_mask=_to(bm, device), return_lse=True, return_block_mass=True)
    kc_d, vc_d = dev(kc.clone()), dev(vc.clone())
    want = dk.attention(dev(q), dev(k), dev(v), kc_d, vc_d, dev(pos), dev(lens), backend=backend, **kw)
    (pk, pv), table = paged_caches(
        (kc.clone(), vc.clone()), page_size, seed=21, shuffle=shuffle, extra_pages=2 * shuffle
    )
    pk_d, pv_d = dev(pk), dev(pv)
    got = dk.attention(
        dev(q), dev(k), dev(v), pk_d, pv_d, dev(pos), dev(lens), block_table=dev(table), backend=backend, **kw
    )
    for nm, a, b in zip(("out", "lse", "block_mass"), got, want):
        assert torch.equal(_bits(a), _bits(b)), nm
    rows = table.flatten().long()
    for pool, cache in ((pk_d, kc_d), (pv_d, vc_d)):
        assert torch.equal(_bits(pool.cpu()[rows].reshape(B, S, Hkv, D)), _bits(cache.cpu()))


@pytest.mark.parametrize("backend,device", attention_backends())
@pytest.mark.parametrize("write_back", [True, False])
@pytest.mark.usefixtures("host_isa")
def test_paged_absent_pages_are_never_read_or_written(backend, device, write_back):
    """Unchecked page ids outside the pool (-1, P, INT32_MIN / MAX: as under capture, validate=False)
    inside seq_lens, window rows among them: those positions are never attended and never written,
    even where a valid window row sits (its NaN k / v are ignored), and nothing outside the pool
    is touched. Pages 0 and P - 1, where a kernel clamping ids would read, hold NaN / inf."""
    B, W, S, ps, Hq, Hkv, D = 2, 6, 40, 4, 4, 2, 64
    dtype = dtype_for(backend, F32)
    q, k, v, kc, vc, pos, lens = make_case(B, W, S, Hq, Hkv, D, dtype, seed=13)
    lens = torch.tensor([S, S - 5], dtype=torch.int32)
    pos = torch.stack(
        [torch.randperm(int(L), generator=torch.Generator().manual_seed(b))[:W] for b, L in enumerate(lens)]
    )
    MP = S // ps
    P = B * MP + 2
    table = (
        (1 + torch.randperm(B * MP, generator=torch.Generator().manual_seed(5))).view(B, MP).to(torch.int32)
    )
    pools = []
    for c in (kc, vc):
        pool = torch.empty(P, ps, Hkv, D, dtype=dtype)
        pool[table.flatten().long()] = c.reshape(B * MP, ps, Hkv, D)
        pool[0], pool[P - 1] = float("nan"), float("inf")
        pools.append(pool)
    pk, pv = pools
    i32 = torch.iinfo(torch.int32)
    table[0, pos[0, 0] // ps] = -1  # a page holding a valid window row
    table[0, 7] = P
    table[1, int(pos[1, 2]) // ps] = i32.max
    table[1, 0] = i32.min
    for b in range(B):  # valid window rows at absent positions: their k / v must not be read
        hit = (table[b].long()[pos[b] // ps] < 0) | (table[b].long()[pos[b] // ps] >= P)
        k[b, hit], v[b, hit] = float("nan"), float("inf")
    dev = lambda t: t.to(device)
    pk_d, pv_d = dev(pk.clone()), dev(pv.clone())
    res = dk.attention(
        dev(q),
        dev(k),
        dev(v),
        pk_d,
        pv_d,
        dev(pos),
        dev(lens),
        block_table=dev(table),
        write_back=write_back,
        return_lse=True,
        backend=backend,
        validate=False,
    )
    kw = dict(block_table=table, return_lse=True)
    same_k, same_v = pk.clone(), pv.clone()
    same = attention_reference(q, k, v, same_k, same_v, pos, lens, write_back, **kw)
    truth = attention_reference(
        q, k, v, pk.clone(), pv.clone(), pos, lens, write_back, compute_dtype=torch.float64, **kw
    )
    assert torch.isfinite(same[0]).all() and torch.isfinite(same[1]).all()  # nothing absent was read
    for nm, got, s, t in zip(("out", "lse"), res, same, truth):
        assert_precision(got.cpu(), s, t, nm)
    assert torch.equal(_bits(pk_d.cpu()), _bits(same_k)) and torch.equal(_bits(pv_d.cpu()), _bits(same_v))
    with pytest.raises(ValueError, match="block_table"):  # checked on host tensors
        dk.attention(q, k, v, pk.clone(), pv.clone(), pos, lens, block_table=table, backend=backend)


@pytest.mark.parametrize("backend,device", attention_backends())
@pytest.mark.usefixtures("host_isa")
def test_paged_strided_pool(backend, device):
    """A pool that is a strided view (one layer of a [P, layers, page_size, Hkv, D] allocation) is
    read and written through its strides; the other layer is untouched."""
    B, W, S, ps, Hq, Hkv, D = 2, 5, 48, 8, 2, 1, 64
    dtype = dtype_for(backend, F32)
    q, k, v, kc, vc, pos, lens = make_case(B, W, S, Hq, Hkv, D, dtype, seed=17)
    (pk, pv), table = paged_caches((kc, vc), ps, seed=17, extra_pages=1)
    big_k = torch.randn(pk.shape[0], 2, *pk.shape[1:]).to(dtype)
    big_v = torch.randn(pv.shape[0], 2, *pv.shape[1:]).to(dtype)
    big_k[:, 1], big_v[:, 1] = pk, pv
    other_k, other_v = big_k[:, 0].clone(), big_v[:, 0].clone()
    big_k, big_v = big_k.to(device), big_v.to(device)
    out = dk.attention(
        q.to(device),
        k.to(device),
        v.to(device),
        big_k[:, 1],
        big_v[:, 1],
        pos.to(device),
        lens.to(device),
        block_table=table.to(device),
        backend=backend,
    ).cpu()
    same_k, same_v = pk.clone(), pv.clone()
    same = attention_reference(q, k, v, same_k, same_v, pos, lens, block_table=table)
    truth = attention_reference(
        q, k, v, pk.clone(), pv.clone(), pos, lens, block_table=table, compute_dtype=torch.float64
    )
    assert_precision(out, same, truth, "out")
    big_k, big_v = big_k.cpu(), big_v.cpu()
    assert torch.equal(_bits(big_k[:, 1]), _bits(same_k)) and torch.equal(_bits(big_v[:, 1]), _bits(same_v))
    assert torch.equal(_bits(big_k[:, 0]), _bits(other_k)) and torch.equal(_bits(big_v[:, 0]), _bits(other_v))
    # the reference on the strided view, written in place, is the reference on a contiguous pool
    strided_k = torch.stack([other_k, pk], 1)[:, 1]
    strided_v = torch.stack([other_v, pv], 1)[:, 1]
    assert torch.equal(
        _bits(attention_reference(q, k, v, strided_k, strided_v, pos, lens, block_table=table)), _bits(same)
    )
    assert torch.equal(_bits(strided_k), _bits(same_k)) and torch.equal(_bits(strided_v), _bits(same_v))


@pytest.mark.skipif(
    "cpu" not in _backend.available_backends("cpu", "attention"),
    reason="dinfer_kernels._C was built without the host attention kernel",
)
def test_auto_picks_the_same_backend_for_paged_calls(monkeypatch):
    picked = []
    real = _backend.impl
    monkeypatch.setattr(_backend, "impl", lambda op, b: picked.append(b) or real(op, b))
    q, k, v, kc, vc, pos, lens = make_case(2, 4, 24, 2, 2, 32, F32, seed=3)
    dk.attention(q, k, v, kc.clone(), vc.clone(), pos, lens)
    contiguous = list(picked)
    (pk, pv), table = paged_caches((kc, vc), 8, seed=3)
    dk.attention(q, k, v, pk, pv, pos, lens, block_table=table)
    assert picked == contiguous * 2
    dk.attention(q, k, v, pk, pv, pos, lens, block_table=table, backend="cpu")
    assert picked[-1] == "cpu"


def _paged_err_case():
    q, k, v, kc, vc, pos, lens = make_case(2, 5, 40, 4, 2, 64, F32, seed=2)
    lens = torch.tensor([40, 30], dtype=torch.int32)
    pos = torch.tensor([[0, 9, 17, 25, 39], [3, 8, 12, 20, 29]])
    (pk, pv), table = paged_caches((kc, vc), 8, seed=2, extra_pages=2)
    return q, k, v, pk, pv, pos, lens, table


def _paged(**changes):
    """A call on _paged_err_case's arguments with `changes` (name: function of the arguments)."""

    def call(write_back):
        q, k, v, pk, pv, pos, lens, table = _paged_err_case()
        a = dict(q=q, k=k, v=v, k_cache=pk, v_cache=pv, positions=pos, seq_lens=lens, block_table=table)
        for key, fn in changes.items():
            a[key] = fn(a)
        return dk.attention(**a, write_back=write_back)

    return call


def _set(t, index, value):
    t = t.clone()
    t[index] = value
    return t


PAGED_ERRORS = [
    (_paged(block_table=lambda a: a["block_table"].long()), "block_table", TypeError),
    (_paged(block_table=lambda a: a["block_table"][0]), "block_table", ValueError),
    (_paged(block_table=lambda a: a["block_table"][None]), "block_table", ValueError),
    (_paged(block_table=lambda a: torch.cat([a["block_table"]] * 2)), "block_table", ValueError),
    (_paged(block_table=lambda a: a["block_table"].to("meta")), "block_table", ValueError),
    (_paged(v_cache=lambda a: a["v_cache"][:-1]), "v_cache", ValueError),
    (_paged(v_cache=lambda a: a["v_cache"][:, :-1]), "v_cache", ValueError),
    (_paged(k_cache=lambda a: a["k_cache"][..., :32]), "k_cache", ValueError),
    (_paged(k_cache=lambda a: a["k_cache"][:0], v_cache=lambda a: a["v_cache"][:0]), "k_cache", ValueError),
    (_paged(k_cache=lambda a: a["k_cache"].double()), "k_cache", TypeError),
    # a page before seq_lens outside the pool
    (_paged(block_table=lambda a: _set(a["block_table"], (1, 3), -1)), "block_table", ValueError),
    (_paged(block_table=lambda a: _set(a["block_table"], (0, 4), 12)), "block_table", ValueError),
    # positions are checked against S = MP * page_size
    (_paged(positions=lambda a: _set(a["positions"], (0, 0), 40)), "positions", ValueError),
    (_paged(seq_lens=lambda a: _set(a["seq_lens"], 0, 41)), "seq_lens", ValueError),
    # sequence 1's page 1 is sequence 0's page 1: window rows sit in it (positions 9 and 8, 12)
    (
        _paged(block_table=lambda a: _set(a["block_table"], (1, 1), int(a["block_table"][0, 1]))),
        "block_table",
        ValueError,
    ),
    # the same pool row written twice (write_back) and substituted twice (without)
    (
        _paged(
            positions=lambda a: _set(a["positions"], (1, 0), 1),
            block_table=lambda a: _set(a["block_table"], (1, 0), int(a["block_table"][0, 2])),
        ),
        "block_table",
        ValueError,
    ),
    (_paged(attn_mask=lambda a: torch.ones(2, 5, 41, dtype=torch.bool)), "attn_mask", ValueError),
]


@pytest.mark.parametrize(
    "call,name,exc", PAGED_ERRORS, ids=[f"{e[1]}-{i}" for i, e in enumerate(PAGED_ERRORS)]
)
@pytest.mark.parametrize("write_back", [True, False])
def test_paged_errors_name_the_argument(call, name, exc, write_back):
    """Bad block tables and pools raise naming the argument; pool rows of window rows are checked
    without write_back too (the GPU kernels write them for the call)."""
    _paged()(write_back)  # the unchanged call is valid
    with pytest.raises(exc, match=name):
        call(write_back)


# ---- BlockMask helpers -------------------------------------------------------------------------------


def test_block_mask_helpers():
    full = dk.BlockMask.full(2, 3, 17, 100, 8, 32)
    assert full.kv_num_blocks.shape == (2, 3, 3) and (full.kv_num_blocks == 4).all()
    assert full.to_dense(100).all()
    dense = torch.rand(2, 3, 3, 4) < 0.5
    bm = dk.BlockMask.from_dense(dense, 8, 32)
    assert torch.equal(bm.to_dense(100), dense)
    assert torch.equal(bm.kv_num_blocks, dense.sum(-1).int())
    c = int(bm.kv_num_blocks[0, 0, 0])
    assert bm.kv_indices[0, 0, 0, :c].tolist() == sorted(bm.kv_indices[0, 0, 0, :c].tolist())
    # block-causal: window at position 64, block_len 32, q_block 16: q-blocks 0,1 in diffusion block 2
    # (keys < 96 -> 6 key blocks of 16), q-blocks 2,3 in block 3 (keys < 128 -> 8)
    bc = dk.BlockMask.block_causal(1, 1, 64, 200, 32, 16, 16, start=64)
    assert bc.kv_num_blocks.flatten().tolist() == [6, 6, 8, 8]
    with pytest.raises(ValueError, match="kv_block"):
        dk.BlockMask.block_causal(1, 1, 64, 200, 32, 16, 24)
    with pytest.raises(ValueError, match="start"):
        dk.BlockMask.block_causal(1, 1, 64, 200, 32, 16, 16, start=8)
    # vicinity: q-block 1 (positions 16..31 when start 0) with before 16, after 16 -> keys 0..47,
    # i.e. key blocks 0..2 of 16; sink=1 adds block 0 for every q-block
    vb = dk.BlockMask.vicinity(1, 1, 64, 256, 16, 16, before=16, after=16, sink=1)
    d = vb.to_dense(256)[0, 0]
    assert d[1].nonzero().flatten().tolist() == [0, 1, 2]
    assert d[3].nonzero().flatten().tolist() == [0, 2, 3, 4]
    # far-suffix pruning: the whole prefix, 32 positions of suffix
    fs = dk.BlockMask.vicinity(1, 1, 64, 256, 16, 16, before=None, after=32)
    assert fs.to_dense(256)[0, 0, 0].nonzero().flatten().tolist() == [0, 1, 2]
    assert fs.kv_num_blocks.flatten().tolist() == [3, 4, 5, 6]


def test_block_mask_dense_is_capture_safe_shape():
    """The reference's dense expansion ignores entries past the count and out-of-range indices."""
    counts = torch.tensor([[[2, 0]]], dtype=torch.int32)
    idx = torch.tensor([[[[3, -1, 0], [1, 2, 3]]]], dtype=torch.int32)
    d = block_mask_dense(counts, idx, 3)
    assert d.tolist() == [[[[False, False, False], [False, False, False]]]]


# ---- registration ----------------------------------------------------------------------------------


def _small():
    q, k, v, kc, vc, pos, lens = make_case(2, 5, 40, 4, 2, 64, F32, seed=2)
    bm = random_block_mask(2, 2, 5, 40, q_block=2, kv_block=16, seed=2)[0]
    return q, k, v, kc, vc, pos, lens, bm


@pytest.mark.parametrize("backend", [b for b, d in attention_backends() if d == "cpu"])
def test_opcheck(backend):
    q, k, v, kc, vc, pos, lens, bm = _small()
    for extras in ((True, True), (False, False), (True, False)):
        torch.library.opcheck(
            torch.ops.dinfer.attention.default,
            (
                q,
                k,
                v,
                kc,
                vc,
                pos,
                lens,
                None,
                True,
                None,
                bm.kv_num_blocks,
                bm.kv_indices,
                bm.q_block,
                bm.kv_block,
                0.125,
                *extras,
                backend,
            ),
            test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
        )
    torch.library.opcheck(
        torch.ops.dinfer.attention.default,
        (q, k, v, kc, vc, pos, lens, None, False, None, None, None, 5, 64, 0.125, False, False, backend),
    )
    # the paged layout: the same cache as a pool of 8-row pages in shuffled order
    (pool_k, pool_v), table = paged_caches((kc, vc), 8, seed=2)
    torch.library.opcheck(
        torch.ops.dinfer.attention.default,
        (q, k, v, pool_k, pool_v, pos, lens, table, True, None, bm.kv_num_blocks, bm.kv_indices)
        + (bm.q_block, bm.kv_block, 0.125, True, True, backend),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


def test_torch_compile_fullgraph_with_block_mask():
    q, k, v, kc, vc, pos, lens, bm = _small()

    def f(q, k, v, kc, vc, counts, idx):
        mask = dk.BlockMask(counts, idx, 2, 16)
        out, lse, mass = dk.attention(
            q, k, v, kc, vc, pos, lens, block_mask=mask, return_lse=True, return_block_mass=True
        )
        return out * 2, lse, mass

    kc2, vc2 = kc.clone(), vc.clone()
    want = f(q, k, v, kc, vc, bm.kv_num_blocks, bm.kv_indices)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(
        q, k, v, kc2, vc2, bm.kv_num_blocks, bm.kv_indices
    )
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, equal_nan=True)
    assert torch.equal(_bits(kc2), _bits(kc))


def test_auto_backend_choice():
    q, k, v, kc, vc, pos, lens, bm = _small()
    avail = _backend.available_backends("cpu", "attention")
    ext = _backend.compiled()
    assert avail[-1] == "torch"
    assert ("cpu" in avail) == (ext is not None and hasattr(ext, "attention"))  # the host kernel
    if ext is not None:
        assert ("cuda" in _backend.available_backends("cuda", "attention")) == (
            _backend._EXTENSION_HAS_CUDA and hasattr(ext, "attention_workspace_bytes")
        )


# ---- errors ----------------------------------------------------------------------------------------


def _err_case():
    q, k, v, kc, vc, pos, lens, bm = _small()
    return (q, k, v, kc, vc, pos, lens), bm


def _with(bm, **kw):
    return bm._replace(**kw)


ERRORS = [
    (
        lambda a, bm: dk.attention(*a, block_mask=(bm.kv_num_blocks, bm.kv_indices, 2, 16)),
        "block_mask",
        TypeError,
    ),
    (lambda a, bm: dk.attention(*a, block_mask=_with(bm, q_block=0)), "q_block", ValueError),
    (lambda a, bm: dk.attention(*a, block_mask=_with(bm, kv_block=1.5)), "kv_block", TypeError),
    (lambda a, bm: dk.attention(*a, block_mask=_with(bm, q_block=4)), "kv_num_blocks", ValueError),
    (
        lambda a, bm: dk.attention(*a, block_mask=_with(bm, kv_num_blocks=bm.kv_num_blocks.long())),
        "kv_num_blocks",
        TypeError,
    ),
    (
        lambda a, bm: dk.attention(*a, block_mask=_with(bm, kv_indices=bm.kv_indices[:1])),
        "kv_indices",
        ValueError,
    ),
    (
        lambda a, bm: dk.attention(*a, block_mask=_with(bm, kv_num_blocks=bm.kv_num_blocks + 9)),
        "kv_num_blocks",
        ValueError,
    ),
    (
        lambda a, bm: dk.attention(*a, block_mask=_with(bm, kv_indices=bm.kv_indices + 7)),
        "kv_indices",
        ValueError,
    ),
    (
        lambda a, bm: dk.attention(
            *a,
            block_mask=_with(
                bm,
                kv_indices=torch.zeros_like(bm.kv_indices),
                kv_num_blocks=torch.full_like(bm.kv_num_blocks, 2),
            ),
        ),
        "distinct",
        ValueError,
    ),
    (lambda a, bm: dk.attention(*a, return_block_mass=True), "block_mask", ValueError),
    (
        lambda a, bm: dk.attention(*a, attn_mask=torch.ones(2, 5, 40, dtype=torch.bool), backend="triton"),
        "attn_mask",
        ValueError,
    ),
    (
        lambda a, bm: dk.attention(
            a[0][..., :32],
            a[1][..., :32],
            a[2][..., :32],
            a[3][..., :32],
            a[4][..., :32],
            a[5],
            a[6],
            backend="triton",
        ),
        "q",
        ValueError,
    ),
    (lambda a, bm: dk.attention(*a, scale=0.0), "scale", ValueError),
    (lambda a, bm: dk.attention(*a[:5], a[5] + 100, a[6]), "positions", ValueError),
    (lambda a, bm: dk.attention(*a[:6], a[6] + 100), "seq_lens", ValueError),
    (lambda a, bm: dk.attention(*a, backend="nope"), "backend", ValueError),
]


@pytest.mark.parametrize("call,name,exc", ERRORS)
def test_errors_name_the_argument(call, name, exc):
    a, bm = _err_case()
    if "triton" not in _backend.available_backends("cpu", "attention") and name in ("attn_mask", "q"):
        pytest.skip("needs the triton backend on the host (TRITON_INTERPRET=1)")
    with pytest.raises(exc, match=name):
        call(a, bm)


def test_kernel_backend_rejects_unsupported_head_dim_but_auto_falls_back():
    a, _ = _err_case()
    sliced = [t[..., :32] for t in a[:5]] + list(a[5:])
    out = dk.attention(*sliced)  # auto: torch takes any head dim
    assert out.shape == (2, 5, 4, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("paged", [False, True])
def test_cuda_graph_capture(backend, paged):
    if backend not in dk.available_backends("cuda", "attention"):
        pytest.skip(f"{backend} not available")
    B, W, S, Hq, Hkv, D = 1, 96, 2048, 16, 16, 128
    q, k, v, kc, vc, pos, lens = make_case(B, W, S, Hq, Hkv, D, BF16, seed=4)
    extra = {}
    if paged:  # pages of 32 in shuffled order, absent ids past seq_lens
        (kc, vc), table = paged_caches((kc, vc), 32, lens, seed=4, absent=True)
        extra = dict(block_table=table.cuda())
    q, k, v, kc, vc, pos, lens = [t.cuda() for t in (q, k, v, kc, vc, pos, lens)]
    bm = _to(random_block_mask(B, Hkv, W, S, 32, 64, seed=4)[0], "cuda")
    kw = dict(block_mask=bm, return_lse=True, return_block_mass=True, backend=backend, **extra)
    want = dk.attention(q, k, v, kc.clone(), vc.clone(), pos, lens, write_back=False, **kw)
    kc2, vc2 = kc.clone(), vc.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = dk.attention(q, k, v, kc2, vc2, pos, lens, write_back=False, **kw)
    g.replay()
    torch.cuda.synchronize()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(_bits(kc2), _bits(kc)) and torch.equal(_bits(vc2), _bits(vc))
    assert math.isfinite(float(got[2].sum()))


@pytest.mark.parametrize("backend,device", kernel_backends())
@pytest.mark.usefixtures("host_isa")
def test_kernel_backends_take_strided_positions_and_queries(backend, device):
    """An expanded arange of positions (stride 0 over the batch) and a query whose last dim is strided
    reach the kernels as the dense arrays they read; the result is the reference's."""
    B, W, S, Hq, Hkv, D = 2, 8, 40, 2, 2, 64
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, W, D, Hq, generator=g).transpose(-1, -2)  # last-dim stride Hq
    k, v = torch.randn(B, W, Hkv, D, generator=g), torch.randn(B, W, Hkv, D, generator=g)
    kc, vc = torch.randn(B, S, Hkv, D, generator=g), torch.randn(B, S, Hkv, D, generator=g)
    pos = (torch.arange(W) + 10).expand(B, W)
    lens = torch.full((B,), S, dtype=torch.int32)
    dtype = dtype_for(backend, F32)
    dev = lambda t: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
    got = dk.attention(
        dev(q), dev(k), dev(v), dev(kc), dev(vc), pos.to(device), lens.to(device), backend=backend
    ).cpu()
    cast = lambda t: t.to(dtype)
    want = attention_reference(
        cast(q), cast(k), cast(v), cast(kc), cast(vc), pos, lens, compute_dtype=torch.float64
    )
    same = attention_reference(cast(q), cast(k), cast(v), cast(kc), cast(vc), pos, lens)
    assert_precision(got, same, want, "out")
