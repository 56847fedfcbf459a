"""bench_kernels/bench_serving.py on a tiny run: a server in a subprocess, its rows, the answers equal
to LLM.generate's in-process, and the JSON."""

import json

import pytest
import torch
from conftest import load_bench

pytest.importorskip("fastapi")
pytest.importorskip("httpx")


def test_bench_serving_quick_run(tmp_path):
    out = tmp_path / "serving.json"
    threads = torch.get_num_threads()
    try:
        load_bench("bench_serving").main(
            ["--tasks", "add,chain", "--concurrency", "1,3", "--quick", "--device", "cpu", "--json", str(out)]
        )
    finally:  # the bench runs torch on one thread (--threads 1): the tests after it get theirs back
        torch.set_num_threads(threads)
    payload = json.loads(out.read_text())
    rows = payload["results"]
    assert [r["concurrency"] for r in rows] == [1, 3]
    for r in rows:
        assert r["requests"] == 4 and r["same_answers"] and r["tokens"] > 0
        assert r["ratio"] == round(r["inprocess_seconds"] / r["seconds"], 3)
        assert r["requests_per_second"] == round(4 / r["seconds"], 2)
        assert 0 < r["first_block_p50_ms"] <= r["first_block_p99_ms"]
        assert r["rps_runs"] == [r["requests_per_second"]]  # --quick: one timed run
    assert payload["env"]["model"] == "tiny-llada-moe" and len(payload["notes"]) == 2
