"""Microbenchmark of one decode step: dInfer's formulation vs dinfer_kernels.decode_step backends.

    python bench_kernels/bench_decode.py [--device cpu|cuda] [--rows 32,64,512] [--shapes 16x32]
                                         [--vocab 157184] [--dtype bf16] [--quick] [--json out.json]

For each N of --rows: bf16 logits [N, V] as one sequence (B = 1) whose block is the N positions, all
masked except every 16th; for each BxL of --shapes: B sequences of L rows each (N = B * L; the batched
engine's step, dInfer's [B, L, V] layout). Timed on the same logits (rotating copies on the GPU):
  dinfer-threshold   dInfer eager threshold decode (fp32 softmax over V, [1, N, V] layout)
  dinfer-credit      dInfer credit decode, dense fp32 credit [1, N, V], a steady iteration (k > 0)
  dinfer-compiled    torch.compile(dynamic=True) of dInfer's threshold rule (skipped if it fails)
  ours-threshold     dinfer_kernels.decode_step(rule="threshold", backend=b) for each available b
  ours-credit        the same with a CreditState of K = --slots slots (steady iteration)
  ours-joint         rule="joint" (LLaDA2.1's JointThreshold) on the same logits, with every other row
                     committed and editable, edit_threshold --edit-threshold: the threshold rule on
                     the masked half plus token-to-token edits of the committed half
  max(-1)            one logits.max(-1) pass: the bandwidth yardstick
and the bandwidth yardsticks of timing.py (copy, read-only kernel, datasheet HBM of the GPU).
Columns: median time, GB/s of logits read (N*V*itemsize / time), % of each yardstick,
speedup vs each dInfer baseline, time / max(-1) time, time / ours-threshold's on the same backend
(the cost of the credit and of the edits), and whether the step committed the same tokens as dInfer
(first step from the same state; ours-joint: as the torch reference, dInfer has no joint rule).
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout  # noqa: F401  (puts the checkout's dinfer and dinfer_kernels on sys.path)
import cli_options
import environment
import markdown_tables
import results_json
import timing
import torch

LLADA_MOE_VOCAB, LLADA_MOE_MASK = 157184, 156895
UNMASK_EVERY = 16


def make_inputs(N, V, dtype, device, seed=0):
    """Logits with a spread of confidences: z = 2*randn plus, on every other row, a peak of random
    height (so a realistic share of rows clears tau = 0.9). One position in UNMASK_EVERY is already
    decoded."""
    from dinfer_kernels import op_inputs

    a = op_inputs.decode_step_inputs(
        N,
        V,
        dtype=dtype,
        device=device,
        generator=torch.Generator(device="cpu").manual_seed(seed),
        mask_id=LLADA_MOE_MASK if V > LLADA_MOE_MASK else V - 1,
        masked_frac=1 - 1 / UNMASK_EVERY,
        scale=2.0,
        peak_rows=0.5,
        peak=(10.0, 25.0),  # p(top-1) from ~0.02 to ~1
    )
    return a["logits"], a["tokens"], a["mask_id"]


def joint_tokens(N, V, mask_id, seed=1):
    """The joint case's tokens: every other row committed (a random non-mask token), the rest
    masked; and the committed rows as the editable ones."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    committed = torch.arange(N) % 2 == 1
    tok = torch.randint(0, V - 1, (N,), generator=g)
    tok = tok + (tok >= mask_id).to(torch.int64)
    return torch.where(committed, tok, torch.full_like(tok, mask_id)), committed


def parse_shapes(rows, shapes):
    """[(B, N)]: one sequence per --rows entry, then the BxL entries of --shapes as N = B * L rows."""
    out = [(1, n) for n in rows]
    for item in str(shapes or "").split(","):
        if item.strip():
            b, sep, length = item.strip().lower().partition("x")
            if not sep or not b.isdigit() or not length.isdigit() or int(b) < 1 or int(length) < 1:
                raise SystemExit(f"--shapes: {item!r} is not BxL (sequences x rows), e.g. 16x32")
            out.append((int(b), int(b) * int(length)))
    return out


