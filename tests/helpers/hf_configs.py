"""The released config.json values (LLaDA-8B, LLaDA-MoE-7B, LLaDA2-mini: dinfer.models.released, re-exported
here) and tiny configs of each family built from them: what the checkpoint tests parse and what the
engine tests build models from."""

from dinfer.models import ModelConfig
from dinfer.models.released import DENSE_8B, LLADA2_MINI, MOE_7B

TINY_DENSE = dict(
    DENSE_8B,
    d_model=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=4,
    mlp_hidden_size=96,
    vocab_size=101,
    embedding_size=101,
    max_sequence_length=128,
    mask_token_id=100,
    eos_token_id=99,
    pad_token_id=99,
)


TINY_MOE = dict(
    MOE_7B,
    hidden_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    expert_intermediate_size=40,
    moe_layer_freq=[1, 1],
    num_experts=8,
    num_experts_per_tok=2,
    vocab_size=97,
    max_position_embeddings=128,
    mask_token_id=96,
    eos_token_id=95,
    pad_token_id=95,
)


TINY_LLADA2 = dict(
    LLADA2_MINI,
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=40,
    moe_intermediate_size=12,
    num_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    rotary_dim=4,
    max_position_embeddings=128,
    mask_token_id=96,
    eos_token_id=95,
    pad_token_id=95,
)


def tiny(kind, **changes):
    base = {"dense": TINY_DENSE, "moe": TINY_MOE, "llada2": TINY_LLADA2}[kind]
    return ModelConfig.from_hf(dict(base, **changes))
