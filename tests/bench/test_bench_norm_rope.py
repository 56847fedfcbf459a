"""bench_kernels/bench_norm_rope.py runs on the host, times every method of every op and writes its
JSON with the speedup against the reference and the difference from it (qk_rope also against the
rms_norm + rope calls it replaces)."""

import json

from conftest import load_bench

from dinfer_kernels import available_backends


def test_quick_run_writes_every_case(tmp_path):
    out = tmp_path / "norm_rope.json"
    load_bench("bench_norm_rope").main(
        ["--device", "cpu", "--quick", "--rows", "3", "--reps", "3", "--json", str(out)]
    )
    payload = json.loads(out.read_text())
    results = payload["results"]
    assert any("triton skipped" in n for n in payload["notes"])
    for op, name in (
        ("rms_norm", "rms_norm"),
        ("qk_norm", "rms_norm"),
        ("rope", "rope"),
        ("qk_rope", "qk_rope"),
    ):
        got = {(r["method"], r["backend"]) for r in results if r["op"] == op}
        backends = set(available_backends("cpu", name)) - {"triton"}  # bf16: not in the interpreter
        want = {("torch fused", "eager")} | {("ours", b) for b in backends}
        if op == "qk_rope":  # and the four calls it replaces
            want |= {("norm+rope x2", b) for b in backends}
        assert got == want
    for r in results:
        assert r["us"] > 0 and r["speedup"] > 0
        assert r["rel_err"] < 1e-2, r  # every method computes the same op
