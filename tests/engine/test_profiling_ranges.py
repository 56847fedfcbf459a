"""The engine's profiler ranges with DINFER_NVTX=1 (dinfer_kernels.profiling): a forward is
model.forward > layer.{i} > attention / mlp > dinfer::<op>[<backend>], a generate's iterations are
its phases forward (around model.forward), decode and smoothing; the outputs are the same with ranges
on or off. NVTX is recorded by a stand-in for torch's NVTX functions (CPU builds have none)."""

import re

import pytest
import torch
from helpers.engine_models import MOE, model_of, run
from helpers.nvtx import record_ranges

from dinfer_kernels import profiling

OP_RANGE = re.compile(r"dinfer::(\w+)\[(cpu|torch|triton|cuda)\]$")


@pytest.fixture
def nvtx(monkeypatch):
    fake = record_ranges(monkeypatch)
    yield fake
    assert fake.depth == 0, "a range was left open"


def names(nodes):
    return [n for n, _ in nodes]


def ops(nodes):
    """The op names of `nodes`, each an op range dinfer::<op>[<backend>]."""
    found = []
    for name, children in nodes:
        m = OP_RANGE.match(name)
        assert m is not None and children == [], name
        found.append(m.group(1))
    return found


def check_forward(node, num_layers):
    name, layers = node
    assert name == "model.forward"
    assert names(layers[:-1]) == [f"layer.{i}" for i in range(num_layers)]
    assert ops(layers[-1:]) == ["rms_norm"]  # the final norm
    for _, parts in layers[:-1]:
        assert names(parts) == ["attention", "mlp"]
        attention, mlp = (children for _, children in parts)
        assert ops(attention)[0] == "rms_norm" and "attention" in ops(attention)
        assert ops(mlp) == ["rms_norm", "moe"]


def _forward_inputs(model, B=2, W=5, S=9):
    g = torch.Generator().manual_seed(0)
    c = model.config
    emb = torch.randn(B, W, c.hidden_size, generator=g)
    pos = torch.arange(S - W, S).repeat(B, 1)
    return emb, pos, model.new_cache(B, S), torch.full((B,), S, dtype=torch.int32)


def test_a_forward_names_its_layers_and_their_ops(nvtx):
    model = model_of(MOE)
    model.forward(*_forward_inputs(model))
    assert len(nvtx.root[1]) == 1
    check_forward(nvtx.root[1][0], MOE.num_layers)


def test_no_range_by_default(monkeypatch):
    fake = record_ranges(monkeypatch)
    monkeypatch.setattr(profiling, "ENABLED", False)
    model = model_of(MOE)
    model.forward(*_forward_inputs(model))
    assert fake.root[1] == []


def test_a_generate_names_its_phases_and_keeps_its_output(nvtx, monkeypatch):
    model = model_of(MOE, scale=8.0)
    kw = dict(gen_length=16, block_length=8, smoothing=True)
    monkeypatch.setattr(profiling, "ENABLED", False)
    plain, _ = run(model, [[1, 2, 3], [4, 5]], **kw)
    assert nvtx.root[1] == []
    monkeypatch.setattr(profiling, "ENABLED", True)
    ranged, stats = run(model, [[1, 2, 3], [4, 5]], **kw)
    assert ranged == plain
    phases = nvtx.root[1]
    assert names(phases) == ["forward", "decode", "smoothing"] * stats.forwards
    for i in range(0, len(phases), 3):
        (_, fwd), (_, dec), (_, smooth) = phases[i : i + 3]
        assert len(fwd) == 1
        check_forward(fwd[0], MOE.num_layers)
        assert ops(dec) == ["decode_step"] and ops(smooth) == ["soft_embedding"]
