"""bench_kernels/bench_credit.py on a tiny run: the sweep's rows, the floor of one forward per block
and the ratios it reports."""

import json

from conftest import load_bench


def test_bench_credit_quick_run(tmp_path):
    out = tmp_path / "credit.json"
    load_bench("bench_credit").main(
        [
            "--quick",
            "--num-problems",
            "2",
            "--tasks",
            "add,chain",
            "--thresholds",
            "0.9,0.99",
            "--device",
            "cpu",
            "--json",
            str(out),
        ]
    )
    payload = json.loads(out.read_text())
    rows = payload["results"]
    assert [(r["threshold"], r["decoder"]) for r in rows] == [
        (tau, d) for tau in (0.9, 0.99) for d in ("threshold", "credit", "credit+smoothing")
    ]
    assert {r["block_length"] for r in rows} == {8}  # --quick: the model's block length only
    for i in range(0, len(rows), 3):
        base = rows[i]
        assert base["tpf_vs_threshold"] == 1.0
        for r in rows[i : i + 3]:
            assert r["blocks"] >= 4 and r["forwards"] >= r["blocks"]  # 4 prompts, >= 1 forward per block
            assert r["ceiling"] == round(base["forwards"] / base["blocks"], 3)
            assert r["tpf_vs_threshold"] == round(r["tokens_per_forward"] / base["tokens_per_forward"], 3)
    assert payload["notes"][0].startswith("credit+smoothing TPF / threshold-only, best")
