"""dinfer_kernels.attention with its dense key prefix delegated to torch's SDPA (attention_sdpa): the
delegated path against the fp64 reference on every kernel backend (forced with mode("always"), so the
host runs it through torch's CPU flash kernel), the shape rule and the switch, the fallback when no
SDPA kernel takes the call; and the causal-tile trap (SGLang #39703) on every backend, delegated or
not: a block-causal mask whose bidirectional blocks reach past the query block's diagonal tile, over a
dense prefix, attends exactly the keys the reference attends."""

import types

import pytest
import torch
from conftest import assert_precision
from test_attention import (
    CASES,
    F16,
    F32,
    _bits,
    _check_call,
    _impl,
    _to,
    attention_backends,
    dtype_for,
    kernel_backends,
    make_case,
)

import dinfer_kernels as dk
from dinfer_kernels import _backend, attention_sdpa
from dinfer_kernels.reference.attention import attention_reference

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Counts the delegated SDPA calls (each one's key count)."""
    calls = []
    real = attention_sdpa.sdpa_with_lse

    def counted(q, k, v, scale):
        calls.append(k.shape[2])
        return real(q, k, v, scale)

    monkeypatch.setattr(attention_sdpa, "sdpa_with_lse", counted)
    return calls


def _host_case(c):
    return c[-1] == "all"


# Every host-sized case of test_attention without block_mass (delegation refuses it: checked below)
@pytest.mark.parametrize("backend,device", kernel_backends())
@pytest.mark.parametrize("case", [c for c in CASES if _host_case(c)], ids=lambda c: c[0])
@pytest.mark.usefixtures("host_isa")
def test_delegated_matches_reference(backend, device, case, sdpa_calls):
    if device == "cpu" and backend == "triton" and case[7] not in (F16, F32):
        pytest.skip("bf16 in the interpreter")
    with attention_sdpa.mode("always"):
        _check_call(backend, device, case, want_lse=True, want_mass=False)
        _check_call(backend, device, case, want_lse=False, want_mass=False)
    # not vacuous: an fp32 call with a dense prefix of whole 64-key blocks and a rest is delegated
    B, W, S, Hq, Hkv, D, dtype, kind, write_back = case[1:10]
    q, k, v, kc, vc, pos, lens = make_case(
        B, W, S, Hq, Hkv, D, dtype, aligned=32 if kind == "causal" else None
    )
    if dtype == F32 and kind is None and int(lens.min()) >= 64:
        assert sdpa_calls, "the delegated path did not run"


@pytest.mark.parametrize("backend,device", kernel_backends())
@pytest.mark.usefixtures("host_isa")
def test_full_refresh_delegates_everything(backend, device, sdpa_calls, monkeypatch):
    """W = S, every key: SDPA takes all S keys and the backend's kernel runs no attention at all."""
    B, W, S, Hq, Hkv, D = 2, 72, 72, 4, 2, 64
    dtype = dtype_for(backend, F32)
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)
    q, k, v, kc, vc = r(B, W, Hq, D), r(B, W, Hkv, D), r(B, W, Hkv, D), r(B, S, Hkv, D), r(B, S, Hkv, D)
    pos = torch.stack([torch.randperm(S, generator=g) for _ in range(B)])
    lens = torch.full((B,), S, dtype=torch.int32)
    never = lambda **kw: pytest.fail("the kernel ran beside an SDPA over every key")
    monkeypatch.setattr(_backend, "impl", lambda op, b: never)
    kc_d, vc_d = kc.clone().to(device), vc.clone().to(device)
    with attention_sdpa.mode("always"):
        out, lse = dk.attention(
            *(t.to(device) for t in (q, k, v)),
            kc_d,
            vc_d,
            pos.to(device),
            lens.to(device),
            return_lse=True,
            backend=backend,
        )
    assert sdpa_calls == [S]
    truth = attention_reference(
        q, k, v, kc.clone(), vc.clone(), pos, lens, return_lse=True, compute_dtype=torch.float64
    )
    same = attention_reference(q, k, v, kc.clone(), vc.clone(), pos, lens, return_lse=True)
    assert_precision(out.cpu(), same[0], truth[0], "out")
    assert_precision(lse.cpu(), same[1], truth[1], "lse")
    want_k = kc.clone()
    want_k.scatter_(1, pos[:, :, None, None].expand(B, W, Hkv, D), k)
    assert torch.equal(_bits(kc_d.cpu()), _bits(want_k))


