"""dinfer.models: model configs and checkpoint I/O for LLaDA (dense) and LLaDA-MoE."""

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
