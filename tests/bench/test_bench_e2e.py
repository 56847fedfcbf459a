"""bench_kernels/bench_e2e.py end to end on a tiny run: every recipe and backend, the batch-8 row, the
target ratios computed from the rows, one block layout for all recipes, and the JSON it writes."""

import json

import pytest
from conftest import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("bench_e2e")


def test_bench_e2e_quick_run(bench, tmp_path):
    out = tmp_path / "e2e.json"
    bench.main(["--tasks", "reverse", "--quick", "--device", "cpu", "--json", str(out)])
    payload = json.loads(out.read_text())
    rows = {(r["recipe"], r["backend"], r["batch"]): r for r in payload["results"]}
    want = {(name, backend, 1) for name in bench.RECIPES for backend in ("auto", "torch")}
    assert set(rows) == want | {("dinfer-full", "auto", 8)}
    for r in rows.values():
        assert r["options"]["align_blocks"] is False  # the same block layout for every recipe
        assert r["forwards"] >= 1 and 0.0 <= r["accuracy"] <= 1.0 and r["tokens_per_second"] > 0
        assert r["tps_runs"] == [r["tokens_per_second"]]  # --quick: one timed run
    van, fast = rows["vanilla", "auto", 1], rows["fast-dllm", "auto", 1]
    assert van["tokens_per_forward"] < 1.0 and van["speedup_vs_vanilla"] == 1.0  # one token per step
    full = rows["dinfer-full", "auto", 1]
    assert full["speedup_vs_fast_dllm"] == round(full["tokens_per_second"] / fast["tokens_per_second"], 2)
    assert any(n.startswith("batch 8 TPS / batch 1 TPS") for n in payload["notes"])
    thr = rows["dinfer", "auto", 1]
    assert thr["forwards"] >= thr["refreshes"] >= 4  # >= one block per prompt, one forward per block
    ceiling = (
        f"threshold-only forwards / blocks (the most any decoder can gain at this layout): "
        f"{round(thr['forwards'] / thr['refreshes'], 2)}"
    )
    assert ceiling in payload["notes"]


def test_bench_e2e_block_diffusion_recipes(bench, tmp_path):
    """A block-causal model (the embedded tiny-llada2) runs the block-diffusion recipes on the paged
    cache, and the notes compare editing with the same threshold without it."""
    out = tmp_path / "e2e.json"
    bench.main(["--model", "tiny-llada2", "--tasks", "add", "--quick", "--device", "cpu", "--json", str(out)])
    payload = json.loads(out.read_text())
    rows = {(r["recipe"], r["backend"], r["batch"]): r for r in payload["results"]}
    want = {(name, backend, 1) for name in bench.BLOCK_RECIPES for backend in ("auto", "torch")}
    assert set(rows) == want | {("threshold", "auto", 8)}
    for r in rows.values():
        assert r["options"]["cache"] == "paged" and r["options"]["align_blocks"] is True
        assert r["forwards"] >= 1 and 0.0 <= r["accuracy"] <= 1.0 and r["tokens_per_second"] > 0
    one, thr, fwd = (
        rows["one-token", "auto", 1],
        rows["threshold", "auto", 1],
        rows["threshold-fwd", "auto", 1],
    )
    assert one["speedup_vs_one_token"] == 1.0 and one["forwards"] > thr["forwards"]
    # the clean K/V from an extra forward (at each block after the first) never changes the tokens
    assert fwd["forwards"] >= thr["forwards"] and fwd["accuracy"] == thr["accuracy"]
    assert any(n.startswith("joint-quality accuracy - joint-no-edit") for n in payload["notes"])


@pytest.mark.parametrize("model", ["tiny-llada-moe", "tiny-llada2"])
def test_torch_rows_run_the_torch_backend(bench, model, monkeypatch):
    """A "/torch" row runs the engine on the references: inside the row every op the model calls,
    attention included, resolves to torch and no kernel backend runs; its "auto" row runs the host
    kernels that beat the references (so a row mislabelled torch would be seen)."""
    from dinfer_kernels import _backend

    resolved, kernels = [], []
    real_resolve, real_impl = _backend.resolve, _backend.impl

    def resolve(backend, device, op, **call):
        resolved.append((op, real_resolve(backend, device, op, **call)))
        return resolved[-1][1]

    monkeypatch.setattr(_backend, "resolve", resolve)
    monkeypatch.setattr(_backend, "impl", lambda op, b: kernels.append((op, b)) or real_impl(op, b))
    args = bench.cli_options.engine_parser("e2e", "add", 1).parse_args(["--model", model])
    llm = bench.engine_runs.engine_llm(args)
    table, _ = bench.recipes(llm)
    recipe = "dinfer" if "dinfer" in table else "threshold"
    bench.run_once(llm, (recipe, "torch", 1), args, first=False)
    ops = {op for op, _ in resolved}
    assert {"attention", "rms_norm", "qk_rope", "decode_step"} <= ops, ops
    assert {b for _, b in resolved} == {"torch"} and kernels == []
    resolved.clear()
    bench.run_once(llm, (recipe, "auto", 1), args, first=False)
    # moe's host kernel wins only at some shapes (MOE_HOST_WINS): the other fast ops run it always
    fast = set(_backend.host_auto_ops()) & ops - {"moe"}
    assert fast <= {op for op, b in resolved if b == "cpu"} and fast <= {op for op, _ in kernels}


@pytest.mark.parametrize("model", ["llada-moe-7b", "llada2-mini"])
def test_synthetic_generation(bench, model, tmp_path):
    """--synthetic on the tiny variant: one request and 3 at once through the engine, the fixed decoder
    at 32 / round(32 / 5) tokens per forward, every block decoded (early stop off), the JSON's rows."""
    out = tmp_path / "e2e.json"
    argv = ["--synthetic", model, "--tiny", "--device", "cpu", "--quick", "--prompt-len", "64"]
    bench.main(argv + ["--gen-length", "64", "--concurrent", "3", "--json", str(out)])
    payload = json.loads(out.read_text())
    assert payload["complete"] and payload["env"]["model"] == f"synthetic {model} (tiny)"
    rows = {r["batch"]: r for r in payload["results"]}
    assert set(rows) == {1, 3}
    for batch, r in rows.items():
        assert (
            r["graphs"] is False
            and r["model"] == model
            and r["cache"] == ("paged" if "2" in model else "vicinity")
        )
        assert r["tpf_set"] == 32 / 6
        # two blocks of 32 after the prompt's 64, six forwards each whatever the batch
        assert r["forwards"] == 12 and r["sequence_forwards"] == 12 * batch
        # generated tokens, EOS ids aside (random weights may emit some)
        assert 0 < r["tokens"] <= 64 * batch and r["tokens_per_second"] > 0
        assert 0 < r["first_block_s"] < r["seconds"] and r["tps_runs"] == [r["tokens_per_second"]]
        # the timed pass ran after an untimed one on the same Generator, its Stats its own
        assert r["warm_seconds"] > 0 and r["graph_captures_runs"] == [r["graph_captures"]] == [0]
    assert any("depends on the model" in n for n in payload["notes"])
