"""Microbenchmark of window attention with partial KV refresh: dInfer's formulation (SDPA after an
out-of-place slice_scatter merge of the window into the cache), FlexAttention with the same block mask,
and dinfer_kernels.attention backends; and LLaDA2's block decoding over a paged KV cache.

    python bench_kernels/bench_attention.py [--device cpu|cuda] [--dtype bf16|fp16|fp32] [--quick]
        [--json out.json] [--windows 1024,2048,4096,8192] [--refresh 2048,8192] [--densities 1,0.5]
        [--heads 16] [--kv-heads 16] [--head-dim 128] [--backends triton,cuda] [--no-flex]
        [--paged-prefixes 1024,2048,4096,8192] [--page-size 32] [--no-paged | --paged-only]
        [--batches 32,64] [--batched-rows 32] [--batched-keys 2048,8192] [--no-batched]

LLaDA-MoE shapes by default (B = 1, 16 heads x 128, MHA): window steps W = 96 rows (a vicinity window
in the middle of the sequence) over S in --windows, and full refreshes W = S in --refresh; key-block
densities in --densities (1 = every block; 0.5 = a random half of the 128-key blocks per head and
query block). --quick on the GPU: S = 1k, 4k, 8k windows and the 2k / 8k refreshes; on the CPU
(default there) small shapes (4 heads x 64, W = 16, S = 256 / 1024, refresh 256).
Methods:
  sdpa+merge     k = k_cache.slice_scatter(k_win, ...) (a whole-cache copy per call, as dInfer), then
                 F.scaled_dot_product_attention over [B, H, S, D]; dense bool mask when density < 1
  flex+merge     the same merge, then torch.compile(flex_attention) with the same block mask (skipped
                 where torch lacks it; on the CPU only with --flex)
  ours wb / ro   dinfer_kernels.attention(write_back=True / False, block_mask=...) per backend
Measured in the same run: the bandwidth yardsticks of timing.py (copy, read-only kernel; beside the
GPU's datasheet HBM) and the dense matmul rate of the dtype. Columns: median time, TFLOP/s over the
attended (row, key) pairs (4 * Hq * D per pair), % of the matmul rate and of the datasheet's dense bf16
rate, GB/s over the K/V bytes of the attended key blocks, % of each bandwidth yardstick,
speedup vs sdpa+merge, and max |out - sdpa| / max |sdpa|.

Paged (first; --no-paged skips it, --paged-only runs nothing else): LLaDA2-mini shapes (16 query / 4 KV
heads x 128, --paged-heads / --paged-kv-heads / --paged-head-dim), one sequence decoding a block of 32
query rows (--paged-block) after a prefix of --paged-prefixes keys (default 1k, 2k, 4k, 8k; --quick:
1k and 8k on the GPU, 1k on the CPU). Methods:
  sdpa dense-mask  what a peer without paged kernels runs: the block's K/V written in place into a
                   contiguous [B, Hkv, S, D] cache (S = prefix + block), then SDPA over it with the
                   dense [W, S] bool block-causal mask (GQA through enable_gqa)
  ours paged       dinfer_kernels.attention(write_back=True) over page pools of --page-size rows
                   (shuffled page ids, 1/8 spare pages) through a block table, with
                   BlockMask.block_causal(q_block = kv_block = block), per backend available
  ours contiguous  the same call over the contiguous [B, S, Hkv, D] cache (the paging's own cost)
Columns: median time, the ratio sdpa / ours (> 1: ours is faster), max |out - sdpa| / max |sdpa|.

Full refreshes (W = S) add: "sdpa alone" (the SDPA kernel on the merged cache, no merge copy: the
bar of the delegated refresh), "ours wb" with the delegation off (our kernel alone) and "ours+sdpa"
(dinfer_kernels.attention_sdpa.mode("always"): the dense key prefix to torch's SDPA, the rest ours).
The backend column names the SDPA kernel: torch's own choice for F.scaled_dot_product_attention
(torch._fused_sdp_choice), the aten op the delegation ran for ours+sdpa ("none (declined)": nothing
delegated, e.g. a half-precision call with blocks past the dense prefix).

Batched window steps (--no-batched skips them): B sequences (--batches; GPU 32,64, --quick 32; CPU 2)
each refreshing W = --batched-rows (32) rows in the middle of S = --batched-keys (GPU 2048,8192; CPU
256) keys, every key attended, with the window heads. Methods: "sdpa in place" (the window written
into a contiguous [B, Hkv, S, D] cache, then SDPA, kernel named), "ours" (contiguous caches) and
"ours paged" (one shared page pool of --page-size rows, shuffled pages) per backend. Columns: median
time, GB/s over the K/V bytes (every key read once) and % of each bandwidth yardstick, sdpa / ours.
"""

