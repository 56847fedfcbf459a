"""Generation parameters checked in one place (dinfer.params): every GenerationConfig / DecoderConfig
field's type and range, block_length capped to gen_length, the look-ahead bounded by the model's
positions, and the memory estimate that refuses a run before its caches are allocated."""

import dataclasses

import numpy as np
import pytest
import torch

from dinfer import LLM, GenerationConfig, params
from dinfer.decoders import DecoderConfig
from dinfer.models.embedded import generation_defaults, model_dir

NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu")  # the embedded default model


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(threshold=2), ValueError, r"threshold: must be in \[0.0, 1.0\], got 2"),
        (dict(threshold=INF), ValueError, "threshold: must be finite"),
        (dict(threshold=NAN), ValueError, "threshold: must be finite"),
        (dict(threshold=-1), ValueError, "threshold: must be in"),
        (dict(threshold="0.9"), TypeError, "threshold: expected a number, got str"),
        (dict(threshold=True), TypeError, "threshold: expected a number, got bool"),
        (dict(low_threshold=1.5), ValueError, "low_threshold"),
        (dict(temperature=-0.5), ValueError, "temperature"),
        (dict(temperature=INF), ValueError, "temperature: must be finite"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(seed=2**32), ValueError, "seed"),
        (dict(seed=1.5), TypeError, "seed: expected an int"),
        (dict(credit_slots=2000), ValueError, "credit_slots"),
        (dict(credit_alpha=-1), ValueError, "credit_alpha"),
        (dict(credit_beta=1.5), ValueError, "credit_beta"),
        (dict(credit_gamma=NAN), ValueError, "credit_gamma"),
        (dict(steps_per_block=True), TypeError, "steps_per_block: expected an int, got bool"),
        (dict(steps_per_block="4"), TypeError, "steps_per_block"),
        (dict(name=3), TypeError, "decoder"),
    ],
)
def test_decoder_config_rejects(kwargs, error, match):
    with pytest.raises(error, match=match):
        DecoderConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(smoothing_weight=(NAN, 0, 1)), ValueError, r"smoothing_weight\[0\]: must be finite"),
        (dict(smoothing_weight=(0.1, INF, 1)), ValueError, r"smoothing_weight\[1\]"),
        (dict(smoothing_weight=(0.1, 0.0, 2.0)), ValueError, r"smoothing_weight\[2\]"),
        (dict(smoothing_weight=(0.1, 0.2)), TypeError, "smoothing_weight: expected a sequence of 3"),
        (dict(smoothing_weight="abc"), TypeError, "smoothing_weight"),
        (dict(smoothing=1), TypeError, "smoothing: expected True or False"),
        (dict(early_stop="no"), TypeError, "early_stop"),
        (dict(gen_length="32"), TypeError, "gen_length: expected an int, got str"),
        (dict(gen_length=32.0), TypeError, "gen_length"),
        (dict(block_length=True), TypeError, "block_length"),
        (dict(cache=1), TypeError, "cache"),
        (dict(decoder="credit"), TypeError, "decoder: expected a DecoderConfig"),
    ],
)
def test_generation_config_rejects(kwargs, error, match):
    with pytest.raises(error, match=match):
        GenerationConfig(**kwargs)


def test_every_field_has_a_rule():
    @dataclasses.dataclass(frozen=True)
    class Two:
        a: int = 1
        b: int = 2

    with pytest.raises(AssertionError, match=r"no check for field\(s\) \['b'\]"):
        params.check(Two(), dict(a=params.Int()))


def test_numpy_scalars_are_numbers(llm):
    d = DecoderConfig(threshold=np.float32(0.5), seed=np.int64(7), credit_slots=np.int32(4))
    assert type(d.threshold) is float and type(d.seed) is int and type(d.credit_slots) is int
    g = GenerationConfig(gen_length=np.int64(16), smoothing=np.bool_(True), smoothing_weight=[0.1, 0, 0.2])
    assert type(g.gen_length) is int and g.smoothing is True and g.smoothing_weight == (0.1, 0.0, 0.2)
    # The kernels take Python ints only: a numpy seed reaches them as one.
    r = llm.generate("add:1+2", seed=np.int64(3), temperature=np.float64(0.5))
    assert r.texts == llm.generate("add:1+2", seed=3, temperature=0.5).texts


def test_block_length_capped_to_gen_length(llm):
    assert GenerationConfig(gen_length=16, block_length=1000).block_length == 16
    prompt, gen = "add:048213+000937", generation_defaults(model_dir(None))["gen_length"]
    capped = llm.generate(prompt, block_length=100000)
    one_block = llm.generate(prompt, block_length=gen)
    assert capped.token_ids == one_block.token_ids
    assert capped.stats["forwards"] == one_block.stats["forwards"]


def _no_cache(model, monkeypatch):
    def refuse(*args):
        raise AssertionError("the cache was allocated")

    monkeypatch.setattr(model, "new_cache", refuse)


@pytest.mark.parametrize("name", ["after_look", "prefix_look"])
def test_look_bounded_by_positions(llm, monkeypatch, name):
    _no_cache(llm.model, monkeypatch)
    limit = llm.model.config.max_positions
    with pytest.raises(ValueError, match=f"{name}: must be <= the model's {limit} positions"):
        llm.generate("add:1+2", **{name: 10**8})


def test_smoothing_weight_nan_is_refused_not_a_hang(llm):
    with pytest.raises(ValueError, match="smoothing_weight"):
        llm.generate("add:1+2", smoothing=True, smoothing_weight=(NAN, 0, 1))


def test_memory_estimate_covers_the_cache(llm):
    model, B, S, bl = llm.model, 3, 40, 8
    cache = model.new_cache(B, S)
    kv = sum(t.numel() * t.element_size() for t in cache.keys + cache.values)
    need = params.run_bytes(model.config, model.dtype, B * S, B * S, B * bl)
    assert kv < need
    assert params.run_bytes(model.config, model.dtype, 2 * B * S, 2 * B * S, 2 * B * bl) > need
    assert params.run_bytes(model.config, torch.float16, B * S, B * S, B * bl) < need
    assert params.free_bytes(torch.device("cpu")) > 0


def test_memory_refused_before_allocating(llm, monkeypatch):
    _no_cache(llm.model, monkeypatch)
    need = params.run_bytes(llm.model.config, llm.model.dtype, 8, 8, 8)
    monkeypatch.setattr(params, "free_bytes", lambda device: need // 2)
    with pytest.raises(MemoryError, match=r"more than the .* free on cpu; lower batch_size, gen_length"):
        llm.generate("add:1+2")


def test_look_bounded_when_the_llm_is_built():
    with pytest.raises(ValueError, match="after_look: must be <= the model's"):
        LLM(device="cpu", after_look=10**8)


def test_memory_with_cuda_graphs_counts_the_pool_beside_the_eager_forward(llm, monkeypatch):
    """A captured forward's activations and logits stay in the graph pool beside the allocator's
    eager copy of them: a run that fits eagerly may not fit with graphs, and is refused, not OOM'd."""
    model, kv, rows, logits = llm.model, 64, 64, 16
    eager = params.run_bytes(model.config, model.dtype, kv, rows, logits)
    monkeypatch.setattr(params, "free_bytes", lambda device: eager + 1)
    params.check_memory(model, kv, rows, logits, "a run")
    with pytest.raises(MemoryError, match="with their CUDA graphs"):
        params.check_memory(model, kv, rows, logits, "a run", graphs=True)
