"""The op fuzz suite: for every public op and every backend that runs here, >= 500 calls from
a seeded generator, valid and broken.

Valid calls draw odd shapes (1, primes, non-powers of two), every dtype the backend takes, strided
views and NaN / +-inf values; they must agree with the reference (dinfer_kernels.precision's
precision-tied bound for float outputs, exactly for ids, flags and copied cache rows), with every
allocation of the op poisoned first so that an element the op fails to write fails the comparison.
Broken calls change one thing (dtype, shape, device, layout, a scalar, an out-of-range id or value,
overlapping arrays); they must raise ValueError / TypeError / RuntimeError whose message starts with the
name of the broken argument (or of the argument whose check sees the break). No call may crash: the
compiled host kernels run in a child process, so that a crash fails these tests with its signal
instead of killing the run. Attention gets NaN / inf only where the contract says nothing is read
(see test_attention_non_finite_attended_values_propagate for the rest).

Host tensors only: the GPU backends (cuda, triton on a GPU) are not fuzzed here. Budget: about two
minutes on a busy 2-core box (tiny shapes; the Triton interpreter gets fewer valid calls, the broken
ones never reach a kernel). `python tests/kernels/test_fuzz_ops.py OP[,OP...] BACKEND` runs pairs alone.
"""

import contextlib
import dataclasses
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pytest
import torch

if __name__ == "__main__":
    if not torch.cuda.is_available():  # as conftest does for pytest
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, as under pytest: conftest


import dinfer_kernels as dk
from dinfer_kernels import _backend, op_inputs, precision
from dinfer_kernels.op_inputs import paged_caches
from dinfer_kernels.ops import OPS
from dinfer_kernels.reference.attention import attention_reference
from dinfer_kernels.reference.decode import decode_params, decode_step_reference
from dinfer_kernels.reference.moe import moe_reference
from dinfer_kernels.reference.qk_rope import qk_rope_reference
from dinfer_kernels.reference.rms_norm import rms_norm_reference
from dinfer_kernels.reference.rope import rope_reference
from dinfer_kernels.reference.soft_embedding import soft_embedding_reference

CALLS = 500
SIZES = (1, 2, 3, 5, 7, 11, 13, 6)
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# The Triton interpreter computes bf16 arithmetic wrongly (it is a correctness tool for fp16/fp32).
INTERPRETER_FLOATS = (torch.float32, torch.float16)
# Share of valid calls: a valid call runs a kernel (slow in the Triton interpreter); broken calls
# stop at the checks.
VALID_SHARE = {
    "triton": {
        "rms_norm": 0.2,
        "rope": 0.1,
        "qk_rope": 0.1,
        "soft_embedding": 0.1,
        "decode_step": 0.08,
        "moe": 0.05,
        "attention": 0.05,
    }
}


# ---- recording and replaying backend calls ------------------------------------------------------


@dataclasses.dataclass
class Case:
    """One call: `run` calls the op and returns its outputs (including inputs it updates in place).
    Valid: `reference` returns (same-precision outputs, float64 truths or None per output) and
    `exact` says which outputs must match exactly. Broken: `names` are the arguments the error may
    name first (the broken one, or the one whose check sees it)."""

    what: str
    run: Callable
    names: tuple = ()
    reference: Optional[Callable] = None
    exact: tuple = ()


