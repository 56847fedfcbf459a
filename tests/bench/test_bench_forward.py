"""bench_kernels/bench_forward.py on the tiny variants of both released models: every planned row in
the JSON with sane numbers (bytes between bounds computed here from the config, launches counted), the
peer-style baseline computing the same model as ours, the time limit and the nsys mode."""

import json
import math

import pytest
import torch
from conftest import assert_precision, load_bench

import dinfer_kernels as dk
from dinfer.models import expected_shapes
from dinfer.models.checkpoint import kept_fp32


@pytest.fixture(scope="module")
def bench():
    return load_bench("bench_forward")


def _bounds(config, dtype_size):
    """(bytes of every weight the forward reads but the experts, bytes of one expert of any layer,
    the number of MoE layers), from the config's shapes."""
    dense, expert, moe_layers = 0, 0, 0
    for name, shape in expected_shapes(config).items():
        size = math.prod(shape) * (4 if kept_fp32(config, name) else dtype_size)
        if name.endswith((".w13", ".w2")):
            expert += size // shape[0]
            moe_layers += name.endswith(".w13")
        elif name != "embed":
            dense += size
    return dense, expert // moe_layers, moe_layers


def test_quick_tiny_run(bench, tmp_path):
    out = tmp_path / "forward.json"
    argv = ["--device", "cpu", "--tiny", "--quick", "--seq", "96", "--batch", "1,2", "--reps", "2"]
    bench.main(argv + ["--json", str(out)])
    payload = json.loads(out.read_text())
    assert payload["complete"] and payload["bench"] == "forward"
    rows = {(r["model"], r["kind"], r["batch"], r["backend"]): r for r in payload["results"]}
    want = {("llada-moe-7b", "refresh", 1, "ours")}  # --quick's one refresh
    want |= {("llada-moe-7b", "window", b, be) for b in (1, 2) for be in ("ours", "torch", "peer")}
    want |= {("llada2-mini", "block", b, be) for b in (1, 2) for be in ("ours", "torch", "peer")}
    assert set(rows) == want
    # the target rows (batch 1, ours) of both models first: the time limit cannot cut them
    first = [(r["model"], r["kind"], r["batch"], r["backend"]) for r in payload["results"][:2]]
    assert first == [("llada-moe-7b", "window", 1, "ours"), ("llada2-mini", "block", 1, "ours")]
    for (model, kind, batch, _), r in rows.items():
        c = bench.synthetic_model.config(model, tiny=True)
        dense, expert, moe_layers = _bounds(c, 2)
        assert (
            r["graphs"] is False
            and r["graphs_asked"] is False
            and r["S"] == 96
            and r["ms"] > 0
            and r["median_s"] > 0
        )
        # at least top_k distinct experts per MoE layer, at most all of them
        assert (
            dense + moe_layers * c.top_k * expert
            <= r["weight_bytes"]
            <= dense + moe_layers * c.num_experts * expert
        )
        assert r["weight_bytes"] == dense + round(r["experts_per_layer"] * moe_layers) * expert
        assert r["kv_bytes"] == 2 * c.num_layers * batch * 96 * c.num_kv_heads * c.head_dim * 2
        assert r["launches"] > 0 and r["launches_counted"] == "dispatched ops"
        assert r["hbm_pct"] is None  # no datasheet bandwidth on the host
        assert r["W"] == {"refresh": 96, "window": 64, "block": 32}[kind]
        if kind != "refresh":
            peer = rows[model, kind, batch, "peer"]
            assert r["x_peer"] == pytest.approx(peer["median_s"] / r["median_s"])
    # the peer's expert loop dispatches more ops than our one moe op
    assert (
        rows["llada2-mini", "block", 1, "peer"]["launches"]
        > rows["llada2-mini", "block", 1, "ours"]["launches"]
    )
    assert any(n.startswith("target (H200") for n in payload["notes"])
    assert {c["case"] for c in payload["cases"]} >= {r["case"] for r in payload["results"]}


@pytest.mark.parametrize(
    "model,kind", [("llada-moe-7b", "window"), ("llada-moe-7b", "refresh"), ("llada2-mini", "block")]
)
def test_peer_style_forward_is_the_same_model(bench, model, kind):
    """In fp32, ours (auto and the torch references) and the peer-style forward err against the peer
    in fp64 as much as the peer in fp32 does: the baseline computes the model we time."""
    m = bench.synthetic_model.build(model, dtype=torch.float32, tiny=True)
    f = bench.Forward(m, kind, 2, 96)
    m64 = bench.DiffusionLM(m.config, {k: v.double() for k, v in m.w.items()})
    f64 = bench.Forward(m64, kind, 2, 96)
    f64.emb = f.emb.double()
    for a, b in zip(f64.cache.keys + f64.cache.values, f.cache.keys + f.cache.values):
        a.copy_(b)
    truth, peer = bench.peer_forward(f64), bench.peer_forward(f)
    assert_precision(f.ours(), peer, truth, f"{model} {kind} ours")
    with dk.prefer_backend("torch"):
        assert_precision(f.ours(), peer, truth, f"{model} {kind} torch references")


def test_time_limit_stops_and_writes_the_json(bench, tmp_path):
    out = tmp_path / "forward.json"
    bench.main(["--device", "cpu", "--tiny", "--seq", "96", "--time-limit", "0", "--json", str(out)])
    payload = json.loads(out.read_text())
    assert payload["complete"] and payload["results"] == []
    assert any(n.startswith("stopped at --time-limit 0 s") for n in payload["notes"])


def test_nsys_one_runs_one_forward(bench, tmp_path, capsys):
    out = tmp_path / "forward.json"
    assert bench.main(["--device", "cpu", "--tiny", "--seq", "96", "--nsys-one", "--json", str(out)]) is None
    assert "bench_forward.one" in capsys.readouterr().out and not out.exists()


def test_datasheet_bandwidth(bench):
    sheet = bench.environment.datasheet_hbm_tbs
    assert sheet("NVIDIA H200") == 4.8 and sheet("NVIDIA H100 80GB HBM3") == 3.35
    assert sheet("NVIDIA H100 PCIe") == 2.0 and sheet("NVIDIA A100-SXM4-80GB") is None and sheet(None) is None
