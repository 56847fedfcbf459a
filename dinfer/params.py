"""Generation parameters checked in one place.

GenerationConfig and DecoderConfig name a rule for each of their fields (Int, Real, Bool, OneOf, ...)
and run them through `check` in __post_init__; the CLI, LLM and the server all build those configs, so
a bad value gets the same error everywhere: a TypeError (wrong type, a string where a number goes) or
a ValueError (out of range, not finite) that names the option. Numbers may be numpy scalars; they are
stored as Python ints / floats, which the kernels' own checks expect.

What needs the model is checked here too, before anything is allocated: the look-ahead windows
within the model's positions (`check_windows`), and the memory a run's KV cache and forwards need
against what the device has free (`check_memory`).
"""

import dataclasses
import math
import numbers
import os
from typing import Optional, Sequence

import torch


def _typename(v) -> str:
    return f"{type(v).__name__} {v!r}" if isinstance(v, str) else type(v).__name__


def _in_range(name: str, v, lo, hi):
    """v, or a ValueError naming `name` when it lies outside [lo, hi] (either end open when None)."""
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(
            f"{name}: must be in [{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}], got {v}"
        )
    return v


@dataclasses.dataclass(frozen=True)
class Int:
    """An integer in [lo, hi] (either end open when None); bools are refused (True is not a length)."""

    lo: Optional[int] = None
    hi: Optional[int] = None

    def __call__(self, name: str, v) -> int:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{name}: expected an int, got {_typename(v)}")
        return _in_range(name, int(v), self.lo, self.hi)


@dataclasses.dataclass(frozen=True)
class Real:
    """A finite number in [lo, hi]: NaN or inf would pass every comparison the loop makes, or none."""

    lo: Optional[float] = None
    hi: Optional[float] = None

    def __call__(self, name: str, v) -> float:
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{name}: expected a number, got {_typename(v)}")
        v = float(v)
        if not math.isfinite(v):
            raise ValueError(f"{name}: must be finite, got {v}")
        return _in_range(name, v, self.lo, self.hi)


class Bool:
    """True or False (numpy's too); 0 / 1 are refused: an int here is more likely a misplaced value."""

    def __call__(self, name: str, v) -> bool:
        if type(v).__name__ not in ("bool", "bool_"):
            raise TypeError(f"{name}: expected True or False, got {_typename(v)}")
        return bool(v)


@dataclasses.dataclass(frozen=True)
class OneOf:
    options: Sequence[str]

    def __call__(self, name: str, v) -> str:
        if not isinstance(v, str):
            raise TypeError(f"{name}: expected one of {tuple(self.options)}, got {_typename(v)}")
        if v not in self.options:
            raise ValueError(f"{name}: expected one of {tuple(self.options)}, got {v!r}")
        return v


@dataclasses.dataclass(frozen=True)
class Tuple:
    """A fixed-length sequence (tuple or list), each item checked by its own rule; stored as a tuple."""

    items: Sequence

    def __call__(self, name: str, v) -> tuple:
        if isinstance(v, (str, bytes)) or not isinstance(v, Sequence) or len(v) != len(self.items):
            raise TypeError(
                f"{name}: expected a sequence of {len(self.items)} numbers, got {_typename(v)}"
                + (f" of length {len(v)}" if isinstance(v, Sequence) else "")
            )
        return tuple(rule(f"{name}[{i}]", x) for i, (rule, x) in enumerate(zip(self.items, v)))


@dataclasses.dataclass(frozen=True)
class OrNone:
    """None, or a value its rule accepts."""

    rule: object

    def __call__(self, name: str, v):
        return None if v is None else self.rule(name, v)


@dataclasses.dataclass(frozen=True)
class Instance:
    cls: type
    label: str

    def __call__(self, name: str, v):
        if not isinstance(v, self.cls):
            raise TypeError(f"{name}: expected {self.label}, got {_typename(v)}")
        return v


