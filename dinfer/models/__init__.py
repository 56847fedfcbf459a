"""dinfer.models: model configs, checkpoint I/O and the forward of LLaDA (dense), LLaDA-MoE and LLaDA2-MoE."""

from .checkpoint import checkpoint_plan, expected_shapes, load_weights, random_weights, save_checkpoint
from .config import CheckpointError, ModelConfig

__all__ = [
    "CheckpointError",
    "ModelConfig",
    "checkpoint_plan",
    "expected_shapes",
    "load_weights",
    "random_weights",
    "save_checkpoint",
]