import contextlib
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
import torch.nn.functional as F

from dinfer_kernels import attention_sdpa

Q_BLOCK = KV_BLOCK = 128


def flex_available():
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401

        return True
    except ImportError:
        return False


def sdpa_kernel_name(q, k, v, mask=None, enable_gqa=False):
    """Which kernel F.scaled_dot_product_attention runs for these [B, H, L, D] inputs (torch's own
    choice, torch._fused_sdp_choice), e.g. "CUDNN_ATTENTION"; "?" where this torch cannot say."""
    try:
        from torch.nn.attention import SDPBackend

        return SDPBackend(int(torch._fused_sdp_choice(q, k, v, mask, 0.0, False, enable_gqa=enable_gqa))).name
    except Exception:
        return "?"


def make_inputs(W, S, Hq, Hkv, D, density, dtype, device, q_block, kv_block, seed=0):
    import dinfer_kernels as dk
    from dinfer_kernels import op_inputs

    g = torch.Generator().manual_seed(seed)
    a = op_inputs.attention_inputs(1, W, S, Hq, Hkv, D, dtype=dtype, device=device, generator=g)
    start = 0 if W >= S else (S - W) // 2 // 32 * 32
    pos = (start + torch.arange(W))[None].to(device)
    lens = torch.tensor([S], dtype=torch.int32, device=device)
    nqb, nkb = -(-W // q_block), -(-S // kv_block)
    if density >= 1.0:
        dense = torch.ones(1, Hkv, nqb, nkb, dtype=torch.bool)
    else:
        dense = torch.rand(1, Hkv, nqb, nkb, generator=g) < density
        dense[..., 0] = True  # every list non-empty
    bm = dk.BlockMask.from_dense(dense.to(device), q_block, kv_block)
    return dict(
        q=a["q"],
        k=a["k"],
        v=a["v"],
        kc=a["k_cache"],
        vc=a["v_cache"],
        pos=pos,
        lens=lens,
        start=start,
        bm=bm,
        dense=dense.to(device),
    )


def attended_pairs(dense, W, S, Hq, Hkv, q_block, kv_block):
    """sum over query heads and rows of the number of attended keys (exact, with ragged last blocks)."""
    d = dense[0].cpu().double()  # [Hkv, NQB, NKB]
    rows = torch.tensor([min(q_block, W - j * q_block) for j in range(d.shape[1])], dtype=torch.float64)
    keys = torch.tensor([min(kv_block, S - i * kv_block) for i in range(d.shape[2])], dtype=torch.float64)
    return float((d * rows[None, :, None] * keys[None, None, :]).sum()) * (Hq // Hkv)


def kv_bytes(dense, S, Hkv, D, itemsize, kv_block):
    d = dense[0].cpu().any(1).double()  # [Hkv, NKB]: read at least once
    keys = torch.tensor([min(kv_block, S - i * kv_block) for i in range(d.shape[1])], dtype=torch.float64)
    return float((d * keys[None, :]).sum()) * 2 * D * itemsize


def build_cases(W, S, density, args, device, notes, flex_state):
    import dinfer_kernels as dk

    dtype = cli_options.torch_dtype(args.dtype)
    Hq, Hkv, D = args.heads, args.kv_heads, args.head_dim
    x = make_inputs(W, S, Hq, Hkv, D, density, dtype, device, Q_BLOCK, KV_BLOCK)
    per_copy = 2 * S * Hkv * D * x["kc"].element_size()
    copies = timing.num_copies(per_copy, device)
    kcs = [x["kc"]] + [x["kc"].clone() for _ in range(copies - 1)]
    vcs = [x["vc"]] + [x["vc"].clone() for _ in range(copies - 1)]
    # dInfer's layout: [B, H, S, D] caches, window merged out of place every call
    kct = [t.transpose(1, 2).contiguous() for t in kcs]
    vct = [t.transpose(1, 2).contiguous() for t in vcs]
    qt, kt, vt = (x[n].transpose(1, 2) for n in ("q", "k", "v"))
    st = x["start"]
    group = Hq // Hkv
    mask = None
    if density < 1.0:
        # dense [1, Hq, W, S] bool mask from the block mask
        qb = torch.arange(W, device=device) // Q_BLOCK
        kb = torch.arange(S, device=device) // KV_BLOCK
        mask = x["dense"][:, :, qb][:, :, :, kb].repeat_interleave(group, 1)

    def sdpa(i):
        k_all = kct[i].slice_scatter(kt, dim=2, start=st, end=st + W)
        v_all = vct[i].slice_scatter(vt, dim=2, start=st, end=st + W)
        return F.scaled_dot_product_attention(
            qt, k_all, v_all, attn_mask=mask, enable_gqa=group > 1
        ).transpose(1, 2)

    sdpa_name = sdpa_kernel_name(qt, kct[0], vct[0], mask, group > 1)
    cases = [
        (
            "sdpa",
            "sdpa+merge",
            f"torch {sdpa_name}",
            timing.Case(f"sdpa+merge W={W} S={S} d={density}", sdpa, copies),
        )
    ]
    if W == S:
        # the SDPA kernel alone on caches merged beforehand (no merge copy): the delegated refresh's bar
        merged = [(kt.contiguous(), vt.contiguous()) for _ in range(copies)]  # W = S: the window is all

        def sdpa_alone(i):
            return F.scaled_dot_product_attention(
                qt, *merged[i], attn_mask=mask, enable_gqa=group > 1
            ).transpose(1, 2)

        cases.append(
            (
                "sdpa_alone",
                "sdpa alone",
                f"torch {sdpa_name}",
                timing.Case(f"sdpa alone W={W} S={S} d={density}", sdpa_alone, copies),
            )
        )

    if flex_state["on"]:
        try:
            from torch.nn.attention.flex_attention import BlockMask as FlexBlockMask
            from torch.nn.attention.flex_attention import flex_attention

            if flex_state.get("fn") is None:
                flex_state["fn"] = torch.compile(flex_attention, dynamic=False)
            flex = flex_state["fn"]
            bm = x["bm"]
            counts = bm.kv_num_blocks.repeat_interleave(group, 1)
            idx = bm.kv_indices.repeat_interleave(group, 1)
            fbm = FlexBlockMask.from_kv_blocks(
                counts, idx, BLOCK_SIZE=(Q_BLOCK, KV_BLOCK), seq_lengths=(W, S)
            )

            def flex_call(i):
                k_all = kct[i].slice_scatter(kt, dim=2, start=st, end=st + W)
                v_all = vct[i].slice_scatter(vt, dim=2, start=st, end=st + W)
                return flex(qt, k_all, v_all, block_mask=fbm, enable_gqa=group > 1).transpose(1, 2)

            t0 = time.perf_counter()
            flex_call(0)
            timing.sync(device)
            flex_state["compile_s"] += time.perf_counter() - t0
            cases.append(
                (
                    "flex",
                    "flex+merge",
                    "inductor",
                    timing.Case(f"flex+merge W={W} S={S} d={density}", flex_call, copies),
                )
            )
            if flex_state["compile_s"] > flex_state["budget_s"]:
                flex_state["on"] = False
                notes.append(
                    f"flex: compile time {flex_state['compile_s']:.0f}s passed the budget "
                    f"({flex_state['budget_s']:.0f}s); later shapes skip FlexAttention"
                )
        except Exception as e:
            first = str(e).splitlines()[0][:140] if str(e) else ""
            notes.append(f"W={W} S={S} flex skipped: {type(e).__name__}: {first}")

    backends = [
        b
        for b in dk.available_backends(device, "attention")
        if (not args.backends or b in args.backends.split(","))
    ]
    if device == "cuda" and not args.backends and "torch" in backends:
        backends.remove("torch")  # the reference itself, not a kernel
    if device == "cpu" and not args.backends:
        backends = [b for b in backends if b != "triton"]  # the interpreter is not a timing target
    bm = x["bm"]
    # (tag, write_back, delegation): window steps run as the op does by default (the backends' rule
    # never delegates W < its min_rows); a refresh is timed with our kernel alone ("off") and with its
    # dense key prefix handed to torch's SDPA ("always": whatever the backend's rule says)
    modes = [("wb", True, None)] + ([("ro", False, None)] if W < S else [("sdpa", True, "always")])
    if W == S:
        modes[0] = ("wb", True, "off")
    for be in backends:
        for tag, wb, delegation in modes:
            if delegation == "always" and be == "torch":
                continue  # the reference delegates nothing

            def ours(i, be=be, wb=wb, delegation=delegation):
                with attention_sdpa.mode(delegation) if delegation else contextlib.nullcontext():
                    return dk.attention(
                        x["q"],
                        x["k"],
                        x["v"],
                        kcs[i],
                        vcs[i],
                        x["pos"],
                        x["lens"],
                        write_back=wb,
                        block_mask=bm,
                        backend=be,
                    )

            label = "ours+sdpa" if tag == "sdpa" else f"ours {tag}"
            cases.append(
                (
                    f"ours_{tag}_{be}",
                    label,
                    be,
                    timing.Case(f"{label}[{be}] W={W} S={S} d={density}", ours, copies),
                )
            )
    meta = dict(
        pairs=attended_pairs(x["dense"], W, S, Hq, Hkv, Q_BLOCK, KV_BLOCK),
        kv_bytes=kv_bytes(x["dense"], S, Hkv, D, x["kc"].element_size(), KV_BLOCK),
    )
    return cases, meta


def measure_against_sdpa(cases, tag, device, args, notes):
    """(key, label, backend, timing, error) of each case (key, label, backend, timing.Case) that runs:
    its max |diff| relative to the output of the case keyed "sdpa" before it (None before that one); a
    failing case is printed and noted under `tag`, and the others still run."""
    ref = None
    for key, label, be, case in cases:
        try:
            y = case.fn(0).float()
            timing.sync(device)
            if key == "sdpa":
                ref = y
            err = None if ref is None else float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
            m = timing.measure(case, device, quick=args.quick, reps=args.reps)
        except Exception as e:
            print(f"  {tag} {label}[{be}]: FAILED ({type(e).__name__}: {e})")
            notes.append(f"{tag} {label}[{be}] failed: {type(e).__name__}: {str(e)[:160]}")
            continue
        if m["note"]:
            notes.append(f"{tag} {label}[{be}]: {m['note']}")
        yield key, label, be, m, err


def paged_cases(args, device, env, notes):
    """The LLaDA2 paged block-decoding case (module docstring): (rows, tables)."""
    import dinfer_kernels as dk

    dtype = cli_options.torch_dtype(args.dtype)
    Hq, Hkv, D, W, ps = (
        args.paged_heads,
        args.paged_kv_heads,
        args.paged_head_dim,
        args.paged_block,
        args.page_size,
    )
    if args.paged_prefixes:
        prefixes = cli_options.parse_ints(args.paged_prefixes)
    elif args.quick:
        prefixes = [1024] if device == "cpu" else [1024, 8192]
    else:
        prefixes = [1024, 2048, 4096, 8192]
    backends = [
        b
        for b in dk.available_backends(device, "attention")
        if (not args.backends or b in args.backends.split(","))
    ]
    if device == "cuda" and not args.backends and "torch" in backends:
        backends.remove("torch")
    if device == "cpu" and not args.backends:
        backends = [b for b in backends if b != "triton"]
    group = Hq // Hkv
    rows, tables = [], []
    for prefix in prefixes:
        if prefix % W:
            notes.append(f"paged prefix={prefix} skipped: not a multiple of the block ({W})")
            continue
        S = prefix + W  # keys: the prefix and the block
        g = torch.Generator().manual_seed(prefix)
        r = lambda *s: torch.randn(*s, generator=g).to(dtype).to(device)
        q, k, v = r(1, W, Hq, D), r(1, W, Hkv, D), r(1, W, Hkv, D)
        kc, vc = r(1, S, Hkv, D), r(1, S, Hkv, D)
        pos = (prefix + torch.arange(W, device=device))[None]
        lens = torch.tensor([S], dtype=torch.int32, device=device)
        # the peer: a contiguous [B, Hkv, S, D] cache and a dense block-causal mask
        mask = (torch.arange(S, device=device)[None, :] < (pos[0, :, None] // W + 1) * W)[None, None]
        kct, vct = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
        # ours: page pools (shuffled, 1/8 spare pages) and a block table
        MP = -(-S // ps)
        P = MP + max(1, MP // 8)
        table = torch.randperm(P, generator=g)[:MP].view(1, MP).to(torch.int32).to(device)
        pool_k = torch.zeros(P, ps, Hkv, D, dtype=dtype, device=device)
        pool_v = torch.zeros_like(pool_k)
        for pool, c in ((pool_k, kc), (pool_v, vc)):
            padded = torch.zeros(1, MP * ps, Hkv, D, dtype=dtype, device=device)
            padded[:, :S] = c
            pool[table[0].long()] = padded.view(MP, ps, Hkv, D)
        bm = dk.BlockMask.block_causal(1, Hkv, W, MP * ps, W, W, W, start=prefix, device=device)
        copies = timing.num_copies(2 * pool_k.numel() * pool_k.element_size(), device)
        pools = [(pool_k, pool_v)] + [(pool_k.clone(), pool_v.clone()) for _ in range(copies - 1)]
        peer = [(kct, vct)] + [(kct.clone(), vct.clone()) for _ in range(copies - 1)]
        flat = [(kc, vc)] + [(kc.clone(), vc.clone()) for _ in range(copies - 1)]
        flat_bm = dk.BlockMask.block_causal(1, Hkv, W, S, W, W, W, start=prefix, device=device)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def sdpa(i):
            kc_i, vc_i = peer[i]
            kc_i[:, :, prefix:S] = kt
            vc_i[:, :, prefix:S] = vt
            return F.scaled_dot_product_attention(
                qt, kc_i, vc_i, attn_mask=mask, enable_gqa=group > 1
            ).transpose(1, 2)

        cases = [
            ("sdpa", "sdpa dense-mask", "torch", timing.Case(f"paged sdpa prefix={prefix}", sdpa, copies))
        ]
        for be in backends:

            def ours(i, be=be):
                return dk.attention(
                    q,
                    k,
                    v,
                    *pools[i],
                    pos,
                    lens,
                    block_table=table,
                    block_mask=bm,
                    write_back=True,
                    backend=be,
                )

            def contiguous(i, be=be):
                return dk.attention(
                    q, k, v, *flat[i], pos, lens, block_mask=flat_bm, write_back=True, backend=be
                )

            cases.append(
                (
                    f"paged_{be}",
                    "ours paged",
                    be,
                    timing.Case(f"paged ours[{be}] prefix={prefix}", ours, copies),
                )
            )
            cases.append(
                (
                    f"contiguous_{be}",
                    "ours contiguous",
                    be,
                    timing.Case(f"paged-case ours contiguous[{be}] prefix={prefix}", contiguous, copies),
                )
            )
        shape_rows = []
        for key, label, be, m, err in measure_against_sdpa(
            cases, f"paged prefix={prefix}", device, args, notes
        ):
            row = dict(
                case="paged",
                W=W,
                prefix=prefix,
                S=S,
                page_size=ps,
                heads=Hq,
                kv_heads=Hkv,
                head_dim=D,
                dtype=args.dtype,
                key=key,
                method=label,
                backend=be,
                timer=m["timer"],
                median_s=m["median_s"],
                p20_s=m["p20_s"],
                p80_s=m["p80_s"],
                us=m["median_s"] * 1e6,
                rel_err=err,
            )
            shape_rows.append(row)
            print(f"  paged prefix={prefix:5d} {label:15s} {be:6s} {row['us']:10.1f} us  ({m['timer']})")
        base = next((x for x in shape_rows if x["key"] == "sdpa"), None)
        for x in shape_rows:
            x["x_sdpa"] = base["median_s"] / x["median_s"] if base else None
        rows += shape_rows
    if rows:
        title = (
            f"LLaDA2 paged block decoding: block of {W} query rows after a prefix, {Hq}/{Hkv} heads x {D}, "
            f"pages of {ps}, {args.dtype}, {device} ({env.get('gpu') or env['cpu']})"
        )
        cols = [
            ("prefix", "prefix", None),
            ("method", "method", None),
            ("backend", "backend", None),
            ("median µs", "us", ".1f"),
            ("sdpa ÷ ours", "x_sdpa", ".2f"),
            ("rel err vs sdpa", "rel_err", ".2g"),
            ("timer", "timer", None),
        ]
        table = f"**{title}**\n\n" + markdown_tables.markdown_table(rows, cols)
        print("\n" + table + "\n")
        tables.append(table)
    return rows, tables


def batched_cases(args, device, env, notes, bw):
    """Batched window and paged steps (module docstring): (rows, tables)."""
    import dinfer_kernels as dk

    dtype = cli_options.torch_dtype(args.dtype)
    Hq, Hkv, D, W, ps = args.heads, args.kv_heads, args.head_dim, args.batched_rows, args.page_size
    cpu = device == "cpu"
    batches = cli_options.parse_ints(args.batches or ("2" if cpu else "32" if args.quick else "32,64"))
    keys = cli_options.parse_ints(args.batched_keys or ("256" if cpu else "2048,8192"))
    backends = [
        b
        for b in dk.available_backends(device, "attention")
        if b != "torch" and (not args.backends or b in args.backends.split(","))
    ]
    if cpu and not args.backends:
        backends = [b for b in backends if b != "triton"]
    group = Hq // Hkv
    rows, tables = [], []
    for B in batches:
        for S in keys:
            if S % ps or W > S:
                notes.append(f"batched B={B} S={S} skipped: S must be a multiple of --page-size and >= W")
                continue
            g = torch.Generator(device=device).manual_seed(B * S)  # GBs of inputs: made on the device
            r = lambda *s: torch.randn(*s, generator=g, device=device).to(dtype)
            q, k, v = r(B, W, Hq, D), r(B, W, Hkv, D), r(B, W, Hkv, D)
            kc, vc = r(B, S, Hkv, D), r(B, S, Hkv, D)
            start = (S - W) // 2 // 32 * 32  # a window in the middle of every sequence
            pos = (start + torch.arange(W, device=device))[None].repeat(B, 1)
            lens = torch.full((B,), S, dtype=torch.int32, device=device)
            # pages: shuffled ids over one pool shared by the B sequences
            MP = S // ps
            table = torch.randperm(B * MP, generator=g, device=device).view(B, MP).to(torch.int32)
            pool_k = torch.empty(B * MP, ps, Hkv, D, dtype=dtype, device=device)
            pool_v = torch.empty_like(pool_k)
            pool_k[table.flatten().long()] = kc.view(B * MP, ps, Hkv, D)
            pool_v[table.flatten().long()] = vc.view(B * MP, ps, Hkv, D)
            kct, vct = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            copies = timing.num_copies(2 * kc.numel() * kc.element_size(), device)
            flat = [(kc, vc)] + [(kc.clone(), vc.clone()) for _ in range(copies - 1)]
            pools = [(pool_k, pool_v)] + [(pool_k.clone(), pool_v.clone()) for _ in range(copies - 1)]
            peer = [(kct, vct)] + [(kct.clone(), vct.clone()) for _ in range(copies - 1)]

            def sdpa(i):  # the peer: the window written in place into [B, Hkv, S, D], then SDPA
                kc_i, vc_i = peer[i]
                kc_i[:, :, start : start + W] = kt
                vc_i[:, :, start : start + W] = vt
                return F.scaled_dot_product_attention(qt, kc_i, vc_i, enable_gqa=group > 1).transpose(1, 2)

            name = sdpa_kernel_name(qt, kct, vct, None, group > 1)
            cases = [("sdpa", "sdpa in place", f"torch {name}", sdpa)]
            for be in backends:
                cases.append(
                    (
                        f"ours_{be}",
                        "ours",
                        be,
                        lambda i, be=be: dk.attention(q, k, v, *flat[i], pos, lens, backend=be),
                    )
                )
                cases.append(
                    (
                        f"paged_{be}",
                        "ours paged",
                        be,
                        lambda i, be=be: dk.attention(
                            q, k, v, *pools[i], pos, lens, block_table=table, backend=be
                        ),
                    )
                )
            kv_bytes = 2.0 * B * S * Hkv * D * kc.element_size()  # every key and value read once
            timed = [
                (key, label, be, timing.Case(f"batched {label}[{be}] B={B} W={W} S={S}", fn, copies))
                for key, label, be, fn in cases
            ]
            shape_rows = []
            for key, label, be, m, err in measure_against_sdpa(
                timed, f"batched B={B} S={S}", device, args, notes
            ):
                row = dict(
                    case="batched",
                    B=B,
                    W=W,
                    S=S,
                    page_size=ps,
                    heads=Hq,
                    kv_heads=Hkv,
                    head_dim=D,
                    dtype=args.dtype,
                    key=key,
                    method=label,
                    backend=be,
                    timer=m["timer"],
                    median_s=m["median_s"],
                    p20_s=m["p20_s"],
                    p80_s=m["p80_s"],
                    us=m["median_s"] * 1e6,
                    GBps=kv_bytes / m["median_s"] / 1e9,
                    rel_err=err,
                )
                row.update(timing.bandwidth_percents(row["GBps"], bw))
                shape_rows.append(row)
                print(
                    f"  batched B={B:3d} S={S:5d} {label:13s} {be:24s} {row['us']:10.1f} us {row['GBps']:8.1f} GB/s"
                )
            base = next((x for x in shape_rows if x["key"] == "sdpa"), None)
            for x in shape_rows:
                x["x_sdpa"] = base["median_s"] / x["median_s"] if base else None
            rows += shape_rows
            flat = pools = peer = cases = None  # freed before the next shape's caches
            if device == "cuda":
                torch.cuda.empty_cache()
    if rows:
        title = (
            f"batched window steps: W = {W} rows per sequence over S keys each (every key), contiguous and "
            f"paged (pages of {ps}), {Hq}/{Hkv} heads x {D}, {args.dtype}, {device} "
            f"({env.get('gpu') or env['cpu']}); {timing.bandwidth_text(bw)}"
        )
        cols = [
            ("B", "B", None),
            ("S", "S", None),
            ("method", "method", None),
            ("backend", "backend", None),
            ("median µs", "us", ".1f"),
            ("KV GB/s", "GBps", ".1f"),
            *timing.BANDWIDTH_COLUMNS,
            ("sdpa ÷ ours", "x_sdpa", ".2f"),
            ("rel err vs sdpa", "rel_err", ".2g"),
            ("timer", "timer", None),
        ]
        table = f"**{title}**\n\n" + markdown_tables.markdown_table(rows, cols)
        print("\n" + table + "\n")
        tables.append(table)
    return rows, tables


def run(args):
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU visible")
    cpu = device == "cpu"
    if cpu and args.heads == 16 and args.head_dim == 128 and not args.full_size:
        args.heads, args.kv_heads, args.head_dim = 4, 4, 64
    if args.kv_heads is None:
        args.kv_heads = args.heads
    win_w = args.window_rows if not cpu or args.full_size else min(args.window_rows, 16)
    if args.windows:
        windows = cli_options.parse_ints(args.windows)
    else:
        windows = (
            ([256, 1024] if cpu else [1024, 4096, 8192])
            if args.quick
            else ([256, 1024, 2048] if cpu else [1024, 2048, 4096, 8192])
        )
    if args.refresh:
        refresh = cli_options.parse_ints(args.refresh)
    else:
        refresh = [256] if cpu else [2048, 8192]
    densities = [float(d) for d in args.densities.split(",")]
    notes = []
    env = environment.environment(device)
    print(
        f"# bench_attention  device={device} ({env.get('gpu') or env['cpu']})  dtype={args.dtype}  "
        f"heads={args.heads}/{args.kv_heads}x{args.head_dim}  commit={env['commit']}"
    )
    bw = timing.bandwidth_yardsticks(device, quick=args.quick)
    mm = timing.matmul_rate(device, cli_options.torch_dtype(args.dtype), args.quick)
    print(f"bandwidth: {timing.bandwidth_text(bw)}; {args.dtype} matmul: {mm['TFLOPs']:.1f} TFLOP/s")
    flex_on = flex_available() and not args.no_flex and (device == "cuda" or args.flex)
    if not flex_available():
        notes.append("FlexAttention not in this torch: flex+merge skipped")
    elif not flex_on and cpu and not args.no_flex:
        notes.append("flex+merge not timed on the CPU (--flex to add)")
    flex_state = {"on": flex_on, "fn": None, "compile_s": 0.0, "budget_s": 45.0 if args.quick else 300.0}

    shapes = [(win_w, S) for S in windows] + [(S, S) for S in refresh]
    results, tables = [], []
    if not args.no_paged:
        results, tables = paged_cases(args, device, env, notes)
    if args.paged_only:
        shapes = []
    for W, S in shapes:
        for density in densities:
            try:
                cases, meta = build_cases(W, S, density, args, device, notes, flex_state)
            except Exception as e:
                notes.append(
                    f"W={W} S={S} density={density}: setup failed: {type(e).__name__}: {str(e)[:160]}"
                )
                continue
            ref = None
            rows = []
            for key, label, be, case in cases:
                try:
                    attention_sdpa.last_backend(clear=True)
                    y = case.fn(0).float()
                    timing.sync(device)
                    if key == "sdpa":
                        ref = y
                    if key.startswith("ours_sdpa"):  # which SDPA kernel took the prefix, if any did
                        be = f"{be}+{attention_sdpa.last_backend() or 'none (declined)'}"
                    err = (
                        None
                        if ref is None
                        else float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                    )
                    m = timing.measure(case, device, quick=args.quick, reps=args.reps)
                except Exception as e:
                    print(f"  {label}[{be}]: FAILED ({type(e).__name__}: {e})")
                    notes.append(
                        f"W={W} S={S} d={density} {label}[{be}] failed: {type(e).__name__}: {str(e)[:160]}"
                    )
                    continue
                if m["note"]:
                    notes.append(f"W={W} S={S} d={density} {label}[{be}]: {m['note']}")
                t = m["median_s"]
                r = dict(
                    W=W,
                    S=S,
                    density=density,
                    heads=args.heads,
                    kv_heads=args.kv_heads,
                    head_dim=args.head_dim,
                    dtype=args.dtype,
                    key=key,
                    method=label,
                    backend=be,
                    timer=m["timer"],
                    median_s=t,
                    p20_s=m["p20_s"],
                    p80_s=m["p80_s"],
                    us=t * 1e6,
                    TFLOPs=4.0 * meta["pairs"] * args.head_dim / t / 1e12,
                    GBps=meta["kv_bytes"] / t / 1e9,
                    rel_err=err,
                )
                r.update(timing.bandwidth_percents(r["GBps"], bw))
                r.update(timing.matmul_percents(r["TFLOPs"], mm))
                rows.append(r)
                print(
                    f"  W={W:5d} S={S:5d} d={density:.2f} {label:11s} {be:8s} {r['us']:10.1f} us "
                    f"{r['TFLOPs']:7.2f} TFLOP/s {r['GBps']:8.1f} GB/s  ({m['timer']})"
                )
            base = next((r for r in rows if r["key"] == "sdpa"), None)
            for r in rows:
                r["x_sdpa"] = base["median_s"] / r["median_s"] if base else None
            results += rows
            kind = "window step" if W < S else "full refresh"
            title = (
                f"{kind}: W = {W}, S = {S}, density {density:g}, {args.heads}/{args.kv_heads} heads x "
                f"{args.head_dim}, {args.dtype}, {device} ({env.get('gpu') or env['cpu']}); "
                f"{timing.bandwidth_text(bw)}, matmul {mm['TFLOPs']:.0f} TFLOP/s"
            )
            cols = [
                ("method", "method", None),
                ("backend", "backend", None),
                ("median µs", "us", ".1f"),
                ("TFLOP/s", "TFLOPs", ".2f"),
                ("% matmul", "pct_mm", ".1f"),
                ("% bf16 spec", "pct_mm_spec", ".1f"),
                ("KV GB/s", "GBps", ".1f"),
                *timing.BANDWIDTH_COLUMNS,
                ("× sdpa+merge", "x_sdpa", ".2f"),
                ("rel err vs sdpa", "rel_err", ".2g"),
                ("timer", "timer", None),
            ]
            table = f"**{title}**\n\n" + markdown_tables.markdown_table(rows, cols)
            print("\n" + table + "\n")
            tables.append(table)
            del cases
            if device == "cuda":
                torch.cuda.empty_cache()
    if not (args.no_batched or args.paged_only):  # last: the hero step's share may stop it
        more_rows, more_tables = batched_cases(args, device, env, notes, bw)
        results, tables = results + more_rows, tables + more_tables
    # 50% density speedup over dense, per method and shape
    for r in results:
        if r.get("density", 1.0) < 1.0:
            dense = next(
                (
                    o
                    for o in results
                    if o.get("density") == 1.0
                    and o["W"] == r["W"]
                    and o["S"] == r["S"]
                    and o["key"] == r["key"]
                ),
                None,
            )
            r["x_dense"] = dense["median_s"] / r["median_s"] if dense else None
    sparse = [r for r in results if r.get("x_dense") is not None]
    if sparse:
        cols = [
            ("W", "W", None),
            ("S", "S", None),
            ("density", "density", ".2f"),
            ("method", "method", None),
            ("backend", "backend", None),
            ("median µs", "us", ".1f"),
            ("× dense", "x_dense", ".2f"),
        ]
        table = (
            "**block-sparse speedup over the dense (density 1) run of the same method**\n\n"
            + markdown_tables.markdown_table(sparse, cols)
        )
        print(table + "\n")
        tables.append(table)
    if flex_state["compile_s"]:
        notes.append(f"flex: {flex_state['compile_s']:.1f}s of torch.compile (first calls, not timed)")
    env["matmul_rate"] = mm
    return results_json.finish("attention", env, args, bw, results, tables, notes)


def main(argv=None):
    p = cli_options.base_parser(__doc__.splitlines()[0])
    p.add_argument("--windows", default=None, help="comma-separated S of the window steps")
    p.add_argument("--refresh", default=None, help="comma-separated S of the full refreshes (W = S)")
    p.add_argument("--window-rows", type=int, default=96, help="W of the window steps")
    p.add_argument("--densities", default="1,0.5", help="comma-separated key-block densities")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--full-size", action="store_true", help="keep the GPU shapes on the CPU")
    p.add_argument("--backends", default=None, help="comma-separated subset of our backends")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    p.add_argument("--flex", action="store_true", help="time FlexAttention on the CPU too")
    p.add_argument("--paged-prefixes", default=None, help="comma-separated prefix lengths of the paged case")
    p.add_argument("--page-size", type=int, default=32, help="rows per page of the paged case")
    p.add_argument(
        "--paged-block", type=int, default=32, help="query rows (diffusion block) of the paged case"
    )
    p.add_argument("--paged-heads", type=int, default=16)
    p.add_argument("--paged-kv-heads", type=int, default=4)
    p.add_argument("--paged-head-dim", type=int, default=128)
    p.add_argument("--batches", default=None, help="batch sizes of the batched window steps (GPU: 32,64)")
    p.add_argument("--batched-rows", type=int, default=32, help="W of the batched window steps")
    p.add_argument("--batched-keys", default=None, help="S of the batched window steps (GPU: 2048,8192)")
    p.add_argument("--no-batched", action="store_true", help="skip the batched window steps")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--no-paged", action="store_true", help="skip the paged case")
    mode.add_argument("--paged-only", action="store_true", help="run only the paged case")
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