@pytest.mark.parametrize("backend,device", kernel_backends())
@pytest.mark.usefixtures("host_isa")
def test_block_mass_and_off_never_delegate(backend, device, sdpa_calls):
    case = ("mass", 1, 17, 63, 2, 2, 64, F32, "full", True, "all")
    with attention_sdpa.mode("always"):
        _check_call(backend, device, case, want_lse=True, want_mass=True)
    with attention_sdpa.mode("off"):
        _check_call(backend, device, case, want_lse=True, want_mass=False)
    assert sdpa_calls == []


@pytest.mark.usefixtures("host_isa")
def test_shape_rule(sdpa_calls):
    """mode "auto" follows the backend module's SDPA_DENSE: rows and dense keys at least its minimums;
    a module without a rule (the host kernel) never delegates."""
    impl = _impl("cpu")
    B, W, S, Hq, Hkv, D = 1, 24, 64, 2, 1, 64
    q, k, v, kc, vc, pos, lens = make_case(B, W, S, Hq, Hkv, D, F32)
    outs = []
    for rule, delegated in (
        (None, False),
        ({"min_rows": W, "min_keys": 32}, True),
        ({"min_rows": W + 1, "min_keys": 32}, False),
        ({"min_rows": W, "min_keys": S + 1}, False),
    ):
        module = types.SimpleNamespace(SDPA_DENSE=rule)
        out = torch.full((B, W, Hq, D), float("nan"))
        n = len(sdpa_calls)
        ran = attention_sdpa.delegate(
            module,
            impl,
            q=q,
            k=k,
            v=v,
            k_cache=kc.clone(),
            v_cache=vc.clone(),
            positions=pos,
            seq_lens=lens,
            block_table=None,
            kv_num_blocks=None,
            kv_indices=None,
            out=out,
            lse=None,
            block_mass=None,
            write_back=True,
            q_block=W,
            kv_block=16,
            scale=D**-0.5,
        )
        assert ran == delegated and (len(sdpa_calls) > n) == delegated, rule
        if ran:
            outs.append(out)
    truth = attention_reference(q, k, v, kc.clone(), vc.clone(), pos, lens, compute_dtype=torch.float64)
    same = attention_reference(q, k, v, kc.clone(), vc.clone(), pos, lens)
    assert_precision(outs[0], same, truth, "delegated under the rule")
    assert _backend.module("attention", "cpu").SDPA_DENSE is None


@pytest.mark.parametrize("write_back", [True, False])
@pytest.mark.usefixtures("host_isa")
def test_no_sdpa_kernel_falls_back(monkeypatch, write_back):
    """Where no SDPA kernel takes the call, the backend's kernel runs it whole: same result, and a
    kept cache is left as it was."""
    monkeypatch.setattr(attention_sdpa, "_sdpa_ops", lambda device_type: [])
    with attention_sdpa.mode("always"):
        _check_call(
            "cpu", "cpu", ("fallback", 2, 17, 100, 4, 2, 64, F32, None, write_back, "all"), True, False
        )


def test_merge_of_empty_sides():
    o = torch.randn(3, 2, 4)
    lse = torch.tensor([[0.5, float("-inf")], [float("-inf"), float("-inf")], [1.0, 2.0]])
    z, ninf = torch.zeros_like(o), torch.full_like(lse, float("-inf"))
    out, m = attention_sdpa.merge(o, lse, z, ninf)
    assert torch.equal(out, o.masked_fill(torch.isneginf(lse)[..., None], 0.0))
    assert torch.equal(m, lse)


