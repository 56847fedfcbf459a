"""One model forward at the released shapes (random weights): ours against the torch references and
a peer-style baseline, per forward kind, batch and CUDA-graph mode.

    python bench_kernels/bench_forward.py [--device cuda|cpu] [--models llada-moe-7b,llada2-mini]
        [--kinds refresh,window,block] [--seq 2048,8192] [--batch 1,32,64] [--layers N] [--tiny]
        [--dtype bf16] [--quick] [--reps N] [--time-limit S] [--json out.json] [--nsys-one]

Models (bench_kernels/synthetic_model.py): LLaDA-MoE-7B-A1B and LLaDA2.0-mini as released, every
layer (--layers N: the first N), random bf16 weights drawn on the device; --tiny: the same families
at a few thousand parameters per layer (the tests). The forward kinds the engine runs (dinfer/kv):
  refresh  LLaDA-MoE's full refresh: all S positions (W = S), the cache written, logits of a block of
           32 rows
  window   LLaDA-MoE's vicinity step: 16 + 32 + 16 rows at the end of S, attending the S cached keys
           with the window's fresh K/V in place (write_back False), logits of the block's 32 rows
  block    LLaDA2's paged step: the last block of 32 rows of S, over a paged cache (pages of 32)
           holding the prefix of S - 32 positions; its K/V written, logits of its 32 rows
(LLaDA2 never refreshes; its prefill and fused first forwards are not timed here.) Caches hold random
K/V. Per (kind, S, batch) three implementations of the same forward:
  ours     dinfer.models.DiffusionLM with backend "auto" (our kernels)
  torch    the same forward on the pure-torch references (dk.prefer_backend("torch"); under CUDA-graph
           capture the MoE reference runs every expert on every row, its capturable form)
  peer     what the released HF modeling code does, written here: torch rms_norm, the rope cos/sin of
           the forward's positions built once per forward, SDPA over the cache's K/V concatenated with
           the window's (GQA by repeating K/V), the router's top-k, then a Python loop over the experts
           that received tokens (index the tokens, run the expert's gate/up/down, index_add weighted),
           plus LLaDA2's shared expert. Like ours it runs the last layer's MLP and the LM head on the
           logits rows only (HF's full-window LM head would be 20 GB of logits at a refresh of 32 x 2048).
           It syncs with the host per expert, so it never runs in a CUDA graph.
with CUDA graphs on (timing.py: a graph of repeated forwards, timed by CUDA events) and off
(do_bench); the host has no graphs. A row's graphs column says how it was timed: a capture that
failed fell back to do_bench (its timer and timing_note say so; graphs_asked keeps the plan). Columns:
  ms             median time of one forward
  weights GB     weight bytes the forward reads: every dense weight (attention, norms, routers, dense
                 and shared MLPs, LM head; the embedding is looked up before the forward) and, per MoE
                 layer, the experts the router's top-k of this forward selected (w13 and w2 of each);
                 every expert on the torch rows with graphs on (the capturable MoE reference runs
                 them all on every row)
  KV GB          the keys and values its attention reads (B x S rows x Hkv x D, K and V, per layer)
  % HBM          (weights + KV) / time against the GPU's datasheet bandwidth (environment.datasheet_hbm_tbs;
                 "-" on the host or an unknown GPU, and on refresh rows: compute-bound)
  launches       per eager forward: on a GPU the CUDA kernels torch.profiler saw (memcpy/memset and
                 user annotations such as DINFER_NVTX=1's ranges excluded); on the host the ops dispatched (aten ops plus each dinfer::* op as one,
                 counted with a TorchDispatchMode)
  experts/layer  distinct experts selected, averaged over the MoE layers
  x peer         the peer-style forward's time over this row's (same kind, S and batch)
--quick: S 2048, batches 1 and 32, the window and block kinds (all three implementations, graphs on and
off) and one batch-1 refresh (ours, graphs on): the GPU check's step. It runs the target rows first
(batch 1, ours, graphs on then off, both models), then the rest, so --time-limit cannot cut them. Batches whose KV cache and
activations would not fit the free memory are skipped with a note. --time-limit stops before the next
case once that many seconds have passed, and still writes the JSON (every finished case is in it as
it finishes). --nsys-one runs one eager forward of the first case inside the NVTX range
`bench_forward.one` and exits, for
  NSYS_NVTX_PROFILER_REGISTER_ONLY=0 nsys profile -t cuda,nvtx --capture-range=nvtx \\
      --nvtx-capture=bench_forward.one --capture-range-end=stop -o out/forward \\
      python bench_kernels/bench_forward.py --quick --nsys-one
The targets (H200, bf16, every layer) are printed as notes: a batch-1 LLaDA-MoE-7B window forward
<= 4.5 ms, a batch-1 LLaDA2-mini block forward <= 5.5 ms, each >= 3x the peer-style forward.
"""

