"""LLaDA (dense): the OLMo-style block of LLaDA-8B (separate q/k/v projections, a SwiGLU MLP, no
QK-norm), its config.json under OLMo's keys (`d_model`, `n_layers`, ...) and its tensors under
`model.transformer.`."""

from __future__ import annotations

from .config_keys import ConfigKeys, head_dim, reject_unsupported, special_ids
from .family import Family, Plan

NAME = "llada"
ARCH = "LLaDAModelLM"
# Special-token ids the release hard-codes when config.json omits them.
MASK_ID, EOS_ID = 126336, 126081

# Keys that, when present with any other value, describe a computation we do not implement.
ONLY = {
    "block_type": "llama",  # separate q/k/v projections and an up_proj
    "block_group_size": 1,  # flat `blocks.{i}` names
    "activation_type": "silu",
    "layer_norm_type": "rms",
    "layer_norm_with_affine": True,
    "bias_for_layer_norm": False,
    "attention_layer_norm": False,  # OLMo's QK-norm is over all heads at once: not the per-head form
    "include_bias": False,
    "include_qkv_bias": False,
    "weight_tying": False,
    "rope": True,
    "alibi": False,
    "clip_qkv": None,
    "scale_logits": False,
    "input_emb_norm": False,
}

# The vocabulary is embedding_size when set (it may pad vocab_size).
HF_KEYS = {
    "hidden_size": "d_model",
    "num_layers": "n_layers",
    "num_heads": "n_heads",
    "num_kv_heads": "n_kv_heads",
    "head_dim": "head_dim (d_model/n_heads)",
    "vocab_size": "embedding_size/vocab_size",
    "intermediate_size": "mlp_hidden_size",
}


def parse(d: ConfigKeys) -> dict:
    reject_unsupported(d, ONLY)
    hidden, heads = d.int("d_model"), d.int("n_heads")
    # OLMo semantics: multi_query_attention overrides n_kv_heads; a null n_kv_heads means MHA.
    kv_heads = 1 if d.bool("multi_query_attention", False) else d.int("n_kv_heads", default=heads)
    dim = head_dim(d, hidden, heads, kv_heads, "d_model", "n_heads")
    # The embedding has embedding_size rows (possibly padded beyond vocab_size).
    vocab_key = "embedding_size" if d.get("embedding_size") is not None else "vocab_size"
    vocab = d.int(vocab_key)
    mask, eos, pad = special_ids(d, vocab, vocab_key, MASK_ID, EOS_ID)
    return dict(
        hidden_size=hidden,
        num_layers=d.int("n_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=dim,
        vocab_size=vocab,
        intermediate_size=d.int("mlp_hidden_size"),  # mlp_ratio is ignored when this is set
        num_experts=0,
        top_k=0,
        expert_intermediate_size=None,
        qk_norm=False,
        rope_theta=d.float("rope_theta"),
        rotary_dim=dim,
        rms_eps=d.float("rms_norm_eps", 1e-5),
        max_positions=d.int("max_sequence_length"),
        mask_id=mask,
        eos_id=eos,
        pad_id=pad,
        tie_embeddings=False,
        router_renormalize=False,
        expert_bias=False,
    )


def to_hf(c, layout: str) -> dict:
    if layout == "fused":
        raise ValueError("the fused layout exists only for LLaDA-MoE checkpoints")
    d = {
        "architectures": [ARCH],
        "model_type": "llada",
        "d_model": c.hidden_size,
        "n_layers": c.num_layers,
        "n_heads": c.num_heads,
        "n_kv_heads": c.num_kv_heads,
        "multi_query_attention": None,
        "mlp_hidden_size": c.intermediate_size,
        "mlp_ratio": 4,
        "vocab_size": c.vocab_size,
        "embedding_size": c.vocab_size,
        "rms_norm_eps": c.rms_eps,
        "rope_theta": c.rope_theta,
        "rope_full_precision": True,
        "max_sequence_length": c.max_positions,
        "mask_token_id": c.mask_id,
        "eos_token_id": c.eos_id,
        "pad_token_id": c.pad_id,
        "use_cache": False,
    }
    d.update(ONLY)
    return d


def plan(c, layout: str) -> Plan:
    names = {
        "embed": "model.transformer.wte.weight",
        "final_norm": "model.transformer.ln_f.weight",
        "lm_head": "model.transformer.ff_out.weight",
    }
    per_layer = {
        "attn_norm": "attn_norm",
        "q": "q_proj",
        "k": "k_proj",
        "v": "v_proj",
        "o": "attn_out",
        "mlp_norm": "ff_norm",
        "gate": "ff_proj",
        "up": "up_proj",
        "down": "ff_out",
    }  # ff_proj is the gate
    for i in range(c.num_layers):
        names.update(
            {
                f"layers.{i}.{ours}": f"model.transformer.blocks.{i}.{theirs}.weight"
                for ours, theirs in per_layer.items()
            }
        )
    return {ours: [(theirs, ())] for ours, theirs in names.items()}


FAMILY = Family(
    name=NAME,
    title="LLaDA",
    architectures=frozenset({ARCH}),
    own_keys=(),
    marker_keys=("d_model", "n_layers"),
    parse=parse,
    to_hf=to_hf,
    hf_keys=HF_KEYS,
    moe=False,
    fused_qkv=False,
    layouts=("hf",),
    plan=plan,
    optional_tensors=lambda c: (),
    fp32_tensors=(),
    tensor_root="model.transformer.",
    layer_prefix="model.transformer.blocks.",
)
