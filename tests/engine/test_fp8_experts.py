"""FP8 expert weights in the engine (dinfer.models.quantization) and the shared expert fused into the
moe op.

An FP8 checkpoint is made from an embedded MoE model the way a user would (LLM(quantize="fp8"), then
save_checkpoint), checked on disk against the fine-grained FP8 format, and loaded back: it must equal
`--quantize fp8` of the original exactly. Broken or foreign quantization configs and tensors end in
errors that name the key or tensor. The fused shared expert is held to the old unfused path by the
precision-tied tolerance (dinfer_kernels.precision).
"""

import json
import os
import shutil

import pytest
import torch
from conftest import assert_precision
from helpers.cli import cli
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import dinfer_kernels as dk
from dinfer.llm import LLM
from dinfer.models import CheckpointError, ModelConfig, load_weights, save_checkpoint
from dinfer.models.embedded import model_dir
from dinfer.models.transformer import DiffusionLM
from dinfer_kernels.reference.moe import moe_reference

MOE, LLADA2, DENSE = "tiny-llada-moe", "tiny-llada2", "tiny-llada"
FP8 = torch.float8_e4m3fn
PROMPTS = ["What is 2 + 3?", "Sort: c a b"]
FAST = dict(gen_length=16, block_length=8)
# A routed expert's and the shared expert's released gate projection in layer 1 (both families' first MoE layer but one)
EXPERT = "model.layers.1.mlp.experts.3.gate_proj.weight"
SHARED = "model.layers.1.mlp.shared_experts.up_proj.weight"
ATTENTION = {
    MOE: "model.layers.2.self_attn.q_proj.weight",
    LLADA2: "model.layers.2.attention.query_key_value.weight",
}


