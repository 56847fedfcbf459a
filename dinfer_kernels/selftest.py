"""python -m dinfer_kernels selftest: every op on every backend available here against its reference.

Run it after installing. Each op runs through its public entry (the `backend=` switch) at a real shape
(vocabulary 157184, head dim 128, the MoE layers of LLaDA-MoE (64 experts top-8) and LLaDA2-mini (256
experts top-8, grouped sigmoid routing, a shared expert); the hidden sizes of the models on a GPU,
smaller on the host so the float64 truth stays cheap there), once per dtype the backend serves;
attention runs over contiguous caches and over the paged layout (outputs 2 and 3 of its row), moe at
both layers with the weights in the dtype and in FP8 (outputs 0-1 and 2-3). The result is
held to the precision-tied bound of dinfer_kernels.precision (the error against a float64 truth at
most twice that of the torch reference run in the same dtype); outputs that are integers or masks
must equal the reference's (decode_step's row holds two calls: rule="threshold", and rule="joint" on
half-committed rows, with token-to-token edits of the editable ones). One table; the exit status is 1
if any row fails.

Without a GPU the Triton kernels can only run in the interpreter, which is far too slow at real shapes:
with --quick every shape is small and the interpreter rows run (in fp32: its bf16 arithmetic is not
trustworthy), without it they are skipped with a line saying so.
"""

import argparse
import json
import os
import time
import warnings

import torch

from . import _backend, op_inputs, precision
from .ops import OPS
from .ops.attention import attention
from .ops.decode import decode_step
from .ops.moe import moe
from .ops.qk_rope import qk_rope
from .ops.rms_norm import rms_norm
from .ops.rope import rope
from .ops.soft_embedding import soft_embedding
from .reference.attention import attention_reference
from .reference.decode import decode_params, decode_step_reference
from .reference.moe import moe_reference
from .reference.qk_rope import qk_rope_reference
from .reference.rms_norm import rms_norm_reference
from .reference.rope import rope_reference
from .reference.soft_embedding import soft_embedding_reference

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
VOCAB = 157184


def _shapes(device, quick):
    """Per op the sizes one call runs at. On the host the hidden sizes shrink (the float64 truth of a
    2048-wide MoE layer alone is gigabytes), never the dimensions named in the module docstring."""
    if quick:
        return {
            "decode_step": dict(N=5, V=1000),
            "soft_embedding": dict(M=5, V=1000, d=48),
            "rms_norm": dict(T=7, D=96),
            "rope": dict(B=1, T=9, H=2, D=64),
            "qk_rope": dict(B=1, T=9, Hq=4, Hk=2, D=64),
            "attention": dict(B=1, W=8, S=70, Hq=4, Hkv=2, D=64, page_size=16),
            "moe": dict(T=5, H=64, llada_moe=(8, 2, 48), llada2_mini=(16, 4, 16, 24)),
        }
    gpu = torch.device(device).type == "cuda"
    return {
        "decode_step": dict(N=64, V=VOCAB),
        "soft_embedding": dict(M=32, V=VOCAB, d=2048 if gpu else 128),
        "rms_norm": dict(T=512, D=2048),
        "rope": dict(B=2, T=256, H=16, D=128),
        "qk_rope": dict(B=2, T=256, Hq=16, Hk=4, D=128),
        "attention": dict(B=2, W=32, S=4096 if gpu else 1024, Hq=16, Hkv=4, D=128, page_size=32),
        "moe": dict(
            T=64 if gpu else 16,
            H=2048 if gpu else 256,
            llada_moe=(64, 8, 1024 if gpu else 128),
            llada2_mini=(256, 8, 512, 512) if gpu else (256, 8, 64, 64),
        ),
    }


def _dtypes(backend, device):
    if torch.device(device).type == "cuda":
        return [BF16, F16] if backend == "cuda" else [BF16]
    if backend == "triton":
        return [F32]  # the interpreter's bf16 arithmetic is not trustworthy
    return [F32, BF16]


# Each case builder returns (out, same, truth, exact): the backend's floating output, the same-precision
# reference, the float64 truth, and {name: (backend's, reference's)} outputs that must be equal.


