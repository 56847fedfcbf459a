"""Argument checks shared by the public ops: each raises TypeError/ValueError naming the argument."""

import math
import numbers

import torch

from . import _dispatch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def tensor(name, t, dtypes=None, ndim=None, device=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: expected dtype {names}, got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {list(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (where logits are), got {t.device}")
    return t


def logits_matrix(name, t):
    """A [rows, V] float tensor with V >= 1 and a contiguous last dim; returns (rows, V)."""
    tensor(name, t, FLOAT_DTYPES, ndim=2)
    rows, V = t.shape
    if V < 1:
        raise ValueError(f"{name}: the vocabulary dimension must be >= 1")
    if V > 1 and t.stride(1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous, got strides {t.stride()}")
    return rows, V


def shape(name, t, expected):
    if list(t.shape) != list(expected):
        raise ValueError(f"{name}: expected shape {list(expected)}, got {list(t.shape)}")


def contiguous(name, t):
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def integer(name, v, lo=None, hi=None):
    """v as a Python int: any numbers.Integral (NumPy's integer scalars too), never a bool."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    v = int(v)
    if (lo is not None and v < lo) or (hi is not None and v >= hi):
        raise ValueError(f"{name}: {v} is outside [{lo}, {hi})")
    return v


def number(name, v, lo=None, hi=None, lo_open=False):
    """v as a finite Python float: any numbers.Real (NumPy's scalars too), never a bool."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name}: expected a number, got {type(v).__name__}")
    v = float(v)
    if not math.isfinite(v):
        raise ValueError(f"{name}: must be finite, got {v}")
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise ValueError(f"{name}: must be {'>' if lo_open else '>='} {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name}: must be <= {hi}, got {v}")
    return v


def data_checks_possible(*ts) -> bool:
    """Reading tensor values is free on the host; on a GPU it would sync, and under torch.compile or
    CUDA-graph capture it is impossible, so there it is only done when the caller asks."""
    if torch.compiler.is_compiling():
        return False
    return all(t.device.type == "cpu" for t in ts)


def token_range(name, t, vocab):
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
        raise ValueError(
            f"{name}: token ids must be in [0, {vocab}), got range [{int(t.min())}, {int(t.max())}]"
        )


def _byte_span(t):
    """[lo, hi): the addresses of the bytes t's elements occupy (an empty tensor occupies none)."""
    base = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
    if t.numel() == 0:
        return base, base
    lo = sum(min(0, (n - 1) * s) for n, s in zip(t.shape, t.stride()))
    hi = sum(max(0, (n - 1) * s) for n, s in zip(t.shape, t.stride()))
    return base + lo * t.element_size(), base + (hi + 1) * t.element_size()


def disjoint(written, read):
    """Refuses (ValueError naming both) any byte shared by a tensor the op writes and another tensor of
    the call, the rule the compiled bindings apply (csrc/bindings/tensor_arg.h): the kernels read
    while writing, in parallel, so an overlap gives wrong values. (No public op writes an input in
    place of another, so unlike the bindings' rms_norm / rope `out`, nothing may alias.)
    written / read: {name: tensor or None}. Only plain tensors with memory are compared: fake and
    meta tensors (tracing) have no addresses."""
    if torch.compiler.is_compiling():
        return

    def real(items):
        return [(n, t) for n, t in items if type(t) in _dispatch._PLAIN and t.device.type != "meta"]

    named = real(written.items())
    others = named + real(read.items())
    for i, (wn, w) in enumerate(named):
        w_lo, w_hi = _byte_span(w)
        for rn, r in others[i + 1 :]:
            if r.device != w.device:
                continue
            r_lo, r_hi = _byte_span(r)
            if w_lo < r_hi and r_lo < w_hi:
                raise ValueError(
                    f"{wn}: overlaps {rn} in memory (the op reads and writes them in "
                    "parallel: use separate tensors)"
                )