def shape_text(B, N):
    return f"N={N}" if B == 1 else f"B={B}x{N // B}"


def build_cases(N, V, args, device, notes, B=1):
    import dinfer_baseline as db

    import dinfer_kernels

    dtype = cli_options.torch_dtype(args.dtype)
    L = N // B  # rows per sequence
    logits0, tok0, mask_id = make_inputs(N, V, dtype, device)
    copies = timing.num_copies(logits0.numel() * logits0.element_size(), device)
    logits = [logits0] + [logits0.clone() for _ in range(copies - 1)]
    tok_init = tok0.unsqueeze(0).expand(copies, N).contiguous()
    tok = tok_init.clone()  # one row of tokens per rotating copy
    offsets = torch.arange(0, N + 1, L, dtype=torch.int32, device=device)
    tau = args.threshold

    joint0, editable = joint_tokens(N, V, mask_id)
    tokj_init = joint0.to(device).unsqueeze(0).expand(copies, N).contiguous()
    tokj = tokj_init.clone()
    editable = editable.to(device)

    def restore():
        tok.copy_(tok_init)

    def restore_joint():
        tokj.copy_(tokj_init)

    cases = []  # (key, label, backend, Case, kind) ; kind in threshold|credit|joint|yardstick

    def add(key, label, backend, fn, kind, setup=None, graph=True, restore=restore):
        cases.append(
            (
                key,
                label,
                backend,
                timing.Case(f"{label}[{backend}] {shape_text(B, N)}", fn, copies, restore, setup, graph),
                kind,
            )
        )

    add(
        "dinfer_thr",
        "dinfer-threshold",
        "eager",
        lambda i: db.dinfer_threshold_decode(logits[i].view(B, L, V), tok[i].view(B, L), mask_id, tau),
        "threshold",
    )

    dec = db.DinferCreditDecoder(mask_id, tau)
    add(
        "dinfer_credit",
        "dinfer-credit",
        "eager",
        lambda i: dec.decode(logits[i].view(B, L, V), tok[i].view(B, L), block=(0, L)),
        "credit",
        setup=dec.reset,
        graph=False,
    )  # host sync per call (dInfer's `if not has_mask`)

    if not args.no_compile:
        try:
            t0 = time.perf_counter()
            x = tok[0].clone().view(B, L)
            db.dinfer_threshold_decode_compiled(logits[0].view(B, L, V), x, mask_id, tau)
            timing.sync(device)
            notes.append(
                f"{shape_text(B, N)}: torch.compile of dInfer's threshold rule took "
                f"{time.perf_counter() - t0:.1f}s (first call)"
            )
            add(
                "dinfer_compiled",
                "dinfer-compiled",
                "inductor",
                lambda i: db.dinfer_threshold_decode_compiled(
                    logits[i].view(B, L, V), tok[i].view(B, L), mask_id, tau
                ),
                "threshold",
            )
        except Exception as e:
            notes.append(
                f"dinfer-compiled skipped: torch.compile failed ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:120] if str(e) else ''})"
            )
            torch._dynamo.reset()

    backends = [
        b
        for b in dinfer_kernels.available_backends(device)
        if not args.backends or b in args.backends.split(",")
    ]
    if "torch" in backends and device == "cuda" and not args.backends:
        backends.remove("torch")  # the reference itself: per-row Python loops, not a kernel
        notes.append("backend torch (the pure-torch reference) not timed on cuda; --backends torch to add")
    for be in backends:
        thr = torch.full((B,), tau, dtype=torch.float32, device=device)
        add(
            f"ours_thr_{be}",
            "ours-threshold",
            be,
            lambda i, be=be, thr=thr: dinfer_kernels.decode_step(
                logits[i], tok[i], offsets, mask_id, rule="threshold", threshold=thr, backend=be
            ),
            "threshold",
        )
        cs = dinfer_kernels.CreditState.empty(N, slots=args.slots, device=device)
        add(
            f"ours_credit_{be}",
            "ours-credit",
            be,
            lambda i, be=be, thr=thr, cs=cs: dinfer_kernels.decode_step(
                logits[i], tok[i], offsets, mask_id, rule="threshold", threshold=thr, credit=cs, backend=be
            ),
            "credit",
            setup=cs.reset_,
        )
        add(
            f"ours_joint_{be}",
            "ours-joint",
            be,
            lambda i, be=be, thr=thr: dinfer_kernels.decode_step(
                logits[i],
                tokj[i],
                offsets,
                mask_id,
                rule="joint",
                threshold=thr,
                editable=editable,
                edit_threshold=args.edit_threshold,
                backend=be,
            ),
            "joint",
            restore=restore_joint,
        )

    add("max", "max(-1)", "torch", lambda i: logits[i].max(-1), "yardstick")
    return cases, dict(
        logits=logits,
        tok=tok,
        tok_init=tok_init,
        tokj=tokj,
        tokj_init=tokj_init,
        editable=editable,
        offsets=offsets,
        mask_id=mask_id,
        tau=tau,
        dec=dec,
    )


