"""bench_kernels/bench_attention.py's paged case (LLaDA2 block decoding over a paged KV cache) runs on
the host: the peer's SDPA with a dense block-causal mask, ours paged and ours contiguous per host
backend, each agreeing with SDPA, with the ratio in the JSON; a prefix off the block grid is skipped
with a note."""

import json

from conftest import load_bench

from dinfer_kernels import available_backends


def test_paged_case_writes_every_method(tmp_path):
    out = tmp_path / "attention.json"
    load_bench("bench_attention").main(
        ["--device", "cpu", "--dtype", "fp32", "--quick", "--paged-only", "--paged-prefixes", "64,50"]
        + ["--paged-heads", "4", "--paged-kv-heads", "2", "--paged-head-dim", "64", "--page-size", "3"]
        + ["--reps", "2", "--json", str(out)]
    )
    payload = json.loads(out.read_text())
    assert payload["complete"]
    rows = payload["results"]
    host = [b for b in available_backends("cpu", "attention") if b != "triton"]
    assert {(r["key"], r["backend"]) for r in rows} == {("sdpa", "torch")} | {
        (f"{kind}_{b}", b) for b in host for kind in ("paged", "contiguous")
    }
    for r in rows:
        assert r["case"] == "paged" and r["prefix"] == 64 and r["S"] == 96 and r["page_size"] == 3
        assert r["us"] > 0 and r["x_sdpa"] > 0
        assert r["rel_err"] < 1e-5, r  # every method computes the same attention
    assert any("prefix=50 skipped" in n for n in payload["notes"])
    assert any("LLaDA2 paged block decoding" in t for t in payload["tables"])
