"""bench_kernels/gpu_check.sh: its plan (the steps and limits that run) fits one command of a lent GPU
machine, and --dry-run runs that plan's plumbing on this CPU machine (host and interpreter backends,
tiny shapes, the existing build), so the script cannot rot between the rare runs on a GPU. A dry run
must write OUT/report.md with every section, each saying what ran or why not, name its result files
after the device, and leave the checkout as it was."""

import json
import re
import subprocess
import sys
import tarfile
import time

import pytest
from conftest import ROOT, load_bench

sys.path.insert(0, str(ROOT / "bench_kernels"))
import report

COMMAND_S = 540  # one command on the lent machine: <= 600 s, less the start of the call and the copies back
ONE_CALL_ORDER = [
    "environment",
    "build",
    "selftest",
    "gpu-tests",
    "bench_forward",
    "e2e_synthetic",
    "hero",
    "nsys",
    "report",
]


def plan(*options):
    """[(step, limit)] and the total of `gpu_check.sh --plan`: the limits the script runs its steps with."""
    out = subprocess.run(
        ["bash", "bench_kernels/gpu_check.sh", *options, "--plan"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    rows = [ln.split("\t") for ln in out.splitlines()]
    assert rows[-1][0] == "total", out
    return [(name, int(limit)) for name, limit in rows[:-1]], int(rows[-1][1])


@pytest.mark.parametrize("options", [(), ("--more",)], ids=["one call", "more"])
def test_each_call_fits_one_command(options):
    steps, total = plan(*options)
    assert total == sum(limit for _, limit in steps)
    assert total <= COMMAND_S, f"{' '.join(options) or 'the one call'}: {total} s of steps > {COMMAND_S} s"
    assert all(limit >= 10 for _, limit in steps), steps


def test_the_one_call_proves_and_measures_in_order():
    steps, _ = plan()
    assert [name for name, _ in steps] == ONE_CALL_ORDER


def test_more_runs_every_benchmark_and_the_sanitizer():
    names = [name for name, _ in plan("--more")[0]]
    assert {"gpu-tests", "memcheck", "racecheck"} <= set(names)
    assert set(report.bench_names()) <= set(names)


def checkout_state():
    return subprocess.run(
        ["git", "status", "--porcelain", "--ignored"], cwd=ROOT, capture_output=True, text=True
    ).stdout


def dry_run(out, *options):
    """Runs the dry run into `out`; (report.md, report.json, the names in raw.tar.gz, seconds)."""
    before = checkout_state()
    t0 = time.monotonic()
    run = subprocess.run(
        ["bash", "bench_kernels/gpu_check.sh", *options, "--dry-run", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    seconds = time.monotonic() - t0
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert checkout_state() == before, "the dry run wrote into the checkout"
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu_check.log",
        "raw.tar.gz",
        "report.json",
        "report.md",
    ]
    md = (out / "report.md").read_text()
    for title, _ in report.SECTIONS:
        assert f"## {title}" in md
    with tarfile.open(out / "raw.tar.gz") as tar:
        raw = set(tar.getnames())
    rep = json.loads((out / "report.json").read_text())
    return md, rep, raw, seconds


def assert_finished_or_cut(step):
    """A benchmark step finished, or on a busy host was stopped at its limit or found the budget used
    up, and said so."""
    assert (
        step["rc"] == "0"
        or step["note"].startswith("stopped at its limit")
        or (step["rc"] == "skipped" and "budget" in step["note"])
    ), step


@pytest.mark.slow
def test_dry_run_of_the_one_call(tmp_path):
    md, rep, raw, seconds = dry_run(tmp_path / "out")
    assert seconds < 280
    ran = [s["step"] for s in rep["steps"]]
    # The plan's steps, in its order (the GPU tests as the fixes' and the rest's; the report has none).
    expected = [s for s in ONE_CALL_ORDER if s != "report"]
    expected[expected.index("gpu-tests")] = "gpu-tests-fixes"
    expected.insert(expected.index("gpu-tests-fixes") + 1, "gpu-tests-rest")
    assert ran == expected
    assert re.search(r"- selftest: (\d+)/\1 ok", md), "selftest did not pass"
    for step in ("gpu-tests-fixes", "gpu-tests-rest"):
        assert re.search(rf"- {step}: 0 passed, 0 failed, 0 errors, [1-9]\d* skipped", md), step
    assert "- `build`: skipped — dry run" in md and "- `nsys`: skipped — dry run" in md
    assert {"junit-gpu-tests-fixes.xml", "junit-gpu-tests-rest.xml", "selftest.json", "steps.tsv"} <= raw
    assert (
        "environment.txt" in raw
        and "results named *_cpu.json" in (tmp_path / "out/gpu_check.log").read_text()
    )
    steps = {s["step"]: s for s in rep["steps"]}
    assert_finished_or_cut(steps["hero"])
    if (ROOT / "bench_kernels/bench_forward.py").exists():
        assert_finished_or_cut(steps["bench_forward"])
    else:
        assert steps["bench_forward"]["rc"] == "skipped" and steps["bench_forward"]["note"].startswith(
            "missing"
        )
    written = [name for name in raw if name.endswith(".json") and name not in ("selftest.json",)]
    assert written and all(name.endswith("_cpu.json") for name in written), written
    if steps["hero"]["rc"] == "0":
        assert {"moe_llada-moe_cpu.json", "moe_llada2-mini_cpu.json", "attention_hero_cpu.json"} <= raw
        for name in written:
            assert rep["benchmarks"][name]["complete"], name
            assert f"### {name}" in md
    assert_finished_or_cut(steps["e2e_synthetic"])
    if steps["e2e_synthetic"]["rc"] == "0":
        synthetic = {"e2e_synthetic_llada-moe-7b_cpu.json", "e2e_synthetic_llada2-mini_cpu.json"}
        assert synthetic <= raw and all(f"### {name}" in md for name in synthetic)
        assert all(rep["benchmarks"][name]["complete"] for name in synthetic)


@pytest.mark.slow
def test_dry_run_of_more(tmp_path):
    md, rep, raw, seconds = dry_run(tmp_path / "out", "--more")
    assert seconds < 280
    steps = {s["step"]: s for s in rep["steps"]}
    assert steps["kernel-calls"]["rc"] == "0" and "- `memcheck`: skipped — dry run" in md
    assert re.search(r"- gpu-tests: 0 passed, 0 failed, 0 errors, [1-9]\d* skipped", md)
    for i, name in enumerate(report.bench_names()):
        step = steps[name]
        assert_finished_or_cut(step)
        if i < 5:  # the kernels' benchmarks come first and fit in any case
            assert step["rc"] == "0" or step["note"].startswith("stopped"), step
        if step["rc"] == "0":
            file = f"{name.removeprefix('bench_')}_cpu.json"
            assert rep["benchmarks"][file]["complete"], file


def test_hero_cases_past_their_time_stop_and_the_rest_still_run(tmp_path, capsys):
    hero = load_bench("hero_cases")
    argv = sys.argv
    code = hero.main(
        ["--device", "cpu", "--out", str(tmp_path), "--gpu", "cpu", "--time-limit", "4", "--tiny"]
    )
    assert sys.argv == argv
    out = capsys.readouterr().out
    summary = out[out.index("hero cases:") :]
    ended = dict(ln.strip().split(": ", 1) for ln in summary.splitlines()[1 : 1 + len(hero.HERO)])
    assert list(ended) == [label for label, *_ in hero.HERO]
    # 4 s cannot hold every case on this host: some stopped or never started, and the run says so
    assert code == 1 and any(how != "ok" for how in ended.values())
    for label, how in ended.items():
        path = tmp_path / f"{label}_cpu.json"
        if how == "ok":
            assert json.loads(path.read_text())["complete"] is True
        elif how.startswith("stopped") and path.exists():  # cut mid-case: the finished cases, valid JSON
            assert json.loads(path.read_text())["complete"] is False
        else:
            assert how.startswith(("stopped", "not run")), how
