"""The model's rope table: built once, at its first forward, for the positions its cache can hold, and
grown only when a larger cache shows up; no forward builds a cos / sin table of its own, on any
backend (the Triton rope built one per call, twice per layer), and the forward calls qk_rope once per
layer."""

import dataclasses

import pytest
import torch
from helpers.block_diffusion import llada2_model
from helpers.engine_models import MOE, model_of, run

import dinfer_kernels as dk
from dinfer.decoders import DecoderConfig
from dinfer_kernels import _backend, reference
from dinfer_kernels.cpu import rope as cpu_rope
from dinfer_kernels.ops import rope as ops_rope

TABLE_USERS = [reference.rope, ops_rope, cpu_rope]  # every module that builds tables with it


@pytest.fixture
def tables(monkeypatch):
    """The sizes of the cos / sin tables built from here on, wherever they are built."""
    import dinfer_kernels.triton.rope as triton_rope  # after conftest chose the interpreter

    built = []
    real = reference.rope.cos_sin_table

    def counted(positions, theta, rotary_dim):
        built.append(positions.numel())
        return real(positions, theta, rotary_dim)

    for module in TABLE_USERS + [triton_rope]:
        monkeypatch.setattr(module, "cos_sin_table", counted)
    cpu_rope._tables.clear()  # the host rope's own cache would hide a build
    return built


def forward(model, B, W, S, lo=0, **kw):
    c = model.config
    tokens = torch.randint(0, c.vocab_size, (B, W))
    positions = (lo + torch.arange(W)).expand(B, W)
    cache = kw.pop("cache", None) or model.new_cache(B, S)
    return model.forward(model.embed(tokens), positions, cache, torch.full((B,), S, dtype=torch.int32), **kw)


@pytest.mark.parametrize(
    "backend", [b for b in ("cpu", "triton", "torch") if b in dk.available_backends("cpu")]
)
def test_forwards_build_no_table(tables, backend):
    """Three forwards of one model (a refresh and two window steps, on the QK-norm model): one
    table, built by the first, of the cache's length rounded up to a power of two."""
    model = model_of(dataclasses.replace(MOE, num_layers=2))
    cache = model.new_cache(1, 40)
    with _backend.prefer_backend(backend):
        forward(model, 1, 40, 40, cache=cache)
        for lo in (8, 30):
            forward(model, 1, 5, 40, lo=lo, cache=cache, write_back=False)
    assert tables == [64]


def test_generate_builds_one_table_per_model(tables):
    for model in (model_of(MOE, scale=8.0), model_of(dataclasses.replace(MOE, qk_norm=False))):
        for cache in ("none", "dual", "vicinity"):
            run(model, [[1, 2, 3], [4, 5, 6, 7, 8]], cache=cache)
    assert len(tables) == 2, tables  # one per model


def test_paged_generate_builds_one_table(tables):
    model = llada2_model()
    for _ in range(2):
        run(
            model,
            [[1, 2, 3, 4, 5], [6, 7]],
            cache="paged",
            block_length=4,
            decoder=DecoderConfig(threshold=0.5),
        )
    assert len(tables) <= 2, tables  # the block table's pages grow as sequences do: a power of two each time
    assert model._rope_tables[-1].shape[0] >= 32


def test_the_table_grows_only_for_a_larger_cache(tables):
    model = model_of(MOE)
    forward(model, 2, 3, 40)  # the cache's 40 positions: 64 rows
    forward(model, 1, 3, 64)
    forward(model, 1, 3, 17)
    assert tables == [64]
    forward(model, 1, 3, 65)  # a larger cache
    assert tables == [64, 128]
    pool = model.new_cache(12, 8)  # paged: 12 pages of 8, a block table of 20 pages covers 160
    table = torch.tensor([list(range(12)) + [-1] * 8], dtype=torch.int32)
    seq_lens = torch.tensor([16], dtype=torch.int32)
    tokens = torch.randint(0, MOE.vocab_size, (1, 16))
    model.forward(model.embed(tokens), torch.arange(16)[None], pool, seq_lens, block_table=table)
    assert tables == [64, 128, 256]
    assert torch.equal(model._rope_tables[-1], dk.rope_table(MOE.rope_theta, MOE.rotary_dim, 256))
    # the smaller tables stay alive: graphs captured on them (another Generator's) still read them
    assert [t.shape[0] for t in model._rope_tables] == [64, 128, 256]


def test_one_qk_rope_call_per_layer(monkeypatch):
    model = model_of(MOE)
    calls = []
    real = dk.qk_rope

    def spy(q, k, positions, table, **kw):
        calls.append(sorted(kw))
        return real(q, k, positions, table, **kw)

    monkeypatch.setattr(dk, "qk_rope", spy)
    monkeypatch.setattr(dk, "rope", None)  # the model no longer calls it
    forward(model, 1, 6, 12)
    assert calls == [["eps", "k_norm", "q_norm"]] * MOE.num_layers
