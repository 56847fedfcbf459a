"""LLaDA2-MoE (BailingMoeV2) in dinfer reproduces the published forward pass.

An independent check: the transcription below is written from the published model description
(/work/shared/reference/models.md §3: config.json keys, released safetensors names and shapes, the
forward pass with its router table and block-causal mask), not from dinfer's code. Random checkpoints
are written in the released layout with the real safetensors writer and loaded through
`DiffusionLM.from_pretrained`. dinfer runs in fp32 (its kernels take no fp64) and is held to the
project's precision rule: its error against a float64 run of the transcription may be at most the
bound set by a float32 run of the same transcription.

Cases: a tiny model (block-causal mask with a partial last block, and the full mask); a model with the
released LLaDA2.0-mini widths that matter for routing and indexing (256 experts, top-8, 8 groups,
16/4 heads of 128, vocabulary 157184); a sharded save and dInfer's pre-fused expert layout, which must
give the per-expert file's logits; and broken checkpoints (a missing, an unknown and a mis-shaped
tensor) whose error must name the tensor.
"""

import json
import math
import re

import pytest
import torch
from helpers.hf_configs import LLADA2_MINI
from safetensors.torch import save_file

from dinfer.models.config import CheckpointError
from dinfer.models.transformer import DiffusionLM
from dinfer_kernels.precision import within_precision


def llada2_config(**sizes):
    """The released mini config.json (every key the loader reads); `sizes` override its values."""
    return dict(LLADA2_MINI, **sizes)


TINY = llada2_config(
    vocab_size=97,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    moe_intermediate_size=24,
    num_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    rotary_dim=8,
    max_position_embeddings=64,
    # The release leaves mask and eos to the defaults 156895 / 156892, outside this vocabulary.
    pad_token_id=96,
    eos_token_id=96,
    mask_token_id=95,
)
# The mini widths except the layer count and the dense MLP width, which only cost CPU time.
MINI = llada2_config(num_hidden_layers=2, intermediate_size=512, moe_intermediate_size=64)

# Every routing choice (kept groups, top-k experts) wins by at least this much in the fp64 truth: far
# above fp32 rounding of the scores (~1e-7), so no run picks other experts than the truth does.
ROUTING_MARGIN = 1e-5
HEAD_CHUNK = 16384  # lm_head rows cast to the compute dtype at a time (the mini head is 157184 rows)


# ------------------------------------------------------------------------------------- checkpoints


def random_checkpoint(cfg, seed, dtype):
    """Random weights in the released layout (§3.2), stored as `dtype` (expert_bias in fp32, as
    released). Scales keep activations O(1): norms near 1, linears N(0, 1/fan_in), a wider router so
    the sigmoid scores spread (no routing ties), and a bias big enough to change the choice."""
    g = torch.Generator().manual_seed(seed)
    H, hd = cfg["hidden_size"], cfg["head_dim"]
    nh, nkv, V = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    # Sampled straight into the stored dtype: the mini embedding and head are 322M values each.
    normal = lambda shape, mean, std, dt=dtype: torch.empty(shape, dtype=dt).normal_(mean, std, generator=g)
    norm = lambda n: normal(n, 1.0, 0.1)
    linear = lambda out, inp, scale=1.0: normal((out, inp), 0.0, scale / math.sqrt(inp))

    def swiglu(prefix, width):
        return {
            f"{prefix}gate_proj.weight": linear(width, H),
            f"{prefix}up_proj.weight": linear(width, H),
            f"{prefix}down_proj.weight": linear(H, width),
        }

    w = {"model.word_embeddings.weight": normal((V, H), 0.0, 1.0)}
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        w[pre + "input_layernorm.weight"] = norm(H)
        w[pre + "attention.query_key_value.weight"] = linear((nh + 2 * nkv) * hd, H)
        w[pre + "attention.query_layernorm.weight"] = norm(hd)
        w[pre + "attention.key_layernorm.weight"] = norm(hd)
        w[pre + "attention.dense.weight"] = linear(H, nh * hd)
        w[pre + "post_attention_layernorm.weight"] = norm(H)
        if i < cfg["first_k_dense_replace"]:
            w.update(swiglu(pre + "mlp.", cfg["intermediate_size"]))
            continue
        w[pre + "mlp.gate.weight"] = linear(cfg["num_experts"], H, scale=4.0)
        w[pre + "mlp.gate.expert_bias"] = normal(cfg["num_experts"], 0.0, 0.1, torch.float32)
        for e in range(cfg["num_experts"]):
            w.update(swiglu(f"{pre}mlp.experts.{e}.", cfg["moe_intermediate_size"]))
        shared_width = cfg["moe_intermediate_size"] * cfg["num_shared_experts"]
        w.update(swiglu(pre + "mlp.shared_experts.", shared_width))
    w["model.norm.weight"] = norm(H)
    w["lm_head.weight"] = linear(V, H)
    return w


