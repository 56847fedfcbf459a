"""Per-ISA table of the host kernels: decode_step, attention, moe, rms_norm and rope with every ISA
copy this CPU runs, each against its op's torch reference, in one run.

    python bench_kernels/bench_host_isa.py [--quick] [--json out.json] [--isas generic,avx2]
                                           [--dtypes fp32,bf16] [--threads N]

For each ISA (dinfer_kernels._backend.set_cpu_isa) and dtype, runs the op benchmarks on the host
with their own inputs and baselines, limited to one shape each:
  decode_step  bench_decode     N = 32 rows, V = 157184 (ours-threshold)
  attention    bench_attention  the window step W = 16, S = 1024 (write-back)
  moe          bench_moe        T = 32 tokens of the small (embedded-size) layer
  rms_norm     bench_norm_rope  70 rows of hidden 256
  rope         bench_norm_rope  70 rows of 8 heads x 32
Columns: µs per call of the host kernel; × ref = the torch reference's time / ours, timed in the same
benchmark run (> 1: the host kernel is faster; "auto" should pick it only then, see
csrc/cpu_isa/dispatch.cpp and, for moe's dtype and shape, dinfer_kernels/_backend.py MOE_HOST_WINS),
next to what "auto" picks for that call ("auto cpu" / "auto torch"); for decode also ÷ max = ours / one logits.max(-1) pass and × dInfer =
dInfer's eager threshold decode / ours.
"""

import argparse
import contextlib
import importlib
import io
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout  # noqa: F401  (puts the checkout's dinfer and dinfer_kernels on sys.path)
import cli_options
import environment
import markdown_tables
import results_json
import torch

# (op, bench module, its arguments, pick): pick(results) -> (ours, reference, extras) rows.
CASES = [
    (
        "decode_step",
        "bench_decode",
        ["--rows", "32", "--backends", "cpu,torch", "--no-compile"],
        lambda by: (by("ours_thr_cpu"), by("ours_thr_torch"), {"max": by("max"), "dinfer": by("dinfer_thr")}),
    ),
    (
        "attention",
        "bench_attention",
        ["--windows", "1024", "--refresh", "16", "--densities", "1", "--backends", "cpu,torch", "--no-flex"],
        lambda by: (by("ours_wb_cpu", S=1024), by("ours_wb_torch", S=1024), {}),
    ),
    (
        "moe",
        "bench_moe",
        ["--tokens", "32", "--backends", "cpu"],
        lambda by: (by("ours_cpu"), by("torch_loop"), {}),
    ),
    (
        "rms_norm",
        "bench_norm_rope",
        ["--rows", "70", "--backends", "cpu,torch"],
        lambda by: (by(None, op="rms_norm", backend="cpu"), by(None, op="rms_norm", backend="torch"), {}),
    ),
    (
        "rope",
        "bench_norm_rope",
        ["--rows", "70", "--backends", "cpu,torch"],
        lambda by: (by(None, op="rope", backend="cpu"), by(None, op="rope", backend="torch"), {}),
    ),
]