def joint_reference(state, edit_threshold):
    """The tokens after one joint step of the torch reference (on the host) from the joint state."""
    from dinfer_kernels.reference import decode_params, decode_step_reference

    tokens = state["tokj_init"][0].cpu().clone()
    decode_step_reference(
        state["logits"][0].cpu(),
        tokens,
        state["offsets"].cpu(),
        decode_params(
            state["mask_id"],
            rule="joint",
            threshold=torch.full((state["offsets"].numel() - 1,), state["tau"]),
            editable=state["editable"].cpu(),
            edit_threshold=edit_threshold,
        ),
    )
    return tokens


def agreement(cases, state, edit_threshold):
    """Runs each case once from the restored state; compares the committed tokens to dInfer's (the
    joint rule's to the torch reference's)."""
    ref = {"joint": joint_reference(state, edit_threshold)}
    res = {}
    for key, _, _, case, kind in cases:
        if kind == "yardstick":
            continue
        if case.setup is not None:
            case.setup()
        case.restore()
        case.fn(0)
        tok, init = ("tokj", "tokj_init") if kind == "joint" else ("tok", "tok_init")
        got = state[tok][0].clone()
        if key in ("dinfer_thr", "dinfer_credit"):
            ref[kind] = got
        base = ref.get(kind)
        res[key] = None if base is None else ("yes" if torch.equal(got.cpu(), base.cpu()) else "NO")
        n_commit = int((got != state[init][0]).sum())
        res[key + "_commits"] = n_commit
    return res


