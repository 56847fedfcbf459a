"""LLaDA2-MoE (BailingMoeV2): fused QKV with GQA, QK-norm, partial RoPE, dense first layers, sigmoid
group-limited routing with a selection-only expert bias, a shared expert; decoded block by block under
a block-causal mask. Its config.json is HF-style (`moe_intermediate_size`, `first_k_dense_replace`,
`n_group`, ...); its tensors live under `model.layers.` (per expert as released, or stacked: dInfer's
pre-fused layout)."""

from __future__ import annotations

from .config_keys import ConfigKeys, reject_unsupported, special_ids
from .family import Family, Plan, stacked_experts
from .llada_moe import EOS_ID, MASK_ID

NAME = "llada2_moe"
ARCH = "LLaDA2MoeModelLM"
BLOCK_LENGTH = 32  # not in config.json; dInfer's, SGLang's and HF generate()'s default

# Keys that, when present with any other value, describe a computation we do not implement.
ONLY = {
    "hidden_act": "silu",
    "use_qkv_bias": False,
    "use_bias": False,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "norm_head": False,
    "use_sliding_window": False,
    "num_nextn_predict_layers": 0,
    "score_function": "sigmoid",  # a softmax router would be LLaDA-MoE's; no release uses it here
}

HF_KEYS = {
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
    "intermediate_size": "intermediate_size",
    "num_experts": "num_experts",
    "expert_intermediate_size": "moe_intermediate_size",
    "shared_intermediate_size": "moe_intermediate_size x num_shared_experts",
    "expert_bias": "moe_router_enable_expert_bias",
    "first_k_dense": "first_k_dense_replace",
}


