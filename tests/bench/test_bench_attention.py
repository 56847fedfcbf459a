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


def test_refresh_rows_and_batched_window_steps(tmp_path):
    """A full refresh times ours (delegation off), ours+sdpa (naming the aten op that took the dense
    prefix) and SDPA alone (naming torch's kernel); the batched window steps time the in-place SDPA,
    ours and ours paged at every batch size, with % of the bandwidth yardsticks, all agreeing."""
    out = tmp_path / "attention.json"
    load_bench("bench_attention").main(
        ["--device", "cpu", "--dtype", "fp32", "--quick", "--no-paged", "--windows", "64", "--refresh", "32"]
        + ["--densities", "1", "--window-rows", "8", "--heads", "2", "--kv-heads", "1", "--head-dim", "64"]
        + ["--batches", "1,3", "--batched-keys", "64", "--batched-rows", "8", "--page-size", "16"]
        + ["--backends", "cpu", "--reps", "2", "--json", str(out)]
    )
    payload = json.loads(out.read_text())
    assert payload["complete"]
    rows = payload["results"]
    refresh = {r["key"]: r for r in rows if r.get("case") != "batched" and r["W"] == r["S"]}
    assert set(refresh) == {"sdpa", "sdpa_alone", "ours_wb_cpu", "ours_sdpa_cpu"}
    assert refresh["ours_sdpa_cpu"]["backend"] == "cpu+_scaled_dot_product_flash_attention_for_cpu"
    assert refresh["sdpa_alone"]["backend"].startswith("torch ")
    for r in refresh.values():
        assert r["rel_err"] < 1e-5, r
    batched = [r for r in rows if r.get("case") == "batched"]
    assert {(r["B"], r["key"]) for r in batched} == {
        (B, key) for B in (1, 3) for key in ("sdpa", "ours_cpu", "paged_cpu")
    }
    for r in batched:
        assert r["S"] == 64 and r["W"] == 8 and r["us"] > 0 and r["GBps"] > 0 and r["pct_copy"] > 0
        assert r["rel_err"] < 1e-5, r
    assert any("batched window steps" in t for t in payload["tables"])
