"""LLaDA-MoE: every layer a softmax-routed MoE (top-k weights not renormalised, an optional expert bias),
per-head QK-norm, its config.json under HF keys (`hidden_size`, `expert_intermediate_size`, ...) and
its tensors under `model.layers.`: per expert as released, or stacked as dInfer's fused layout."""

from __future__ import annotations

from .config_keys import ConfigKeys, head_dim, reject_unsupported, special_ids
from .family import Family, Plan, stacked_experts

NAME = "llada_moe"
ARCH = "LLaDAMoEModelLM"
FUSED_ARCH = "FusedLLaDAMoEModelLM"  # written by dInfer's tools/transfer.py (stacked experts)
ARCHS = frozenset({ARCH, "LLaDAMoEModel", FUSED_ARCH})  # some copies of the release say LLaDAMoEModel
# Special-token ids the release hard-codes when config.json omits them (LLaDA2 shares its tokenizer).
MASK_ID, EOS_ID = 156895, 156892

# Keys that, when present with any other value, describe a computation we do not implement.
ONLY = {
    "hidden_act": "silu",
    "attention_bias": False,
    "clip_qkv": None,
    "rope_scaling": None,
    "partial_rotary_factor": 1.0,
    "tie_word_embeddings": False,
}

HF_KEYS = {
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim (hidden_size/num_attention_heads)",
    "vocab_size": "vocab_size",
    "num_experts": "num_experts",
    "expert_intermediate_size": "expert_intermediate_size",
    "qk_norm": "qk_layernorm",
    "expert_bias": "moe_router_enable_expert_bias",
}


def parse(d: ConfigKeys) -> dict:
    reject_unsupported(d, ONLY)
    for key in ("shared_expert_intermediate_size", "num_shared_experts"):
        if d.get(key):
            raise d.error(f"{key}={d.get(key)!r}: shared experts are not supported")
    freq = d.get("moe_layer_freq", [1])
    if any(f != 1 for f in (freq if isinstance(freq, list) else [freq])):
        raise d.error(
            f"moe_layer_freq={freq!r}: only all-MoE models are supported (0 entries are dense layers)"
        )
    hidden, heads = d.int("hidden_size"), d.int("num_attention_heads")
    kv_heads = d.int("num_key_value_heads", default=heads)
    dim = head_dim(d, hidden, heads, kv_heads, "hidden_size", "num_attention_heads")
    if d.get("head_dim") not in (None, dim):
        raise d.error(
            f"head_dim={d.get('head_dim')!r} differs from hidden_size/num_attention_heads={dim}; "
            "only that head size is supported"
        )
    experts, top_k = d.int("num_experts"), d.int("num_experts_per_tok")
    if top_k > experts:
        raise d.error(f"num_experts_per_tok={top_k} exceeds num_experts={experts}")
    vocab = d.int("vocab_size")
    mask, eos, pad = special_ids(d, vocab, "vocab_size", MASK_ID, EOS_ID)
    return dict(
        hidden_size=hidden,
        num_layers=d.int("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=dim,
        vocab_size=vocab,
        intermediate_size=None,
        num_experts=experts,
        top_k=top_k,
        expert_intermediate_size=d.int("expert_intermediate_size"),
        qk_norm=d.bool("qk_layernorm"),  # no safe default: a wrong one silently changes the model
        rope_theta=d.float("rope_theta"),
        rotary_dim=dim,
        rms_eps=d.float("rms_norm_eps", 1e-5),
        max_positions=d.int("max_position_embeddings"),
        mask_id=mask,
        eos_id=eos,
        pad_id=pad,
        tie_embeddings=False,
        router_renormalize=False,  # the HF and dInfer code ignore norm_topk_prob and never renormalise
        expert_bias=d.bool("moe_router_enable_expert_bias", False),
    )


def to_hf(c, layout: str) -> dict:
    """The release's config.json; the fused layout's differs only in `architectures`."""
    d = {
        "architectures": [FUSED_ARCH if layout == "fused" else ARCH],
        "model_type": "llada",
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "vocab_size": c.vocab_size,
        "expert_intermediate_size": c.expert_intermediate_size,
        "shared_expert_intermediate_size": None,
        "moe_layer_freq": [1] * c.num_layers,
        "num_experts": c.num_experts,
        "num_experts_per_tok": c.top_k,
        "moe_router_score_function": "softmax",
        "moe_router_enable_expert_bias": c.expert_bias,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1,
        "qk_layernorm": c.qk_norm,
        "rms_norm_eps": c.rms_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_positions,
        "eos_token_id": c.eos_id,
        "pad_token_id": c.pad_id,
        "use_cache": False,
    }
    d.update(ONLY)
    if c.mask_id != MASK_ID:  # the release has no mask key; write one only when it matters
        d["mask_token_id"] = c.mask_id
    return d


def plan(c, layout: str) -> Plan:
    out = {
        "embed": [("model.embed_tokens.weight", ())],
        "final_norm": [("model.norm.weight", ())],
        "lm_head": [("lm_head.weight", ())],
    }
    E, I = c.num_experts, c.expert_intermediate_size
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        names = {
            "attn_norm": "input_layernorm.weight",
            "q": "self_attn.q_proj.weight",
            "k": "self_attn.k_proj.weight",
            "v": "self_attn.v_proj.weight",
            "o": "self_attn.o_proj.weight",
            "q_norm": "self_attn.q_norm.weight",
            "k_norm": "self_attn.k_norm.weight",
            "mlp_norm": "post_attention_layernorm.weight",
            "router": "mlp.gate.weight",
            "expert_bias": "mlp.expert_bias",
        }
        out.update({f"layers.{i}.{ours}": [(p + theirs, ())] for ours, theirs in names.items()})
        if layout == "fused":
            out[f"layers.{i}.w13"] = [(p + "mlp.w1", ())]
            out[f"layers.{i}.w2"] = [(p + "mlp.w2", ())]
        else:
            stacked = stacked_experts(p, E, I, "gate_proj.weight", "up_proj.weight", "down_proj.weight")
            out.update({f"layers.{i}.{ours}": sources for ours, sources in stacked.items()})
    return out


FAMILY = Family(
    name=NAME,
    title="LLaDA-MoE",
    architectures=ARCHS,
    own_keys=(),
    marker_keys=("expert_intermediate_size", "moe_layer_freq"),
    parse=parse,
    to_hf=to_hf,
    hf_keys=HF_KEYS,
    moe=True,
    fused_qkv=False,
    layouts=("hf", "fused"),
    plan=plan,
    # every layer has both or neither: layer 0's say which flag is wrong
    optional_tensors=lambda c: (("layers.0.q_norm", "qk_norm"), ("layers.0.expert_bias", "expert_bias")),
    fp32_tensors=("router",),  # as dInfer keeps its gate
    tensor_root="model.layers.",
    layer_prefix="model.layers.",
)
