"""bench_kernels/bench_batching.py on a tiny run: the three rows, decoded the same, and the JSON."""

import json

from conftest import load_bench


def test_bench_batching_quick_run(tmp_path):
    out = tmp_path / "batching.json"
    load_bench("bench_batching").main(
        ["--num-problems", "3", "--batch", "4", "--device", "cpu", "--repeats", "2", "--json", str(out)]
    )
    payload = json.loads(out.read_text())
    rows = {r["mode"]: r for r in payload["results"]}
    assert set(rows) == {"batch 1", "runs", "continuous"}
    one, runs, cont = rows["batch 1"], rows["runs"], rows["continuous"]
    # 12 prompts: batch 1 runs one sequence per forward; runs of 4 and continuous decode the same tokens.
    assert one["forwards"] == one["sequence_forwards"] and runs["batch"] == cont["batch"] == 4
    assert (
        one["accuracy"] == runs["accuracy"] == cont["accuracy"]
        and one["tokens"] == runs["tokens"] == cont["tokens"]
    )
    # At most 4 in flight: fewer batch forwards than batch 1, never more than 4 sequences in one.
    for r in (runs, cont):
        assert one["forwards"] > r["forwards"] and r["sequence_forwards"] <= 4 * r["forwards"]
    for r in rows.values():  # two timed runs; TPS from the slower (lower middle)
        assert len(r["tps_runs"]) == 2 and r["tokens_per_second"] == min(r["tps_runs"])
    assert cont["speedup_vs_batch1"] == round(cont["tokens_per_second"] / one["tokens_per_second"], 2)
    assert any(n.startswith("continuous / runs, tokens/s") for n in payload["notes"])
