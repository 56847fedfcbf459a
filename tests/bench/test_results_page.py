"""bench_kernels/results_page.py: RESULTS.md and the README's headline table are what the JSON in
bench_kernels/results/ gives, and the generator renders a run's machine, date, commit, command and
tables from its JSON."""

import json
import shutil

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


def results_with_readme(page, tmp_path):
    """A copy of the results folder (the headline's files are in it) and a README with empty markers."""
    results = tmp_path / "results"
    shutil.copytree(page.RESULTS_DIR, results)
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\n{page.HEADLINE_BEGIN}\n{page.HEADLINE_END}\n\nafter\n")
    return results, readme


def test_check_fails_on_a_page_that_drifted(page, tmp_path, capsys):
    results, readme = results_with_readme(page, tmp_path)
    (results / "decode_cpu.json").write_text(json.dumps(payload("decode", CPU_ENV, tables=["t"])))
    md = tmp_path / "RESULTS.md"
    args = ["--results", str(results), "--page", str(md), "--readme", str(readme)]
    assert page.main(args) == 0
    assert page.main(["--check", *args]) == 0
    md.write_text(md.read_text() + "a number typed in by hand\n")
    assert page.main(["--check", *args]) == 1
    assert "differs" in capsys.readouterr().out


def test_readme_headline_is_what_the_generator_makes(page):
    readme = page.README.read_text()
    start, end = readme.index(page.HEADLINE_BEGIN), readme.index(page.HEADLINE_END)
    assert readme[start : end + len(page.HEADLINE_END)] == page.headline()


def test_headline_is_written_between_the_markers_and_checked(page, tmp_path, capsys):
    results, readme = results_with_readme(page, tmp_path)
    args = ["--results", str(results), "--page", str(tmp_path / "RESULTS.md"), "--readme", str(readme)]
    assert page.main(args) == 0
    text = readme.read_text()
    assert text.startswith("# title\n\n") and text.endswith("\n\nafter\n")
    assert page.headline(results) in text
    # a row of the headline, from the JSON: the dinfer-full recipe at batch 1 against vanilla
    e2e = json.loads((results / "e2e_cpu.json").read_text())
    full, vanilla = (
        next(r for r in e2e["results"] if r["recipe"] == name and r["batch"] == 1 and r["backend"] == "auto")
        for name in ("dinfer-full", "vanilla")
    )
    speedup = full["tokens_per_second"] / vanilla["tokens_per_second"]
    env = e2e["env"]
    assert (
        f"| {env['model']} | dinfer-full | 1 | {full['accuracy']:.3f} | {full['tokens_per_forward']:.2f} "
        f"| {full['tokens_per_second']:.1f} | {speedup:.2f}x vanilla | {env['cpu']} | {env['date'][:10]} "
        f"| {env['commit'][:7]}"
    ) in text
    readme.write_text(text.replace(f"{full['tokens_per_second']:.1f}", "9999.9"))
    assert page.main(["--check", *args]) == 1
    assert "README.md differs" in capsys.readouterr().out


def test_headline_names_the_file_a_picked_row_is_missing_from(page, tmp_path):
    results, _ = results_with_readme(page, tmp_path)
    e2e = json.loads((results / "e2e_cpu.json").read_text())
    e2e["results"] = [r for r in e2e["results"] if r["recipe"] != "dinfer-full"]
    (results / "e2e_cpu.json").write_text(json.dumps(e2e))
    with pytest.raises(ValueError, match="e2e_cpu.json: 0 results"):
        page.headline(results)


def test_readme_without_markers_is_refused(page):
    with pytest.raises(ValueError, match="headline markers"):
        page.with_headline("# a README\n", "table")


def test_a_command_names_no_machine_folder(page):
    """The GPU check writes its JSON into its output folder; the page shows that folder as $OUT."""
    argv = "bench_kernels/bench_moe.py --quick --device cuda --json /somewhere/out/bench_moe.json"
    assert page.command(argv) == "bench_kernels/bench_moe.py --quick --device cuda --json $OUT/bench_moe.json"
    kept = "bench_kernels/bench_e2e.py --json bench_kernels/results/e2e_cpu.json"
    assert page.command(kept) == kept


def test_a_gpu_run_must_name_its_gpu(page, tmp_path):
    (tmp_path / "decode_h100.json").write_text(json.dumps(payload("decode", GPU_ENV, tables=["t"])))
    with pytest.raises(
        ValueError, match=r"decode_h100.json: a run on NVIDIA H200 must be named \*_h200.json"
    ):
        page.render(tmp_path, tmp_path)


def test_a_gpu_run_states_its_yardsticks_against_its_datasheet(page, tmp_path):
    old = payload(
        "moe", GPU_ENV, tables=["t"], copy_bandwidth={"GBps": 2400.0}
    )  # a run before the read yardstick
    new = payload(
        "decode", GPU_ENV, tables=["t"], bandwidth={"copy": {"GBps": 2400.0}, "read": {"GBps": 4320.0}}
    )
    (tmp_path / "moe_h200.json").write_text(json.dumps(old))
    (tmp_path / "decode_h200.json").write_text(json.dumps(new))
    (tmp_path / "decode_cpu.json").write_text(
        json.dumps(payload("decode", CPU_ENV, bandwidth=new["bandwidth"]))
    )
    text = page.render(tmp_path, tmp_path)
    # 4.8 TB/s is the H200's datasheet: 2400 GB/s is 50 % of it, 4320 GB/s 90 %; the host has no datasheet
    assert "- yardsticks: copy 2400 GB/s = 50 % of the datasheet's 4.8 TB/s (NVIDIA H200)\n" in text
    assert "- yardsticks: copy 2400 GB/s = 50 %; read 4320 GB/s = 90 % of the datasheet's 4.8 TB/s" in text
    assert text.count("- yardsticks:") == 2