def _decode(backend, device, dtype, N, V):
    outs, sames, truths, exact = [], [], [], {}
    thr = torch.full((2,), 0.3, device=device)
    k = torch.zeros(2, dtype=torch.int32, device=device)
    for rule, masked_share in (("threshold", 0.7), ("joint", 0.5)):
        # a third of the rows confident in one token
        a = op_inputs.decode_step_inputs(
            N,
            V,
            dtype=dtype,
            device=device,
            seq_offsets=[0, N // 3, N],
            masked_frac=masked_share,
            peak_rows=1 / 3,
        )
        edits = {}
        if rule == "joint":
            edits = dict(editable=torch.rand(N, device=device) < 0.7, edit_threshold=0.5)
        tokens = a.pop("tokens")
        tok_b, tok_s, tok_t = tokens.clone(), tokens.clone(), tokens.clone()
        out = decode_step(tokens=tok_b, **a, rule=rule, threshold=0.3, backend=backend, **edits)
        params = decode_params(a["mask_id"], rule=rule, threshold=thr, num_commit=k, **edits)
        same = decode_step_reference(a["logits"], tok_s, a["seq_offsets"], params)
        truth = decode_step_reference(a["logits"], tok_t, a["seq_offsets"], params, compute_dtype=F64)
        outs.append(out.confidence)
        sames.append(same.confidence)
        truths.append(truth.confidence)
        exact.update(
            {
                f"{rule} candidate": (out.candidate, same.candidate),
                f"{rule} commit": (out.commit, same.commit),
                f"{rule} tokens": (tok_b, tok_s),
            }
        )
    return outs, sames, truths, exact


def _soft_embedding(backend, device, dtype, M, V, d):
    a = op_inputs.soft_embedding_inputs(M, V, d, dtype=dtype, device=device)
    out = soft_embedding(**a, backend=backend)
    same = soft_embedding_reference(**a)
    truth = soft_embedding_reference(**dict(a, embedding=a["embedding"].double()), compute_dtype=F64)
    return [out], [same], [truth], {}


def _rms_norm(backend, device, dtype, T, D):
    a = op_inputs.rms_norm_inputs((T, D), dtype=dtype, device=device)
    out = rms_norm(**a, backend=backend)
    return [out], [rms_norm_reference(**a)], [rms_norm_reference(**a, compute_dtype=F64)], {}


def _rope(backend, device, dtype, B, T, H, D):
    a = op_inputs.rope_inputs(B, T, H, D, dtype=dtype, device=device)
    out = rope(**a, backend=backend)
    return [out], [rope_reference(**a)], [rope_reference(**a, compute_dtype=F64)], {}


def _qk_rope(backend, device, dtype, B, T, Hq, Hk, D):
    """LLaDA2's call: half the head dim rotates, QK-norm fused."""
    a = op_inputs.qk_rope_inputs(B, T, Hq, Hk, D, rotary_dim=D // 2, dtype=dtype, device=device)
    out = qk_rope(**a, backend=backend)
    return list(out), list(qk_rope_reference(**a)), list(qk_rope_reference(**a, compute_dtype=F64)), {}


def _attention(backend, device, dtype, B, W, S, Hq, Hkv, D, page_size):
    """A window refreshed in place over contiguous caches, then one over a paged layout (pages of
    page_size rows in shuffled order in a pool with spare pages)."""
    outs, sames, truths = [], [], []
    for pages in (None, page_size):
        a = op_inputs.attention_inputs(B, W, S, Hq, Hkv, D, dtype=dtype, device=device, page_size=pages)
        caches = lambda: dict(k_cache=a["k_cache"].clone(), v_cache=a["v_cache"].clone())
        out, lse = attention(**dict(a, **caches()), return_lse=True, backend=backend)
        same = attention_reference(**dict(a, **caches()), return_lse=True)
        truth = attention_reference(**dict(a, **caches()), return_lse=True, compute_dtype=F64)
        outs += [out, lse]
        sames += list(same)
        truths += list(truth)
    return outs, sames, truths, {}


# LLaDA2's router: sigmoid scores with an expert bias that only chooses, 4 of 8 expert groups kept,
# renormalised and scaled weights
LLADA2_ROUTING = dict(scoring="sigmoid", renormalize=True, num_groups=8, topk_groups=4, routed_scaling=2.5)


def _moe(backend, device, dtype, T, H, llada_moe, llada2_mini):
    """Both released layers: LLaDA-MoE's (E, k, I = llada_moe; softmax top-k) and LLaDA2-mini's
    (E, k, I, S = llada2_mini; LLADA2_ROUTING, a drawn expert bias and a shared expert of width S in
    the same call), each with expert weights in the dtype (outputs 0 and 1) and in FP8 with 128 x 128
    block scales (outputs 2 and 3). The float64 truth runs on the same FP8 values, dequantised exactly."""
    outs, sames, truths = [], [], []
    for fp8 in (False, True):
        for (E, k, I, *S), routing in ((llada_moe, {}), (llada2_mini, LLADA2_ROUTING)):
            shared = dict(shared_inter=S[0], bias_scale=0.1, router_scale=H**-0.5) if S else {}
            a = op_inputs.moe_inputs(T, E, H, I, k, dtype=dtype, device=device, fp8=fp8, **shared)
            a.update(routing)
            outs.append(moe(**a, backend=backend))
            sames.append(moe_reference(**a))
            wide = ("hidden",) if fp8 else ("hidden", "w13", "w2", "shared_w13", "shared_w2")
            truth = dict(a, **{n: a[n].double() for n in wide if n in a})
            truths.append(moe_reference(**truth, compute_dtype=F64))
    return outs, sames, truths, {}


# Every op's case, by the op's name: _<op> above, or _decode for decode_step (its module's name).
CASES = {op: globals()[f"_{module}"] for op, module in OPS.items()}
DTYPE_NAMES = {F32: "fp32", F16: "fp16", BF16: "bf16"}


def _check(op, backend, device, dtype, shape):
    """One row of the table."""
    row = {
        "op": op,
        "backend": backend,
        "device": str(device),
        "dtype": DTYPE_NAMES[dtype],
        "shape": " ".join(f"{k}={v}" for k, v in shape.items()),
    }
    t0 = time.perf_counter()
    try:
        outs, sames, truths, exact = CASES[op](backend, device, dtype, **shape)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        problems, errors = [], []
        for i, (o, s, t) in enumerate(zip(outs, sames, truths)):
            if o.dtype != s.dtype or o.shape != s.shape:
                problems.append(f"output {i}: {o.dtype}{list(o.shape)}, expected {s.dtype}{list(s.shape)}")
                continue
            ok, msg, err, bnd = precision.within_precision(o.cpu(), s.cpu(), t.cpu())
            if not ok:
                problems.append(f"output {i}: {msg}")
            errors.append((err, bnd))
        # the output closest to its bound is the one reported
        worst, limit = max(
            errors, key=lambda e: e[0] / e[1] if e[1] > 0 else float("inf"), default=(None, None)
        )
        for name, (a, b) in exact.items():
            if not torch.equal(a.cpu(), b.cpu()):
                problems.append(
                    f"{name}: differs from the reference in {int((a.cpu() != b.cpu()).sum())} places"
                )
        row.update(max_error=worst, bound=limit, ok=not problems, note="; ".join(problems))
    except Exception as e:
        row.update(
            max_error=None, bound=None, ok=False, note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        )
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def plan(quick=False, devices=None):
    """(op, backend, device, dtype, shape) rows to run, and the skip lines for what cannot run here."""
    if devices is None:
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows, skipped = [], []
    for device in devices:
        shapes = _shapes(device, quick)
        for op in CASES:
            for backend in _backend.available_backends(device, op):
                for dtype in _dtypes(backend, device):
                    rows.append((op, backend, device, dtype, shapes[op]))
            if (
                device == "cpu"
                and _backend.triton_version()
                and "triton" in _backend.implemented(op)
                and "triton" not in _backend.available_backends(device, op)
            ):
                skipped.append(
                    f"{op} triton on cpu: the interpreter is too slow at real shapes "
                    "(--quick runs it at small ones)"
                )
    return rows, skipped


def format_table(rows):
    cols = ["op", "backend", "device", "dtype", "shape", "max error", "bound", "ok", "seconds"]
    cells = [
        [
            r["op"],
            r["backend"],
            r["device"],
            r["dtype"],
            r["shape"],
            "-" if r["max_error"] is None else f"{r['max_error']:.3g}",
            "-" if r["bound"] is None else f"{r['bound']:.3g}",
            "ok" if r["ok"] else "FAIL",
            f"{r['seconds']:.2f}",
        ]
        for r in rows
    ]
    widths = [max(len(c), *(len(x[i]) for x in cells)) if cells else len(c) for i, c in enumerate(cols)]
    line = lambda xs: "  ".join(x.ljust(w) for x, w in zip(xs, widths)).rstrip()
    out = [line(cols), line(["-" * w for w in widths])] + [line(x) for x in cells]
    out += [
        f"FAIL {r['op']} {r['backend']} {r['device']} {r['dtype']}: {r['note']}" for r in rows if not r["ok"]
    ]
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m dinfer_kernels selftest", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--quick", action="store_true", help="small shapes; runs the Triton interpreter without a GPU"
    )
    ap.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        action="append",
        help="only this device (repeatable; default: cpu and, when present, cuda)",
    )
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    if args.quick and not torch.cuda.is_available():
        # Triton is imported only when a kernel first runs: the interpreter can still be chosen here.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        # numpy's warnings on the interpreter's masked-off lanes (log 0, 0/0): not results
        warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.")
    if args.device and "cuda" in args.device and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU is visible")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    todo, skipped = plan(args.quick, args.device)
    rows = []
    for x in todo:
        rows.append(_check(*x))
        _write_json(args.json, rows, skipped, args.quick, complete=False)  # a run cut short keeps its rows
    _write_json(args.json, rows, skipped, args.quick, complete=True)
    print(format_table(rows))
    for s in skipped:
        print(f"skipped: {s}")
    failed = sum(not r["ok"] for r in rows)
    print(f"selftest: {len(rows) - failed}/{len(rows)} ok in {time.perf_counter() - t0:.1f}s")
    return 1 if failed or not rows else 0


def _write_json(path, rows, skipped, quick, complete):
    if not path:
        return
    with open(f"{path}.tmp", "w") as f:
        json.dump({"rows": rows, "skipped": skipped, "quick": quick, "complete": complete}, f, indent=1)
    os.replace(f"{path}.tmp", path)
