"""bench_kernels/bench_moe.py on the host at small sizes: both released layers (--shape) with the
weights in the activations' dtype and in FP8, every method that runs here (torch._grouped_mm alone
and in its pipeline where this torch has it on the host, the plain Triton GEMM and our Triton kernels
in the interpreter, our host kernel) with a row per (T, weights) that computes the layer (a small
difference from the torch loop), and the byte and FLOP counts the percentages rest on."""

import argparse
import json

import pytest
import torch
from conftest import load_bench

from dinfer_kernels import FP8_BLOCK, _backend, available_backends

bench = load_bench("bench_moe")


def cdiv(a, b):
    return -(-a // b)


def expert_bytes(H, I, fp8):
    """One expert's (or a shared expert of width I's) bytes: 1 B a weight + fp32 128 x 128 block
    scales (gate and up blocked on their own) in FP8, 4 B a weight in fp32."""
    if not fp8:
        return 3 * H * I * 4
    scales = 2 * cdiv(I, FP8_BLOCK) * cdiv(H, FP8_BLOCK) + cdiv(H, FP8_BLOCK) * cdiv(I, FP8_BLOCK)
    return 3 * H * I + 4 * scales


# (--shape, sizes: E, k, H, I, S): I and S not multiples of the FP8 block, S not one of I
SHAPES = [
    ("llada-moe", dict(E=8, k=2, H=160, I=48, S=0)),
    ("llada2-mini", dict(E=16, k=4, H=160, I=32, S=40)),
]


@pytest.mark.parametrize("shape, size", SHAPES, ids=[s for s, _ in SHAPES])
def test_both_shapes_with_fp8_weights_write_every_row(tmp_path, shape, size):
    out = tmp_path / "moe.json"
    E, k, H, I, S = (size[n] for n in ("E", "k", "H", "I", "S"))
    tokens = (3, 7)
    argv = ["--device", "cpu", "--quick", "--shape", shape, "--dtype", "fp32", "--weights", "fp32,fp8"]
    argv += ["--tokens", ",".join(map(str, tokens)), "--experts", str(E), "--top-k", str(k)]
    argv += ["--hidden", str(H), "--inter", str(I), "--reps", "1", "--json", str(out)]
    if shape == "llada2-mini":
        argv += ["--shared", str(S)]
    bench.main(argv)
    payload = json.loads(out.read_text())
    assert payload["complete"] and payload["args"]["shape"] == shape
    assert not [n for n in payload["notes"] if "failed" in n], payload["notes"]
    gmm = bench.grouped_mm_available("cpu", torch.float32)
    ours = {f"ours_{b}" for b in available_backends("cpu", "moe") if b != "torch"}
    if _backend.triton_interpreted():
        ours |= {"ours_triton"}
    for T in tokens:
        for weights in ("fp32", "fp8"):
            rows = [r for r in payload["results"] if r["T"] == T and r["weights"] == weights]
            want = {"torch_loop", *ours}
            if _backend.triton_interpreted():
                want.add("triton_plain")
            if gmm and weights == "fp32":  # torch._grouped_mm has no block-scaled FP8
                want |= {"grouped_mm", "grouped_mm_alone"}
                if "ours_triton" in ours:
                    want.add("ours_grouped_mm")
            assert {r["key"] for r in rows} == want, (T, weights)
            assert len(rows) == len(want)
            for r in rows:
                assert (r["shape"], r["E"], r["top_k"], r["H"], r["I"], r["S"]) == (shape, E, k, H, I, S)
                assert min(E, k) <= r["touched"] <= min(E, T * k)
                nbytes = r["touched"] * expert_bytes(H, I, weights == "fp8")
                nbytes += expert_bytes(H, S, weights == "fp8") if S else 0
                assert r["weight_MB"] * 1e6 == pytest.approx(nbytes, rel=1e-12)
                assert r["GBps"] * r["median_s"] * 1e9 == pytest.approx(nbytes, rel=1e-9)
                flops = 6 * T * k * H * I + 6 * T * H * S
                assert r["TFLOPs"] * r["median_s"] * 1e12 == pytest.approx(flops, rel=1e-9)
                assert r["us"] > 0 and r["speedup"] > 0
                # every method computes the layer: fp32 activations, the same (dequantised) weights
                assert r["rel_err"] < 1e-5, r
                if r["key"].startswith("ours"):
                    assert r["bitwise_repeat"] == "yes", r
    # one table per (T, weights), T outermost: a run cut short keeps the smallest T's tables
    titles = [t.split("\n")[0] for t in payload["tables"]]
    assert len(titles) == 4
    assert all(f"T = {T} tokens" in t for T, t in zip((3, 3, 7, 7), titles))
    assert all(f"{w} weights" in t for w, t in zip(("fp32", "fp8") * 2, titles))


def test_the_shapes_are_the_released_layers():
    def shape(name, small=False, **given):
        sizes = dict(experts=None, top_k=None, hidden=None, inter=None, shared=None)
        return bench.layer_shape(argparse.Namespace(shape=name, small=small, **{**sizes, **given}))

    moe = shape("llada-moe")
    assert (moe["E"], moe["k"], moe["H"], moe["I"], moe["S"], moe["bias"]) == (64, 8, 2048, 1024, 0, False)
    assert moe["routing"] == dict(
        renormalize=False, scoring="softmax", num_groups=1, topk_groups=1, routed_scaling=1.0
    )
    mini = shape("llada2-mini")
    assert (mini["E"], mini["k"], mini["H"], mini["I"], mini["S"], mini["bias"]) == (
        256,
        8,
        2048,
        512,
        512,
        True,
    )
    assert mini["routing"] == dict(
        renormalize=True, scoring="sigmoid", num_groups=8, topk_groups=4, routed_scaling=2.5
    )
    small = shape("llada2-mini", small=True)
    assert (small["E"], small["k"], small["H"], small["I"], small["S"]) == (16, 8, 256, 64, 64)
    assert small["routing"] == mini["routing"]
    assert shape("llada2-mini", small=True, shared=0, top_k=2)["S"] == 0


def test_the_shared_expert_as_groups_is_the_dense_mlp():
    """grouped_mm_alone's shared expert: ceil(S/I) groups of width I, the last zero-padded."""
    g = torch.Generator().manual_seed(0)
    S, I, H = 40, 16, 24
    w13, w2 = torch.randn(2 * S, H, generator=g), torch.randn(H, S, generator=g)
    x = torch.randn(5, H, generator=g)
    ew13, ew2 = bench.shared_as_experts(w13, w2, I)
    assert ew13.shape == (3, 2 * I, H) and ew2.shape == (3, H, I)
    got = sum(bench.silu_mul(x @ ew13[j].t(), x.dtype) @ ew2[j].t() for j in range(3))
    torch.testing.assert_close(got, bench.shared_mlp(x, dict(shared_w13=w13, shared_w2=w2)))


@pytest.mark.parametrize(
    "option, value", [("--weights", "bf16"), ("--weights", "int4"), ("--methods", "loop")]
)
def test_bad_options_name_themselves(option, value):
    with pytest.raises(SystemExit, match=option):
        bench.main(["--device", "cpu", "--dtype", "fp32", option, value])


def test_moe_inputs_options_keep_the_default_draws_and_quantise_them():
    """The bench draws each kind of weights from one seed: the options draw after the defaults, and
    fp8 quantises the very values the other kind holds."""
    from dinfer_kernels import fp8_block_dequantize, op_inputs

    draw = lambda **kw: op_inputs.moe_inputs(
        5, 4, 136, 40, 2, generator=torch.Generator().manual_seed(3), **kw
    )
    plain, shared, fp8 = draw(), draw(shared_inter=24, bias_scale=0.1), draw(shared_inter=24, fp8=True)
    for name in ("hidden", "router_weight", "w13", "w2"):
        assert torch.equal(plain[name], shared[name]), name
    assert shared["shared_w13"].shape == (48, 136) and shared["shared_w2"].shape == (136, 24)
    assert shared["expert_bias"].shape == (4,) and "expert_bias" not in fp8
    assert not any(n.endswith("_scale") for n in shared)
    for name, halves in (("w13", 2), ("w2", 1), ("shared_w13", 2), ("shared_w2", 1)):
        q, scale = fp8[name], fp8[f"{name}_scale"]
        assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        back = fp8_block_dequantize(q, scale, torch.float32, halves=halves)
        # e4m3 keeps 3 mantissa bits: within 1/16 of each value, plus the smallest step of its block
        err = (back - shared[name]).abs()
        assert (err <= shared[name].abs() / 16 + scale.max() * 2**-9).all(), name
