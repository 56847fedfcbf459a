"""What a model family is to the shared code: one row of dinfer.models.families.FAMILIES.

A family module (llada.py, llada_moe.py, llada2.py) builds one Family: how its config.json is
recognised and read, the config.json key of each ModelConfig size field (errors name the key the user
would edit), how its checkpoints name the canonical tensors (dinfer.models.checkpoint), and the few
layer quirks the shared code asks about. ModelConfig, the checkpoint checks and the forward read these
fields and never test the family's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, List, Tuple

from .config_keys import ConfigKeys

# A source is (released tensor name, index into the canonical tensor it fills); () is the whole tensor.
Source = Tuple[str, tuple]
# Canonical name -> the released tensors that fill it.
Plan = Dict[str, List[Source]]

LAYOUTS = ("hf", "fused")  # as released; dInfer's stacked experts (tools/transfer.py)
EXPERTS = "mlp.experts."  # under a layer's prefix: expert e's tensors in the released MoE layouts


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.family
    title: str  # the model's name in messages
    # Recognising a config.json (dinfer.models.families.family_of; `model_type` is shared, so unused):
    architectures: FrozenSet[str]  # `architectures` entries that name this family
    own_keys: Tuple[str, ...]  # keys that name it whatever `architectures` says (no other family reads them)
    marker_keys: Tuple[str, ...]  # keys that name it when no architecture does
    parse: Callable[[ConfigKeys], dict]  # config.json -> ModelConfig's fields, family and architectures aside
    to_hf: Callable[..., dict]  # (config, layout) -> its config.json in this family's released format
    hf_keys: Dict[str, str]  # ModelConfig field -> the config.json key (or keys) that set it
    # The model:
    moe: bool  # it has MoE layers (ModelConfig.is_moe)
    fused_qkv: bool  # one qkv projection (Q heads, then K, then V) instead of q, k and v
    # The checkpoint (dinfer.models.checkpoint):
    layouts: Tuple[str, ...]  # the LAYOUTS its checkpoints come in
    plan: Callable[..., Plan]  # (config, layout) -> every canonical tensor it may have -> its sources
    optional_tensors: Callable[..., Tuple[Tuple[str, str], ...]]  # config -> (canonical name, its flag)
    fp32_tensors: Tuple[str, ...]  # canonical name endings that load in fp32 whatever the dtype
    tensor_root: str  # the prefix of its tensor names: a checkpoint of another family lacks it
    layer_prefix: str  # layer i's tensors start with layer_prefix + f"{i}."


def stacked_experts(p: str, E: int, I: int, gate: str, up: str, down: str) -> Plan:
    """w13 / w2 of one layer from per-expert tensors under prefix p (gate rows, then up rows): the
    released layout of both MoE families."""
    experts = [p + f"{EXPERTS}{e}." for e in range(E)]
    return {
        "w13": [
            src
            for e, x in enumerate(experts)
            for src in ((x + gate, (e, slice(0, I))), (x + up, (e, slice(I, 2 * I))))
        ],
        "w2": [(x + down, (e,)) for e, x in enumerate(experts)],
    }
