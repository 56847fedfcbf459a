"""The model-layer ops (rms_norm, rope, attention, moe): references against independent
formulations, their edge cases, the torch.library registration, and clear errors."""

import math
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_precision

import dinfer_kernels as dk
from dinfer_kernels.reference.attention import attention_reference
from dinfer_kernels.reference.moe import moe_reference, route
from dinfer_kernels.reference.rms_norm import rms_norm_reference
from dinfer_kernels.reference.rope import inv_freq, rope_reference

# ---- rms_norm ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [1, 7, 128])
def test_rms_norm_matches_formula(dtype, D):
    x = (torch.randn(3, 5, D) * 4).to(dtype)
    w = torch.randn(D).to(dtype)
    got = dk.rms_norm(x, w, 1e-5)
    xf = x.float()
    normed = (xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    assert got.dtype == dtype
    eps = torch.finfo(dtype).eps  # sqrt vs rsqrt may differ by an ulp or two before the cast
    torch.testing.assert_close(got.float(), (normed * w).float(), rtol=4 * eps, atol=0)
    if dtype == torch.float32:
        assert_precision(
            got,
            F.rms_norm(x, (D,), w, 1e-5),
            rms_norm_reference(x, w, 1e-5, compute_dtype=torch.float64),
            "rms_norm",
        )


# ---- rope ------------------------------------------------------------------------------------------


def test_rope_is_a_complex_rotation():
    B, T, H, D, theta = 2, 5, 3, 8, 500.0
    x = torch.randn(B, T, H, D, dtype=torch.float64)
    pos = torch.randint(0, 1000, (B, T))
    got = rope_reference(x, pos, theta, compute_dtype=torch.float64)
    half = D // 2
    freq = inv_freq(theta, D).double()  # the frequencies are fp32, as in the released models
    z = torch.complex(x[..., :half], x[..., half:]) * torch.polar(
        torch.ones(1, dtype=torch.float64), pos[..., None, None] * freq
    )
    torch.testing.assert_close(got, torch.cat([z.real, z.imag], -1))


def test_rope_relative_positions_and_partial_dims():
    q = torch.randn(1, 1, 2, 16)
    k = torch.randn(1, 1, 2, 16)
    dots = []
    for shift in (0, 37, 1000):
        qr = dk.rope(q, torch.tensor([[5 + shift]]), 10000.0)
        kr = dk.rope(k, torch.tensor([[2 + shift]]), 10000.0)
        dots.append((qr * kr).sum(-1))
    torch.testing.assert_close(dots[0], dots[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dots[0], dots[2], rtol=1e-4, atol=1e-4)
    part = dk.rope(q, torch.tensor([[9]]), 10000.0, rotary_dim=8)
    assert torch.equal(part[..., 8:], q[..., 8:])
    torch.testing.assert_close(part[..., :8], dk.rope(q[..., :8], torch.tensor([[9]]), 10000.0))
    assert torch.equal(dk.rope(q, torch.tensor([[0]]), 10000.0), q)


# ---- attention -------------------------------------------------------------------------------------


def attn_case(B=2, W=5, S=12, Hq=4, Hkv=2, D=8, dtype=torch.float32):
    q = torch.randn(B, W, Hq, D, dtype=dtype)
    k = torch.randn(B, W, Hkv, D, dtype=dtype)
    v = torch.randn(B, W, Hkv, D, dtype=dtype)
    kc = torch.randn(B, S, Hkv, D, dtype=dtype)
    vc = torch.randn(B, S, Hkv, D, dtype=dtype)
    return q, k, v, kc, vc


def test_attention_full_sequence_equals_sdpa():
    B, S, H, D = 2, 9, 4, 16
    q, k, v, kc, vc = attn_case(B, S, S, H, H, D)
    pos = torch.arange(S).expand(B, S).contiguous()
    lens = torch.full((B,), S, dtype=torch.int32)
    got = dk.attention(q, k, v, kc, vc, pos, lens)
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    truth = attention_reference(q, k, v, kc.clone(), vc.clone(), pos, lens, compute_dtype=torch.float64)
    assert_precision(got, want.transpose(1, 2), truth, "attention against sdpa")
    assert torch.equal(kc, k) and torch.equal(vc, v)  # written back in place


def test_attention_window_refresh_writes_only_window_rows():
    q, k, v, kc, vc = attn_case()
    pos = torch.tensor([[3, 4, 5, 6, 7], [0, 1, 2, 3, 9]])
    lens = torch.tensor([12, 9], dtype=torch.int32)  # row (1, 4) at position 9 >= 9 is padding
    kc0, vc0 = kc.clone(), vc.clone()
    out_ro = dk.attention(q, k, v, kc, vc, pos, lens, write_back=False)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
    out = dk.attention(q, k, v, kc, vc, pos, lens, write_back=True)
    torch.testing.assert_close(out, out_ro, rtol=0, atol=0)
    written = torch.zeros(2, 12, dtype=torch.bool)
    written[0, 3:8] = True
    written[1, 0:4] = True
    assert torch.equal(kc[written], torch.cat([k[0], k[1, :4]]))
    assert torch.equal(kc[~written], kc0[~written]) and torch.equal(vc[~written], vc0[~written])
    assert torch.equal(out[1, 4], torch.zeros_like(out[1, 4]))  # padding row


def test_attention_ignores_padding_keys_and_matches_gqa_expansion():
    q, k, v, kc, vc = attn_case()
    pos = torch.tensor([[0, 1, 2, 3, 4], [2, 3, 4, 5, 6]])
    lens = torch.tensor([7, 10], dtype=torch.int32)
    out = dk.attention(q, k, v, kc.clone(), vc.clone(), pos, lens)
    kp, vp = kc.clone(), vc.clone()
    kp[0, 7:] = 1e4
    vp[1, 10:] = float("nan")
    torch.testing.assert_close(dk.attention(q, k, v, kp, vp, pos, lens), out, rtol=0, atol=0)
    mha = dk.attention(
        q,
        k.repeat_interleave(2, 2),
        v.repeat_interleave(2, 2),
        kc.repeat_interleave(2, 2),
        vc.repeat_interleave(2, 2),
        pos,
        lens,
    )
    truth = attention_reference(q, k, v, kc.clone(), vc.clone(), pos, lens, compute_dtype=torch.float64)
    assert_precision(mha, out, truth, "heads expanded against grouped")


def test_attention_block_causal_mask_equals_sdpa():
    B, S, H, D, bl = 1, 12, 2, 8, 4
    q, k, v, kc, vc = attn_case(B, S, S, H, H, D)
    pos = torch.arange(S)[None]
    blk = torch.arange(S) // bl
    mask = (blk[None, :] <= blk[:, None])[None]
    got = dk.attention(q, k, v, kc, vc, pos, torch.tensor([S], dtype=torch.int32), attn_mask=mask)
    want = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None]
    )
    truth = attention_reference(
        q,
        k,
        v,
        kc.clone(),
        vc.clone(),
        pos,
        torch.tensor([S], dtype=torch.int32),
        attn_mask=mask,
        compute_dtype=torch.float64,
    )
    assert_precision(got, want.transpose(1, 2), truth, "block-causal attention against sdpa")