def prefused(cfg, tensors):
    """dInfer's pre-fused expert layout: per MoE layer mlp.w1 [E, 2I, H] (gate rows, then up rows) and
    mlp.w2 [E, H, I] in place of the per-expert tensors."""
    out = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for i in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]):
        expert = lambda e, proj: tensors[f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"]
        experts = range(cfg["num_experts"])
        out[f"model.layers.{i}.mlp.w1"] = torch.stack(
            [torch.cat([expert(e, "gate_proj"), expert(e, "up_proj")]) for e in experts]
        )
        out[f"model.layers.{i}.mlp.w2"] = torch.stack([expert(e, "down_proj") for e in experts])
    return out


def write_checkpoint(folder, cfg, tensors, shards=1):
    """config.json plus model.safetensors, or `shards` files with a model.safetensors.index.json."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return folder


def block_causal_mask(L, bl):
    """[L, L] bool, True = attend: blocks of `bl` aligned at position 0; a query sees its own block and
    every earlier one (§3.3)."""
    block = torch.arange(L) // bl
    return block[None, :] <= block[:, None]


# ----------------------------------------------------------------------------- §3.3 transcription


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def swiglu(x, p, prefix):
    gate, up = x @ p(prefix + "gate_proj.weight").T, x @ p(prefix + "up_proj.weight").T
    return (torch.nn.functional.silu(gate) * up) @ p(prefix + "down_proj.weight").T


def rope_tables(cfg, L, dtype):
    """cos, sin [L, rotary_dim]: inv_freq[j] = theta^(-2j/rotary_dim), frequencies repeated twice."""
    rd = int(cfg["head_dim"] * cfg["partial_rotary_factor"])
    assert rd == cfg["rotary_dim"]
    inv_freq = cfg["rope_theta"] ** (-torch.arange(0, rd, 2, dtype=dtype) / rd)
    freqs = torch.arange(L, dtype=dtype)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def partial_rope(x, cos, sin):
    """Rotate-half RoPE on the first rotary_dim dims of each head of x [B, L, heads, hd]; the rest pass."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


def attention(cfg, a, p, cos, sin, mask):
    B, L, _ = a.shape
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    # The fused projection's output is [Q heads | K heads | V heads], head_dim rows per head.
    q, k, v = (a @ p("query_key_value.weight").T).view(B, L, nh + 2 * nkv, hd).split([nh, nkv, nkv], dim=2)
    # Per-head QK-norm comes before RoPE; V is not normed.
    q = partial_rope(rms_norm(q, p("query_layernorm.weight"), eps), cos, sin)
    k = partial_rope(rms_norm(k, p("key_layernorm.weight"), eps), cos, sin)
    # GQA (repeat_kv): query head h reads kv head h // (nh / nkv).
    k, v = (t.repeat_interleave(nh // nkv, dim=2) for t in (k, v))
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, L, hd]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, L, nh * hd)
    return o @ p("dense.weight").T


def moe(cfg, m, p):
    """Routed experts plus the shared expert for m [T, H], routed by the §3.3 router table; also the
    smallest margin by which a kept group or a chosen expert beat the first one left out."""
    T = m.shape[0]
    E, k, groups, keep = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["n_group"], cfg["topk_group"]
    scores = torch.sigmoid(m @ p("gate.weight").T)
    biased = scores + p("gate.expert_bias")  # the bias only chooses; the weights use `scores`
    group_score = biased.view(T, groups, E // groups).topk(2, dim=-1).values.sum(-1)
    ranked_groups = group_score.topk(keep + 1, dim=-1)
    kept = torch.zeros(T, groups, dtype=torch.bool).scatter_(1, ranked_groups.indices[:, :keep], True)
    candidates = biased.masked_fill(~kept.repeat_interleave(E // groups, dim=1), float("-inf"))
    ranked = candidates.topk(k + 1, dim=-1)
    idx = ranked.indices[:, :k]
    weight = scores.gather(1, idx)
    if k > 1:
        weight = weight / (weight.sum(-1, keepdim=True) + 1e-20)
    weight = weight * cfg["routed_scaling_factor"]
    expert = lambda t, j: swiglu(m[t], p, f"experts.{int(idx[t, j])}.")
    routed = torch.stack([sum(weight[t, j] * expert(t, j) for j in range(k)) for t in range(T)])
    margin = min(
        float((ranked_groups.values[:, keep - 1] - ranked_groups.values[:, keep]).min()),
        float((ranked.values[:, k - 1] - ranked.values[:, k]).min()),
    )
    return routed + swiglu(m, p, "shared_experts."), margin


def reference_logits(cfg, tensors, tokens, mask, dtype):
    """(logits [B, L, V], smallest routing margin) of §3.3 in plain torch at `dtype`, from the stored
    tensors (each cast when used, so the mini-sized model never exists in fp64 all at once)."""
    B, L = tokens.shape
    eps = cfg["rms_norm_eps"]
    cos, sin = rope_tables(cfg, L, dtype)
    h = tensors["model.word_embeddings.weight"][tokens].to(dtype)
    margins = []
    for i in range(cfg["num_hidden_layers"]):
        p = lambda name, pre=f"model.layers.{i}.": tensors[pre + name].to(dtype)
        a = rms_norm(h, p("input_layernorm.weight"), eps)
        h = h + attention(cfg, a, lambda n: p("attention." + n), cos, sin, mask)
        m = rms_norm(h, p("post_attention_layernorm.weight"), eps)
        mlp = lambda n: p("mlp." + n)
        if i < cfg["first_k_dense_replace"]:
            h = h + swiglu(m, mlp, "")
        else:
            y, margin = moe(cfg, m.reshape(B * L, -1), mlp)
            h = h + y.view(B, L, -1)
            margins.append(margin)
    x = rms_norm(h, tensors["model.norm.weight"].to(dtype), eps)
    logits = torch.cat([x @ rows.to(dtype).T for rows in tensors["lm_head.weight"].split(HEAD_CHUNK)], dim=-1)
    return logits, min(margins)


# ------------------------------------------------------------------------------------------ dinfer


def dinfer_logits(folder, tokens, mask):
    """dinfer's logits [B*L, V] in fp32 (its kernels take fp32/fp16/bf16, not fp64) for the whole
    sequence in one forward with the given [B, L, L] mask."""
    model = DiffusionLM.from_pretrained(folder, dtype=torch.float32)
    B, L = tokens.shape
    positions = torch.arange(L).expand(B, L)
    seq_lens = torch.full((B,), L, dtype=torch.int32)
    return model.forward(model.embed(tokens), positions, model.new_cache(B, L), seq_lens, attn_mask=mask)


def transcription(cfg, tensors, tokens, mask):
    """(truth, same_precision): the transcription's logits [B*L, V] in fp64 and in fp32."""
    truth, margin = reference_logits(cfg, tensors, tokens, mask, torch.float64)
    same, _ = reference_logits(cfg, tensors, tokens, mask, torch.float32)
    assert margin > ROUTING_MARGIN, f"routing margin {margin:.3g}: pick another seed"
    rows = tokens.numel()
    return truth.view(rows, -1), same.view(rows, -1)


def assert_within_precision(got, truth, same):
    """The project's precision rule: dinfer's fp32 logits err against the fp64 truth no more than the
    bound set by the fp32 run of the same transcription."""
    ok, msg, _, _ = within_precision(got.double(), same, truth)
    assert ok, msg


def random_tokens(cfg, B, L, seed):
    return torch.randint(cfg["vocab_size"], (B, L), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def tiny():
    """(tensors, tokens [2, 11]) of the tiny model, stored in fp32."""
    return random_checkpoint(TINY, seed=0, dtype=torch.float32), random_tokens(TINY, 2, 11, seed=1)


@pytest.fixture(scope="module")
def tiny_dir(tiny, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("llada2") / "per_expert", TINY, tiny[0])


def tiny_mask(kind, B, L):
    # bl = 4 with L = 11 leaves a partial last block.
    mask = block_causal_mask(L, 4) if kind == "block" else torch.ones(L, L, dtype=torch.bool)
    return mask.expand(B, L, L)


# ------------------------------------------------------------------------------------------- tests


def test_config_parsed(tiny_dir):
    c = DiffusionLM.from_pretrained(tiny_dir, dtype=torch.float32).config
    assert (c.family, c.num_kv_heads, c.head_dim, c.num_layers) == ("llada2_moe", 2, 16, 3)


@pytest.mark.parametrize("mask_kind", ["block", "full"])
def test_tiny_matches_transcription(tiny, tiny_dir, mask_kind):
    tensors, tokens = tiny
    mask = tiny_mask(mask_kind, *tokens.shape)
    assert_within_precision(
        dinfer_logits(tiny_dir, tokens, mask), *transcription(TINY, tensors, tokens, mask)
    )


@pytest.mark.parametrize("layout", ["sharded", "prefused"])
def test_layouts_give_same_logits(tiny, tiny_dir, tmp_path, layout):
    tensors, tokens = tiny
    mask = tiny_mask("block", *tokens.shape)
    if layout == "sharded":
        folder = write_checkpoint(tmp_path / layout, TINY, tensors, shards=2)
    else:
        folder = write_checkpoint(tmp_path / layout, TINY, prefused(TINY, tensors))
    got = dinfer_logits(folder, tokens, mask)
    # The same weights, however stored, load into the same model: the very same logits.
    torch.testing.assert_close(got, dinfer_logits(tiny_dir, tokens, mask), rtol=0, atol=0)


def test_mini_shaped(tmp_path):
    """Released mini widths (vocab 157184, 256 experts in 8 groups of 32, 16/4 heads of 128), stored in
    bf16 like the release."""
    tensors = random_checkpoint(MINI, seed=2, dtype=torch.bfloat16)
    folder = write_checkpoint(tmp_path / "mini", MINI, tensors)
    tokens = random_tokens(MINI, 1, 13, seed=3)
    mask = block_causal_mask(13, 8)[None]  # bl = 8 with L = 13: a partial last block
    truth, same = transcription(MINI, tensors, tokens, mask)
    del tensors  # 1.5 GB: the model loads its own copy
    assert_within_precision(dinfer_logits(folder, tokens, mask), truth, same)


def drop_expert_down(tensors):
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    return {k: v for k, v in tensors.items() if k != name}, name


def add_unknown(tensors):
    name = "model.layers.2.attention.unknown_proj.weight"
    return {**tensors, name: torch.zeros(4, 64)}, name


def misshape_key_norm(tensors):
    name = "model.layers.1.attention.key_layernorm.weight"
    return {**tensors, name: torch.ones(TINY["head_dim"] + 1)}, name


@pytest.mark.parametrize("breaks", [drop_expert_down, add_unknown, misshape_key_norm])
def test_bad_checkpoint_names_tensor(tiny, tmp_path, breaks):
    tensors, name = breaks(tiny[0])
    folder = write_checkpoint(tmp_path / "bad", TINY, tensors)
    with pytest.raises(CheckpointError, match=re.escape(name)) as err:
        DiffusionLM.from_pretrained(folder, dtype=torch.float32)
    assert isinstance(err.value, ValueError)
