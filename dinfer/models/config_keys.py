"""Reading a released config.json: typed reads whose errors name the file, the key and the value.

Every family module (llada.py, llada_moe.py, llada2.py) parses its config.json with these; every
error is a CheckpointError (a ValueError).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

CONFIG_FILE = "config.json"


class CheckpointError(ValueError):
    """A checkpoint folder whose files are broken or disagree with each other; the message names the
    file, the key (or tensor) and the values that disagree."""


class ConfigKeys:
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


def special_ids(
    d: ConfigKeys, vocab: int, vocab_key: str, mask_default: int, eos_default: int
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


def reject_unsupported(d: ConfigKeys, supported: dict) -> None:
    """An error naming the first key of `supported` (key -> the only value we implement) that the
    config sets to anything else: a computation we do not implement is refused, not run wrongly."""
    for key, value in supported.items():
        if d.get(key, value) not in (value, None):
            raise d.error(f"{key}={d.get(key)!r} is not supported (only {value!r})")


def head_dim(d: ConfigKeys, hidden: int, heads: int, kv_heads: int, hidden_key: str, heads_key: str) -> int:
    """hidden / heads, checked to be integral and to group evenly over the key/value heads."""
    if hidden % heads:
        raise d.error(
            f"{hidden_key}={hidden} is not a multiple of {heads_key}={heads}, so head_dim is not integral"
        )
    if heads % kv_heads:
        raise d.error(f"{heads_key}={heads} is not a multiple of the {kv_heads} key/value heads")
    return hidden // heads