def bits(t):
    """A tensor's raw bits (FP8 tensors compare as bytes: torch.equal has no FP8 kernel)."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


def assert_same_weights(a, b):
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(bits(a[name]), bits(b[name])), name


def fp8_checkpoint(name, dst, dtype="bf16"):
    """The embedded model `name` saved as an FP8 checkpoint in dst (its experts quantised at load by
    LLM(quantize="fp8")), with its tokenizer and generation config; returns (dst, that LLM)."""
    llm = LLM(name, device="cpu", dtype=dtype, quantize="fp8")
    save_checkpoint(dst, llm.model.config, llm.model.w)
    for file in os.listdir(model_dir(name)):
        if file not in ("model.safetensors", "config.json"):
            shutil.copy(os.path.join(model_dir(name), file), dst)
    return str(dst), llm


@pytest.fixture(scope="module", params=[MOE, LLADA2])
def saved(request, tmp_path_factory):
    """(model name, FP8 checkpoint folder, the LLM it was saved from) per MoE family."""
    path, llm = fp8_checkpoint(request.param, tmp_path_factory.mktemp("fp8") / request.param)
    return request.param, path, llm


def test_quantize_fp8_makes_expert_weights_fp8_with_their_scales(saved):
    name, _, llm = saved
    w, config = llm.model.w, llm.model.config
    plain = load_weights(model_dir(name), config, dtype=torch.bfloat16)
    experts = [n for n in w if n.rsplit(".", 1)[-1] in ("w13", "w2", "shared_w13", "shared_w2")]
    assert experts and any("shared" in n for n in experts) == (name == LLADA2)
    for n in experts:
        halves = 2 if n.endswith("w13") else 1
        q, scale = dk.fp8_block_quantize(plain[n], halves=halves)
        assert w[n].dtype == FP8 and torch.equal(bits(w[n]), bits(q)), n
        assert torch.equal(w[n + "_scale"], scale), n
    others = {n: t for n, t in w.items() if n not in experts and not n.endswith("_scale")}
    assert others.keys() == plain.keys() - set(experts)
    assert all(torch.equal(t, plain[n]) for n, t in others.items())


def test_saved_fp8_checkpoint_is_the_fine_grained_format(saved):
    name, path, _ = saved
    with open(os.path.join(path, "config.json")) as f:
        q = json.load(f)["quantization_config"]
    assert (q["quant_method"], q["fmt"], q["weight_block_size"], q["activation_scheme"]) == (
        "fp8",
        "e4m3",
        [128, 128],
        "dynamic",
    )
    assert ATTENTION[name][: -len(".weight")] in q["modules_to_not_convert"]
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        names = set(f.keys())
        gate = f.get_slice(EXPERT)
        assert gate.get_dtype() == "F8_E4M3"
        scale = f.get_slice(EXPERT + "_scale_inv")
        rows, cols = gate.get_shape()
        assert scale.get_dtype() == "F32" and scale.get_shape() == [-(-rows // 128), -(-cols // 128)]
        assert f.get_slice(ATTENTION[name]).get_dtype() == "BF16"
        assert ATTENTION[name] + "_scale_inv" not in names
        if name == LLADA2:
            assert f.get_slice(SHARED).get_dtype() == "F8_E4M3" and SHARED + "_scale_inv" in names


def test_fp8_checkpoint_loads_as_quantize_fp8_exactly(saved):
    _, path, llm = saved
    loaded = LLM(path, device="cpu", dtype="bf16")
    assert loaded.model.config.quantization == "fp8"
    assert_same_weights(loaded.model.w, llm.model.w)
    want = llm.generate(PROMPTS, **FAST)
    got = loaded.generate(PROMPTS, **FAST)
    assert got.token_ids == want.token_ids and got.texts == want.texts


def test_fp8_experts_run_as_their_dequantised_weights(saved):
    """The FP8 model's logits are those of the same model on the dequantised expert weights."""
    _, _, llm = saved
    model = llm.model
    dequantised = {
        n: t
        if n.endswith("_scale") or t.dtype != FP8
        else dk.fp8_block_dequantize(
            t, model.w[n + "_scale"], torch.bfloat16, halves=2 if n.endswith("w13") else 1
        )
        for n, t in model.w.items()
    }
    dequantised = {n: t for n, t in dequantised.items() if not n.endswith("_scale")}
    plain = DiffusionLM(model.config, dequantised)
    c = model.config
    tokens = torch.randint(0, c.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    logits = []
    for m in (model, plain):
        cache = m.new_cache(1, 24)
        logits.append(
            m.forward(m.embed(tokens), torch.arange(24)[None], cache, torch.tensor([24], dtype=torch.int32))
        )
    assert torch.equal(logits[0], logits[1])


# ------------------------------------------------------------------------------- the shared expert


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_shared_expert_equals_the_unfused_path_within_precision(dtype):
    config = ModelConfig.from_dir(model_dir(LLADA2))
    model = DiffusionLM(config, load_weights(model_dir(LLADA2), config, dtype=dtype))
    w, i = model.w, config.first_k_dense
    p = f"layers.{i}."
    h = torch.randn(2, 13, config.hidden_size, generator=torch.Generator().manual_seed(3)).to(dtype)
    fused = model._mlp(i, h, None).reshape(-1, config.hidden_size)
    m = dk.rms_norm(h, w[p + "mlp_norm"], config.rms_eps).reshape(-1, config.hidden_size)
    routing = dict(
        renormalize=config.router_renormalize,
        expert_bias=w[p + "expert_bias"],
        scoring=config.router_scoring,
        num_groups=config.num_groups,
        topk_groups=config.topk_groups,
        routed_scaling=config.routed_scaling,
    )
    # the path DiffusionLM took before the op had the shared expert: its output added in the dtype
    routed = dk.moe(m, w[p + "router"], w[p + "w13"], w[p + "w2"], config.top_k, **routing)
    g, u = (m @ w[p + "shared_w13"].t()).chunk(2, dim=-1)
    unfused = routed + (torch.nn.functional.silu(g) * u) @ w[p + "shared_w2"].t()
    shared = dict(shared_w13=w[p + "shared_w13"], shared_w2=w[p + "shared_w2"])
    truth = moe_reference(
        m,
        w[p + "router"],
        w[p + "w13"],
        w[p + "w2"],
        config.top_k,
        compute_dtype=torch.float64,
        **routing,
        **shared,
    )
    assert_precision(fused, unfused, truth, f"fused shared expert ({dtype})")
    assert_precision(unfused, fused, truth, f"unfused shared expert ({dtype})")


# ------------------------------------------------------------------------------- refusals


def edited(saved, tmp_path, config=None, tensors=None):
    """A copy of the FP8 checkpoint with config.json's quantization_config updated by `config` and
    the tensors by `tensors(dict)`."""
    _, path, _ = saved
    dst = shutil.copytree(path, tmp_path / "edited")
    if config is not None:
        with open(dst / "config.json") as f:
            d = json.load(f)
        if config == "drop":
            del d["quantization_config"]
        else:
            d["quantization_config"].update(config)
        with open(dst / "config.json", "w") as f:
            json.dump(d, f)
    if tensors is not None:
        raw = load_file(dst / "model.safetensors")
        tensors(raw)
        save_file(raw, dst / "model.safetensors")
    return str(dst)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"quant_method": "gptq"}, r"quantization_config\.quant_method='gptq' is not supported \(only 'fp8'"),
        ({"fmt": "e5m2"}, r"quantization_config\.fmt='e5m2' is not supported \(only 'e4m3'\)"),
        (
            {"weight_block_size": [64, 64]},
            r"quantization_config\.weight_block_size=\[64, 64\] is not supported",
        ),
        (
            {"activation_scheme": "static"},
            r"quantization_config\.activation_scheme='static' is not supported",
        ),
    ],
)
def test_other_quantizations_are_refused_naming_the_key(saved, tmp_path, change, message):
    with pytest.raises(CheckpointError, match="config.json: " + message):
        LLM(edited(saved, tmp_path, config=change), device="cpu")