def run(args):
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU visible")
    rows = cli_options.parse_ints(args.rows) if args.rows else ([32, 512] if args.quick else [32, 64, 512])
    shapes = parse_shapes(rows, args.shapes)
    V = args.vocab
    notes = []
    env = environment.environment(device)
    print(
        f"# bench_decode  device={device} ({env.get('gpu') or env['cpu']})  V={V}  dtype={args.dtype}  "
        f"shapes={[shape_text(b, n) for b, n in shapes]}  commit={env['commit']}"
    )
    if device == "cpu" and env["loadavg_1min"] > 0.5 * (os.cpu_count() or 1):
        notes.append(
            f"busy host: 1-min load average {env['loadavg_1min']} on {os.cpu_count()} CPUs; "
            "CPU times are noisy (OMP_NUM_THREADS=1 steadies them)"
        )
    bw = timing.bandwidth_yardsticks(device, quick=args.quick)
    print(f"bandwidth: {timing.bandwidth_text(bw)}")

    results, tables = [], []
    for B, N in shapes:
        cases, state = build_cases(N, V, args, device, notes, B)
        agree = agreement(cases, state, args.edit_threshold)
        itemsize = state["logits"][0].element_size()
        nbytes = N * V * itemsize
        rows_out = []
        for key, label, be, case, kind in cases:
            try:
                m = timing.measure(case, device, quick=args.quick, reps=args.reps)
            except Exception as e:
                print(f"  {label}[{be}]: FAILED ({type(e).__name__}: {e})")
                notes.append(f"{shape_text(B, N)} {label}[{be}] failed: {type(e).__name__}: {str(e)[:160]}")
                rows_out.append(
                    dict(N=N, seqs=B, key=key, method=label, backend=be, kind=kind, error=str(e)[:300])
                )
                continue
            if m["note"]:
                notes.append(f"{shape_text(B, N)} {label}[{be}]: {m['note']}")
            r = dict(
                N=N,
                seqs=B,
                V=V,
                dtype=args.dtype,
                key=key,
                method=label,
                backend=be,
                kind=kind,
                timer=m["timer"],
                median_s=m["median_s"],
                p20_s=m["p20_s"],
                p80_s=m["p80_s"],
                us=m["median_s"] * 1e6,
                GBps=nbytes / m["median_s"] / 1e9,
                agree=agree.get(key),
                commits=agree.get(key + "_commits"),
            )
            r.update(timing.bandwidth_percents(r["GBps"], bw))
            rows_out.append(r)
            print(f"  {label:17s} {be:9s} {r['us']:10.1f} us  {r['GBps']:8.1f} GB/s  ({m['timer']})")
        by = {r["key"]: r for r in rows_out if "median_s" in r}
        for r in rows_out:
            if "median_s" not in r:
                continue
            for base, col in (
                ("dinfer_thr", "x_thr"),
                ("dinfer_credit", "x_credit"),
                ("dinfer_compiled", "x_compiled"),
            ):
                r[col] = by[base]["median_s"] / r["median_s"] if base in by else None
            r["per_max"] = r["median_s"] / by["max"]["median_s"] if "max" in by else None
            thr_key = f"ours_thr_{r['backend']}"
            r["per_thr"] = (
                r["median_s"] / by[thr_key]["median_s"]
                if r["key"].startswith("ours_") and thr_key in by
                else None
            )
        results += rows_out
        layout = f"N = {N} rows" if B == 1 else f"B = {B} sequences x {N // B} rows (N = {N})"
        title = (
            f"{layout}, V = {V}, {args.dtype} logits ({nbytes / 1e6:.1f} MB), {device}"
            f" ({env.get('gpu') or env['cpu']}); {timing.bandwidth_text(bw)}"
        )
        cols = [
            ("method", "method", None),
            ("backend", "backend", None),
            ("median µs", "us", ".1f"),
            ("GB/s", "GBps", ".1f"),
            *timing.BANDWIDTH_COLUMNS,
            ("× dInfer thr", "x_thr", ".2f"),
            ("× dInfer credit", "x_credit", ".2f"),
            ("× compiled", "x_compiled", ".2f"),
            ("÷ max(-1)", "per_max", ".2f"),
            ("÷ ours thr", "per_thr", ".2f"),
            ("same tokens", "agree", None),
            ("commits", "commits", None),
            ("timer", "timer", None),
        ]
        table = f"**{title}**\n\n" + markdown_tables.markdown_table(
            [r for r in rows_out if "median_s" in r], cols
        )
        print("\n" + table + "\n")
        tables.append(table)
        del cases, state
        if device == "cuda":
            torch.cuda.empty_cache()

    return results_json.finish("decode", env, args, bw, results, tables, notes)


def main(argv=None):
    p = cli_options.base_parser(__doc__.splitlines()[0])
    p.add_argument("--rows", default=None, help="comma-separated N (default 32,64,512; --quick 32,512)")
    p.add_argument(
        "--shapes",
        default=None,
        help="comma-separated BxL: B sequences of L rows each (the batched step), after the --rows cases",
    )
    p.add_argument("--vocab", type=int, default=LLADA_MOE_VOCAB)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--slots", type=int, default=16, help="credit slots K of our CreditState")
    p.add_argument(
        "--edit-threshold", type=float, default=0.5, help="edit_threshold of ours-joint (JOINT_QUALITY's)"
    )
    p.add_argument("--backends", default=None, help="comma-separated subset of our backends")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