def test_attention_precision_bf16():
    q, k, v, kc, vc = attn_case(dtype=torch.bfloat16)
    pos = torch.tensor([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]])
    lens = torch.tensor([12, 9], dtype=torch.int32)
    got = dk.attention(q, k, v, kc.clone(), vc.clone(), pos, lens)
    truth = attention_reference(q, k, v, kc.clone(), vc.clone(), pos, lens, compute_dtype=torch.float64)
    assert (got.double() - truth).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * truth.abs().max()


# ---- moe -------------------------------------------------------------------------------------------


def moe_case(T=7, H=24, E=6, inter=10, dtype=torch.float32):
    hidden = torch.randn(T, H, dtype=dtype)
    router = torch.randn(E, H)
    w13 = (torch.randn(E, 2 * inter, H) * 0.3).to(dtype)
    w2 = (torch.randn(E, H, inter) * 0.3).to(dtype)
    return hidden, router, w13, w2


def naive_moe(hidden, router, w13, w2, k, renorm=False, bias=None):
    """Token by token, every expert computed, weighted by its top-k routing weight (0 if unchosen)."""
    inter = w13.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        p = torch.softmax(router.double() @ hidden[t].double(), -1)
        score = p + (bias.double() if bias is not None else 0)
        chosen = torch.argsort(score, descending=True, stable=True)[:k]
        w = score[chosen] / (score[chosen].sum() if renorm else 1)
        for wk, e in zip(w, chosen):
            gu = w13[e].double() @ hidden[t].double()
            out[t] += wk * (w2[e].double() @ (F.silu(gu[:inter]) * gu[inter:]))
    return out


@pytest.mark.parametrize(
    "k,renorm,bias",
    [(1, False, False), (2, False, False), (2, True, False), (3, False, True), (6, False, False)],
)
def test_moe_matches_token_by_token(k, renorm, bias):
    hidden, router, w13, w2 = moe_case()
    eb = torch.rand(6) * 0.1 if bias else None
    got = dk.moe(hidden, router, w13, w2, k, renormalize=renorm, expert_bias=eb)
    assert_precision(
        got,
        moe_reference(hidden, router, w13, w2, k, renorm, eb),
        naive_moe(hidden, router, w13, w2, k, renorm, eb),
        "moe",
    )


def test_moe_static_shape_path_equals_the_routed_one():
    """The CUDA-graph path (every expert on every token, weight 0 where unchosen) sums the same
    terms; only the GEMMs' row counts differ, so agreement is to fp32 rounding."""
    hidden, router, w13, w2 = moe_case()
    assert_precision(
        moe_reference(hidden, router, w13, w2, 2, static_shapes=True),
        moe_reference(hidden, router, w13, w2, 2),
        naive_moe(hidden, router, w13, w2, 2),
        "static shapes",
    )


