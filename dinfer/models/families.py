"""The model families dinfer runs: one row each (a dinfer.models.family.Family), and how a config.json
picks its row. Adding a family is a module like llada.py and one entry here.

Each row extends the one before it (LLaDA-MoE's layers replace LLaDA's MLP by experts, LLaDA2-MoE adds
dense first layers, grouped routing and a shared expert), so where a config.json could name two
families the later, more specific one wins.
"""

from __future__ import annotations

from . import llada, llada2, llada_moe
from .config_keys import ConfigKeys
from .family import Family

FAMILIES = {f.name: f for f in (llada.FAMILY, llada_moe.FAMILY, llada2.FAMILY)}


def family_of(d: ConfigKeys) -> Family:
    """The family of a config.json: by keys only one family reads, then by `architectures`, then by
    its marker keys; never by `model_type` (LLaDA and LLaDA-MoE both say "llada")."""
    archs = set(d.architectures())
    most_specific_first = list(FAMILIES.values())[::-1]
    for names in (
        lambda f: any(k in d for k in f.own_keys),
        lambda f: archs & f.architectures,
        lambda f: any(k in d for k in f.marker_keys),
    ):
        for family in most_specific_first:
            if names(family):
                return family
    markers = " nor ".join(
        f"{f.title}'s {'/'.join(f.marker_keys)}" for f in FAMILIES.values() if f.marker_keys
    )
    raise d.error(f"unsupported architectures {sorted(archs)!r}: it has neither {markers}")