import inspect
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout  # noqa: F401  (puts the checkout's dinfer and dinfer_kernels on sys.path)
import cli_options
import environment
import markdown_tables
import results_json
import synthetic_model
import timing
import torch
import torch.nn.functional as F

import dinfer_kernels as dk
from dinfer.kv.paged import PagePool
from dinfer.models.transformer import DiffusionLM
from dinfer.parallel import weight_bytes
from dinfer.params import free_bytes, run_bytes
from dinfer_kernels.reference.moe import route
from dinfer_kernels.reference.rope import inv_freq

KINDS = {"llada-moe-7b": ("refresh", "window"), "llada2-mini": ("block",)}
BACKENDS = ("ours", "torch", "peer")
BLOCK, LOOK = 32, 16  # the engine's block and its vicinity look-around (prefix_look = after_look)
TARGETS = {("llada-moe-7b", "window"): 4.5, ("llada2-mini", "block"): 5.5}  # H200 ms at batch 1
TARGET_SPEEDUP = 3.0


# ------------------------------------------------------------------------------------ the forwards
class Forward:
    """The inputs of one forward of `kind` over B sequences of S positions (see the docstring)."""

    def __init__(self, model, kind: str, B: int, S: int, seed: int = 0):
        c, dev = model.config, model.device
        self.model, self.kind, self.B, self.S = model, kind, B, S
        W = {"refresh": S, "window": LOOK + BLOCK + LOOK, "block": BLOCK}[kind]
        if not BLOCK + LOOK <= S or W > S or (kind == "block" and S % BLOCK):
            raise ValueError(
                f"seq: {S} positions cannot hold a {kind} forward of {W} rows (pages of {BLOCK})"
            )
        self.W, self.lo = W, S - W if kind != "refresh" else 0
        block = S - BLOCK - LOOK if kind == "refresh" else self.lo + (LOOK if kind == "window" else 0)
        gen = torch.Generator(device=dev).manual_seed(seed)
        tokens = torch.randint(0, c.eos_id, (B, W), generator=gen, device=dev)
        self.emb = model.embed(tokens)
        self.pos = (self.lo + torch.arange(W, device=dev)).expand(B, W)
        self.rows = (
            (block - self.lo + torch.arange(BLOCK, device=dev)) + W * torch.arange(B, device=dev)[:, None]
        ).flatten()
        self.seq_lens = torch.full((B,), S, dtype=torch.int32, device=dev)
        self.write_back = kind != "window"
        self.table = None
        if kind == "block":  # pages of one block; sequence b holds pages [b * S/32, (b + 1) * S/32)
            self.cache = PagePool(model, B * S // BLOCK, BLOCK)
            self.table = torch.arange(B * S // BLOCK, dtype=torch.int32, device=dev).view(B, -1)
        else:
            self.cache = model.new_cache(B, S)
        for t in self.cache.keys + self.cache.values:
            t.normal_(generator=gen)

    def ours(self, model=None):
        """Logits [B * 32, V] of DiffusionLM.forward (`model`: the same weights with other ops)."""
        return (model or self.model).forward(
            self.emb,
            self.pos,
            self.cache,
            self.seq_lens,
            write_back=self.write_back,
            logits_rows=self.rows,
            block_table=self.table,
        )

    def cached_kv(self, i: int, k, v):
        """Layer i's keys and values [B, Hkv, S, D] as an HF cache holds them: the cache's, with the
        fresh window's (k, v: [B, Hkv, W, D]) concatenated in its place."""
        if self.kind == "refresh":
            return k, v
        B, S, lo, W = self.B, self.S, self.lo, self.W
        c = self.model.config
        full = lambda t: t.view(B, S, c.num_kv_heads, c.head_dim).transpose(1, 2)  # pages are in order
        kc, vc = full(self.cache.keys[i]), full(self.cache.values[i])
        cat = lambda cached, fresh: torch.cat([cached[:, :, :lo], fresh, cached[:, :, lo + W :]], dim=2)
        return cat(kc, k), cat(vc, v)


def _rope_tables(positions, c, dtype):
    """cos, sin [B, 1, W, rotary_dim] of the forward's positions, as HF's rotary embedding builds them
    once per forward: fp32 angles, cast to the activations' dtype."""
    ang = positions.float()[..., None] * inv_freq(c.rope_theta, c.rotary_dim, positions.device)
    emb = torch.cat([ang, ang], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x, cos, sin):
    """Rotate-half rope on the first rotary_dim dims of x [B, H, W, D]; the rest pass through."""
    rd = cos.shape[-1]
    xr, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    return torch.cat([xr * cos + rotated * sin, rest], dim=-1)


def _repeat_kv(t, groups: int):
    B, H, S, D = t.shape
    return t if groups == 1 else t[:, :, None].expand(B, H, groups, S, D).reshape(B, H * groups, S, D)


def _peer_experts(m, w, p, c, routing):
    """HF's MoE block: the router's top-k, then a loop over the experts that received tokens."""
    weights, experts = route(
        m, w[p + "router"], c.top_k, c.router_renormalize, w.get(p + "expert_bias"), **routing
    )
    weights = weights.to(m.dtype)
    out = torch.zeros_like(m)
    I = c.expert_intermediate_size
    hit = torch.bincount(experts.flatten(), minlength=c.num_experts).nonzero().flatten()
    for e in hit.tolist():
        token, slot = torch.where(experts == e)
        x = m[token]
        gate, up = x @ w[p + "w13"][e, :I].t(), x @ w[p + "w13"][e, I:].t()
        y = (F.silu(gate) * up) @ w[p + "w2"][e].t()
        out.index_add_(0, token, y * weights[token, slot, None])
    return out


def peer_forward(f: Forward):
    """Logits [B * 32, V] of the forward as the released HF modeling code computes it."""
    model = f.model
    c, w, eps = model.config, model.w, model.config.rms_eps
    B, W, H = f.emb.shape
    Hq, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
    routing = dict(
        scoring=c.router_scoring,
        num_groups=c.num_groups,
        topk_groups=c.topk_groups,
        routed_scaling=c.routed_scaling,
    )
    cos, sin = _rope_tables(f.pos, c, f.emb.dtype)
    h = f.emb.reshape(B * W, H)
    for i in range(c.num_layers):
        p = f"layers.{i}."
        a = F.rms_norm(h, (H,), w[p + "attn_norm"], eps)
        if p + "qkv" in w:
            q, k, v = (a @ w[p + "qkv"].t()).split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        else:
            q, k, v = a @ w[p + "q"].t(), a @ w[p + "k"].t(), a @ w[p + "v"].t()
        q, k, v = (t.reshape(B, W, -1, D).transpose(1, 2) for t in (q, k, v))
        if c.qk_norm:
            q, k = F.rms_norm(q, (D,), w[p + "q_norm"], eps), F.rms_norm(k, (D,), w[p + "k_norm"], eps)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k, v = f.cached_kv(i, k, v)
        o = F.scaled_dot_product_attention(q, _repeat_kv(k, Hq // Hkv), _repeat_kv(v, Hq // Hkv))
        o = o.transpose(1, 2).reshape(B * W, Hq * D)
        if i == c.num_layers - 1:  # past the last attention only the logits rows are read
            h, o = h.index_select(0, f.rows), o.index_select(0, f.rows)
        h = h + o @ w[p + "o"].t()
        m = F.rms_norm(h, (H,), w[p + "mlp_norm"], eps)
        if c.is_dense_layer(i):
            out = (F.silu(m @ w[p + "gate"].t()) * (m @ w[p + "up"].t())) @ w[p + "down"].t()
        else:
            out = _peer_experts(m, w, p, c, routing)
            if p + "shared_w13" in w:
                g, u = (m @ w[p + "shared_w13"].t()).chunk(2, dim=-1)
                out = out + (F.silu(g) * u) @ w[p + "shared_w2"].t()
        h = h + out
    return F.rms_norm(h, (H,), w["final_norm"], eps) @ w["lm_head"].t()


# ------------------------------------------------------------------------------- what is measured
ROUTER_OPTIONS = frozenset(inspect.signature(route).parameters)


class _RoutingRecorder:
    """dinfer_kernels with moe wrapped: records the distinct experts each MoE call's router selects."""

    def __init__(self):
        self.touched = []

    def __getattr__(self, name):
        return getattr(dk, name)

    def moe(self, hidden, router, w13, w2, top_k, **kw):
        # the router's options of what the model passes (the shared expert and FP8 scales besides)
        options = {k: v for k, v in kw.items() if k in ROUTER_OPTIONS}
        experts = route(hidden, router, top_k, **options)[1]
        self.touched.append(int(torch.unique(experts).numel()))
        return dk.moe(hidden, router, w13, w2, top_k, **kw)


def traffic(f: Forward) -> dict:
    """Bytes one forward reads: weights (the routing-selected experts of a run of it) and KV."""
    model, c = f.model, f.model.config
    recorder = _RoutingRecorder()
    with torch.no_grad():
        f.ours(DiffusionLM(c, model.w, ops=recorder))
    size = lambda t: t.numel() * t.element_size()
    dense = sum(size(t) for n, t in model.w.items() if n != "embed" and not n.endswith((".w13", ".w2")))
    per_expert = [
        size(model.w[f"layers.{i}.w13"][0]) + size(model.w[f"layers.{i}.w2"][0])
        for i in range(c.num_layers)
        if not c.is_dense_layer(i)
    ]
    experts = sum(n * b for n, b in zip(recorder.touched, per_expert))
    every_expert = c.num_experts * sum(per_expert)
    kv = 2 * c.num_layers * f.B * f.S * c.num_kv_heads * c.head_dim * model.dtype.itemsize
    return {
        "weight_bytes": dense + experts,
        "dense_weight_bytes": dense,
        "every_expert_weight_bytes": every_expert,
        "kv_bytes": kv,
        "experts_per_layer": sum(recorder.touched) / len(recorder.touched) if recorder.touched else 0.0,
    }


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def launches(fn, device):
    """(count, what was counted) for one eager call of fn: CUDA kernels on a GPU, dispatched ops on the
    host; (None, why) when the profiler cannot say."""
    if str(device).startswith("cuda"):
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        try:
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            events = prof.profiler.kineto_results.events()
            kernels = [
                e
                for e in events
                if e.device_type() == DeviceType.CUDA
                and not e.is_user_annotation()  # DINFER_NVTX=1's ranges show up as gpu_user_annotation
                and not e.name().startswith(("Memcpy", "Memset"))
            ]
            return len(kernels), "cuda kernels"
        except Exception as e:  # a GPU image without CUPTI: the rest of the bench still runs
            return None, f"profiler failed ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
    counter = _OpCounter()
    with counter:
        fn()
    return counter.ops, "dispatched ops"


# --------------------------------------------------------------------------------------- the run
def case_name(model, kind, S, B, graphs, backend):
    return f"{model.replace('-', '_')}.{kind}.s{S}.b{B}.{'graphs' if graphs else 'eager'}.{backend}"


def planned(args, kind, B):
    """(backend, graphs) of the rows of (model, kind, batch), in the order they run."""
    graph_modes = (True, False) if args.device == "cuda" else (False,)
    rows = [(b, g) for b in args.backends for g in graph_modes if not (b == "peer" and g)]
    if args.quick and kind == "refresh":  # the one full refresh of --quick
        rows = [r for r in rows if r == ("ours", args.device == "cuda")] if B == 1 else []
    return rows


def fits(model, kind, B, S, device):
    """(whether the case fits the free memory, a note when it does not)."""
    c = model.config
    W = {"refresh": S, "window": LOOK + BLOCK + LOOK, "block": BLOCK}[kind]
    # the cache, a forward's activations (x2: the MoE's fp32 partial sums), logits, and the peer's K/V
    # concatenated then repeated to every query head (_repeat_kv: Hq heads)
    need = (
        run_bytes(c, model.dtype, B * S, 2 * B * W, B * BLOCK)
        + 2 * c.num_heads * c.head_dim * B * (S + W) * model.dtype.itemsize
    )
    free = free_bytes(torch.device(device))
    if free is None or need <= free:
        return True, ""
    return (
        False,
        f"skipped {kind} S {S} batch {B}: needs about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free",
    )


def time_row(f, name, backend, graphs, device, args):
    fn = (lambda i: peer_forward(f)) if backend == "peer" else (lambda i: f.ours())
    with dk.prefer_backend("torch" if backend == "torch" else "auto"), torch.no_grad():
        case = timing.Case(case_name(name, f.kind, f.S, f.B, graphs, backend), fn, graph=graphs)
        return timing.measure(case, device, quick=args.quick, reps=args.reps)


class Run:
    """A run's options, machine and what it has measured so far; `late()` once --time-limit passed."""

    def __init__(self, args, env):
        self.args, self.env, self.device = args, env, args.device
        self.datasheet = environment.datasheet_hbm_tbs(env.get("gpu"))
        self.deadline = time.monotonic() + (float("inf") if args.time_limit is None else args.time_limit)
        self.results, self.notes, self.stopped = [], [], False

    def late(self) -> bool:
        self.stopped = self.stopped or time.monotonic() > self.deadline
        return self.stopped

    def note(self, text):
        self.notes.append(text)
        print("note:", text)


def run_model(run, name, keep):
    """The cases of model `name` whose rows pass keep(name, kind, S, B, (backend, graphs)); False when
    the run stops (time limit, --nsys-one)."""
    args = run.args
    model = synthetic_model.build(
        name, run.device, cli_options.torch_dtype(args.dtype), args.layers, args.tiny
    )
    c = model.config
    print(f"## {name}: {c.num_layers} layers, {weight_bytes(model.w) / 1e9:.2f} GB of weights")
    going = True
    for kind, S, B in [
        (k, S, B) for k in KINDS[name] if k in args.kinds for S in args.seq for B in args.batch
    ]:
        rows = [r for r in planned(args, kind, B) if keep(name, kind, S, B, r)]
        if not rows:
            continue
        ok, why = fits(model, kind, B, S, run.device)
        if not ok:
            run.note(why)
            continue
        if run.late() or args.nsys_one:
            if args.nsys_one:
                nsys_one(Forward(model, kind, B, S), run.device)
            going = False
            break
        try:
            measure_forward(run, model, name, kind, S, B, rows)
        except torch.OutOfMemoryError:
            run.note(f"{name} {kind} S {S} batch {B}: out of memory")
        if run.device == "cuda":
            torch.cuda.empty_cache()
        if run.stopped:
            going = False
            break
    del model
    if run.device == "cuda":
        torch.cuda.empty_cache()
    return going


def measure_forward(run, model, name, kind, S, B, rows):
    """The rows (backend, graphs) of one forward (kind, S, B) into run.results."""
    f = Forward(model, kind, B, S)
    tr = traffic(f)
    counted = {}
    for backend in dict.fromkeys(b for b, _ in rows):
        fn = (lambda: peer_forward(f)) if backend == "peer" else f.ours
        with dk.prefer_backend("torch" if backend == "torch" else "auto"), torch.no_grad():
            counted[backend] = launches(fn, run.device)
    results_json.record(f"{name.replace('-', '_')}.{kind}.s{S}.b{B}.traffic", {**tr, "launches": counted})
    for backend, graphs in rows:
        if run.late():
            break
        try:
            m = time_row(f, name, backend, graphs, run.device, run.args)
        except torch.OutOfMemoryError:  # the peer's repeated K/V, a graph of big forwards: the rest may fit
            torch.cuda.empty_cache()
            run.note(f"{case_name(name, kind, S, B, graphs, backend)}: out of memory")
            continue
        # a failed capture falls back to do_bench (timing.measure): the row says how it was timed
        timed_graph = m["timer"].startswith("cuda-graph")
        r = dict(
            case=case_name(name, kind, S, B, graphs, backend),
            model=name,
            layers=model.config.num_layers,
            kind=kind,
            S=S,
            W=f.W,
            batch=B,
            backend=backend,
            graphs=timed_graph,
            graphs_asked=graphs,
            ms=m["median_s"] * 1e3,
            median_s=m["median_s"],
            p20_s=m["p20_s"],
            p80_s=m["p80_s"],
            timer=m["timer"],
            timing_note=m["note"],
            **tr,
            launches=counted[backend][0],
            launches_counted=counted[backend][1],
        )
        if backend == "torch" and timed_graph:  # the capturable MoE reference runs every expert
            r["weight_bytes"] = tr["dense_weight_bytes"] + tr["every_expert_weight_bytes"]
        moved = (r["weight_bytes"] + r["kv_bytes"]) / r["median_s"]
        r["GBps"] = moved / 1e9
        # a refresh (S rows) is compute-bound: a share of the bandwidth says nothing there
        r["hbm_pct"] = 100 * moved / (run.datasheet * 1e12) if run.datasheet and kind != "refresh" else None
        run.results.append(r)
        print(
            f"  {r['case']:<48} {r['ms']:9.3f} ms  {r['GBps']:8.1f} GB/s  "
            f"launches {r['launches']}  experts/layer {r['experts_per_layer']:.1f}"
        )


def nsys_one(f, device):
    """One eager forward (after a warm-up one) inside the NVTX range bench_forward.one."""
    with torch.no_grad():
        f.ours()
        timing.sync(device)
        with timing.nvtx_range("bench_forward.one"):
            f.ours()
            timing.sync(device)
    print("ran one forward inside the NVTX range bench_forward.one")


def target_notes(results, env):
    """The speed targets, with what this run measured (they hold on an H200 with every layer)."""
    notes = []
    gpu = env.get("gpu") or f"host ({env['cpu']})"
    for (model, kind), ms in TARGETS.items():
        ours = [
            r
            for r in results
            if r["model"] == model and r["kind"] == kind and r["batch"] == 1 and r["backend"] == "ours"
        ]
        if not ours:
            continue
        best = min(ours, key=lambda r: r["ms"])
        speedup = f", {best['x_peer']:.2f}x the peer-style forward" if best.get("x_peer") else ""
        notes.append(
            f"target (H200, bf16, every layer): {model} {kind} forward at batch 1 <= {ms} ms and >= "
            f"{TARGET_SPEEDUP:g}x the peer-style one; this run ({gpu}, {best['layers']} layers, S {best['S']}, "
            f"graphs {'on' if best['graphs'] else 'off'}): {best['ms']:.3f} ms{speedup}"
        )
    return notes


COLUMNS = [
    ("model", "model", None),
    ("kind", "kind", None),
    ("S", "S", None),
    ("W", "W", None),
    ("batch", "batch", None),
    ("backend", "backend", None),
    ("graphs", "graphs", None),
    ("ms", "ms", ".3f"),
    ("weights GB", "weight_bytes_gb", ".2f"),
    ("KV GB", "kv_bytes_gb", ".3f"),
    ("% HBM", "hbm_pct", ".1f"),
    ("launches", "launches", None),
    ("experts/layer", "experts_per_layer", ".1f"),
    ("x peer", "x_peer", ".2f"),
]


def run(args):
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU visible")
    unknown = set(args.models) - set(KINDS)
    if unknown:
        raise SystemExit(f"--models: unknown {sorted(unknown)}; expected some of {sorted(KINDS)}")
    env = environment.environment(args.device)
    env["layers"] = args.layers or "all"
    print(
        f"# bench_forward  device={args.device} ({env.get('gpu') or env['cpu']})  models={args.models}  "
        f"kinds={args.kinds}  S={args.seq}  batch={args.batch}  layers={env['layers']}  dtype={args.dtype}"
    )
    run = Run(args, env)
    # --quick: the target rows (batch 1, ours, graphs on then off, both models) before the rest, so the
    # time limit cannot cut them
    target = lambda name, kind, S, B, row: (
        (name, kind) in TARGETS and S == args.seq[0] and B == 1 and row[0] == "ours"
    )
    phases = [target, lambda *case: not target(*case)] if args.quick else [lambda *case: True]
    going = True
    for keep in phases:
        for name in args.models:
            going = going and run_model(run, name, keep)
    if args.nsys_one:
        return None
    if run.stopped:
        run.note(f"stopped at --time-limit {args.time_limit:g} s after {len(run.results)} rows")
    results = run.results
    peers = {(r["model"], r["kind"], r["S"], r["batch"]): r for r in results if r["backend"] == "peer"}
    for r in results:
        r["weight_bytes_gb"], r["kv_bytes_gb"] = r["weight_bytes"] / 1e9, r["kv_bytes"] / 1e9
        peer = peers.get((r["model"], r["kind"], r["S"], r["batch"]))
        r["x_peer"] = peer["median_s"] / r["median_s"] if peer else None
    counted = sorted({r["launches_counted"] for r in results})
    notes = run.notes + [f"launches counted: {', '.join(counted) or '-'} (one eager forward)"]
    notes += target_notes(results, env)
    table = markdown_tables.markdown_table(results, COLUMNS)
    print("\n" + table + "\n")
    return results_json.finish("forward", env, args, None, results, [table], notes)


def main(argv=None):
    p = cli_options.base_parser(__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(KINDS), help="comma-separated models (default: both)")
    p.add_argument("--kinds", default="refresh,window,block", help="comma-separated forward kinds")
    p.add_argument(
        "--seq", default=None, help="comma-separated S (default 2048,8192; --quick 2048; host 256)"
    )
    p.add_argument(
        "--batch", default=None, help="comma-separated batches (default 1,32,64; --quick 1,32; host 1,4)"
    )
    p.add_argument("--layers", type=int, default=None, help="the first N layers (default: all; host 2)")
    p.add_argument("--tiny", action="store_true", help="the tiny variants of the models (tests)")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated subset of ours,torch,peer")
    p.add_argument(
        "--time-limit", type=float, default=None, help="stop before the next case after this many seconds"
    )
    p.add_argument(
        "--nsys-one",
        action="store_true",
        help="one eager forward of the first case in NVTX range bench_forward.one",
    )
    args = p.parse_args(argv)
    host = args.device == "cpu"
    args.models = [m for m in args.models.split(",") if m]
    args.kinds = [k for k in args.kinds.split(",") if k]
    args.backends = [b for b in args.backends.split(",") if b]
    if set(args.backends) - set(BACKENDS):
        raise SystemExit(f"--backends: expected some of {BACKENDS}, got {args.backends}")
    args.seq = (
        cli_options.parse_ints(args.seq)
        if args.seq
        else ([256] if host else [2048] if args.quick else [2048, 8192])
    )
    args.batch = (
        cli_options.parse_ints(args.batch)
        if args.batch
        else ([1, 4] if host else [1, 32] if args.quick else [1, 32, 64])
    )
    if args.layers is None and host and not args.tiny:
        args.layers = 2
    return run(args)


if __name__ == "__main__":
    main()
