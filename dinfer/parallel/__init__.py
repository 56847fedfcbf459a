"""dinfer.parallel: tensor and expert parallelism on torch.distributed (NCCL on GPUs, gloo on the host).

    plan.py    which rank holds which slice of every canonical weight; divisibility errors
    load.py    each rank reads only its slices from the memory-mapped safetensors
    comm.py    the collectives, with a bounded wait and a clear error when a rank dies
    tp.py      what the forward does differently on a rank (DiffusionLM(..., parallel=...))
    launch.py  joining torchrun's group, or spawning LLM's workers

The decode step and the soft embedding run on the rank's vocabulary range of the logits
(dinfer_kernels.decode_step_vocab_parallel / soft_embedding_vocab_parallel): no rank ever holds [N, V].
Everything else of the engine (tokens, schedule, caches' bookkeeping) is replicated: every rank runs
the same loop on the same values, so the only communication is the forward's and the decode's.
"""

from __future__ import annotations

from typing import Dict

import torch

from ..models.config import ModelConfig
from ..models.quantization import quantize_experts
from ..models.transformer import DiffusionLM
from .comm import Comm, ParallelError, backend_for
from .launch import join, under_torchrun
from .load import load_shard
from .plan import EP_MODES, ParallelConfigError, ShardPlan, split, weight_bytes
from .tp import TensorParallel


def load_model(
    path, comm: Comm, ep_mode: str = "allreduce", dtype=torch.bfloat16, device="cpu", quantize=None
) -> DiffusionLM:
    """This rank's DiffusionLM of the checkpoint folder `path` (its slices only are read); quantize
    "fp8": its routed experts converted to FP8 (dinfer.models.quantization; the shared expert's
    column slices stay in `dtype`, as an FP8 checkpoint's are dequantised: load_shard)."""
    config = ModelConfig.from_dir(path)
    plan = ShardPlan(config, comm.world, comm.rank, ep_mode)
    weights = load_shard(path, config, plan, dtype=dtype, device=device)
    if quantize:
        weights = quantize_experts(weights, config, shared=False)
    return DiffusionLM(plan.local_config, weights, parallel=TensorParallel(plan, comm))


def shard_model(
    config: ModelConfig, weights: Dict[str, torch.Tensor], comm: Comm, ep_mode: str = "allreduce"
) -> DiffusionLM:
    """This rank's DiffusionLM from the full canonical weights in memory (tests, benchmarks)."""
    plan = ShardPlan(config, comm.world, comm.rank, ep_mode)
    return DiffusionLM(plan.local_config, plan.shard_weights(weights), parallel=TensorParallel(plan, comm))


__all__ = [
    "Comm",
    "EP_MODES",
    "ParallelConfigError",
    "ParallelError",
    "ShardPlan",
    "TensorParallel",
    "backend_for",
    "join",
    "load_model",
    "load_shard",
    "shard_model",
    "split",
    "under_torchrun",
    "weight_bytes",
]
