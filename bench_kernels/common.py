"""Shared helpers of the bench_kernels/bench_*.py scripts: timing, NVTX ranges, tables, JSON, report.

Timing
------
GPU: each case is captured into a CUDA graph of many calls that cycle through rotating input copies
(sized to several times the L2 so that every call reads from HBM), and the graph replays are timed
with CUDA events; a case that cannot be captured (a host sync, say dInfer's credit decoder) falls back
to triton.testing.do_bench (which flushes the L2 before each call) and says so in its `timer` field.
CPU: warm-up, then the median of repeated time.perf_counter() measurements of single calls.
Every measured region sits in an NVTX range named after the case (`nvtx` is a no-op without a profiler).

Report
------
`python bench_kernels/common.py report OUT_DIR` gathers OUT_DIR/*.json written by the bench scripts
(and OUT_DIR/steps.tsv, OUT_DIR/junit.xml, OUT_DIR/pytest.log when present) into OUT_DIR/report.md
and OUT_DIR/report.json. bench_kernels/gpu_check.sh calls it.
"""

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing: both packages sit at the root
    sys.path.insert(0, str(ROOT))

try:
    import nvtx
except ImportError:  # keep the benches runnable without it
    nvtx = None

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
ROTATE_BYTES = {"cuda": 256 << 20, "cpu": 64 << 20}  # rotating-input footprint (H200 L2: 50 MB)
MAX_COPIES = 64


# ------------------------------------------------------------------------------------------- CLI
def base_parser(description):
    import torch

    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="logits dtype")
    p.add_argument("--quick", action="store_true", help="fewer rows and repeats (GPU check script)")
    p.add_argument(
        "--json",
        default=None,
        type=json_path,
        help="write the results to this JSON file (case by case as they finish)",
    )
    p.add_argument("--reps", type=int, default=None, help="timed repeats (default: by device / --quick)")
    return p


def engine_parser(description, tasks, num_problems, timed=True):
    """The options of the benchmarks that run an embedded model end to end (bench_e2e and friends);
    timed: the benchmark reports tokens/s (and takes --repeats)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--model", default=None, help="embedded model name or checkpoint folder (default: tiny-llada-moe)"
    )
    p.add_argument("--tasks", default=tasks, help=f"comma-separated tasks of dinfer.tasks (default: {tasks})")
    p.add_argument("--num-problems", type=int, default=num_problems, help="held-out problems per task")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--dtype", default=None, help="model dtype (default: bf16 on a GPU, fp32 on the host)")
    p.add_argument(
        "--quick", action="store_true", help="a few problems per task, one timed run (the GPU check script)"
    )
    if timed:
        p.add_argument(
            "--repeats",
            type=int,
            default=3,
            help="timed runs per row; tokens/s is over the median run (default 3; --quick: 1)",
        )
    p.add_argument(
        "--json",
        default=None,
        type=json_path,
        help="write the results to this JSON file (run by run as they finish)",
    )
    return p


def repeats(args):
    """How many timed runs an engine benchmark makes per row (ValueError naming --repeats if < 1)."""
    if args.repeats < 1:
        raise ValueError(f"--repeats: must be >= 1, got {args.repeats}")
    return 1 if args.quick else args.repeats


def interleaved_medians(rows, run_once, repeats, key="tokens_per_second"):
    """Times every row `repeats` times, round-robin (row 1, row 2, ..., then again), so a drift of the
    host's speed over minutes lands on every row alike rather than on whichever rows ran then. Returns
    per row its median run (median_run) with every run's `key` in `tps_runs`. run_once(row, i) times
    row once; i is the pass (0: the first)."""
    runs = [[] for _ in rows]
    for i in range(repeats):
        for j, row in enumerate(rows):
            runs[j].append(run_once(row, i))
            record(f"{row} run {i}", runs[j][-1])
    out = []
    for row_runs in runs:
        best, rates = median_run(row_runs, key)
        out.append({**best, "tps_runs": rates})
    return out


def median_run(runs, key):
    """The run with the median `key` (the lower middle one for an even count) and every run's `key`.
    Decoding is deterministic, so the runs differ only in time: anything else differing is an error."""
    same = [{k: v for k, v in r.items() if k not in ("seconds", key)} for r in runs]
    if any(x != same[0] for x in same[1:]):
        raise RuntimeError(f"timed runs disagree beyond timing: {same}")
    ordered = sorted(runs, key=lambda r: r[key])
    return ordered[(len(ordered) - 1) // 2], [r[key] for r in runs]


def engine_llm(args):
    """The model an engine benchmark runs, on args.threads CPU threads when given."""
    import torch

    from dinfer.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    return LLM(args.model, device=args.device, dtype=args.dtype)


def finish_engine(bench, args, results, table, notes):
    """finish() for an engine benchmark: prints the table, records the model's name (not its path)."""
    from dinfer.models.embedded import DEFAULT

    print(table)
    env = environment(args.device)
    env["model"] = args.model or DEFAULT  # the name or path given, not this machine's install path
    return finish(bench, env, args, None, results, [table], notes)