def test_fp8_tensors_without_the_config_are_refused(saved, tmp_path):
    with pytest.raises(
        CheckpointError, match=r"is FP8 \(F8_E4M3\) but config.json has no quantization_config"
    ):
        LLM(edited(saved, tmp_path, config="drop"), device="cpu")


def test_a_weight_without_its_scales_is_named(saved, tmp_path):
    path = edited(saved, tmp_path, tensors=lambda t: t.pop(EXPERT + "_scale_inv"))
    with pytest.raises(
        CheckpointError, match=f"tensor '{EXPERT}' .* is FP8 but the checkpoint has no '{EXPERT}_scale_inv'"
    ):
        LLM(path, device="cpu")


def test_scales_of_the_wrong_shape_are_named(saved, tmp_path):
    def shrink(t):
        t[EXPERT + "_scale_inv"] = t[EXPERT + "_scale_inv"][:1].contiguous()

    with pytest.raises(
        CheckpointError, match=f"'{EXPERT}_scale_inv' .* has shape \\[1, 2\\], expected \\[2, 2\\]"
    ):
        LLM(edited(saved, tmp_path, tensors=shrink), device="cpu")


def test_scales_of_a_weight_that_is_not_fp8_are_named(saved, tmp_path):
    name, _, _ = saved

    def stray(t):
        t[ATTENTION[name] + "_scale_inv"] = torch.ones(2, 2)

    with pytest.raises(
        CheckpointError,
        match=f"'{ATTENTION[name]}_scale_inv' holds block scales but .* is not FP8 \\(dtype BF16\\)",
    ):
        LLM(edited(saved, tmp_path, tensors=stray), device="cpu")


# ------------------------------------------------------------------------------- other FP8 tensors


def test_other_fp8_tensors_are_dequantised_and_a_partly_fp8_layer_too(saved, tmp_path):
    """An FP8 attention weight loads dequantised in the model dtype; a layer whose shared expert is
    not FP8 while its routed experts are has all of them dequantised (the op takes one dtype)."""
    name, _, llm = saved
    att = ATTENTION[name]

    def change(t):
        t[att], t[att + "_scale_inv"] = dk.fp8_block_quantize(t[att])
        if name == LLADA2:  # the shared expert back in bf16
            for half in ("gate_proj", "up_proj", "down_proj"):
                key = f"model.layers.1.mlp.shared_experts.{half}.weight"
                t[key] = dk.fp8_block_dequantize(t[key], t.pop(key + "_scale_inv"), torch.bfloat16)

    path = edited(saved, tmp_path, tensors=change)
    w = LLM(path, device="cpu", dtype="bf16").model.w
    canonical = "layers.2.q" if name == MOE else "layers.2.qkv"
    q, scale = dk.fp8_block_quantize(llm.model.w[canonical])
    assert w[canonical].dtype == torch.bfloat16
    assert torch.equal(w[canonical], dk.fp8_block_dequantize(q, scale, torch.bfloat16))
    layer1 = [f"layers.1.{n}" for n in ("w13", "w2", "shared_w13", "shared_w2") if f"layers.1.{n}" in w]
    if name == LLADA2:
        assert all(w[n].dtype == torch.bfloat16 and n + "_scale" not in w for n in layer1)
        assert w["layers.2.w13"].dtype == FP8  # the other layers keep theirs
    else:
        assert all(w[n].dtype == FP8 for n in layer1)


# ------------------------------------------------------------------------------- --quantize


def test_quantize_refuses_dense_models_and_unknown_methods():
    with pytest.raises(
        ValueError,
        match="quantize: 'fp8' converts expert weights, and this LLaDA model has no expert weights to quantise",
    ):
        LLM(DENSE, device="cpu", quantize="fp8")
    with pytest.raises(ValueError, match="quantize: expected one of fp8 or None, got 'int4'"):
        LLM(MOE, device="cpu", quantize="int4")


def test_cli_quantize_fp8_generates_what_the_llm_does(capsys, monkeypatch):
    llm = LLM(LLADA2, device="cpu", quantize="fp8")
    want = llm.generate(PROMPTS, **FAST)
    args = [
        "--model",
        LLADA2,
        "--device",
        "cpu",
        "--quantize",
        "fp8",
        "--gen-length",
        "16",
        "--block-length",
        "8",
    ]
    code, out, err = cli(
        capsys, monkeypatch, "generate", *args, "--json", *(a for p in PROMPTS for a in ("--prompt", p))
    )
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["token_ids"] == want.token_ids
    code, _, err = cli(capsys, monkeypatch, "eval", "--model", DENSE, "--quantize", "fp8", "--tasks", "add")
    assert code == 2 and "no expert weights to quantise" in err
