"""ModelConfig: one normalised description of a LLaDA (dense), LLaDA-MoE or LLaDA2-MoE checkpoint.

The two families store their hyper-parameters under different key names (OLMo-style `d_model`/`n_layers`
for dense, HF-style `hidden_size`/... for MoE) and both say `model_type: "llada"`, so `from_hf` tells them
apart by `architectures` or by which keys exist, then maps each onto the
same fields. LLaDA2 (BailingMoeV2: fused QKV, partial RoPE, a dense first layer, sigmoid grouped routing,
a shared expert; decoded block by block under a block-causal mask) is told by its architecture or its
`first_k_dense_replace` / `n_group` keys. Anything whose computation we do not implement is rejected with the offending key named,
rather than loaded and run wrongly; so are values of the wrong type and special-token ids that would
break decoding (outside the vocabulary, or a mask token that is also the eos/pad token). Every error is a
CheckpointError (a ValueError) that names the file, the key and the value.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Optional, Tuple

CONFIG_FILE = "config.json"

DENSE = "llada"
MOE = "llada_moe"
LLADA2 = "llada2_moe"

DENSE_ARCH = "LLaDAModelLM"
MOE_ARCH = "LLaDAMoEModelLM"
FUSED_MOE_ARCH = "FusedLLaDAMoEModelLM"  # written by dInfer's tools/transfer.py (stacked experts)
_MOE_ARCHS = {MOE_ARCH, "LLaDAMoEModel", FUSED_MOE_ARCH}  # some copies of the release say LLaDAMoEModel
LLADA2_ARCH = "LLaDA2MoeModelLM"
_LLADA2_KEYS = ("first_k_dense_replace", "n_group")
LLADA2_BLOCK_LENGTH = 32  # not in config.json; dInfer's, SGLang's and HF generate()'s default

# Special-token ids the releases hard-code when config.json omits them.
DENSE_MASK_ID, DENSE_EOS_ID = 126336, 126081
MOE_MASK_ID, MOE_EOS_ID = 156895, 156892

# Keys that, when present with any other value, describe a computation we do not implement.
_DENSE_ONLY = {
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
_LLADA2_ONLY = {
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
_MOE_ONLY = {
    "hidden_act": "silu",
    "attention_bias": False,
    "clip_qkv": None,
    "rope_scaling": None,
    "partial_rotary_factor": 1.0,
    "tie_word_embeddings": False,
}


class CheckpointError(ValueError):
    """A checkpoint folder whose files are broken or disagree with each other; the message names the
    file, the key (or tensor) and the values that disagree."""


# The config.json key of each size field, per family: cross-checks against the weights name the key the
# user would edit. The dense vocabulary is embedding_size when set (it may pad vocab_size).
_HF_KEYS = {
    DENSE: {
        "hidden_size": "d_model",
        "num_layers": "n_layers",
        "num_heads": "n_heads",
        "num_kv_heads": "n_kv_heads",
        "vocab_size": "embedding_size/vocab_size",
        "intermediate_size": "mlp_hidden_size",
    },
    MOE: {
        "hidden_size": "hidden_size",
        "num_layers": "num_hidden_layers",
        "num_heads": "num_attention_heads",
        "num_kv_heads": "num_key_value_heads",
        "vocab_size": "vocab_size",
        "num_experts": "num_experts",
        "expert_intermediate_size": "expert_intermediate_size",
        "qk_norm": "qk_layernorm",
        "expert_bias": "moe_router_enable_expert_bias",
    },
    LLADA2: {
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
    },
}


@dataclass(frozen=True)
class ModelConfig:
    family: str  # DENSE ("llada"), MOE ("llada_moe") or LLADA2 ("llada2_moe")
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # rows of the embedding and of the LM head
    intermediate_size: Optional[int]  # dense MLP width (LLaDA2: of its dense layers); None for LLaDA-MoE
    num_experts: int  # 0 for dense
    top_k: int  # 0 for dense
    expert_intermediate_size: Optional[int]  # per-expert width; None for dense
    qk_norm: bool  # per-head RMSNorm on q and k (weight [head_dim]) before RoPE
    rope_theta: float
    rotary_dim: int
    rms_eps: float
    max_positions: int
    mask_id: int
    eos_id: int
    pad_id: int
    tie_embeddings: bool
    router_renormalize: bool  # LLaDA-MoE: top-k weights are not renormalised
    expert_bias: bool  # a per-layer [E] bias added to the router probabilities
    architectures: Tuple[str, ...]
    # LLaDA2 only (the defaults are LLaDA / LLaDA-MoE's):
    first_k_dense: int = 0  # layers [0, first_k_dense) have a dense MLP
    shared_intermediate_size: int = 0  # the shared expert's width (0: none)
    router_scoring: str = "softmax"  # "sigmoid": the bias only chooses, weights are the plain scores
    num_groups: int = 1  # group-limited routing: keep topk_groups of num_groups expert groups
    topk_groups: int = 1
    routed_scaling: float = 1.0  # multiplies the final top-k weights
    block_length: int = 0  # > 0: block-causal attention in blocks of this length from position 0

    def __post_init__(self):
        if self.family not in (DENSE, MOE, LLADA2):
            raise ValueError(
                f"ModelConfig.family must be {DENSE!r}, {MOE!r} or {LLADA2!r}, got {self.family!r}"
            )
        dense_mlp = self.family == DENSE or (self.family == LLADA2 and self.first_k_dense > 0)
        if dense_mlp == (self.intermediate_size is None) or self.is_moe == (
            self.expert_intermediate_size is None
        ):
            raise ValueError(
                "ModelConfig: intermediate_size is set exactly when the model has dense MLP layers, "
                "expert_intermediate_size exactly when it has MoE layers"
            )

    @property
    def is_moe(self) -> bool:
        return self.family in (MOE, LLADA2)

    @property
    def block_causal(self) -> bool:
        """Whether the model attends block-causally (LLaDA2): a block sees itself and earlier blocks."""
        return self.block_length > 0

    def is_dense_layer(self, i: int) -> bool:
        return self.family == DENSE or i < self.first_k_dense

    def hf_key(self, field: str) -> str:
        """The config.json key that sets `field` in this family (the field's name where none does)."""
        return _HF_KEYS[self.family].get(field, field)

    @classmethod
    def from_hf(cls, d: dict, file: str = CONFIG_FILE) -> "ModelConfig":
        """Normalise a Hugging Face config.json dict (the released format of either family); `file`
        names the source in errors."""
        keys = _Keys(d, file)
        return {DENSE: _parse_dense, MOE: _parse_moe, LLADA2: _parse_llada2}[_family(keys)](keys)

    @classmethod
    def from_dir(cls, path) -> "ModelConfig":
        """Read `config.json` from a checkpoint directory."""
        file = os.path.join(os.fspath(path), CONFIG_FILE)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no {CONFIG_FILE} in checkpoint directory {os.fspath(path)!r}")
        with open(file, encoding="utf-8") as f:
            try:
                d = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{file}: not valid JSON ({e})") from e
        return cls.from_hf(d, file)

    def to_hf(self, layout: str = "hf") -> dict:
        """A config.json dict in the released format of this family; layout "fused" (MoE only) is
        dInfer's stacked-expert checkpoint, which differs only in `architectures`."""
        if layout not in ("hf", "fused"):
            raise ValueError(f"layout must be 'hf' or 'fused', got {layout!r}")
        if self.family == LLADA2:  # dInfer's pre-fused LLaDA2 keeps the released config.json
            return self._llada2_hf()
        if not self.is_moe:
            if layout == "fused":
                raise ValueError("the fused layout exists only for LLaDA-MoE checkpoints")
            return self._dense_hf()
        return self._moe_hf(FUSED_MOE_ARCH if layout == "fused" else MOE_ARCH)

    def _dense_hf(self) -> dict:
        d = {
            "architectures": [DENSE_ARCH],
            "model_type": "llada",
            "d_model": self.hidden_size,
            "n_layers": self.num_layers,
            "n_heads": self.num_heads,
            "n_kv_heads": self.num_kv_heads,
            "multi_query_attention": None,
            "mlp_hidden_size": self.intermediate_size,
            "mlp_ratio": 4,
            "vocab_size": self.vocab_size,
            "embedding_size": self.vocab_size,
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "rope_full_precision": True,
            "max_sequence_length": self.max_positions,
            "mask_token_id": self.mask_id,
            "eos_token_id": self.eos_id,
            "pad_token_id": self.pad_id,
            "use_cache": False,
        }
        d.update(_DENSE_ONLY)
        return d

    def _llada2_hf(self) -> dict:
        d = {
            "architectures": [LLADA2_ARCH],
            "model_type": LLADA2,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "first_k_dense_replace": self.first_k_dense,
            "moe_intermediate_size": self.expert_intermediate_size,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.top_k,
            "num_shared_experts": self.shared_intermediate_size // self.expert_intermediate_size,
            "n_group": self.num_groups,
            "topk_group": self.topk_groups,
            "moe_router_enable_expert_bias": self.expert_bias,
            "routed_scaling_factor": self.routed_scaling,
            "norm_topk_prob": True,
            "router_dtype": "fp32",
            "rms_norm_eps": self.rms_eps,
            "use_qk_norm": True,
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.rotary_dim / self.head_dim,
            "rotary_dim": self.rotary_dim,
            "max_position_embeddings": self.max_positions,
            "eos_token_id": self.eos_id,
            "pad_token_id": self.pad_id,
            "use_cache": False,
        }
        d.update(_LLADA2_ONLY)
        if self.mask_id != MOE_MASK_ID:
            d["mask_token_id"] = self.mask_id
        return d

    def _moe_hf(self, arch: str) -> dict:
        d = {
            "architectures": [arch],
            "model_type": "llada",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "vocab_size": self.vocab_size,
            "expert_intermediate_size": self.expert_intermediate_size,
            "shared_expert_intermediate_size": None,
            "moe_layer_freq": [1] * self.num_layers,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.top_k,
            "moe_router_score_function": "softmax",
            "moe_router_enable_expert_bias": self.expert_bias,
            "norm_topk_prob": False,
            "routed_scaling_factor": 1,
            "qk_layernorm": self.qk_norm,
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_positions,
            "eos_token_id": self.eos_id,
            "pad_token_id": self.pad_id,
            "use_cache": False,
        }
        d.update(_MOE_ONLY)
        if self.mask_id != MOE_MASK_ID:  # the release has no mask key; write one only when it matters
            d["mask_token_id"] = self.mask_id
        return d


class _Keys:
    """A config.json dict and the file it came from: typed reads whose errors name both."""

    def __init__(self, d, file: str):
        if not isinstance(d, dict):
            raise CheckpointError(f"{file}: expected a JSON object, got {type(d).__name__}")
        self.d, self.file = d, file

    def __contains__(self, key: str) -> bool:
        return key in self.d

    def get(self, key: str, default=None):
        return self.d.get(key, default)

    def error(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.file}: {message}")

    def value(self, key: str, default=None):
        """d[key], or default where the key is absent or null; an error naming the key if neither exists."""
        value = self.d.get(key)
        if value is None:
            value = default
        if value is None:
            raise self.error(f"required key {key!r} is missing")
        return value

    def int(self, key: str, default: Optional[int] = None, positive: bool = True) -> int:
        value = self.value(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if positive else 0):
            raise self.error(
                f"{key}={value!r} must be a {'positive' if positive else 'non-negative'} integer"
            )
        return value

    def float(self, key: str, default: Optional[float] = None) -> float:
        value = self.value(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise self.error(f"{key}={value!r} must be a positive number")
        return float(value)

    def bool(self, key: str, default: Optional[bool] = None) -> bool:
        value = self.value(key, default)
        if not isinstance(value, bool):
            raise self.error(f"{key}={value!r} must be true or false")
        return value

    def architectures(self) -> Tuple[str, ...]:
        archs = self.d.get("architectures") or []
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise self.error(f"architectures={archs!r} must be a list of class names")
        return tuple(archs)


def _family(d: _Keys) -> str:
    """DENSE or MOE from `architectures`, else from key presence; never from `model_type` (shared)."""
    archs = set(d.architectures())
    if LLADA2_ARCH in archs or any(k in d for k in _LLADA2_KEYS):
        return LLADA2
    if _MOE_ARCHS & archs:
        return MOE
    if DENSE_ARCH in archs:
        return DENSE
    if "expert_intermediate_size" in d or "moe_layer_freq" in d:
        return MOE
    if "d_model" in d or "n_layers" in d:
        return DENSE
    raise d.error(
        f"unsupported architectures {sorted(archs)!r}: it has neither LLaDA's d_model/n_layers "
        "nor LLaDA-MoE's expert_intermediate_size/moe_layer_freq"
    )


def _parse_dense(d: _Keys) -> ModelConfig:
    _reject_unsupported(d, _DENSE_ONLY)
    hidden, heads = d.int("d_model"), d.int("n_heads")
    # OLMo semantics: multi_query_attention overrides n_kv_heads; a null n_kv_heads means MHA.
    kv_heads = 1 if d.bool("multi_query_attention", False) else d.int("n_kv_heads", default=heads)
    head_dim = _head_dim(d, hidden, heads, kv_heads, "d_model", "n_heads")
    # The embedding has embedding_size rows (possibly padded beyond vocab_size).
    vocab_key = "embedding_size" if d.get("embedding_size") is not None else "vocab_size"
    vocab = d.int(vocab_key)
    mask, eos, pad = _special_ids(d, vocab, vocab_key, DENSE_MASK_ID, DENSE_EOS_ID)
    return ModelConfig(
        family=DENSE,
        hidden_size=hidden,
        num_layers=d.int("n_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        intermediate_size=d.int("mlp_hidden_size"),  # mlp_ratio is ignored when this is set
        num_experts=0,
        top_k=0,
        expert_intermediate_size=None,
        qk_norm=False,
        rope_theta=d.float("rope_theta"),
        rotary_dim=head_dim,
        rms_eps=d.float("rms_norm_eps", 1e-5),
        max_positions=d.int("max_sequence_length"),
        mask_id=mask,
        eos_id=eos,
        pad_id=pad,
        tie_embeddings=False,
        router_renormalize=False,
        expert_bias=False,
        architectures=d.architectures(),
    )


def _parse_moe(d: _Keys) -> ModelConfig:
    _reject_unsupported(d, _MOE_ONLY)
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
    head_dim = _head_dim(d, hidden, heads, kv_heads, "hidden_size", "num_attention_heads")
    if d.get("head_dim") not in (None, head_dim):
        raise d.error(
            f"head_dim={d.get('head_dim')!r} differs from hidden_size/num_attention_heads={head_dim}; "
            "only that head size is supported"
        )
    experts, top_k = d.int("num_experts"), d.int("num_experts_per_tok")
    if top_k > experts:
        raise d.error(f"num_experts_per_tok={top_k} exceeds num_experts={experts}")
    vocab = d.int("vocab_size")
    mask, eos, pad = _special_ids(d, vocab, "vocab_size", MOE_MASK_ID, MOE_EOS_ID)
    return ModelConfig(
        family=MOE,
        hidden_size=hidden,
        num_layers=d.int("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        intermediate_size=None,
        num_experts=experts,
        top_k=top_k,
        expert_intermediate_size=d.int("expert_intermediate_size"),
        qk_norm=d.bool("qk_layernorm"),  # no safe default: a wrong one silently changes the model
        rope_theta=d.float("rope_theta"),
        rotary_dim=head_dim,
        rms_eps=d.float("rms_norm_eps", 1e-5),
        max_positions=d.int("max_position_embeddings"),
        mask_id=mask,
        eos_id=eos,
        pad_id=pad,
        tie_embeddings=False,
        router_renormalize=False,  # the HF and dInfer code ignore norm_topk_prob and never renormalise
        expert_bias=d.bool("moe_router_enable_expert_bias", False),
        architectures=d.architectures(),
    )


def _parse_llada2(d: _Keys) -> ModelConfig:
    _reject_unsupported(d, _LLADA2_ONLY)
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
    mask, eos, pad = _special_ids(d, vocab, "vocab_size", MOE_MASK_ID, MOE_EOS_ID)
    return ModelConfig(
        family=LLADA2,
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
        architectures=d.architectures(),
        first_k_dense=dense,
        shared_intermediate_size=width * d.int("num_shared_experts", 0, positive=False),
        router_scoring="sigmoid",
        num_groups=groups,
        topk_groups=kept,
        routed_scaling=d.float("routed_scaling_factor", 1.0),
        block_length=LLADA2_BLOCK_LENGTH,
    )


def _special_ids(
    d: _Keys, vocab: int, vocab_key: str, mask_default: int, eos_default: int
) -> Tuple[int, int, int]:
    """mask, eos and pad ids, each inside [0, vocab) (else the embedding lookup fails unnamed), and the
    mask distinct from eos and pad: a mask that is also the stop token makes every canvas "finished"
    before decoding and lets decoded tokens count as still masked (the generation loop never ends)."""
    eos = d.int("eos_token_id", default=eos_default, positive=False)
    ids = {
        "mask_token_id": d.int("mask_token_id", default=mask_default, positive=False),
        "eos_token_id": eos,
        "pad_token_id": d.int("pad_token_id", default=eos, positive=False),
    }
    for key, value in ids.items():
        if value >= vocab:
            given = "" if d.get(key) is not None else " (absent, so the release's default)"
            raise d.error(f"{key} is {value}{given} but {vocab_key} is {vocab}: ids must lie in [0, {vocab})")
    for key in ("eos_token_id", "pad_token_id"):
        if ids[key] == ids["mask_token_id"]:
            raise d.error(
                f"mask_token_id and {key} are both {ids[key]}: the mask token must differ from the "
                "end/padding token"
            )
    return ids["mask_token_id"], eos, ids["pad_token_id"]


def _reject_unsupported(d: _Keys, supported: dict) -> None:
    for key, value in supported.items():
        if d.get(key, value) not in (value, None):
            raise d.error(f"{key}={d.get(key)!r} is not supported (only {value!r})")


def _head_dim(d: _Keys, hidden: int, heads: int, kv_heads: int, hidden_key: str, heads_key: str) -> int:
    if hidden % heads:
        raise d.error(
            f"{hidden_key}={hidden} is not a multiple of {heads_key}={heads}, so head_dim is not integral"
        )
    if heads % kv_heads:
        raise d.error(f"{heads_key}={heads} is not a multiple of the {kv_heads} key/value heads")
    return hidden // heads