def torch_dtype(name):
    import torch

    return getattr(torch, DTYPES[name])


def parse_ints(text):
    return [int(x) for x in str(text).split(",") if x.strip()]


# ------------------------------------------------------------------------------------------ timing
def nvtx_range(name):
    if nvtx is not None:
        return nvtx.annotate(name, color="green")
    import torch

    if torch.cuda.is_available():  # the `nvtx` package may be missing on a GPU image: torch has ranges too
        return torch.cuda.nvtx.range(name)
    import contextlib

    return contextlib.nullcontext()


def num_copies(nbytes_per_copy, device):
    """How many rotating input copies make the working set exceed the caches."""
    target = ROTATE_BYTES["cuda" if str(device).startswith("cuda") else "cpu"]
    return int(max(1, min(MAX_COPIES, math.ceil(target / max(1, nbytes_per_copy)))))


class Case:
    """One thing to time. fn(i) runs one call on rotating input copy i (0 <= i < copies).

    restore(): resets whatever the calls mutate (tokens) for every copy, so each call sees the same
    input; it runs outside the timed calls on the CPU, and once per pass over the copies inside a
    captured graph (amortised over the copies). setup(): once before a measurement set (reset state).
    graph=False: never try CUDA-graph capture (the case synchronises with the host).
    """

    def __init__(self, name, fn, copies=1, restore=None, setup=None, graph=True):
        self.name, self.fn, self.copies = name, fn, copies
        self.restore, self.setup, self.graph = restore, setup, graph


def _restore(case):
    if case.restore is not None:
        case.restore()


def _time_cpu(case, warmup, reps, min_seconds, max_reps=500):
    """At least `reps` single-call samples, more until `min_seconds` of calls (the median is robust
    to a shared, busy host)."""
    for i in range(warmup):
        _restore(case)
        case.fn(i % case.copies)
    times = []
    with nvtx_range(case.name):
        while len(times) < reps or (sum(times) < min_seconds and len(times) < max_reps):
            _restore(case)
            t0 = time.perf_counter()
            case.fn(len(times) % case.copies)
            times.append(time.perf_counter() - t0)
    return times, "perf_counter"


def _time_cuda_graph(case, reps, min_calls=20):
    import torch

    calls = max(case.copies, min_calls)
    calls = math.ceil(calls / case.copies) * case.copies
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream before capture
        for i in range(case.copies):
            if i == 0:
                _restore(case)
            case.fn(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for j in range(calls):
            if j % case.copies == 0:
                _restore(case)
            case.fn(j % case.copies)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    with nvtx_range(case.name):
        for _ in range(reps):
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3 / calls)
    del g
    return times, f"cuda-graph x{calls}"


def _time_cuda_do_bench(case, reps, quick):
    import torch
    import triton.testing

    state = {"i": 0}

    def call():
        _restore(case)
        case.fn(state["i"] % case.copies)
        state["i"] += 1

    call()
    torch.cuda.synchronize()
    with nvtx_range(case.name):
        ms = triton.testing.do_bench(
            call, warmup=10 if quick else 25, rep=40 if quick else 100, return_mode="all"
        )
    return [t * 1e-3 for t in ms], "do_bench"