def check(cfg, rules: dict, names: Optional[dict] = None) -> None:
    """Runs each field of the (frozen) dataclass `cfg` through its rule and stores the normalised value.
    names: the option a field is known by where that differs (DecoderConfig.name is `decoder`).
    Every field must have a rule: a new field cannot go unchecked."""
    fields = [f.name for f in dataclasses.fields(cfg)]
    missing = sorted(set(fields) - set(rules))
    if missing:
        raise AssertionError(f"{type(cfg).__name__}: no check for field(s) {missing}")
    for f in fields:
        object.__setattr__(cfg, f, rules[f]((names or {}).get(f, f), getattr(cfg, f)))


# -------------------------------------------------------------------------------- needs the model


def check_windows(cfg, max_positions: int, given=None, config_file: Optional[str] = None) -> None:
    """The vicinity window's look-behind and look-ahead reach at most the model's positions: every
    sequence's buffer keeps after_look spare columns, and its cache rows, whatever the cache mode.
    `given`: the options the user set (None: all); a default that does not fit is the model config's
    fault (`config_file`), not an option's the user never set."""
    for name in ("prefix_look", "after_look"):
        v = getattr(cfg, name)
        if v <= max_positions:
            continue
        if given is None or name in given:
            raise ValueError(f"{name}: must be <= the model's {max_positions} positions, got {v}")
        raise ValueError(
            f"{config_file or 'the model config'}: the model has {max_positions} positions, fewer than "
            f"the {v} of {name}'s default (the vicinity window): too few for a prompt and its answer"
        )


def run_bytes(config, dtype: torch.dtype, kv_rows: int, forward_rows: int, logit_rows: int) -> int:
    """Bytes a generate run holds at its peak, estimated from the model's config: the KV cache
    (`kv_rows` rows per layer, K and V), the largest forward (`forward_rows` rows: the residual stream
    and norms, q/k/v and the attention output, the MLP's or the routed experts' intermediate) and
    the logits of `logit_rows` rows in fp32 (with the decoder's softmax copy)."""
    c = config
    elem = torch.empty((), dtype=dtype).element_size()
    kv = 2 * c.num_layers * kv_rows * c.num_kv_heads * c.head_dim * elem
    mlp = (c.top_k * c.expert_intermediate_size if c.num_experts else c.intermediate_size) or 0
    width = 4 * c.hidden_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + 2 * mlp
    return kv + forward_rows * width * elem + 2 * logit_rows * c.vocab_size * 4


def free_bytes(device: torch.device) -> Optional[int]:
    """Memory a run can still take on `device`: on a GPU what the driver has free plus what torch's
    allocator holds unused; on the host the kernel's MemAvailable (page cache it can drop included).
    None when it cannot be told (then nothing is refused)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(
    model, kv_rows: int, forward_rows: int, logit_rows: int, what: str, graphs: bool = False
) -> None:
    """MemoryError, before the caches are allocated, when the run (run_bytes; `what` says what it
    is) would need more than the device has free: a clear refusal instead of an out-of-memory kill
    (host) or a CUDA OOM mid-run. graphs: the run replays CUDA graphs (dinfer.graphs), whose pool
    keeps a captured forward's activations and logits beside the allocator's eager copy of them (the
    warm-up ran eagerly): counted twice."""
    # The weights' dtype is the cache's and the activations' (model.embedding: what Generator reads)
    dtype = model.embedding.dtype
    need = run_bytes(model.config, dtype, kv_rows, forward_rows, logit_rows)
    if graphs:
        need += run_bytes(model.config, dtype, 0, forward_rows, logit_rows)
    free = free_bytes(model.device)
    if free is not None and need > free:
        raise MemoryError(
            f"{what} needs about {_size(need)} (KV cache and forwards{', with their CUDA graphs' if graphs else ''}), "
            f"more than the {_size(free)} free "
            f"on {model.device}; lower batch_size, gen_length or after_look"
        )


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
