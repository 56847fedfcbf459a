"""The models shipped inside the package (trained by `python -m dinfer.train`), and how a model
argument — a checkpoint folder, an embedded model's name, or nothing — becomes a folder."""

import os
from typing import Optional

from .tokenizer import read_json

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
EMBEDDED = ("tiny-llada-moe", "tiny-llada", "tiny-llada2")
DEFAULT = EMBEDDED[0]
GENERATION_CONFIG = "generation_config.json"


def model_dir(model=None) -> str:
    """The checkpoint folder of `model`: None -> the default embedded model; an embedded model's name
    -> its folder in the package; anything else is taken as a path."""
    if model is None:
        model = DEFAULT
    model = os.fspath(model)
    if model in EMBEDDED and not os.path.isdir(model):
        return os.path.join(ASSETS, model)
    return model


def generation_defaults(path) -> dict:
    """GenerationConfig defaults a checkpoint's generation_config.json sets: `max_new_tokens` is the
    gen_length, `block_length` the block length. Other keys (sampling settings of AR generation)
    do not apply to diffusion decoding and are ignored."""
    file = os.path.join(os.fspath(path), GENERATION_CONFIG)
    d = read_json(file)
    out = {}
    for key, option in (("max_new_tokens", "gen_length"), ("block_length", "block_length")):
        value: Optional[int] = d.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{file}: {key}={value!r} must be a positive integer")
            out[option] = value
    return out
