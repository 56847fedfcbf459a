"""bench_kernels/results_page.py: RESULTS.md is what the JSON in bench_kernels/results/ gives, and the
generator renders a run's machine, date, commit, command and tables from its JSON."""

import json

import pytest
from conftest import load_bench


@pytest.fixture(scope="module")
def page():
    return load_bench("results_page")


def payload(bench, env, **extra):
    return {"bench": bench, "complete": True, "env": env, "args": {"dtype": "bf16"}, **extra}


CPU_ENV = {
    "date": "2026-12-03T10:00:00+00:00",
    "commit": "0123456789abcdef0123456789abcdef01234567-dirty",
    "python": "3.11.7",
    "torch": "2.13.0+cpu",
    "cpu": "Test CPU (2 threads)",
    "cpu_threads": 2,
    "loadavg_1min": 0.5,
    "argv": "bench_kernels/bench_decode.py --device cpu --json x.json",
    "triton": "3.9.0",
}
GPU_ENV = {**CPU_ENV, "commit": "fedcba9876543210", "gpu": "NVIDIA H200", "cuda": "12.8"}


def test_results_md_matches_its_json(page, capsys):
    assert page.main(["--check"]) == 0, capsys.readouterr().out


def test_renders_a_synthetic_run(page, tmp_path):
    table = "| method | median µs |\n|---|---|\n| ours | 12.5 |"
    (tmp_path / "decode_cpu.json").write_text(
        json.dumps(payload("decode", CPU_ENV, tables=[table], notes=["busy host"]))
    )
    text = page.render(tmp_path, tmp_path)
    assert text.startswith(page.HEADER)
    body = text[len(page.HEADER) :]
    assert body == (
        "\n## decode\n\n"
        "Rows and columns: the docstring of `bench_kernels/bench_decode.py`.\n\n"
        "### Test CPU (2 threads), bf16 — 2026-12-03 — commit 0123456-dirty\n\n"
        "- command: `python bench_kernels/bench_decode.py --device cpu --json x.json`\n"
        "- run: 2026-12-03T10:00:00+00:00, commit `0123456789abcdef0123456789abcdef01234567-dirty`; "
        "2 torch threads, 1-min load average 0.5; Python 3.11.7, torch 2.13.0+cpu, triton 3.9.0\n"
        "- data: `decode_cpu.json`\n\n"
        f"{table}\n\n"
        "- note: busy host\n"
    )


def test_a_gpu_run_joins_its_benchmark_first_and_a_cut_run_shows_its_cases(page, tmp_path):
    (tmp_path / "decode_cpu.json").write_text(json.dumps(payload("decode", CPU_ENV, tables=["cpu table"])))
    (tmp_path / "decode_h200.json").write_text(json.dumps(payload("decode", GPU_ENV, tables=["gpu table"])))
    cut = {
        "bench": "bench_moe",
        "complete": False,
        "cases": [{"case": "ours", "median_s": 0.25, "timer": "x"}],
    }
    (tmp_path / "moe_h200.json").write_text(json.dumps(cut))
    text = page.render(tmp_path, tmp_path)
    assert text.count("## decode\n") == 1 and text.count("## moe\n") == 1
    assert text.index("## moe") < text.index("## decode")  # bench_kernels' order: moe before decode
    gpu, cpu = text.index("### NVIDIA H200 (CUDA 12.8), bf16"), text.index("### Test CPU (2 threads)")
    assert gpu < text.index("gpu table") < cpu < text.index("cpu table")
    assert "host CPU Test CPU (2 threads)" in text and "commit fedcba9\n" in text
    assert "Incomplete: 1 cases finished before the run stopped." in text
    assert "| ours | 0.25 | x |" in text


def test_check_fails_on_a_page_that_drifted(page, tmp_path, capsys):
    (tmp_path / "decode_cpu.json").write_text(json.dumps(payload("decode", CPU_ENV, tables=["t"])))
    md = tmp_path / "RESULTS.md"
    assert page.main(["--results", str(tmp_path), "--page", str(md)]) == 0
    assert page.main(["--check", "--results", str(tmp_path), "--page", str(md)]) == 0
    md.write_text(md.read_text() + "a number typed in by hand\n")
    assert page.main(["--check", "--results", str(tmp_path), "--page", str(md)]) == 1
    assert "differs" in capsys.readouterr().out