def run_bench(name, argv, dtype, quick):
    """The results of one bench script's run (its table output silenced)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        args = (
            ["--device", "cpu", "--dtype", dtype, "--json", str(out)] + argv + (["--quick"] if quick else [])
        )
        with contextlib.redirect_stdout(io.StringIO()):
            importlib.import_module(name).main(args)
        return json.loads(out.read_text())["results"]


def finder(results):
    def by(key, **match):
        for r in results:
            if (
                (key is None or r.get("key") == key)
                and all(r.get(k) == v for k, v in match.items())
                and "median_s" in r
            ):
                return r
        raise KeyError(f"no result {key} {match}")

    return by


def auto_choice(op, dtype, ours):
    """The backend "auto" picks on the host, with the ISA in use, for the call `ours` timed."""
    from dinfer_kernels import _backend

    if op != "moe":
        return _backend.resolve("auto", "cpu", op)
    dt = cli_options.torch_dtype(dtype)
    weight_bytes = 3 * ours["E"] * ours["H"] * ours["I"] * torch.empty((), dtype=dt).element_size()
    return _backend.resolve(
        "auto",
        "cpu",
        "moe",
        dtype=dt,
        rows_per_expert=ours["T"] * ours["top_k"] / ours["E"],
        weight_bytes=weight_bytes,
    )


def run(args):
    from dinfer_kernels import _backend

    if args.threads:
        torch.set_num_threads(args.threads)
    isas = args.isas.split(",") if args.isas else _backend.cpu_isas()
    dtypes = args.dtypes.split(",")
    env = environment.environment("cpu")
    print(
        f"# bench_host_isa  cpu={env['cpu']}  ISAs={isas}  dtypes={dtypes}  threads={torch.get_num_threads()}"
        f"  commit={env['commit']}"
    )
    before = _backend.cpu_isa()
    results, notes = [], []
    try:
        for dtype in dtypes:
            for op, name, argv, pick in CASES:
                for isa in isas:
                    _backend.set_cpu_isa(isa)
                    ours, ref, extra = pick(finder(run_bench(name, argv, dtype, args.quick)))
                    r = dict(
                        op=op,
                        dtype=dtype,
                        isa=isa,
                        us=ours["median_s"] * 1e6,
                        median_s=ours["median_s"],
                        ref_us=ref["median_s"] * 1e6,
                        x_ref=ref["median_s"] / ours["median_s"],
                        auto=auto_choice(op, dtype, ours),
                    )
                    if "max" in extra:
                        r["per_max"] = ours["median_s"] / extra["max"]["median_s"]
                        r["x_dinfer"] = extra["dinfer"]["median_s"] / ours["median_s"]
                    results.append(r)
                    print(
                        f"  {op:11s} {dtype:4s} {isa:10s} {r['us']:10.1f} us  x ref {r['x_ref']:6.2f}"
                        f"  auto {r['auto']}"
                    )
    finally:
        _backend.set_cpu_isa(before)
    cols = [("op", "op", None), ("dtype", "dtype", None)]
    rows = []
    for dtype in dtypes:
        for op, *_ in CASES:
            row = {"op": op, "dtype": dtype}
            for r in results:
                if r["op"] == op and r["dtype"] == dtype:
                    row[f"{r['isa']}_us"] = r["us"]
                    row[f"{r['isa']}_x"] = f"{r['x_ref']:.2f} auto {r['auto']}"
                    if "per_max" in r:
                        row[f"{r['isa']}_x"] = (
                            f"{r['x_ref']:.2f} auto {r['auto']} (÷max {r['per_max']:.2f}, "
                            f"×dInfer {r['x_dinfer']:.2f})"
                        )
            rows.append(row)
    for isa in isas:
        cols += [(f"{isa} µs", f"{isa}_us", ".1f"), (f"{isa} × ref", f"{isa}_x", ".2f")]
    title = (
        f"host kernels per ISA, {env['cpu']}, {torch.get_num_threads()} threads "
        f"(× ref: reference time / ours, then what auto picks there; decode also ÷ one max(-1) pass and × dInfer's eager threshold decode)"
    )
    table = f"**{title}**\n\n" + markdown_tables.markdown_table(rows, cols)
    print("\n" + table + "\n")
    return results_json.finish("host_isa", env, args, None, results, [table], notes)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the op benchmarks' --quick (fewer repeats)")
    # The host kernels are timed on the host whatever the device: the flag exists so that the GPU
    # check calls every benchmark with the same arguments.
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="ignored: host kernels only")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument("--isas", default=None, help="comma-separated ISAs (default: every one this CPU runs)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated dtypes (default fp32,bf16)")
    p.add_argument("--threads", type=int, default=None, help="torch / host-kernel threads")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