def test_mode_rejects_unknown():
    with pytest.raises(ValueError, match="mode"):
        with attention_sdpa.mode("sometimes"):
            pass


# ---- the causal-tile trap -------------------------------------------------------------------------


def _trap_case(dtype, seed=0):
    """A window of 3 diffusion blocks (block_len 32) after a prefix of 64 keys: query blocks of 16
    rows, key blocks of 16 keys, so the first query block of each diffusion block must read the key
    block past its diagonal tile (bidirectional within the block). Returns the inputs, the BlockMask
    and the dense [B, W, S] mask (built from positions, independently of BlockMask)."""
    B, W, S, Hq, Hkv, D, bl, prefix = 2, 96, 192, 4, 2, 64, 32, 64
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)
    q, k, v, kc, vc = r(B, W, Hq, D), r(B, W, Hkv, D), r(B, W, Hkv, D), r(B, S, Hkv, D), r(B, S, Hkv, D)
    pos = (prefix + torch.arange(W))[None].repeat(B, 1)
    lens = torch.tensor([prefix + W, prefix + W - 5], dtype=torch.int32)  # 5 padding rows in b = 1
    for t in (kc, vc):  # keys past seq_len: poison, never attended
        t[1, prefix + W - 5 :] = float("nan")
    dense = torch.arange(S)[None, None, :] < (pos[:, :, None] // bl + 1) * bl
    bm = dk.BlockMask.block_causal(B, Hkv, W, S, bl, q_block=16, kv_block=16, start=pos[:, 0])
    return (q, k, v, kc, vc, pos, lens), bm, dense


TRAP_BACKENDS = [(b, d, "off") for b, d in attention_backends()] + [
    (b, d, "always") for b, d in kernel_backends()
]


@pytest.mark.parametrize(
    "backend,device,delegation", TRAP_BACKENDS, ids=[f"{b}-{d}-{m}" for b, d, m in TRAP_BACKENDS]
)
@pytest.mark.usefixtures("host_isa")
def test_block_causal_reaches_past_the_diagonal_tile(backend, device, delegation, sdpa_calls):
    dtype = dtype_for(backend, F32)
    (q, k, v, kc, vc, pos, lens), bm, dense = _trap_case(dtype)
    truth = attention_reference(
        q,
        k,
        v,
        kc.clone(),
        vc.clone(),
        pos,
        lens,
        attn_mask=dense,
        return_lse=True,
        compute_dtype=torch.float64,
    )
    same = attention_reference(q, k, v, kc.clone(), vc.clone(), pos, lens, attn_mask=dense, return_lse=True)
    # the trap is live: stopping each query block at its diagonal key tile changes the result
    tile_causal = torch.arange(192)[None, None, :] < (pos[:, :, None] // 16 + 1) * 16
    trapped = attention_reference(
        q, k, v, kc.clone(), vc.clone(), pos, lens, attn_mask=tile_causal, compute_dtype=torch.float64
    )
    valid = pos < lens[:, None].long()
    assert (trapped - truth[0])[valid].abs().max() > 0.1

    with attention_sdpa.mode(delegation):
        out, lse = dk.attention(
            *(t.to(device) for t in (q, k, v)),
            kc.clone().to(device),
            vc.clone().to(device),
            pos.to(device),
            lens.to(device),
            block_mask=_to(bm, device),
            return_lse=True,
            backend=backend,
        )
    assert_precision(out.cpu(), same[0], truth[0], "out")
    assert_precision(lse.cpu(), same[1], truth[1], "lse")
    if delegation == "always" and dtype == F32:  # in fp16 / bf16 a call with a rest is not delegated
        # the prefix and the first diffusion block: every row attends them
        assert sdpa_calls == [96], "the dense prefix went to SDPA"
    else:
        assert sdpa_calls == []


@pytest.mark.parametrize("backend,device", kernel_backends())
@pytest.mark.usefixtures("host_isa")
def test_trap_through_the_internal_signature_poisoned(backend, device):
    """The delegated path writes every element of out and lse (poisoned before) for the trap case."""
    dtype = dtype_for(backend, F32)
    (q, k, v, kc, vc, pos, lens), bm, dense = _trap_case(dtype, seed=1)
    B, W, Hq, D = q.shape
    dev = lambda t: t.to(device)
    out = torch.full((B, W, Hq, D), float("nan"), dtype=dtype, device=device)
    lse = torch.full((B, W, Hq), float("nan"), device=device)
    with attention_sdpa.mode("always"):
        ran = attention_sdpa.delegate(
            _backend.module("attention", backend),
            _impl(backend),
            q=dev(q),
            k=dev(k),
            v=dev(v),
            k_cache=dev(kc.clone()),
            v_cache=dev(vc.clone()),
            positions=dev(pos),
            seq_lens=dev(lens),
            block_table=None,
            kv_num_blocks=dev(bm.kv_num_blocks),
            kv_indices=dev(bm.kv_indices),
            out=out,
            lse=lse,
            block_mass=None,
            write_back=False,
            q_block=bm.q_block,
            kv_block=bm.kv_block,
            scale=D**-0.5,
        )
    if dtype != F32:  # a rest in fp16 / bf16: declined, nothing written
        assert not ran and out.isnan().all() and lse.isnan().all()
        return
    assert ran
    truth = attention_reference(
        q, k, v, kc.clone(), vc.clone(), pos, lens, False, dense, return_lse=True, compute_dtype=torch.float64
    )
    same = attention_reference(q, k, v, kc.clone(), vc.clone(), pos, lens, False, dense, return_lse=True)
    assert_precision(out.cpu(), same[0], truth[0], "out")
    assert_precision(lse.cpu(), same[1], truth[1], "lse")


@pytest.mark.parametrize("backend,device", kernel_backends())
@pytest.mark.parametrize("poison", ["q_inf", "k_nan", "k_inf", "v_nan", "v_inf"])
@pytest.mark.usefixtures("host_isa")
def test_delegated_non_finite_inputs_propagate(backend, device, poison, sdpa_calls):
    """A NaN / inf in what the dense prefix reads gives the contract's non-finite out and lse."""
    dtype = dtype_for(backend, F32)
    B, W, S, Hq, Hkv, D = 1, 8, 64, 2, 1, 64
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)
    q, k, v, kc, vc = r(B, W, Hq, D), r(B, W, Hkv, D), r(B, W, Hkv, D), r(B, S, Hkv, D), r(B, S, Hkv, D)
    pos, lens = torch.arange(20, 20 + W)[None], torch.tensor([S], dtype=torch.int32)
    target, index = {"q": (q, (0, 2, 1, 0)), "k": (kc, (0, 3, 0, 5)), "v": (vc, (0, 3, 0, 5))}[poison[0]]
    target[index] = float("nan") if poison.endswith("nan") else float("inf")
    with attention_sdpa.mode("always"):
        got = dk.attention(
            *(t.to(device) for t in (q, k, v, kc.clone(), vc.clone(), pos, lens)),
            return_lse=True,
            backend=backend,
        )
    assert sdpa_calls == [S]
    truth = attention_reference(
        q, k, v, kc.clone(), vc.clone(), pos, lens, return_lse=True, compute_dtype=torch.float64
    )
    same = attention_reference(q, k, v, kc.clone(), vc.clone(), pos, lens, return_lse=True)
    assert not torch.isfinite(truth[0]).all()
    for name, a, b, t in zip(("out", "lse"), got, same, truth):
        assert_precision(a.cpu(), b, t, f"{poison}: {name}")