def test_moe_expert_ranges_sum_to_the_whole_and_idle_experts():
    hidden, router, w13, w2 = moe_case(T=5)
    hidden = hidden.abs()
    router[3] = -100.0  # expert 3 never chosen
    whole = dk.moe(hidden, router, w13, w2, 2)
    parts = dk.moe(hidden, router, w13[:4], w2[:4], 2) + dk.moe(
        hidden, router, w13[4:], w2[4:], 2, expert_offset=4
    )
    assert_precision(parts, whole, naive_moe(hidden, router, w13, w2, 2), "sum of the expert ranges")
    assert not (route(hidden, router, 2)[1] == 3).any()
    empty = dk.moe(hidden, router, w13[3:3], w2[3:3], 2, expert_offset=3)
    assert torch.equal(empty, torch.zeros_like(empty))


def test_moe_bf16_precision():
    hidden, router, w13, w2 = moe_case(dtype=torch.bfloat16)
    got = dk.moe(hidden, router, w13, w2, 2)
    truth = moe_reference(hidden, router, w13, w2, 2, compute_dtype=torch.float64)
    same = moe_reference(hidden.float(), router, w13.float(), w2.float(), 2).to(torch.bfloat16)
    err, ref_err = (got.double() - truth).abs().max(), (same.double() - truth).abs().max()
    assert err <= 2 * ref_err + 4 * torch.finfo(torch.bfloat16).eps * truth.abs().max()


# ---- registration and errors -------------------------------------------------------------------


def test_opcheck_model_ops():
    x = torch.randn(3, 8)
    torch.library.opcheck(torch.ops.dinfer.rms_norm.default, (x, torch.randn(8), 1e-5, "torch"))
    torch.library.opcheck(
        torch.ops.dinfer.rope.default, (torch.randn(1, 3, 2, 8), torch.arange(3)[None], 1e4, 8, "torch")
    )
    q, k, v, kc, vc = attn_case()
    pos = torch.tensor([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]])
    torch.library.opcheck(
        torch.ops.dinfer.attention.default,
        (
            q,
            k,
            v,
            kc,
            vc,
            pos,
            torch.tensor([12, 9], dtype=torch.int32),
            None,
            True,
            None,
            None,
            None,
            5,
            64,
            1 / math.sqrt(8),
            False,
            False,
            "torch",
        ),
    )
    hidden, router, w13, w2 = moe_case()
    torch.library.opcheck(
        torch.ops.dinfer.moe.default,
        (hidden, router, None, None, None, w13, w2, 2, False, 0, None, 1, 1, 1.0, 0, *(None,) * 6, "torch"),
    )


def test_model_ops_compile_fullgraph():
    q, k, v, kc, vc = attn_case()
    pos = torch.tensor([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]])
    lens = torch.tensor([12, 9], dtype=torch.int32)
    hidden, router, w13, w2 = moe_case()

    def f(q, k, v, kc, vc, hidden):
        a = dk.attention(dk.rope(q, pos, 1e4), dk.rope(k, pos, 1e4), v, kc, vc, pos, lens)
        return a, dk.moe(dk.rms_norm(hidden, torch.ones(24), 1e-5), router, w13, w2, 2)

    want = f(q, k, v, kc.clone(), vc.clone(), hidden)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, kc.clone(), vc.clone(), hidden)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "call,name",
    [
        (lambda: dk.rms_norm(torch.randn(3, 8), torch.randn(7), 1e-5), "weight"),
        (lambda: dk.rms_norm(torch.randn(3, 8), torch.randn(8), 0.0), "eps"),
        (lambda: dk.rope(torch.randn(1, 3, 2, 8), torch.arange(4)[None], 1e4), "positions"),
        (lambda: dk.rope(torch.randn(1, 3, 2, 8), torch.arange(3)[None], 1e4, rotary_dim=5), "rotary_dim"),
        (
            lambda: dk.attention(
                *attn_case(Hq=3, Hkv=2),
                torch.zeros(2, 5, dtype=torch.int64),
                torch.ones(2, dtype=torch.int32),
            ),
            "k_cache",
        ),
        (
            lambda: dk.attention(*attn_case(), torch.full((2, 5), 12), torch.ones(2, dtype=torch.int32)),
            "positions",
        ),
        (lambda: dk.attention(*attn_case(), torch.zeros(2, 5, dtype=torch.int64), torch.ones(2)), "seq_lens"),
        (lambda: dk.moe(*moe_case(), 7), "top_k"),
        (lambda: dk.moe(*moe_case(), 2, expert_offset=2), "expert_offset"),
        (lambda: dk.moe(torch.randn(3, 5), *moe_case()[1:], 2), "w13"),
    ],
)
def test_model_op_errors_name_the_argument(call, name):
    with pytest.raises((TypeError, ValueError), match=rf"^{re.escape(name)}"):
        call()
