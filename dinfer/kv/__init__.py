"""The KV-cache managers (the interface: dinfer.kv.base.KVManager), one per kind of attention:

    refresh   bidirectional models (LLaDA, LLaDA-MoE): a contiguous cache per slot, refreshed
    paged     block-causal models (LLaDA2): an append-only paged cache, exact once written

`manager_for(model)` is the one place that picks a model's manager.
"""

from .base import KVManager, Window
from .paged import CLEAN_KV, PagedKV
from .refresh import RefreshKV

CACHE_MODES = RefreshKV.MODES + PagedKV.MODES  # GenerationConfig.cache: every manager's modes


def manager_for(model) -> type:
    """The KV-cache manager class of `model`: paged for a block-causal one, refreshed for a
    bidirectional one."""
    return PagedKV if model.config.block_causal else RefreshKV


__all__ = ["CACHE_MODES", "CLEAN_KV", "KVManager", "PagedKV", "RefreshKV", "Window", "manager_for"]
