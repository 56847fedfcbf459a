"""python -m dinfer_kernels selftest: every op on every backend available here against its reference.

Run it after installing. Each op runs through its public entry (the `backend=` switch) at a real shape
(vocabulary 157184, head dim 128, 64 experts top-8; the hidden sizes of the models on a GPU, smaller
on the host so the float64 truth stays cheap there), once per dtype the backend serves; attention
runs over contiguous caches and over the paged layout (outputs 2 and 3 of its row). The result is
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

from . import _backend, precision
from .ops.attention import attention
from .ops.decode import decode_step
from .ops.moe import moe
from .ops.rms_norm import rms_norm
from .ops.rope import rope
from .ops.soft_embedding import soft_embedding
from .reference.attention import attention_reference
from .reference.decode import decode_params, decode_step_reference
from .reference.moe import moe_reference
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
            "attention": dict(B=1, W=8, S=70, Hq=4, Hkv=2, D=64, page_size=16),
            "moe": dict(T=5, E=8, k=2, H=64, I=48),
        }
    gpu = torch.device(device).type == "cuda"
    return {
        "decode_step": dict(N=64, V=VOCAB),
        "soft_embedding": dict(M=32, V=VOCAB, d=2048 if gpu else 128),
        "rms_norm": dict(T=512, D=2048),
        "rope": dict(B=2, T=256, H=16, D=128),
        "attention": dict(B=2, W=32, S=4096 if gpu else 1024, Hq=16, Hkv=4, D=128, page_size=32),
        "moe": dict(T=64 if gpu else 16, E=64, k=8, H=2048 if gpu else 256, I=1024 if gpu else 128),
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
    z = torch.randn(N, V, device=device) * 3
    peaks = torch.arange(N, device=device) % 3 == 0  # a third of the rows confident in one token
    z[peaks, torch.randint(0, V, (int(peaks.sum()),), device=device)] += 20.0
    logits = z.to(dtype)
    mask_id = V // 2
    offsets = torch.tensor([0, N // 3, N], dtype=torch.int32, device=device)
    thr = torch.full((2,), 0.3, device=device)
    k = torch.zeros(2, dtype=torch.int32, device=device)
    outs, sames, truths, exact = [], [], [], {}
    for rule, masked_share in (("threshold", 0.7), ("joint", 0.5)):
        tokens = torch.randint(0, V, (N,), device=device)
        tokens[torch.rand(N, device=device) < masked_share] = mask_id
        edits = {}
        if rule == "joint":
            edits = dict(editable=torch.rand(N, device=device) < 0.7, edit_threshold=0.5)
        tok_b, tok_s, tok_t = tokens.clone(), tokens.clone(), tokens.clone()
        out = decode_step(logits, tok_b, offsets, mask_id, rule=rule, threshold=0.3, backend=backend, **edits)
        same = decode_step_reference(
            logits, tok_s, offsets, decode_params(mask_id, rule=rule, threshold=thr, num_commit=k, **edits)
        )
        truth = decode_step_reference(
            logits,
            tok_t,
            offsets,
            decode_params(mask_id, rule=rule, threshold=thr, num_commit=k, **edits),
            compute_dtype=F64,
        )
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
    logits = (torch.randn(M, V, device=device) * 3).to(dtype)
    emb = torch.randn(V, d, device=device).to(dtype)
    mask_id = V // 2
    tokens = torch.randint(0, V, (M,), device=device)
    tokens[torch.rand(M, device=device) < 0.5] = mask_id
    out = soft_embedding(logits, emb, tokens, mask_id, 0.3, backend=backend)
    same = soft_embedding_reference(logits, emb, tokens, mask_id, 0.3)
    truth = soft_embedding_reference(logits, emb.double(), tokens, mask_id, 0.3, compute_dtype=F64)
    return [out], [same], [truth], {}


def _rms_norm(backend, device, dtype, T, D):
    x = (torch.randn(T, D, device=device) * 3).to(dtype)
    w = (torch.rand(D, device=device) + 0.5).to(dtype)
    out = rms_norm(x, w, 1e-6, backend=backend)
    return [out], [rms_norm_reference(x, w, 1e-6)], [rms_norm_reference(x, w, 1e-6, compute_dtype=F64)], {}


def _rope(backend, device, dtype, B, T, H, D):
    x = torch.randn(B, T, H, D, device=device).to(dtype)
    pos = torch.randint(0, 32768, (B, T), device=device)
    out = rope(x, pos, 500000.0, backend=backend)
    return (
        [out],
        [rope_reference(x, pos, 500000.0)],
        [rope_reference(x, pos, 500000.0, compute_dtype=F64)],
        {},
    )


def _pool(cache, table, num_pages):
    """The cache [B, S, Hkv, D] laid out in a pool of num_pages pages through block_table [B, MP]."""
    B, S = cache.shape[:2]
    MP = table.shape[1]
    page_size = -(-S // MP)
    padded = cache.new_zeros(B, MP * page_size, *cache.shape[2:])
    padded[:, :S] = cache
    pool = cache.new_zeros(num_pages, page_size, *cache.shape[2:])
    pool[table.flatten().long()] = padded.view(B * MP, page_size, *cache.shape[2:])
    return pool


def _attention(backend, device, dtype, B, W, S, Hq, Hkv, D, page_size):
    """A window refreshed in place over contiguous caches, then the same call over a paged layout
    (pages of page_size rows in shuffled order in a pool with spare pages)."""
    r = lambda *s: torch.randn(*s, device=device).to(dtype)
    q, k, v, kc, vc = r(B, W, Hq, D), r(B, W, Hkv, D), r(B, W, Hkv, D), r(B, S, Hkv, D), r(B, S, Hkv, D)
    start = torch.randint(0, S - W + 1, (B,))
    pos = (start[:, None] + torch.arange(W)).to(device)  # a window refreshed in place
    extra = (torch.rand(B) * (S - W - start + 1)).long()  # keys past the window too
    lens = (start + W + extra).to(torch.int32).to(device)
    outs, sames, truths = [], [], []
    MP = -(-S // page_size)
    table = torch.randperm(B * MP + 3)[: B * MP].view(B, MP).to(torch.int32).to(device)
    pools = _pool(kc, table, B * MP + 3), _pool(vc, table, B * MP + 3)
    for caches, kw in (((kc, vc), {}), (pools, {"block_table": table})):
        kca, vca = caches
        out, lse = attention(
            q, k, v, kca.clone(), vca.clone(), pos, lens, return_lse=True, backend=backend, **kw
        )
        same = attention_reference(q, k, v, kca.clone(), vca.clone(), pos, lens, return_lse=True, **kw)
        truth = attention_reference(
            q, k, v, kca.clone(), vca.clone(), pos, lens, return_lse=True, compute_dtype=F64, **kw
        )
        outs += [out, lse]
        sames += list(same)
        truths += list(truth)
    return outs, sames, truths, {}


def _moe(backend, device, dtype, T, E, k, H, I):
    hidden = torch.randn(T, H, device=device).to(dtype)
    router = torch.randn(E, H, device=device) * 0.2
    w13 = (torch.randn(E, 2 * I, H, device=device) * 0.9 / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, device=device) * 0.9 / I**0.5).to(dtype)
    out = moe(hidden, router, w13, w2, k, backend=backend)
    same = moe_reference(hidden, router, w13, w2, k)
    truth = moe_reference(hidden.double(), router, w13.double(), w2.double(), k, compute_dtype=F64)
    return [out], [same], [truth], {}


CASES = {
    "decode_step": _decode,
    "soft_embedding": _soft_embedding,
    "rms_norm": _rms_norm,
    "rope": _rope,
    "attention": _attention,
    "moe": _moe,
}
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
