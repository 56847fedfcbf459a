"""bench_kernels/bench_contention.py on a tiny run: every case timed idle and beside the hog, and the
JSON (the ratio is the benchmark's goal, not checked here)."""

import json

from conftest import load_bench


def test_bench_contention_quick_run(tmp_path):
    out = tmp_path / "contention.json"
    args = ["--quick", "--prompts", "2", "--rows", "4", "--vocab", "1000", "--hog-procs", "1"]
    load_bench("bench_contention").main(args + ["--json", str(out)])
    payload = json.loads(out.read_text())
    assert payload["complete"] and payload["bench"] == "contention"
    rows = {r["case"]: r for r in payload["results"]}
    assert list(rows) == [
        "generate 2 prompts",
        "decode_step cpu N 4 V 1000 bf16",
        "torch max(-1) N 4 V 1000 bf16",
    ]
    for r in rows.values():  # --quick: one round of each condition
        assert len(r["idle_runs_ms"]) == len(r["hog_runs_ms"]) == 1
        assert r["idle_ms"] == r["idle_runs_ms"][0] > 0 and r["hog_ms"] == r["hog_runs_ms"][0] > 0
        # the ratio of the unrounded times: the ms are rounded to 0.001, the ratio to 0.001
        ms_error = r["ratio"] * (0.0005 / r["idle_ms"] + 0.0005 / r["hog_ms"])
        assert abs(r["ratio"] - r["hog_ms"] / r["idle_ms"]) <= 0.0005 + ms_error
    gen = rows["generate 2 prompts"]
    for cond in ("idle", "hog"):  # who used the CPU during generate: the main thread did the work
        assert gen[f"{cond}_cpu_ms_main"] > 0 and gen[f"{cond}_cpu_ms_other_threads"] >= 0
    # each round is recorded as it finishes (a run cut short keeps them)
    assert {c["case"] for c in payload["cases"]} >= {
        f"{name} {cond} round 0" for name in rows for cond in ("idle", "hog")
    }
    assert payload["notes"][0].startswith("OpenMP wait policy: ")
    assert payload["env"]["model"] == "tiny-llada-moe"
