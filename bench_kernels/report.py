"""The GPU check's report: `python bench_kernels/report.py report OUT_DIR` gathers OUT_DIR/*.json
written by the bench scripts (and OUT_DIR/steps.tsv, the steps' logs, OUT_DIR/junit-<step>.xml,
OUT_DIR/environment.txt, OUT_DIR/ptxas.txt, OUT_DIR/nsys_stats.txt when present) into OUT_DIR/report.md
and OUT_DIR/report.json; `python bench_kernels/report.py versions`
prints the Python packages the GPU check depends on. bench_kernels/gpu_check.sh calls both."""

import argparse
import datetime
import json
import platform
from pathlib import Path

from checkout import ROOT
from environment import git_commit
from markdown_tables import markdown_table

# The sections of a gpu_check.sh report, each with the steps (names in OUT_DIR/steps.tsv) it covers.
# Every section is always written: what ran, or why not. The benchmarks' steps (bench_<name>, hero)
# and their JSON files come after them.
SECTIONS = [
    ("Environment", ("environment",)),
    ("Build", ("build",)),
    ("Selftest", ("selftest",)),
    ("GPU tests", ("gpu-tests-fixes", "gpu-tests-rest", "gpu-tests")),
    ("Sanitizer", ("kernel-calls", "memcheck", "racecheck")),
    ("Profile of one forward", ("nsys",)),
]
BENCH_STEPS = ("hero", "e2e_synthetic")  # besides bench_<name>: steps that write benchmark JSON


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
        return ["```"] + _tail(out / "environment.txt", 150) + ["```"]
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
    if title == "GPU tests":
        body = []
        for step in ("gpu-tests-fixes", "gpu-tests-rest", "gpu-tests"):
            junit = out / f"junit-{step}.xml"
            if junit.exists():
                try:
                    line, failed = _junit_summary(junit)
                except Exception as e:
                    body.append(f"- {step}: junit-{step}.xml unreadable: {e}")
                    continue
                rep["tests"][step] = line
                rep["failed_tests"] += failed
                body += [f"- {step}: {line}"] + [f"  - FAILED `{t}`" for t in failed[:50]]
            elif (out / f"{step}.log").exists():
                body += (
                    [f"- {step}: no junit; the log ends:", "```"] + _tail(out / f"{step}.log", 8) + ["```"]
                )
        return body
    if title == "Profile of one forward" and (out / "nsys_stats.txt").exists():
        return (
            ["`nsys stats --report cuda_gpu_kern_sum,nvtx_sum`:", "```"]
            + _tail(out / "nsys_stats.txt", 150)
            + ["```"]
        )
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


def _bench_file(path, rep):
    """One benchmark JSON file's subsection."""
    md = [f"### {path.name}", ""]
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        rep["benchmarks"][path.name] = {"error": f"unreadable: {e}"}
        return md + [f"- unreadable: {e}", ""]
    rep["benchmarks"][path.name] = data
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


def _bench_files(out):
    """The benchmark JSON files in OUT_DIR (all but the report's and the selftest's), in bench_names()
    order of the benchmark each names, then by file name."""
    order = {name.removeprefix("bench_"): i for i, name in enumerate(bench_names())}
    found = []
    for path in sorted(out.glob("*.json")):
        if path.name in ("report.json", "selftest.json"):
            continue
        try:
            bench = str(json.loads(path.read_text()).get("bench", ""))
        except (ValueError, AttributeError):
            bench = ""  # unreadable: listed last, and its subsection says so
        found.append((order.get(bench.removeprefix("bench_"), len(order)), path.name, path))
    return [path for _, _, path in sorted(found)]


def _bench_section(out, steps, rep):
    """The benchmarks' steps (each bench_<name> step that wrote no <name>_*.json says so), then one
    subsection per JSON file."""
    files = _bench_files(out)
    md = []
    for st in steps.values():
        if st["step"].startswith("bench_") or st["step"] in BENCH_STEPS:
            md.append(_step_line(st))
            if st["step"] == "hero":  # how each case ended, and what no benchmark option covers yet
                lines = _tail(out / "hero.log", 40)
                start = next((i for i, ln in enumerate(lines) if ln == "hero cases:"), len(lines))
                md += [f"  {ln}" for ln in lines[start:]]
            stem = st["step"].removeprefix("bench_")
            if st["step"].startswith("bench_") and st["rc"] != "skipped":
                if not any(p.name.startswith(f"{stem}_") for p in files):
                    md.append(f"  - no JSON written ({stem}_*.json)")
    md = md or ["- no benchmark ran in this run"]
    md.append("")
    for path in files:
        md += _bench_file(path, rep)
    return md


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
        "tests": {},
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
    body += ["## Benchmarks", ""] + _bench_section(out, steps, rep)
    md = [
        f"# GPU check report ({mode})",
        "",
        f"- commit: `{rep['commit']}`",
        f"- date (UTC): {rep['date']}",
        f"- GPU: {rep['gpu'] or 'none'}",
        f"- selftest: {rep['selftest'] or 'not run'}",
        "- GPU tests: " + ("; ".join(f"{k}: {v}" for k, v in rep["tests"].items()) or "not run"),
        f"- sanitizer: {'; '.join(f'{k}: {v}' for k, v in rep['sanitizer'].items()) or 'not run'}",
        "",
    ]
    (out / "report.md").write_text("\n".join(md + body))
    with open(out / "report.json", "w") as f:
        json.dump(rep, f, indent=1, default=str)
    print(f"wrote {out / 'report.md'} and {out / 'report.json'}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="the GPU check's report")
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
