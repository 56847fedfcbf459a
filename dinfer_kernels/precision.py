"""The precision-tied comparison every backend is held to, shared by the tests and `selftest`.

A kernel's output is compared with a high-precision truth (the reference in float64) next to a
same-precision run of the torch reference: the kernel may err at most twice as much as that run, plus a
few fp32 ulps of the output's magnitude (for cases where the torch run happens to be exact). So the
bound follows the dtype and the op's conditioning instead of a fixed rtol that a different exp
polynomial or ISA can break.
"""

import torch


def max_err(a, b):
    """Max |a - b| over finite positions. Raises AssertionError when the two disagree on which
    positions are non-finite, or on the non-finite values."""
    a, b = a.double(), b.double()
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fa, fb):
        raise AssertionError("outputs disagree on which elements are finite")
    if not torch.equal(a.isnan(), b.isnan()) or not torch.equal(a[a.isinf()], b[b.isinf()]):
        raise AssertionError("non-finite outputs differ")
    return float((a[fa] - b[fb]).abs().max()) if fa.any() else 0.0


def bound(same_precision, truth):
    """The largest error against `truth` allowed to an output of `same_precision`'s precision."""
    theirs = max_err(same_precision, truth)
    finite = truth[torch.isfinite(truth)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return 2 * theirs + 4 * torch.finfo(torch.float32).eps * max(scale, 1.0)


def within_precision(out, same_precision, truth):
    """(ok, message, error, bound): whether `out` errs against `truth` no more than the bound."""
    try:
        ours = max_err(out, truth)
        limit = bound(same_precision, truth)
    except AssertionError as e:
        return False, str(e), float("nan"), float("nan")
    return ours <= limit, f"error {ours:.3g} > bound {limit:.3g}" if ours > limit else "", ours, limit