def measure(case, device, quick=False, reps=None):
    """Times `case`; returns a dict with median_s, p20_s, p80_s, timer, note."""
    note = ""
    if case.setup is not None:
        case.setup()
    if str(device).startswith("cuda"):
        import torch

        reps = reps or (10 if quick else 30)
        times = None
        if case.graph:
            try:
                times, timer = _time_cuda_graph(case, reps)
            except Exception as e:
                note = f"graph capture failed ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
                torch.cuda.synchronize()
                if case.setup is not None:
                    case.setup()
        if times is None:
            times, timer = _time_cuda_do_bench(case, reps, quick)
    else:
        reps = reps or (5 if quick else 15)
        times, timer = _time_cpu(case, warmup=1 if quick else 2, reps=reps, min_seconds=0.2 if quick else 1.0)
    q = statistics.quantiles(times, n=5) if len(times) >= 2 else [times[0]] * 4
    res = {
        "median_s": statistics.median(times),
        "p20_s": q[0],
        "p80_s": q[3],
        "timer": timer,
        "n": len(times),
        "note": note,
    }
    record(case.name, res)
    return res


def copy_bandwidth(device, nbytes=None, quick=False):
    """Measured device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    import torch

    cuda = str(device).startswith("cuda")
    nbytes = nbytes or ((1 << 30) if cuda else (256 << 20))
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    res = measure(Case("copy_bandwidth", lambda i: dst.copy_(src)), device, quick=quick)
    res["GBps"] = 2 * nbytes / res["median_s"] / 1e9
    res["bytes"] = nbytes
    return res


def matmul_rate(device, dtype, quick):
    """Measured dense matmul rate (TFLOP/s) of `dtype` on a square problem."""
    import torch

    n = (8192 if not quick else 4096) if device == "cuda" else 512
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    res = measure(Case(f"matmul {n}^3", lambda i: a @ b), device, quick=quick)
    res["TFLOPs"] = 2.0 * n**3 / res["median_s"] / 1e12
    res["n"] = n
    return res


def sync(device):
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------ environment
def git_commit():
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        # Changed results (this folder's outputs) do not make the code dirty: one benchmark's
        # new JSON must not mark the next run's.
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench_kernels/results"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return (out.stdout.strip() or "unknown") + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def cpu_name():
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                return f"{ln.split(':', 1)[1].strip()} ({os.cpu_count()} threads)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device):
    import torch

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
        "cpu": cpu_name(),
        "cpu_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "loadavg_1min": round(os.getloadavg()[0], 2),
        "argv": " ".join(sys.argv),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if str(device).startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    return env


# ------------------------------------------------------------------------------------------ output
def fmt(v, spec=".3g"):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def markdown_table(rows, columns):
    """rows: list of dicts; columns: list of (header, key, format spec or None)."""
    head = "| " + " | ".join(h for h, _, _ in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    lines = [head, sep]
    for r in rows:
        cells = []
        for _, key, spec in columns:
            v = r.get(key)
            cells.append(fmt(v, spec) if spec else ("-" if v is None else str(v)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(path, payload, quiet=False):
    """Writes through a temporary file and a rename, so that a run killed mid-write leaves the last
    complete file."""
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    os.replace(tmp, path)
    if not quiet:
        print(f"wrote {path}")


# A benchmark cut short (the GPU check's time limits) must keep what it measured: the --json file is
# registered as it is parsed, every finished case is appended to it at once, and finish() replaces
# the partial payload with the whole one.
_progress = {"path": None, "cases": []}


def json_path(path):
    """argparse type of --json: registers the file that record() appends to."""
    _progress["path"], _progress["cases"] = path, []
    return path


def record(name, result):
    """Appends one finished case to the --json file, which stays valid JSON after every case
    ({"bench", "complete": false, "cases"} until finish())."""
    _progress["cases"].append({"case": name, **result})
    if _progress["path"]:
        write_json(
            _progress["path"],
            {"bench": Path(sys.argv[0]).stem, "complete": False, "cases": _progress["cases"]},
            quiet=True,
        )


def finish(bench, env, args, bandwidth, results, tables, notes):
    """Prints the notes and writes the JSON payload every bench script returns."""
    for n in notes:
        print("note:", n)
    payload = {
        "bench": bench,
        "complete": True,
        "env": env,
        "args": vars(args),
        "copy_bandwidth": bandwidth,
        "results": results,
        "tables": tables,
        "notes": notes,
        "cases": _progress["cases"],
    }
    write_json(args.json, payload)
    return payload


# ------------------------------------------------------------------------------------------ report
# The sections of a gpu_check.sh report, each with the steps (names in OUT_DIR/steps.tsv) it covers.
# Every section is always written: what ran, or why not.
SECTIONS = [
    ("Environment", ("nvidia-smi", "versions", "dinfer_kernels-info")),
    ("Build", ("build",)),
    ("Selftest", ("selftest",)),
    ("GPU tests", ("gpu-tests",)),
    ("Sanitizer", ("kernel-calls", "memcheck", "racecheck")),
]


def bench_names():
    """Every benchmark script, the kernels' first (their targets need a GPU), then the engine's."""
    first = ["bench_attention", "bench_moe", "bench_decode", "bench_soft_embedding", "bench_norm_rope"]
    found = sorted(p.stem for p in (ROOT / "bench_kernels").glob("bench_*.py"))
    return [n for n in first if n in found] + [n for n in found if n not in first]


def _junit_summary(path):
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tot = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    secs = sum(float(s.get("time", 0)) for s in suites)
    passed = tot["tests"] - tot["failures"] - tot["errors"] - tot["skipped"]
    failed = [
        f"{c.get('classname')}::{c.get('name')}"
        for c in root.iter("testcase")
        if c.find("failure") is not None or c.find("error") is not None
    ]
    line = (
        f"{passed} passed, {tot['failures']} failed, {tot['errors']} errors, "
        f"{tot['skipped']} skipped in {secs:.1f}s"
    )
    return line, failed


def _read_steps(out):
    steps = {}
    if (out / "steps.tsv").exists():
        for ln in (out / "steps.tsv").read_text().splitlines():
            parts = ln.split("\t")
            if len(parts) >= 3:
                steps[parts[0]] = {
                    "step": parts[0],
                    "rc": parts[1],
                    "seconds": parts[2],
                    "note": parts[3] if len(parts) > 3 else "",
                }
    return steps


def _step_line(st):
    if st["rc"] == "skipped":
        return f"- `{st['step']}`: skipped — {st['note']}"
    status = "ok" if st["rc"] == "0" else ("TIMED OUT" if st["rc"] in ("124", "137") else f"exit {st['rc']}")
    return f"- `{st['step']}`: {status} in {st['seconds']} s" + (f" — {st['note']}" if st["note"] else "")


def _tail(path, n):
    lines = Path(path).read_text(errors="replace").splitlines() if Path(path).exists() else []
    return lines[-n:]


def _section_body(title, out, rep):
    """The lines of one section beyond its step lines."""
    if title == "Environment" and (out / "environment.txt").exists():
        return ["```"] + _tail(out / "environment.txt", 40) + ["```"]
    if title == "Build" and (out / "ptxas.txt").exists():
        return ["ptxas resource report (spills):", "```"] + _tail(out / "ptxas.txt", 30) + ["```"]
    if title == "Selftest" and (out / "selftest.json").exists():
        try:
            data = json.loads((out / "selftest.json").read_text())
        except ValueError as e:
            return [f"selftest.json unreadable: {e}"]
        rows = data["rows"]
        rep["selftest"] = f"{sum(r['ok'] for r in rows)}/{len(rows)} ok" + (
            "" if data.get("complete") else " (INCOMPLETE: stopped before the last row)"
        )
        cols = [
            ("op", "op", None),
            ("backend", "backend", None),
            ("device", "device", None),
            ("dtype", "dtype", None),
            ("shape", "shape", None),
            ("max error", "max_error", ".3g"),
            ("bound", "bound", ".3g"),
            ("ok", "ok", None),
            ("s", "seconds", None),
            ("note", "note", None),
        ]
        return [markdown_table(rows, cols)] + [f"- skipped: {x}" for x in data.get("skipped", [])]
    if title == "GPU tests" and (out / "junit.xml").exists():
        try:
            rep["tests"], rep["failed_tests"] = _junit_summary(out / "junit.xml")
        except Exception as e:
            return [f"junit.xml unreadable: {e}"]
        return [f"{rep['tests']}"] + [f"- FAILED `{t}`" for t in rep["failed_tests"][:50]]
    if title == "GPU tests" and (out / "gpu-tests.log").exists():
        return ["no junit.xml; the log ends:", "```"] + _tail(out / "gpu-tests.log", 8) + ["```"]
    if title == "Sanitizer":
        body = []
        for tool in ("memcheck", "racecheck"):
            summary = [
                ln
                for ln in _tail(out / f"{tool}.log", 400)
                if "ERROR SUMMARY" in ln or "RACECHECK SUMMARY" in ln
            ]
            if summary:
                rep["sanitizer"][tool] = summary[-1].strip()
                body.append(f"- {tool}: {summary[-1].strip()}")
        return body
    return []


def _bench_section(name, out, steps, rep):
    md = [f"### {name}", ""]
    if name in steps:
        md += [_step_line(steps[name])]
    jf = out / f"{name}.json"
    if not jf.exists():
        return md + (["- no JSON written"] if name in steps else ["- not part of this run"]) + [""]
    try:
        data = json.loads(jf.read_text())
    except ValueError as e:
        rep["benchmarks"][name] = {"error": f"unreadable: {e}"}
        return md + [f"- {name}.json unreadable: {e}", ""]
    rep["benchmarks"][name] = data
    if not data.get("complete"):
        cases = data.get("cases", [])
        md += [
            f"- INCOMPLETE: {len(cases)} cases finished before it stopped",
            "",
            markdown_table(
                cases, [("case", "case", None), ("median s", "median_s", ".3g"), ("timer", "timer", None)]
            )
            if cases
            else "",
        ]
        return md + [""]
    env = data.get("env", {})
    md += [
        f"`{env.get('argv', '')}` — commit `{env.get('commit', '?')}`, {env.get('gpu') or env.get('cpu', '')}",
        "",
    ]
    md += [t + "\n" for t in data.get("tables", [])] + [f"- {n}" for n in data.get("notes", [])]
    rep["gpu"] = rep["gpu"] or env.get("gpu")
    return md + [""]


def print_versions():
    import importlib.util

    import torch

    print("python", platform.python_version())
    print(
        "torch",
        torch.__version__,
        "cuda",
        torch.version.cuda,
        "gpu",
        torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    )
    for name in ("triton", "pybind11", "cupy"):
        print(name, __import__(name).__version__ if importlib.util.find_spec(name) else "not installed")
    print(
        "pytest-timeout",
        "yes"
        if importlib.util.find_spec("pytest_timeout")
        else "no (the conftest's DINFER_TEST_TIMEOUT_S stands in)",
    )


def write_report(out_dir, mode="gpu check"):
    """OUT_DIR/report.md and report.json: every section of SECTIONS and every benchmark, each saying
    what ran (and its results) or why not."""
    out = Path(out_dir)
    rep = {
        "mode": mode,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "gpu": None,
        "selftest": None,
        "tests": None,
        "failed_tests": [],
        "sanitizer": {},
        "steps": [],
        "benchmarks": {},
    }
    try:
        import torch

        if torch.cuda.is_available():
            rep["gpu"] = torch.cuda.get_device_name(0)
    except Exception:
        pass
    steps = _read_steps(out)
    rep["steps"] = list(steps.values())
    body = []
    for title, names in SECTIONS:
        body += [f"## {title}", ""]
        mine = [steps[n] for n in names if n in steps]
        body += [_step_line(st) for st in mine] or ["- not part of this run"]
        body += [""] + _section_body(title, out, rep) + [""]
    body += ["## Benchmarks", ""]
    for name in bench_names():
        body += _bench_section(name, out, steps, rep)
    md = [
        f"# GPU check report ({mode})",
        "",
        f"- commit: `{rep['commit']}`",
        f"- date (UTC): {rep['date']}",
        f"- GPU: {rep['gpu'] or 'none'}",
        f"- selftest: {rep['selftest'] or 'not run'}",
        f"- GPU tests: {rep['tests'] or 'not run'}",
        f"- sanitizer: {'; '.join(f'{k}: {v}' for k, v in rep['sanitizer'].items()) or 'not run'}",
        "",
    ]
    (out / "report.md").write_text("\n".join(md + body))
    with open(out / "report.json", "w") as f:
        json.dump(rep, f, indent=1, default=str)
    print(f"wrote {out / 'report.md'} and {out / 'report.json'}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="bench_kernels helpers")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("report", help="summarise a gpu_check.sh output folder")
    r.add_argument("out_dir")
    r.add_argument("--mode", default="gpu check", help="what ran (the report's title)")
    sub.add_parser("versions", help="the Python packages the GPU check depends on")
    a = ap.parse_args()
    if a.cmd == "report":
        write_report(a.out_dir, a.mode)
    else:
        print_versions()
