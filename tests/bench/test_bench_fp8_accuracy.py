"""bench_kernels/bench_fp8_accuracy.py on a tiny run: bf16 and FP8 rows per model on the same problems,
and the layer rows' errors (FP8 well above bf16's own rounding, yet a few percent at most)."""

import json

from conftest import load_bench


def test_bench_fp8_accuracy_quick_run(tmp_path):
    out = tmp_path / "fp8.json"
    load_bench("bench_fp8_accuracy").main(
        ["--quick", "--tasks", "add", "--shrink", "8", "--backend", "torch", "--json", str(out)]
    )
    payload = json.loads(out.read_text())
    tasks, layers = payload["results"]["tasks"], payload["results"]["layers"]
    assert [(r["model"], r["experts"]) for r in tasks] == [
        (m, e) for m in ("tiny-llada-moe", "tiny-llada2") for e in ("bf16", "fp8")
    ]
    assert all(r["forwards"] > 0 and 0 <= r["accuracy"] <= 1 for r in tasks)
    assert [(r["shape"], r["E"], r["H"], r["S"]) for r in layers] == [
        ("LLaDA-MoE-7B", 8, 256, 0),
        ("LLaDA2-mini", 32, 256, 64),
    ]
    for r in layers:
        assert r["bf16_err_rms_rel"] < r["fp8_err_rms_rel"] < 0.1
        assert 0.5 < r["expert_bytes_ratio"] < 0.51  # one byte per weight, plus the scales
