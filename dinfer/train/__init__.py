"""Training the embedded models: `python -m dinfer.train --model tiny-llada-moe --out DIR`."""

from .loop import train
from .presets import DEFAULT_MODEL, PRESETS

__all__ = ["DEFAULT_MODEL", "PRESETS", "train"]
