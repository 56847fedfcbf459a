"""bench_kernels/gpu_check.sh --dry-run: the GPU check's plumbing on this CPU machine (host backends,
tiny shapes, the existing build), so the script cannot rot between the rare runs on a GPU. It must
write OUT/report.md with every section, each saying what ran or why not, and leave the checkout as it
was."""

import json
import re
import subprocess
import sys
import tarfile

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench_kernels"))
import report


def checkout_state():
    return subprocess.run(
        ["git", "status", "--porcelain", "--ignored"], cwd=ROOT, capture_output=True, text=True
    ).stdout


@pytest.mark.slow
def test_dry_run_writes_every_section(tmp_path):
    before = checkout_state()
    out = tmp_path / "out"
    run = subprocess.run(
        ["bash", "bench_kernels/gpu_check.sh", "--dry-run", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
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
    assert re.search(r"- selftest: (\d+)/\1 ok", md), "selftest did not pass"
    assert re.search(r"- GPU tests: 0 passed, 0 failed, 0 errors, [1-9]\d* skipped", md)
    assert "- `build`: skipped — dry run" in md and "- `memcheck`: skipped — dry run" in md
    assert "- `kernel-calls`: ok" in md
    with tarfile.open(out / "raw.tar.gz") as tar:
        raw = set(tar.getnames())
    assert {"junit.xml", "selftest.json", "steps.tsv", "gpu-tests.log"} <= raw
    rep = json.loads((out / "report.json").read_text())
    for i, name in enumerate(report.bench_names()):
        assert f"### {name}" in md
        step = next(s for s in rep["steps"] if s["step"] == name)
        # A benchmark finished (its whole JSON), or on a busy host was stopped at its limit, or (an
        # engine benchmark, the last ones) found the budget used up: each said so in the report.
        late = i >= 5 and step["rc"] == "skipped" and "budget" in step["note"]
        assert step["rc"] == "0" or step["note"].startswith("stopped at its limit") or late, step
        if step["rc"] == "0":
            assert rep["benchmarks"][name]["complete"], name
