"""ModelConfig: one normalised description of a LLaDA (dense), LLaDA-MoE or LLaDA2-MoE checkpoint.

The families store their hyper-parameters under different key names (OLMo-style `d_model`/`n_layers`
for LLaDA, HF-style `hidden_size`/... for the MoE families), so `from_hf` finds the family
(dinfer.models.families.family_of) and lets its module (llada.py, llada_moe.py, llada2.py) map the keys
onto the same fields. Anything whose computation we do not implement is rejected with the offending key
named, rather than loaded and run wrongly; so are values of the wrong type and special-token ids that
would break decoding (outside the vocabulary, or a mask token that is also the eos/pad token). Every
error is a CheckpointError (a ValueError) that names the file, the key and the value.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional, Tuple

from .config_keys import CONFIG_FILE, CheckpointError, ConfigKeys
from .families import FAMILIES, family_of
from .family import LAYOUTS, Family
from .quantization import parse_quantization


@dataclass(frozen=True)
class ModelConfig:
    family: str  # a key of dinfer.models.families.FAMILIES: "llada", "llada_moe" or "llada2_moe"
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
    # "fp8": the checkpoint's config.json has the fine-grained FP8 quantization_config (its tensors
    # may be FP8 with block scales: dinfer.models.quantization); None: no quantization.
    quantization: Optional[str] = None

    def __post_init__(self):
        if self.family not in FAMILIES:
            names = [repr(name) for name in FAMILIES]
            raise ValueError(
                f"ModelConfig.family must be {', '.join(names[:-1])} or {names[-1]}, got {self.family!r}"
            )
        if self.is_dense_layer(0) == (self.intermediate_size is None) or self.is_moe == (
            self.expert_intermediate_size is None
        ):
            raise ValueError(
                "ModelConfig: intermediate_size is set exactly when the model has dense MLP layers, "
                "expert_intermediate_size exactly when it has MoE layers"
            )

    @property
    def family_spec(self) -> Family:
        """The family's row of dinfer.models.families.FAMILIES: its config keys, tensor names, quirks."""
        return FAMILIES[self.family]

    @property
    def is_moe(self) -> bool:
        return self.family_spec.moe

    @property
    def block_causal(self) -> bool:
        """Whether the model attends block-causally (LLaDA2): a block sees itself and earlier blocks."""
        return self.block_length > 0

    def is_dense_layer(self, i: int) -> bool:
        """Whether layer i has a dense MLP: every layer without experts, else those below first_k_dense."""
        return not self.is_moe or i < self.first_k_dense

    def hf_key(self, field: str) -> str:
        """The config.json key that sets `field` in this family, or how keys set it (LLaDA's head_dim:
        "head_dim (d_model/n_heads)"); the field's name where none does."""
        return self.family_spec.hf_keys.get(field, field)

    @classmethod
    def from_hf(cls, d: dict, file: str = CONFIG_FILE) -> "ModelConfig":
        """Normalise a Hugging Face config.json dict (the released format of any family); `file`
        names the source in errors."""
        keys = ConfigKeys(d, file)
        family = family_of(keys)
        return cls(
            family=family.name,
            **family.parse(keys),
            architectures=keys.architectures(),
            quantization=parse_quantization(keys),
        )

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
        dInfer's stacked-expert checkpoint (LLaDA-MoE's differs only in `architectures`)."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be 'hf' or 'fused', got {layout!r}")
        return self.family_spec.to_hf(self, layout)