def parse(d: ConfigKeys) -> dict:
    reject_unsupported(d, ONLY)
    if d.get("use_qk_norm") is False:  # dInfer and HF build the QK-norm whatever the flag says
        raise d.error("use_qk_norm=false is not supported (the released code always applies QK-norm)")
    hidden, heads = d.int("hidden_size"), d.int("num_attention_heads")
    kv_heads = d.int("num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise d.error(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    head_dim = d.int("head_dim", default=hidden // heads if hidden % heads == 0 else None)
    factor = d.float("partial_rotary_factor", 1.0)
    rotary_dim = d.int("rotary_dim", default=int(head_dim * factor))
    if rotary_dim != int(head_dim * factor) or rotary_dim % 2 or rotary_dim > head_dim:
        raise d.error(
            f"rotary_dim={rotary_dim} must be even, at most head_dim={head_dim} and equal to "
            f"head_dim x partial_rotary_factor={factor}"
        )
    layers, dense = d.int("num_hidden_layers"), d.int("first_k_dense_replace", 0, positive=False)
    if dense > layers:
        raise d.error(f"first_k_dense_replace={dense} exceeds num_hidden_layers={layers}")
    experts, top_k = d.int("num_experts"), d.int("num_experts_per_tok")
    groups, kept = d.int("n_group", 1), d.int("topk_group", 1)
    if top_k > experts:
        raise d.error(f"num_experts_per_tok={top_k} exceeds num_experts={experts}")
    if experts % groups or kept > groups or top_k > kept * (experts // groups):
        raise d.error(
            f"n_group={groups}, topk_group={kept}: num_experts={experts} must split into n_group "
            f"equal groups, and the kept groups must hold num_experts_per_tok={top_k} experts"
        )
    width = d.int("moe_intermediate_size")
    vocab = d.int("vocab_size")
    mask, eos, pad = special_ids(d, vocab, "vocab_size", MASK_ID, EOS_ID)
    return dict(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        intermediate_size=d.int("intermediate_size") if dense else None,
        num_experts=experts,
        top_k=top_k,
        expert_intermediate_size=width,
        qk_norm=True,
        rope_theta=d.float("rope_theta"),
        rotary_dim=rotary_dim,
        rms_eps=d.float("rms_norm_eps", 1e-6),
        max_positions=d.int("max_position_embeddings"),
        mask_id=mask,
        eos_id=eos,
        pad_id=pad,
        tie_embeddings=False,
        router_renormalize=top_k > 1,  # the released code renormalises whenever top_k > 1
        expert_bias=d.bool("moe_router_enable_expert_bias", False),
        first_k_dense=dense,
        shared_intermediate_size=width * d.int("num_shared_experts", 0, positive=False),
        router_scoring="sigmoid",
        num_groups=groups,
        topk_groups=kept,
        routed_scaling=d.float("routed_scaling_factor", 1.0),
        block_length=BLOCK_LENGTH,
    )


def to_hf(c, layout: str) -> dict:
    """The release's config.json, whatever the layout: dInfer's pre-fused LLaDA2 keeps it."""
    d = {
        "architectures": [ARCH],
        "model_type": NAME,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "first_k_dense_replace": c.first_k_dense,
        "moe_intermediate_size": c.expert_intermediate_size,
        "num_experts": c.num_experts,
        "num_experts_per_tok": c.top_k,
        "num_shared_experts": c.shared_intermediate_size // c.expert_intermediate_size,
        "n_group": c.num_groups,
        "topk_group": c.topk_groups,
        "moe_router_enable_expert_bias": c.expert_bias,
        "routed_scaling_factor": c.routed_scaling,
        "norm_topk_prob": True,
        "router_dtype": "fp32",
        "rms_norm_eps": c.rms_eps,
        "use_qk_norm": True,
        "rope_theta": c.rope_theta,
        "partial_rotary_factor": c.rotary_dim / c.head_dim,
        "rotary_dim": c.rotary_dim,
        "max_position_embeddings": c.max_positions,
        "eos_token_id": c.eos_id,
        "pad_token_id": c.pad_id,
        "use_cache": False,
    }
    d.update(ONLY)
    if c.mask_id != MASK_ID:
        d["mask_token_id"] = c.mask_id
    return d


def plan(c, layout: str) -> Plan:
    out = {
        "embed": [("model.word_embeddings.weight", ())],
        "final_norm": [("model.norm.weight", ())],
        "lm_head": [("lm_head.weight", ())],
    }
    S = c.shared_intermediate_size
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        names = {
            "attn_norm": "input_layernorm.weight",
            "qkv": "attention.query_key_value.weight",
            "q_norm": "attention.query_layernorm.weight",
            "k_norm": "attention.key_layernorm.weight",
            "o": "attention.dense.weight",
            "mlp_norm": "post_attention_layernorm.weight",
            "gate": "mlp.gate_proj.weight",
            "up": "mlp.up_proj.weight",
            "down": "mlp.down_proj.weight",
            "router": "mlp.gate.weight",
            "expert_bias": "mlp.gate.expert_bias",
            "shared_w2": "mlp.shared_experts.down_proj.weight",
        }
        layer = {ours: [(p + theirs, ())] for ours, theirs in names.items()}
        layer["shared_w13"] = [
            (p + "mlp.shared_experts.gate_proj.weight", (slice(0, S),)),
            (p + "mlp.shared_experts.up_proj.weight", (slice(S, 2 * S),)),
        ]
        if layout == "fused":  # dInfer's pre-fused experts (its load_state_dict accepts them)
            layer.update(w13=[(p + "mlp.w1", ())], w2=[(p + "mlp.w2", ())])
        else:
            layer.update(
                stacked_experts(
                    p,
                    c.num_experts,
                    c.expert_intermediate_size,
                    "gate_proj.weight",
                    "up_proj.weight",
                    "down_proj.weight",
                )
            )
        out.update({f"layers.{i}.{ours}": sources for ours, sources in layer.items()})
    return out


def optional_tensors(c) -> tuple:
    """The expert bias of the first MoE layer (the layers before it are dense; none: no flag to check)."""
    i = c.first_k_dense
    return ((f"layers.{i}.expert_bias", "expert_bias"),) if i < c.num_layers else ()


FAMILY = Family(
    name=NAME,
    title="LLaDA2-MoE",
    architectures=frozenset({ARCH}),
    # grouped routing and dense first layers: another family would read the config and run it wrongly
    own_keys=("first_k_dense_replace", "n_group"),
    marker_keys=(),
    parse=parse,
    to_hf=to_hf,
    hf_keys=HF_KEYS,
    moe=True,
    fused_qkv=True,
    layouts=("hf", "fused"),
    plan=plan,
    optional_tensors=optional_tensors,
    # the routers as dInfer keeps its gate; the expert bias is an fp32 buffer in the release (its
    # selection-only bias would otherwise reorder near-tied experts)
    fp32_tensors=("router", "expert_bias"),
    tensor_root="model.layers.",
    layer_prefix="model.layers.",
)
