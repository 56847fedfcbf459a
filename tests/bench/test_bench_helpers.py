"""The bench scripts' shared modules: the engine benchmarks' repeats (the median timed run, runs that
disagree beyond timing refused), the JSON kept valid after every case, and the GPU check's report."""

import argparse
import json
import re
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench_kernels"))  # as each bench script puts its own folder first
import cli_options
import engine_runs
import report
import results_json


def run(tps, forwards=10):
    return {"tokens_per_second": tps, "seconds": 100.0 / tps, "forwards": forwards, "tokens": 100}


def test_median_run_picks_the_middle_and_keeps_every_rate():
    best, rates = engine_runs.median_run([run(90.0), run(120.0), run(100.0)], "tokens_per_second")
    assert best["tokens_per_second"] == 100.0 and rates == [90.0, 120.0, 100.0]
    best, _ = engine_runs.median_run([run(120.0), run(90.0)], "tokens_per_second")
    assert best["tokens_per_second"] == 90.0  # even count: the lower middle


def test_median_run_refuses_runs_that_differ_beyond_timing():
    with pytest.raises(RuntimeError, match="disagree"):
        engine_runs.median_run([run(90.0), run(95.0, forwards=11)], "tokens_per_second")


def test_repeats_option():
    p = cli_options.engine_parser("x", "add", 1)
    assert cli_options.repeats(p.parse_args([])) == 3
    assert cli_options.repeats(p.parse_args(["--repeats", "5", "--quick"])) == 1
    with pytest.raises(ValueError, match="--repeats"):
        cli_options.repeats(p.parse_args(["--repeats", "0"]))
    untimed = cli_options.engine_parser("x", "add", 1, timed=False)
    with pytest.raises(SystemExit):
        untimed.parse_args(["--repeats", "2"])
    assert isinstance(untimed.parse_args([]), argparse.Namespace)


def test_interleaved_medians_run_passes_over_all_rows():
    calls = []

    def once(row, i):
        calls.append((row, i))
        return run(100.0 + 10 * i + row)

    out = engine_runs.interleaved_medians([1, 2], once, 3)
    assert calls == [(1, 0), (2, 0), (1, 1), (2, 1), (1, 2), (2, 2)]  # round-robin passes
    assert [r["tokens_per_second"] for r in out] == [111.0, 112.0]
    assert out[0]["tps_runs"] == [101.0, 111.0, 121.0]


def test_json_is_valid_after_every_case_and_whole_at_the_end(tmp_path, monkeypatch):
    path = str(tmp_path / "b.json")
    args = cli_options.base_parser("x").parse_args(["--device", "cpu", "--json", path])
    for i in range(3):
        results_json.record(f"case {i}", {"median_s": 0.1 * (i + 1)})
        data = json.loads(open(path).read())
        assert data["complete"] is False and [c["case"] for c in data["cases"]] == [
            f"case {j}" for j in range(i + 1)
        ]
    results_json.finish("x", {}, args, None, [], ["| t |"], [])
    data = json.loads(open(path).read())
    assert data["complete"] is True and len(data["cases"]) == 3 and data["tables"] == ["| t |"]


def test_report_says_what_ran_and_why_not(tmp_path):
    (tmp_path / "steps.tsv").write_text(
        "build\tskipped\t0\tdry run: the existing build is used\n"
        "gpu-tests-fixes\t0\t12.5\t\n"
        "bench_moe\t124\t20.0\tstopped at its limit of 20s\n"
        "bench_decode\t1\t3.0\t\n"
    )
    (tmp_path / "junit-gpu-tests-fixes.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1" time="12.0">'
        '<testcase classname="t" name="a"/><testcase classname="t" name="b"><failure/></testcase>'
        '<testcase classname="t" name="c"><skipped/></testcase></testsuite></testsuites>'
    )
    (tmp_path / "moe_h100.json").write_text(
        json.dumps({"bench": "bench_moe", "complete": False, "cases": [{"case": "moe T=4", "median_s": 0.5}]})
    )
    report.write_report(tmp_path, "test")
    md = (tmp_path / "report.md").read_text()
    assert "- `build`: skipped — dry run: the existing build is used" in md
    assert "- `bench_moe`: TIMED OUT in 20.0 s — stopped at its limit of 20s" in md
    assert "### moe_h100.json" in md and "INCOMPLETE: 1 cases finished" in md and "moe T=4" in md
    assert "- `bench_decode`: exit 1 in 3.0 s\n  - no JSON written (decode_*.json)" in md
    assert "- gpu-tests-fixes: 1 passed, 1 failed, 0 errors, 1 skipped in 12.0s\n  - FAILED `t::b`" in md
    assert "- GPU tests: gpu-tests-fixes: 1 passed, 1 failed" in md
    assert "## Sanitizer" in md and "- not part of this run" in md


@pytest.mark.parametrize(
    "case, nvtx",
    [
        ("ours moe[cuda] T=32", "ours.moe.cuda.T32"),
        ("sdpa+merge W=128 S=2048 d=0.25", "sdpa.merge.W128.S2048.d0.25"),
        ("rms_norm/fused[triton] rows=4096", "rms_norm.fused.triton.rows4096"),
        ("vicinity/auto/b8", "vicinity.auto.b8"),
        ("bench_forward.one", "bench_forward.one"),
        ("matmul 4096^3", "matmul.4096.3"),
        ("décode µs", "d.code.s"),
    ],
)
def test_nvtx_names_are_ascii_and_dotted(case, nvtx):
    import timing

    got = timing.nvtx_name(case)
    assert got == nvtx
    assert re.fullmatch(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*", got)


def test_nvtx_name_refuses_a_name_without_letters_or_digits():
    import timing

    with pytest.raises(ValueError, match="name"):
        timing.nvtx_name("[ ] =")


def test_timed_cases_keep_their_names_in_the_json_and_their_ranges_are_dotted(monkeypatch):
    import timing

    from dinfer_kernels import profiling

    pushed, recorded = [], []
    monkeypatch.setattr(
        profiling, "_NVTX", type("N", (), {"rangePushA": pushed.append, "rangePop": lambda: 0})
    )
    monkeypatch.setattr(timing, "record", lambda name, res: recorded.append(name))
    timing.measure(timing.Case("ours moe[cpu] T=4", lambda i: None), "cpu", quick=True, reps=2)
    assert pushed == ["ours.moe.cpu.T4"] and recorded == ["ours moe[cpu] T=4"]