@contextlib.contextmanager
def poisoned_allocations():
    """torch.empty / empty_like fill what they allocate with values no op writes, so an output
    element the op leaves unwritten disagrees with the reference."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        if t.numel() and t.device.type != "meta":
            if t.is_floating_point():
                t.fill_(-31337.0)
            elif t.dtype == torch.bool:
                t.fill_(True)
            elif not t.is_complex():
                t.fill_(torch.iinfo(t.dtype).max - 3)
        return t

    torch.empty = lambda *a, **k: poison(empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def check_case(case, threads=1):
    """None if the case behaved, else what went wrong. The op runs on `threads` torch threads."""
    try:
        torch.set_num_threads(threads)
        with poisoned_allocations():
            got = case.run()
    except (ValueError, TypeError, RuntimeError) as e:
        if not case.names:
            return f"{case.what}: a valid call raised {type(e).__name__}: {e}"
        named = str(e).split(":")[0].split(", ")  # "a: ..." or "a, b: ..."
        if not set(named) & set(case.names):
            return f"{case.what}: the message names {named}, not one of {case.names}: {e}"
        return None
    except Exception as e:
        return f"{case.what}: {type(e).__name__}: {e}"
    finally:
        torch.set_num_threads(1)
    if case.names:
        return f"{case.what}: a broken call ({case.names[0]}) was accepted"
    same, truth = case.reference()
    if len(got) != len(same):
        return f"{case.what}: {len(got)} outputs, the reference has {len(same)}"
    for i, (out, want, true) in enumerate(zip(got, same, truth)):
        if i in case.exact:
            if not identical(out, want):
                return f"{case.what}: output {i} differs from the reference"
        else:
            msg = disagreement(out, want, true)
            if msg:
                return f"{case.what}: output {i}: {msg}"
    return None


def disagreement(out, same, truth):
    """NaN and +-inf exactly where the same-precision reference has them, and a precision-tied bound on
    the elements finite in both references (with non-finite inputs, fp64 may keep finite what fp32
    overflows, or the reverse): precision.bound, plus one ulp of the output's dtype at the output's
    scale. A fuzz output has a handful of elements, so the same-precision run's largest error can sit
    far below the one rounding to the output dtype that every backend may do differently (a kernel
    that keeps g and u unrounded rounds moe's silu(g) u to the other neighbour); on large outputs
    the ulp is below precision.bound anyway."""
    if out.shape != same.shape:
        return f"shape {list(out.shape)} != {list(same.shape)}"
    out_d, same_d = out.double(), same.double()
    if (
        not torch.equal(out_d.isnan(), same_d.isnan())
        or not torch.equal(out_d.isinf(), same_d.isinf())
        or not torch.equal(out_d[out_d.isinf()], same_d[same_d.isinf()])
    ):
        return "NaN / inf elsewhere than in the reference"
    both = torch.isfinite(same_d) & torch.isfinite(truth)
    if not both.any():
        return None
    scale = float(truth[both].abs().max())
    limit = precision.bound(same_d[both], truth[both]) + torch.finfo(out.dtype).eps * scale
    err = finite_err(out_d[both], truth[both])
    return None if err <= limit else f"error {err:.3g} > bound {limit:.3g}"


def identical(a, b):
    """Same shape, dtype and values (NaN where the other has NaN)."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (a != a) & (b != b)).all())


def finite_err(a, b):
    """max |a - b| over the elements finite in both (0 if none)."""
    a, b = a.double(), b.double()
    both = torch.isfinite(a) & torch.isfinite(b)
    return float((a[both] - b[both]).abs().max()) if both.any() else 0.0


def fuzz(op, backend, calls=CALLS, seed=0):
    """Runs `calls` generated calls of op on backend; returns the counts and the problems found."""
    r = random.Random(f"{op}/{backend}/{seed}")
    torch.manual_seed(r.randrange(2**31))
    floats = INTERPRETER_FLOATS if backend == "triton" and _backend.triton_interpreted() else FLOATS
    share = VALID_SHARE.get(backend, {}).get(op, 0.5)
    gen = GENERATORS[op]
    counts, problems = {"valid": 0, "broken": 0}, []
    threads = torch.get_num_threads()
    # One thread: tiny ops on a busy box spend far more time in the thread pool than working. The host
    # kernels run every other call on two threads (their row partitioning).
    torch.set_num_threads(1)
    try:
        for i in range(calls):
            case = gen(r, backend, floats, r.random() < share)
            counts["broken" if case.names else "valid"] += 1
            problem = check_case(case, threads=2 if backend == "cpu" and i % 2 else 1)
            if problem:
                problems.append(f"call {i}: {problem}")
    finally:
        torch.set_num_threads(threads)
    return {"calls": calls, **counts, "problems": problems}


# ---- value and layout helpers -------------------------------------------------------------------------


def rand(r, shape, dtype, scale=1.0, nonfinite=0.0, strided=None):
    """A random float tensor, perturbed (see perturb)."""
    return perturb(r, (torch.randn(*shape) * scale).to(dtype), nonfinite, strided)


def perturb(r, t, nonfinite=0.0, strided=None):
    """t (a factory's valid input), where with probability `nonfinite` some elements become NaN /
    +-inf, and `strided` (default: a coin flip) makes it a non-contiguous view whose last dim is
    still dense."""
    if nonfinite and r.random() < nonfinite and t.numel():
        hit = torch.rand(t.shape) < 0.15
        t[hit] = r.choice([float("nan"), float("inf"), float("-inf")])
    return strided_copy(r, t) if (r.random() < 0.3 if strided is None else strided) else t


def strided_copy(r, t):
    """The same values in a view with padded rows (the last dim stays contiguous)."""
    if t.dim() < 2 or t.shape[-1] == 0:
        return t
    pad = r.choice((1, 3, 8))
    big = torch.zeros(*t.shape[:-1], t.shape[-1] + pad, dtype=t.dtype)
    view = big[..., pad:]
    view.copy_(t)
    return view


def poison_rows(r, tensors, rows):
    """NaN / +-inf into the selected rows (dim 0) of each tensor."""
    for t in tensors:
        t[rows] = r.choice((float("nan"), float("inf"), float("-inf")))


def other_float(dtype):
    return torch.float64 if dtype != torch.float64 else torch.float32


def corrupt(r, case_args, corruptions):
    """Applies one corruption (names, fn) drawn from the list; returns its names."""
    names, fn = r.choice(corruptions)
    fn(case_args)
    return names


def not_tensor(a, key):
    a[key] = a[key].tolist() if isinstance(a[key], torch.Tensor) else "x"


# ---- rms_norm -------------------------------------------------------------------------------------


def gen_rms_norm(r, backend, floats, valid):
    dt = r.choice(floats)
    D = r.choice(SIZES + (16, 33))
    lead = tuple(r.choice(SIZES) for _ in range(r.randint(0, 2)))
    a = op_inputs.rms_norm_inputs(lead + (D,), dtype=dt, scale=1.0, eps=r.choice((1e-6, 1e-5, 0.25)))
    a["x"] = perturb(r, a["x"], nonfinite=0.2)
    if valid:
        x, w, eps = a["x"], a["weight"], a["eps"]

        def ref():
            return ((rms_norm_reference(x, w, eps),), (rms_norm_reference(x, w, eps, torch.float64),))

        return Case(
            f"rms_norm {dt} {tuple(x.shape)}", lambda: (dk.rms_norm(**a, backend=backend),), reference=ref
        )
    names = corrupt(
        r,
        a,
        [
            (("x",), lambda a: a.update(x=a["x"].to(torch.int32))),
            (("x",), lambda a: a.update(x=a["x"].to(torch.float64))),
            (("x",), lambda a: not_tensor(a, "x")),
            (("x",), lambda a: a.update(x=torch.tensor(1.0, dtype=dt))),
            (("weight",), lambda a: a.update(weight=a["weight"].to(other_float(dt)))),
            (("weight",), lambda a: a.update(weight=torch.ones(D + 1, dtype=dt))),
            (("weight",), lambda a: a.update(weight=torch.ones(1, D, dtype=dt))),
            (("weight",), lambda a: a.update(weight=torch.ones(D, dtype=dt, device="meta"))),
            (("weight",), lambda a: not_tensor(a, "weight")),
            (
                ("eps",),
                lambda a: a.update(eps=r.choice((0.0, -1e-6, float("nan"), float("inf"), True, "1e-6"))),
            ),
            (("backend",), lambda a: a.update(backend_=r.choice(("gpu", "Torch", "")))),
        ],
    )
    use = a.pop("backend_", backend)
    return Case(f"rms_norm broken {names[0]}", lambda: (dk.rms_norm(**a, backend=use),), names)


# ---- rope -----------------------------------------------------------------------------------------


def gen_rope(r, backend, floats, valid):
    dt = r.choice(floats)
    B, T, H = r.choice(SIZES[:5]), r.choice(SIZES), r.choice(SIZES[:5])
    D = r.choice((2, 4, 6, 10, 14, 16, 22))
    rd = r.choice((None, 2, D - D % 4 or 2))
    far = r.random() < 0.1  # past the host backend's cached table
    a = op_inputs.rope_inputs(
        B, T, H, D, dtype=dt, max_position=70000 if far else 300, theta=r.choice((10000.0, 500000.0, 1.5))
    )
    a.update(
        x=perturb(r, a["x"], nonfinite=0.2),
        positions=a["positions"].to(r.choice((torch.int64, torch.int32))),
        rotary_dim=rd,
    )
    if valid:

        def ref():
            args = (a["x"], a["positions"], a["theta"], a["rotary_dim"])
            return (rope_reference(*args),), (rope_reference(*args, torch.float64),)

        return Case(
            f"rope {dt} {(B, T, H, D)} rd={rd}", lambda: (dk.rope(**a, backend=backend),), reference=ref
        )
    names = corrupt(
        r,
        a,
        [
            (("x",), lambda a: a.update(x=a["x"][0])),
            (("x",), lambda a: a.update(x=a["x"].to(torch.int64))),
            (("positions",), lambda a: a.update(positions=a["positions"].float())),
            (("positions",), lambda a: a.update(positions=a["positions"][:, :1].expand(B, T + 1))),
            (
                ("positions",),
                lambda a: a["positions"].view(-1).__setitem__(r.randrange(B * T), -r.randint(1, 9)),
            ),
            (("positions",), lambda a: a.update(positions=a["positions"].to("meta"))),
            (("theta",), lambda a: a.update(theta=r.choice((0.0, -5.0, float("nan"), None)))),
            (("rotary_dim",), lambda a: a.update(rotary_dim=r.choice((D + 2, 0, 1, 3, -2, 2.0)))),
        ],
    )
    return Case(f"rope broken {names[0]}", lambda: (dk.rope(**a, backend=backend),), names)


# ---- qk_rope --------------------------------------------------------------------------------------


def gen_qk_rope(r, backend, floats, valid):
    dt = r.choice(floats)
    B, T = r.choice(SIZES[:5]), r.choice(SIZES)
    Hq, Hk = r.choice((0,) + SIZES[:5]), r.choice(SIZES[:5])
    D = r.choice((2, 4, 6, 10, 14, 16, 22))
    rd = r.choice((2, D - D % 4 or 2, D))
    norm = r.random() < 0.6
    a = op_inputs.qk_rope_inputs(
        B,
        T,
        Hq,
        Hk,
        D,
        rotary_dim=rd,
        norm=norm,
        dtype=dt,
        max_position=r.choice((1, 37, 300)),
        theta=r.choice((10000.0, 500000.0, 1.5)),
        scale=1.0,
        eps=r.choice((1e-6, 1e-5, 0.25)),
    )
    a.update(
        q=perturb(r, a["q"], nonfinite=0.2),
        k=perturb(r, a["k"], nonfinite=0.2),
        positions=a["positions"].to(r.choice((torch.int64, torch.int32))),
    )
    if valid:

        def ref():
            return qk_rope_reference(**a), qk_rope_reference(**a, compute_dtype=torch.float64)

        return Case(
            f"qk_rope {dt} {(B, T, Hq, Hk, D)} rd={rd} norm={norm}",
            lambda: dk.qk_rope(**a, backend=backend),
            reference=ref,
        )
    P = a["table"].shape[0]
    corruptions = [
        (("q",), lambda a: a.update(q=a["q"][0])),
        (("q",), lambda a: a.update(q=a["q"].to(torch.int64))),
        (("k",), lambda a: a.update(k=a["k"].to(other_float(dt)))),
        (("k",), lambda a: a.update(k=torch.zeros(B, T + 1, Hk, D, dtype=dt))),
        (("k",), lambda a: a.update(k=torch.zeros(B, T, Hk, D + 2, dtype=dt))),
        (("positions",), lambda a: a.update(positions=a["positions"].float())),
        (("positions",), lambda a: a.update(positions=a["positions"][:, :1].expand(B, T + 1))),
        (
            ("positions",),
            lambda a: a["positions"].view(-1).__setitem__(r.randrange(B * T), r.choice((-1, P, P + 9))),
        ),
        (("positions",), lambda a: a.update(positions=a["positions"].to("meta"))),
        (("table",), lambda a: a.update(table=a["table"].double())),
        (("table",), lambda a: a.update(table=a["table"][:, :-1])),
        (("table",), lambda a: a.update(table=torch.zeros(P, D + 2))),
        (("table",), lambda a: a.update(table=a["table"].flatten())),
        (("table",), lambda a: a.update(table=a["table"].to("meta"))),
        (("table",), lambda a: a.update(table=torch.zeros(P, 2 * rd)[:, ::2])),
        (("q_norm", "k_norm"), lambda a: a.update(q_norm=torch.ones(D, dtype=dt), k_norm=None)),
        (("q_norm", "k_norm"), lambda a: a.update(q_norm=None, k_norm=torch.ones(D, dtype=dt))),
        (("q_norm",), lambda a: a.update(q_norm=torch.ones(D + 1, dtype=dt), k_norm=torch.ones(D, dtype=dt))),
        (
            ("k_norm",),
            lambda a: a.update(q_norm=torch.ones(D, dtype=dt), k_norm=torch.ones(D, dtype=other_float(dt))),
        ),
        (
            ("eps",),
            lambda a: a.update(
                q_norm=torch.ones(D, dtype=dt),
                k_norm=torch.ones(D, dtype=dt),
                eps=r.choice((0.0, -1e-6, float("nan"), None, "1e-6")),
            ),
        ),
        (("backend",), lambda a: a.update(backend_=r.choice(("gpu", "Torch", "")))),
    ]
    names = corrupt(r, a, corruptions)
    use = a.pop("backend_", backend)
    return Case(f"qk_rope broken {names[0]}", lambda: dk.qk_rope(**a, backend=use), names)


# ---- soft_embedding -------------------------------------------------------------------------------


def gen_soft_embedding(r, backend, floats, valid):
    dt = r.choice(floats)
    M, V, d = r.choice(SIZES), r.choice(SIZES + (17, 40)), r.choice(SIZES + (16,))
    mask_id = r.randrange(V)
    a = op_inputs.soft_embedding_inputs(
        M,
        V,
        d,
        dtype=dt,
        logits_dtype=r.choice(floats),
        mask_id=mask_id,
        weight=r.choice((0.5, 1.0, torch.tensor([0.3]), torch.rand(M))),
    )
    a.update(
        logits=perturb(r, a["logits"], nonfinite=0.2),
        embedding=perturb(r, a["embedding"]),
        mask_id=r.choice((mask_id, np.int64(mask_id))),
        tau=r.choice((1.0, 0.7, 2.0)),
    )
    if valid:

        def ref():
            args = (a["logits"], a["embedding"], a["tokens"], int(a["mask_id"]), a["weight"], a["tau"])
            return (soft_embedding_reference(*args),), (soft_embedding_reference(*args, torch.float64),)

        return Case(
            f"soft_embedding {dt} {(M, V, d)}",
            lambda: (dk.soft_embedding(**a, backend=backend),),
            reference=ref,
        )
    names = corrupt(
        r,
        a,
        [
            (("logits",), lambda a: a.update(logits=a["logits"].to(torch.int32))),
            (("logits",), lambda a: a.update(logits=a["logits"][None])),
            (("logits",), lambda a: a.update(logits=torch.zeros(V, M, dtype=dt).t()))
            if V > 1 and M > 1
            else (("logits",), lambda a: a.update(logits=None)),
            (("embedding",), lambda a: a.update(embedding=torch.zeros(V + 1, d, dtype=dt))),
            (("embedding",), lambda a: a.update(embedding=a["embedding"].to(torch.int64))),
            (("embedding",), lambda a: a.update(embedding=torch.zeros(V, d, dtype=dt, device="meta"))),
            (("tokens",), lambda a: a.update(tokens=a["tokens"].int())),
            (("tokens",), lambda a: a["tokens"].__setitem__(r.randrange(M), r.choice((-1, V, V + 7)))),
            (("mask_id",), lambda a: a.update(mask_id=r.choice((V, -1, True, 1.0, np.bool_(False))))),
            (("tau",), lambda a: a.update(tau=r.choice((0.0, -1.0, float("inf"))))),
            (("weight",), lambda a: a.update(weight=r.choice((float("nan"), torch.ones(M + 1), "w")))),
        ],
    )
    return Case(
        f"soft_embedding broken {names[0]}", lambda: (dk.soft_embedding(**a, backend=backend),), names
    )


# ---- decode_step ----------------------------------------------------------------------------------


def credit_state(r, N, V, K):
    """A state the op could have left: distinct ids per row, values >= 0, empty slots (-1, 0)."""
    cs = dk.CreditState.empty(N, K)
    for n in range(N):
        for j, tok in enumerate(r.sample(range(V), min(K, V))):
            if r.random() < 0.6:
                cs.ids[n, j], cs.vals[n, j] = tok, r.choice((0.0, r.random() * 3))
    return cs


def gen_decode_step(r, backend, floats, valid):
    N, V, K = r.choice(SIZES + (16,)), r.choice(SIZES + (37, 64)), r.choice((0, 1, 3, 4))
    B = r.randint(1, 4)
    offsets = [0] + sorted(r.randint(0, N) for _ in range(B - 1)) + [N]
    mask_id = r.randrange(V)
    rule = r.choice(("threshold", "hierarchical", "fixed", "joint"))
    a = op_inputs.decode_step_inputs(
        N, V, dtype=r.choice(floats), seq_offsets=offsets, mask_id=mask_id, masked_frac=0.6
    )
    tokens, offsets = a["tokens"], a["seq_offsets"]
    a.update(
        logits=perturb(r, a["logits"], nonfinite=0.3),
        mask_id=r.choice((mask_id, np.int64(mask_id), np.int32(mask_id))),
        rule=rule,
        threshold=r.choice((0.9, 0.3, torch.rand(B))),
        low_threshold=0.4,
        num_commit=r.choice((1, 2, torch.randint(0, 3, (B,), dtype=torch.int32)))
        if rule == "fixed"
        else None,
        temperature=r.choice((0.0, 0.0, 0.7)),
        seed=r.randrange(2**32),
        offset=r.randrange(100),
        credit=credit_state(r, N, V, K) if K else None,
    )
    if rule == "joint":  # editing off (None, <= 0) or on; editable rows or all
        a["edit_threshold"] = r.choice((None, 0.0, -0.5, 0.05, 0.3, 0.9))
        a["editable"] = r.choice((None, torch.rand(N) < 0.6))
    if valid:
        before = (tokens.clone(), a["credit"] and (a["credit"].ids.clone(), a["credit"].vals.clone()))

        def run():
            out = dk.decode_step(**a, backend=backend)
            cs = a["credit"]
            return tuple(out) + (a["tokens"],) + ((cs.ids, cs.vals) if cs else ())

        def ref():
            res = []
            for c in (torch.float32, torch.float64):
                tok = before[0].clone()
                ids, vals = before[1] if before[1] else (None, None)
                ids, vals = (ids.clone(), vals.clone()) if ids is not None else (None, None)
                thr = a["threshold"]
                out = decode_step_reference(
                    a["logits"],
                    tok,
                    offsets,
                    decode_params(
                        int(a["mask_id"]),
                        rule=rule,
                        threshold=thr if isinstance(thr, torch.Tensor) else torch.full((B,), thr),
                        low_threshold=0.4,
                        num_commit=None
                        if a["num_commit"] is None
                        else (
                            a["num_commit"]
                            if isinstance(a["num_commit"], torch.Tensor)
                            else torch.full((B,), a["num_commit"], dtype=torch.int32)
                        ),
                        temperature=a["temperature"],
                        seed=a["seed"],
                        offset=a["offset"],
                        editable=a.get("editable"),
                        edit_threshold=None
                        if a.get("edit_threshold") is None or a["edit_threshold"] <= 0
                        else a["edit_threshold"],
                    ),
                    credit_ids=ids,
                    credit_vals=vals,
                    compute_dtype=c,
                )
                res.append(tuple(out) + (tok,) + ((ids, vals) if ids is not None else ()))
            return res[0], tuple(t.double() if t.is_floating_point() else None for t in res[1])

        return Case(
            f"decode_step {a['logits'].dtype} N={N} V={V} K={K} {rule}",
            run,
            reference=ref,
            exact=(0, 2, 3, 4, 5),
        )  # candidate, commit, nonfinite, tokens, credit ids
    cs = a["credit"]
    corruptions = [
        (("logits",), lambda a: a.update(logits=a["logits"].double())),
        (("logits",), lambda a: a.update(logits=a["logits"].reshape(-1))),
        (("tokens",), lambda a: a.update(tokens=a["tokens"].int())),
        (("tokens",), lambda a: a.update(tokens=a["tokens"][:-1] if N > 1 else a["tokens"][:0])),
        (("tokens",), lambda a: a["tokens"].__setitem__(r.randrange(N), r.choice((-1, V, V + 3)))),
        (("tokens",), lambda a: a.update(tokens=a["tokens"].to("meta"))),
        (("seq_offsets",), lambda a: a["seq_offsets"].__setitem__(-1, N + r.randint(1, 3))),
        (("seq_offsets",), lambda a: a.update(seq_offsets=a["seq_offsets"].long())),
        (("mask_id",), lambda a: a.update(mask_id=r.choice((V, -1, True, 2.0, np.bool_(True), None)))),
        (("rule",), lambda a: a.update(rule=r.choice(("greedy", 0, None)))),
        (
            ("threshold",),
            lambda a: a.update(
                threshold=r.choice((float("nan"), torch.full((B,), float("nan")), torch.rand(B + 1), "0.9"))
            ),
        ),
        (("num_commit",), lambda a: a.update(rule="fixed", num_commit=r.choice((-1, None, 1.5)))),
        (("temperature",), lambda a: a.update(temperature=r.choice((-0.1, float("nan"), float("inf"))))),
        (("seed",), lambda a: a.update(seed=r.choice((-1, 2**32, 0.5)))),
        (
            ("editable",),
            lambda a: a.update(
                rule="joint",
                editable=r.choice(
                    (
                        torch.ones(N, dtype=torch.uint8),
                        torch.ones(N, dtype=torch.int32),
                        torch.ones(N + 1, dtype=torch.bool),
                        torch.ones(N, 1, dtype=torch.bool),
                        torch.ones(N, dtype=torch.bool, device="meta"),
                        [True] * N,
                    )
                ),
            ),
        ),
        (
            ("edit_threshold",),
            lambda a: a.update(
                rule="joint", edit_threshold=r.choice((float("nan"), float("inf"), "0.5", True))
            ),
        ),
        # editing asked of another rule
        (
            ("editable", "edit_threshold"),
            lambda a: a.update(
                rule=r.choice(("threshold", "hierarchical")),
                **r.choice(({"editable": torch.ones(N, dtype=torch.bool)}, {"edit_threshold": 0.5})),
            ),
        ),
        # the caller's buffer for both the tokens and the editable rows
        (("tokens",), lambda a: a.update(rule="joint", editable=a["tokens"].view(torch.bool)[:N])),
        (("credit",), lambda a: a.update(credit=(torch.zeros(N, 1),))),
        (
            ("credit.ids", "credit_ids"),
            lambda a: a.update(
                credit=dk.CreditState(torch.full((N, 2), -1, dtype=torch.int64), torch.zeros(N, 2))
            ),
        ),
        (
            ("credit.vals", "credit_vals"),
            lambda a: a.update(
                credit=dk.CreditState(torch.full((N, 2), -1, dtype=torch.int32), torch.zeros(N + 1, 2))
            ),
        ),
        # the caller's buffer for both logits and credit values
        (
            ("credit.vals", "credit_vals"),
            lambda a: (
                a.update(
                    credit=dk.CreditState(
                        torch.full((N, 1), -1, dtype=torch.int32), a["logits"].view(-1)[:N].view(N, 1)
                    )
                )
                if a["logits"].dtype == torch.float32 and a["logits"].is_contiguous()
                else a.update(
                    credit=dk.CreditState(torch.full((N, 1), -1, dtype=torch.int32), torch.full((N, 1), -2.0))
                )
            ),
        ),
    ]
    if cs is not None:
        n, j = r.randrange(N), r.randrange(K)
        corruptions += [
            (("credit.ids", "credit_ids"), lambda a: cs.ids.__setitem__((n, j), r.choice((-2, V, V + 9)))),
            (
                ("credit.vals", "credit_vals"),
                lambda a: cs.vals.__setitem__((n, j), r.choice((float("nan"), float("inf"), -0.5))),
            ),
            (
                ("credit.vals", "credit_vals"),
                lambda a: (cs.ids.__setitem__((n, j), -1), cs.vals.__setitem__((n, j), 1.0)),
            ),
        ]
        if K > 1 and V > 1:
            corruptions.append(
                (
                    ("credit.ids", "credit_ids"),
                    lambda a: (
                        cs.vals[n].zero_(),
                        cs.ids[n].copy_(torch.tensor([1, 1] + [-1] * (K - 2), dtype=torch.int32)),
                    ),
                )
            )
    names = corrupt(r, a, corruptions)
    return Case(f"decode_step broken {names[0]}", lambda: tuple(dk.decode_step(**a, backend=backend)), names)


# ---- attention ------------------------------------------------------------------------------------


def gen_attention(r, backend, floats, valid):
    """Contiguous caches, or (4 calls in 10) shuffled page pools with spare pages, ids outside the
    pool past seq_lens and, for two sequences, pages without window rows shared."""
    dt = r.choice(floats if backend != "cuda" else (torch.float16, torch.bfloat16))
    B, W, Hkv, group = r.randint(1, 2), r.choice((1, 2, 3, 5)), r.randint(1, 2), r.choice((1, 2, 3))
    D = r.choice((64,)) if backend in ("triton", "cuda") else r.choice((1, 3, 8, 13, 16))
    S = W + r.randint(0, 9)
    page_size = r.choice((1, 2, 3, 5)) if r.random() < 0.4 else None
    if page_size:
        S = -(-S // page_size) * page_size  # positions cover whole pages
    Hq = Hkv * group
    scale = r.choice((None, 0.3))
    a = op_inputs.attention_inputs(B, W, S, Hq, Hkv, D, dtype=dt, scattered=True)
    positions, seq_lens = a["positions"], a["seq_lens"]
    a.update(
        q=perturb(r, a["q"]),
        k=perturb(r, a["k"]),
        v=perturb(r, a["v"]),
        write_back=r.random() < 0.6,
        scale=scale,
    )
    if r.random() < 0.3:
        # NaN / inf where the contract says nothing is read: cache rows past seq_lens and the padding
        # window rows (position >= seq_lens). (Attended non-finite values: see the propagation test below.)
        for b in range(B):
            poison_rows(r, [a["k_cache"][b], a["v_cache"][b]], torch.arange(S) >= seq_lens[b])
            poison_rows(r, [a["q"][b], a["k"][b], a["v"][b]], positions[b] >= seq_lens[b])
    table = None
    if page_size:
        pools, table = paged_caches(
            (a["k_cache"], a["v_cache"]),
            page_size,
            seq_lens,
            seed=r.randrange(2**31),
            extra_pages=r.randint(0, 3),
            absent=True,
        )
        P = pools[0].shape[0]
        if B == 2 and r.random() < 0.5:
            # share sequence 0's present pages where no valid window row of either sequence sits
            valid_rows = positions < seq_lens[:, None].long()
            for j in range(S // page_size):
                here = (positions // page_size == j) & valid_rows
                if not here.any() and 0 <= int(table[0, j]) < P:
                    table[1, j] = table[0, j]
        a.update(k_cache=pools[0], v_cache=pools[1], block_table=table)
    if r.random() < 0.5:
        q_block, kv_block = r.choice((1, 2, 3, 4)), r.choice((1, 2, 3, 5))
        a["block_mask"] = (
            dk.BlockMask.full(B, Hkv, W, S, q_block, kv_block)
            if r.random() < 0.5
            else dk.BlockMask.vicinity(
                B,
                Hkv,
                W,
                S,
                q_block,
                kv_block,
                before=r.randint(0, 4),
                after=r.randint(0, 4),
                sink=r.randint(0, 1),
            )
        )
        a["return_block_mass"] = r.random() < 0.5
    a["return_lse"] = r.random() < 0.5
    if valid:
        caches = (a["k_cache"].clone(), a["v_cache"].clone())

        def run():
            res = dk.attention(**a, backend=backend)
            res = res if isinstance(res, tuple) else (res,)
            return res + (a["k_cache"], a["v_cache"])

        def ref():
            bm = a.get("block_mask")
            res = []
            for c in (torch.float32, torch.float64):
                kc, vc = caches[0].clone(), caches[1].clone()
                out = attention_reference(
                    a["q"],
                    a["k"],
                    a["v"],
                    kc,
                    vc,
                    positions,
                    seq_lens,
                    a["write_back"],
                    None,
                    scale,
                    c,
                    block_mask=bm and tuple(bm),
                    return_lse=a["return_lse"],
                    return_block_mass=a.get("return_block_mass", False),
                    block_table=table,
                )
                res.append((out if isinstance(out, tuple) else (out,)) + (kc, vc))
            return res[0], tuple(t.double() for t in res[1])

        n_out = 1 + a["return_lse"] + a.get("return_block_mass", False)
        return Case(
            f"attention {dt} {(B, W, Hq, Hkv, D, S)} pages={page_size} wb={a['write_back']}",
            run,
            reference=ref,
            exact=(n_out, n_out + 1),
        )
    corruptions = [
        (("q",), lambda a: a.update(q=a["q"][0])),
        (("q",), lambda a: a.update(q=a["q"].to(torch.int32))),
        (("k_cache",), lambda a: a.update(k_cache=a["k_cache"].to(other_float(dt)))),
        (("k_cache", "v_cache", "k"), lambda a: a.update(k_cache=torch.zeros(B, S, Hkv + 1, D, dtype=dt))),
        (("v_cache",), lambda a: a.update(v_cache=torch.zeros(B, S + 1, Hkv, D, dtype=dt))),
        (("k",), lambda a: a.update(k=torch.zeros(B, W + 1, Hkv, D, dtype=dt))),
        (("v",), lambda a: a.update(v=a["v"].to("meta"))),
        (("positions",), lambda a: a.update(positions=a["positions"].int())),
        (("positions",), lambda a: a["positions"].__setitem__((0, r.randrange(W)), r.choice((-1, S, S + 4)))),
        (("seq_lens",), lambda a: a["seq_lens"].__setitem__(0, r.choice((-1, S + 1)))),
        (("seq_lens",), lambda a: a.update(seq_lens=a["seq_lens"].long())),
        (("scale",), lambda a: a.update(scale=r.choice((0.0, -1.0, float("nan"), "s")))),
        (("k_cache", "v_cache"), lambda a: a.update(write_back=True, v_cache=a["k_cache"])),
        (("block_mask",), lambda a: a.update(block_mask=None, return_block_mass=True)),
        (("block_mask",), lambda a: a.update(block_mask=(1, 2))),
    ]
    if backend != "torch":
        corruptions.append(
            (("attn_mask",), lambda a: a.update(attn_mask=torch.ones(B, W, S, dtype=torch.bool)))
        )
    if page_size:
        corruptions += paged_corruptions(r, a, page_size, P)
    if "block_mask" in a:
        bm = a["block_mask"]
        corruptions += [
            (("block_mask.kv_indices",), lambda a: bm.kv_indices.view(-1).__setitem__(0, -3)),
            (
                ("block_mask.kv_num_blocks",),
                lambda a: bm.kv_num_blocks.view(-1).__setitem__(0, bm.kv_indices.shape[-1] + 1),
            ),
            (
                ("block_mask.kv_num_blocks",),
                lambda a: a.update(block_mask=bm._replace(kv_num_blocks=bm.kv_num_blocks.long())),
            ),
        ]
    names = corrupt(r, a, corruptions)
    return Case(f"attention broken {names[0]}", lambda: dk.attention(**a, backend=backend), names)


def paged_corruptions(r, a, page_size, P):
    """Breaks of a paged call: the table's dtype / shape, a page id outside the pool before seq_lens,
    a page holding a valid window row also at another attended position, a pool of another shape."""
    table, positions, lens = a["block_table"], a["positions"], a["seq_lens"].long()
    B, MP = table.shape
    out = [
        (("block_table",), lambda a: a.update(block_table=table.long())),
        (("block_table",), lambda a: a.update(block_table=torch.cat([table, table]))),
        (("v_cache",), lambda a: a.update(v_cache=torch.cat([a["v_cache"], a["v_cache"][:1]]))),
        (
            ("k_cache", "v_cache"),
            lambda a: a.update(k_cache=a["k_cache"][:, :-1] if page_size > 1 else a["k_cache"][:0]),
        ),
    ]
    covered = [(b, j) for b in range(B) for j in range(MP) if j * page_size < int(lens[b])]
    if covered:
        b, j = r.choice(covered)
        # b and j bound now: the loops below rebind b
        out.append(
            (("block_table",), lambda a, b=b, j=j: table.__setitem__((b, j), r.choice((-1, P, P + 7))))
        )
    # a second attended position on the pool row of a valid window row
    clashes = []
    for b in range(B):
        for w in range(positions.shape[1]):
            pos = int(positions[b, w])
            if pos >= int(lens[b]):
                continue
            for b2 in range(B):
                for j2 in range(MP):
                    if (b2, j2) != (b, pos // page_size) and j2 * page_size + pos % page_size < int(lens[b2]):
                        clashes.append((b2, j2, int(table[b, pos // page_size])))
    if clashes:
        b2, j2, page = r.choice(clashes)
        out.append((("block_table",), lambda a: table.__setitem__((b2, j2), page)))
    return out


# ---- moe ------------------------------------------------------------------------------------------


def gen_moe(r, backend, floats, valid):
    dt = r.choice(floats)
    T, H, I = r.choice(SIZES), r.choice((1, 3, 8, 16, 24)), r.choice((1, 2, 5, 8))
    E = r.choice((1, 2, 3, 4, 6, 8))
    num_groups = r.choice([g for g in (1, 2, 3, 4) if E % g == 0])
    topk_groups = r.randint(1, num_groups)
    top_k = r.randint(1, topk_groups * (E // num_groups))
    scoring = r.choice(("softmax", "sigmoid"))
    use_logits = r.random() < 0.3
    S = r.choice((1, 2, 5, 9)) if r.random() < 0.3 else 0  # a shared expert (LLaDA2)
    fp8 = r.random() < 0.3  # FP8 expert weights with 128 x 128 block scales
    a = op_inputs.moe_inputs(T, E, H, I, top_k, dtype=dt, router_scale=1.0, shared_inter=S, fp8=fp8)
    a.update(
        hidden=perturb(r, a["hidden"], nonfinite=0.1, strided=False),
        router_weight=None if use_logits else a["router_weight"].to(r.choice((torch.float32, dt))),
        top_k=r.choice((top_k, np.int64(top_k))),
        router_logits=rand(r, (T, E), torch.float32, strided=False) if use_logits else None,
        renormalize=r.random() < 0.5,
        scoring=scoring,
        expert_bias=rand(r, (E,), torch.float32, scale=0.1) if r.random() < 0.3 else None,
        num_groups=num_groups,
        topk_groups=topk_groups,
        routed_scaling=r.choice((1.0, 2.5)),
    )
    if r.random() < 0.2:  # a slice of local experts (expert parallelism)
        e0 = r.randint(0, E)
        e1 = r.randint(e0, E)
        a.update(w13=a["w13"][e0:e1], w2=a["w2"][e0:e1], expert_offset=e0)
        if fp8:
            a.update(w13_scale=a["w13_scale"][e0:e1], w2_scale=a["w2_scale"][e0:e1])
    extra = ("shared_w13", "shared_w2", "w13_scale", "w2_scale", "shared_w13_scale", "shared_w2_scale")
    if valid:

        def ref():
            kw = dict(
                router_logits=a["router_logits"],
                scoring=scoring,
                num_groups=num_groups,
                topk_groups=topk_groups,
                routed_scaling=a["routed_scaling"],
                **{name: a[name] for name in extra if name in a},
            )
            args = (
                a["hidden"],
                a["router_weight"],
                a["w13"],
                a["w2"],
                int(a["top_k"]),
                a["renormalize"],
                a["expert_bias"],
                a.get("expert_offset", 0),
            )
            return (moe_reference(*args, **kw),), (moe_reference(*args, torch.float64, **kw),)

        return Case(
            f"moe {dt} T={T} H={H} I={I} E={E} k={top_k} g={num_groups}/{topk_groups} S={S} fp8={fp8}",
            lambda: (dk.moe(**a, backend=backend),),
            reference=ref,
        )
    corruptions = [
        (("hidden",), lambda a: a.update(hidden=a["hidden"][None])),
        (("hidden",), lambda a: a.update(hidden=a["hidden"].to(torch.int64))),
        (("w13",), lambda a: a.update(w13=a["w13"][:, :-1] if 2 * I > 1 else a["w13"][:, :0])),
        (("w13",), lambda a: a.update(w13=a["w13"].to(other_float(dt)))),
        (("w2",), lambda a: a.update(w2=torch.zeros(E, H + 1, I, dtype=dt))),
        (("w2",), lambda a: a.update(w2=a["w2"].to("meta"))),
        (("router_weight", "router_logits"), lambda a: a.update(router_weight=None, router_logits=None)),
        (
            ("router_weight", "router_logits"),
            lambda a: a.update(router_weight=torch.zeros(E, H), router_logits=torch.zeros(T, E)),
        ),
        (("router_weight",), lambda a: a.update(router_weight=torch.zeros(E, H + 1), router_logits=None)),
        (("router_logits",), lambda a: a.update(router_weight=None, router_logits=torch.zeros(T, E, 2))),
        (("top_k",), lambda a: a.update(top_k=r.choice((0, -1, E + 1, 1.0, True, np.bool_(True))))),
        (("scoring",), lambda a: a.update(scoring=r.choice(("tanh", None, 0)))),
        (("num_groups",), lambda a: a.update(num_groups=r.choice((0, E + 1, 1.5)))),
        (("expert_bias",), lambda a: a.update(expert_bias=torch.zeros(E + 1))),
        (("routed_scaling",), lambda a: a.update(routed_scaling=r.choice((float("nan"), float("inf"), "2")))),
        (("expert_offset",), lambda a: a.update(expert_offset=r.choice((E + 1, -1, 1.5)))),
        (
            ("shared_w2",),
            lambda a: a.update(shared_w13=torch.zeros(4, H, dtype=a["w13"].dtype), shared_w2=None),
        ),
    ]
    if S:
        corruptions += [
            (("shared_w2",), lambda a: a.update(shared_w2=a["shared_w2"][:, :-1])),
            (("shared_w13",), lambda a: a.update(shared_w13=a["shared_w13"][:-1])),
        ]
    if fp8:
        corruptions += [
            (("w13_scale",), lambda a: a.update(w13_scale=None)),
            (("w2_scale",), lambda a: a.update(w2_scale=a["w2_scale"][..., :0])),
            (("w13_scale",), lambda a: a.update(w13_scale=a["w13_scale"].double())),
        ]
    else:
        corruptions.append((("w13_scale",), lambda a: a.update(w13_scale=torch.ones(E, 2, 1))))
    names = corrupt(r, a, corruptions)
    return Case(f"moe broken {names[0]}", lambda: (dk.moe(**a, backend=backend),), names)


# Every op's generator, by the op's name: gen_<op> above (dinfer_kernels.ops.OPS lists the ops).
GENERATORS = {op: globals()[f"gen_{op}"] for op in OPS}


# ---- the tests ------------------------------------------------------------------------------------


def pairs():
    """(op, backend) for every backend that runs the op on host tensors here."""
    return [(op, b) for op in OPS for b in _backend.available_backends("cpu", op)]


@pytest.fixture(scope="module")
def compiled_layer_results():
    """Every cpu-backend pair, run in one child process: a crash in the compiled host kernels (or their
    bindings) shows up as its signal here instead of ending the test run."""
    ops = [op for op, b in pairs() if b == "cpu"]
    root = Path(__file__).resolve().parents[2]
    env = dict(
        os.environ,
        PYTHONFAULTHANDLER="1",
        PYTHONPATH=os.pathsep.join([str(root)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
    )
    proc = subprocess.run(
        [sys.executable, __file__, ",".join(ops), "cpu"],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=600,
    )
    assert proc.returncode == 0, (
        f"the fuzz child died (return code {proc.returncode}, a negative one is a "
        f"signal):\n{proc.stderr[-4000:]}"
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


RESULTS = {}
# The Triton interpreter runs the kernels in NumPy, which warns about the NaN / inf the cases feed it.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


@pytest.mark.parametrize("op,backend", pairs(), ids=[f"{o}-{b}" for o, b in pairs()])
def test_fuzz_op(op, backend, request):
    if backend == "cpu":
        res = request.getfixturevalue("compiled_layer_results")[op]
    else:
        res = fuzz(op, backend)
    RESULTS[(op, backend)] = res
    assert res["calls"] >= CALLS and res["valid"] > 0 and res["broken"] > 0
    assert not res["problems"], f"{len(res['problems'])} problems:\n" + "\n".join(res["problems"][:20])


# ---- the compiled layer: every (written, other) pair of a binding's arrays -------------------------

# The arrays each binding writes (attention's caches only with write_back).
WRITTEN = {
    "rms_norm": ("out",),
    "rope": ("out",),
    "moe": ("out",),
    "attention": ("out", "lse", "block_mass"),
    "decode_step": (
        "tokens",
        "credit_ids",
        "credit_vals",
        "candidate",
        "confidence",
        "commit",
        "nonfinite",
    ),
}


class Recorder:
    """Stands in for dinfer_kernels._C in a cpu backend module: runs each call and keeps it, with
    the capsules turned back into tensors, as (binding, {name: argument})."""

    def __init__(self, calls):
        self.calls = calls

    def __getattr__(self, binding):
        real = getattr(_backend.compiled(), binding)
        names = real.__doc__.split("(", 1)[1].split(")", 1)[0].replace("*, ", "").split(", ")
        names = [n.split(":")[0] for n in names]

        def call(*args, **kwargs):
            def tensor(a):
                return torch.utils.dlpack.from_dlpack(a) if type(a).__name__ == "PyCapsule" else a

            args = [tensor(a) for a in args]
            kwargs = {n: tensor(a) for n, a in kwargs.items()}  # optional arrays come by keyword
            self.calls.append((binding, {**dict(zip(names, args)), **kwargs}))
            return real(*args, **kwargs)

        return call


def recorded_calls(op, count, monkeypatch):
    """The _C calls behind `count` valid cpu-backend cases of op."""
    import importlib

    calls = []
    module = importlib.import_module(f"dinfer_kernels.cpu.{op.replace('_step', '')}")
    monkeypatch.setattr(module, "compiled", lambda: Recorder(calls))
    r = random.Random(f"{op}/recorded")
    while len(calls) < count:
        gen = GENERATORS[op](r, "cpu", FLOATS, True)
        gen.run()
    return calls


def overlapping_pair(a, b, r):
    """Copies of a and b (contiguous) in one byte buffer, b starting inside a's bytes."""
    a_bytes, b_bytes = a.numel() * a.element_size(), b.numel() * b.element_size()
    start = r.randrange(max(a_bytes // b.element_size(), 1)) * b.element_size()
    buf = torch.zeros(max(a_bytes, start + b_bytes), dtype=torch.uint8)
    a2 = buf[:a_bytes].view(a.dtype).view(a.shape)
    a2.copy_(a)
    b2 = buf[start : start + b_bytes].view(b.dtype).view(b.shape)
    b2.copy_(b)
    return a2, b2


@pytest.mark.skipif(_backend.compiled() is None, reason="dinfer_kernels._C was not built")
@pytest.mark.parametrize("op", sorted(WRITTEN))
def test_bindings_refuse_every_partial_overlap(op, monkeypatch):
    """For real host calls of each binding (recorded from the cpu backend), each written array in turn
    is placed inside the bytes of each other array: always a ValueError naming both. Exactly the
    input as output (rms_norm / rope's documented in-place call) gives the out-of-place result."""
    r = random.Random(f"{op}/overlap")
    tried = 0
    for binding, kw in recorded_calls(op, 12, monkeypatch):
        arrays = {n: t for n, t in kw.items() if isinstance(t, torch.Tensor) and t.numel()}
        written = [
            n for n in arrays if n in WRITTEN[op] or (kw.get("write_back") and n in ("k_cache", "v_cache"))
        ]
        for w in written:
            for other in arrays:
                if other == w:
                    continue
                host, inside = overlapping_pair(arrays[other], arrays[w], r)
                call = dict(kw, **{other: host, w: inside})
                with pytest.raises(ValueError, match="overlaps") as e:
                    getattr(_backend.compiled(), binding)(**call)
                assert {w, other} <= set(str(e.value).replace(":", " ").split()), str(e.value)
                tried += 1
        if op in ("rms_norm", "rope"):
            x = kw["x"].clone()
            getattr(_backend.compiled(), binding)(**dict(kw, out=x, x=x))
            assert identical(x, kw["out"])
    assert tried >= 12


ATTENDED_NON_FINITE = [b for b in ("cpu", "triton") if b in _backend.available_backends("cpu", "attention")]


@pytest.mark.parametrize("backend", ATTENDED_NON_FINITE)
def test_attention_non_finite_attended_values_propagate(backend):
    """NaN / inf in what a row attends reach its outputs, as the reference's docstring says, and
    nothing else (the fuzz suite puts them only where nothing is read)."""
    B, W, H, D, S = 1, 5, 1, 64, 6
    q, k, v = (torch.randn(B, W, H, D) for _ in range(3))
    k_cache, v_cache = torch.randn(B, S, H, D), torch.randn(B, S, H, D)
    attends = {0: [0, 1], 1: [0, 4], 2: [2, 3], 3: [2], 4: [3]}
    mask = torch.zeros(B, H, W, S, dtype=torch.bool)  # one query block per row, one key block per key
    for w, keys in attends.items():
        mask[0, 0, w, keys] = True
    q[0, 0, 0, 1] = float("nan")  # row 0: a NaN query
    k_cache[0, 4, 0, :] = float("inf")  # row 1 attends key 4, scored +-inf
    k_cache[0, S - 1], v_cache[0, S - 1] = float("nan"), float("nan")  # past seq_lens: never read
    v[0, 3, 0, 3] = float("inf")  # rows 2 and 4 read window row 3's value, column 3
    q[0, 4, 0, :] = float("nan")  # row 4 is padding: its NaN query is never read
    positions = torch.tensor([[0, 1, 2, 3, S - 1]])
    seq_lens = torch.tensor([S - 1], dtype=torch.int32)  # key S - 1 is padding, and so is row 4
    bm = dk.BlockMask.from_dense(mask, q_block=1, kv_block=1)
    args = (q, k, v, k_cache, v_cache, positions, seq_lens)
    kw = dict(block_mask=bm, return_lse=True, return_block_mass=True)
    want = attention_reference(*[a.clone() for a in args], **kw)
    truth = attention_reference(*[a.clone() for a in args], compute_dtype=torch.float64, **kw)
    got = dk.attention(*args, backend=backend, **kw)
    out, lse, mass = want
    assert out[0, :2].isnan().all() and lse[0, :2].isnan().all()  # the contract, in the reference
    assert out[0, 2, 0, 3].isinf() and out[0, 2].isfinite().sum() == D - 1 and out[0, 3].isfinite().all()
    assert torch.equal(out[0, 4], torch.zeros(H, D)) and lse[0, 4] == float("-inf")
    assert mass[0, 0, [0, 1, 4]].isnan().all() and mass[0, 0, [2, 3, 5]].isfinite().all()
    for name, g, w, t in zip(("out", "lse", "block_mass"), got, want, truth):
        assert disagreement(g, w, t) is None, f"{name}: {disagreement(g, w, t)}"


def test_fuzz_summary():
    """Prints the calls per pair (pytest -s shows it); every pair that ran made >= CALLS calls."""
    for (op, backend), res in sorted(RESULTS.items()):
        print(
            f"fuzz {op:15s} {backend:7s} {res['calls']:4d} calls ({res['valid']} valid, {res['broken']} broken), "
            f"{len(res['problems'])} problems"
        )
        assert res["calls"] >= CALLS


if __name__ == "__main__":
    # python tests/kernels/test_fuzz_ops.py OP[,OP...] BACKEND: the results as one JSON line.
    ops, backend = sys.argv[1].split(","), sys.argv[2]
    print(json.dumps({op: fuzz(op, backend) for op in ops}))
