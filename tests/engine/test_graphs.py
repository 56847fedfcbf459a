"""CUDA graphs of the iteration loop (dinfer.graphs): captured once per (batch size, shape, kinds of
forward) and replayed from static buffers across blocks, requests and compactions, with the tokens
of the eager loop.

On the CPU the graph is a stand-in (StepGraphs' graph_factory): its capture records the chunk and
runs nothing, its replay runs the chunk again on the same static state, as a CUDA graph replays its
kernels on the same buffers, so every part of the static-state plumbing runs (keys, loads, the
static state going on as the live one through polls, compactions and stores). The `gpu` tests run
the real graphs with the same assertions."""

import dataclasses
from collections import Counter

import pytest
import torch
from helpers.block_diffusion import DECODERS, llada2_model
from helpers.engine_models import MOE, model_of

from dinfer.batch import slots
from dinfer.decoders import DecoderConfig
from dinfer.generate import GenerationConfig, Generator
from dinfer.graphs import StepGraphs, signature
from dinfer.kv.refresh import RefreshKV
from dinfer.models.transformer import DiffusionLM


class ReplayByCalling:
    """A CPU stand-in for a CUDA graph: the capture keeps the chunk (running nothing), a replay runs
    it again, on the buffers it was captured on."""

    def __init__(self, chunk):
        self.chunk = chunk

    def replay(self):
        self.chunk()


def run_counted(model, prompts, cfg, batch_size, graph_factory=None, max_signatures=32):
    """The outputs (lists), the Stats, and how many chunks ran per (kinds, batch size). graph_factory: the CPU stand-in in place of CUDA graphs (None: the
    Generator's own choice: CUDA graphs on a GPU when cfg.cuda_graphs)."""
    gen = Generator(model, cfg)
    if graph_factory is not None:
        gen.graphs = StepGraphs(True, graph_factory=graph_factory, max_signatures=max_signatures)
    chunks, count = Counter(), gen.stats.count_chunk

    def counted(kinds, sequences):
        chunks[(kinds, sequences)] += 1
        count(kinds, sequences)

    gen.stats.count_chunk = counted
    outputs = [o.tolist() for o in gen.run(prompts, batch_size)]
    return outputs, gen.stats, chunks


def eager(model, prompts, cfg, batch_size):
    return run_counted(model, prompts, dataclasses.replace(cfg, cuda_graphs=False), batch_size)[0]


def moe_model(device="cpu"):
    return on(device, model_of(MOE, seed=5, scale=20))


def llada2(device="cpu"):
    return on(device, llada2_model())


def on(device, model):
    return DiffusionLM(model.config, {k: v.to(device) for k, v in model.w.items()})


def prompts_of(lengths, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


# The runs whose captures are counted: prompts of one length (so every round has the same columns),
# more than the batch size (slots refilled), several blocks each, compaction on.
COUNTED = {
    "vicinity": (moe_model, dict(cache="vicinity", gen_length=32, block_length=8, smoothing=True), 57),
    "dual, refresh every 2": (
        moe_model,
        dict(cache="dual", gen_length=32, block_length=8, refresh_every=2),
        57,
    ),
    "paged": (llada2, dict(cache="paged", gen_length=16, block_length=4, prefill_chunk=4), 50),
}


def check_captures(name, device, graph_factory):
    make, kw, vocab = COUNTED[name]
    model = make(device)
    cfg = GenerationConfig(
        **kw, unroll=2, expected_tpf=2, decoder=DecoderConfig(name="credit", threshold=0.6)
    )
    prompts, batch = prompts_of([9] * 10, vocab, seed=1), 3
    out, stats, chunks = run_counted(model, prompts, cfg, batch, graph_factory)
    assert out == eager(model, prompts, cfg, batch)
    # Each (kinds, batch size) runs eagerly once (the warm-up), is captured at its second chunk and
    # replayed from then on.
    assert stats.graph_captures == sum(n >= 2 for n in chunks.values())
    assert stats.graph_replays == sum(n - 1 for n in chunks.values())
    # Once per shape, not per block or request: at most each chunk length first in a block and later
    # in it, at each batch size, while 10 requests decode their blocks in rounds of 3.
    unroll, sizes = cfg.unroll, {b for _, b in chunks}
    assert stats.graph_captures <= 2 * unroll * len(sizes)
    assert stats.graph_replays >= 4 * stats.graph_captures
    assert len(sizes) > 1  # compactions and the last rounds ran at smaller batch sizes
    assert (stats.capture_seconds > 0) == (stats.graph_captures > 0)


@pytest.mark.parametrize("name", list(COUNTED))
def test_graphs_are_captured_once_per_shape_and_replayed_across_blocks_and_requests(name):
    check_captures(name, "cpu", ReplayByCalling)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(COUNTED))
def test_cuda_graphs_are_captured_once_per_shape_and_replayed_on_gpu(name):
    check_captures(name, "cuda", None)


# Every KV-cache manager and decoder, smoothing on and off, prompts of mixed lengths through fewer
# slots (refills, rounds of other columns, compactions): the tokens of the eager loop.
MOE_RUNS = [
    ("none", "threshold", False),
    ("prefix", "credit", True),
    ("prefix", "fixed", False),
    ("dual", "fixed", True),
    ("dual", "hierarchical", False),
    ("vicinity", "threshold", True),
    ("vicinity", "credit", False),
]
MOE_DECODERS = {
    "threshold": DecoderConfig(threshold=0.6),
    "credit": DecoderConfig(name="credit", threshold=0.6),
    "fixed": DecoderConfig(name="fixed", steps_per_block=3),
    "hierarchical": DecoderConfig(name="hierarchical", threshold=0.7, low_threshold=0.4),
}


@pytest.mark.parametrize("cache, decoder, smoothing", MOE_RUNS)
def test_graphs_replay_the_eager_tokens_on_the_refreshed_cache(cache, decoder, smoothing):
    model = moe_model()
    cfg = GenerationConfig(
        gen_length=24,
        block_length=8,
        cache=cache,
        decoder=MOE_DECODERS[decoder],
        smoothing=smoothing,
        warmup_steps=2 if cache == "vicinity" else 0,
        unroll=2,
        expected_tpf=2,
    )
    prompts = prompts_of([5, 13, 5, 21, 5, 13, 2], 57, seed=3)
    out, stats, _ = run_counted(model, prompts, cfg, 3, ReplayByCalling)
    assert out == eager(model, prompts, cfg, 3)
    assert stats.graph_replays > 0


@pytest.mark.parametrize(
    "decoder, smoothing, clean_kv",
    [
        ("threshold", False, "fused"),
        ("fixed", True, "fused"),
        ("joint", False, "fused"),  # edits, and post-edit steps after a block's last [MASK]
        ("joint", True, "forward"),
        ("joint-speed", True, "fused"),
    ],
)
def test_graphs_replay_the_eager_tokens_on_the_paged_cache(decoder, smoothing, clean_kv):
    model = llada2()
    cfg = GenerationConfig(
        gen_length=12,
        block_length=4,
        cache="paged",
        decoder=DECODERS[decoder],
        smoothing=smoothing,
        clean_kv=clean_kv,
        prefill_chunk=4,
        unroll=2,
        expected_tpf=2,
    )
    prompts = prompts_of([3, 9, 3, 6, 11, 3], 50, seed=4)
    out, stats, _ = run_counted(model, prompts, cfg, 2, ReplayByCalling)
    assert out == eager(model, prompts, cfg, 2)
    assert stats.graph_replays > 0


def test_at_most_max_signatures_are_kept_and_a_dropped_one_is_captured_again():
    """A server meets many shapes: the least recently used signature is dropped (its static state
    and graphs), and the tokens stay the eager loop's."""
    make, kw, vocab = COUNTED["vicinity"]
    model = make("cpu")
    cfg = GenerationConfig(
        **kw, unroll=2, expected_tpf=2, decoder=DecoderConfig(name="credit", threshold=0.6)
    )
    prompts = prompts_of([9] * 10, vocab, seed=1)
    want = eager(model, prompts, cfg, 3)
    captures = {}
    for cap in (1, 32):
        gen = Generator(model, cfg)
        gen.graphs = StepGraphs(True, graph_factory=ReplayByCalling, max_signatures=cap)
        assert [o.tolist() for o in gen.run(prompts, 3)] == want
        assert len(gen.graphs._static) <= cap
        captures[cap] = gen.stats.graph_captures
    # rounds of 3 sequences compact to fewer and the next round is back at 3: with one signature
    # kept, each comes back dropped and is captured again
    assert captures[1] > captures[32]


def test_a_chunk_that_cannot_be_captured_runs_eagerly(caplog):
    """A capture that raises (an op CUDA cannot capture) leaves that chunk shape eager, with a
    warning, and the run goes on with the eager tokens."""
    tries = []

    def refuse(chunk):
        tries.append(chunk)
        raise RuntimeError("operation not permitted when stream is capturing")

    make, kw, vocab = COUNTED["vicinity"]
    model = make("cpu")
    cfg = GenerationConfig(**kw, unroll=2, expected_tpf=2)
    prompts = prompts_of([9] * 5, vocab, seed=2)
    with caplog.at_level("WARNING", logger="dinfer.graphs"):
        out, stats, chunks = run_counted(model, prompts, cfg, 3, refuse)
    assert out == eager(model, prompts, cfg, 3)
    assert stats.graph_captures == stats.graph_replays == 0
    # one try per shape that came back, never a second one
    assert len(tries) == sum(n >= 2 for n in chunks.values()) > 0
    assert "capture failed" in caplog.text


def test_a_compacted_round_cache_is_the_head_of_the_slot_buffers():
    """What lets a static state share the cache rather than copy it: every round cache of a batch
    size is the same memory, compacted or not."""
    model = moe_model()
    cfg = GenerationConfig(gen_length=8, block_length=4, cache="dual")
    storage = slots(3, 12, 4, 1, MOE.eos_id, "cpu")
    kv = RefreshKV(model, cfg, storage, 12)
    batch = storage.select(torch.arange(3))
    batch.total_len.fill_(12)
    full = kv.start_round(batch, torch.arange(3), torch.zeros(3, dtype=torch.int64), None)
    for t in full.cache.keys + full.cache.values:
        t.copy_(torch.randn(t.shape))
    before = [t.clone() for t in full.cache.keys]
    keep = torch.tensor([0, 2])
    part = kv.select(full, keep)
    fresh = kv.start_round(batch.select(keep), keep, torch.zeros(2, dtype=torch.int64), None)
    for p, f, b in zip(part.cache.keys, fresh.cache.keys, before):
        assert p.data_ptr() == f.data_ptr() and p.shape == f.shape
        assert torch.equal(p, b[keep])
    assert signature(part)[0] == signature(fresh)[0]


def test_the_key_holds_shapes_and_host_values():
    model = moe_model()
    cfg = GenerationConfig(gen_length=8, block_length=4, cache="prefix")
    storage = slots(2, 16, 4, 1, MOE.eos_id, "cpu")
    kv = RefreshKV(model, cfg, storage, 16)
    batch = storage.select(torch.arange(2))
    blocks = torch.zeros(2, dtype=torch.int64)
    batch.total_len.copy_(torch.tensor([8, 12]))
    a = kv.start_round(batch, torch.arange(2), blocks, None)
    batch.total_len.copy_(torch.tensor([8, 9]))  # the prefix window: another width, same shapes
    b = kv.start_round(batch, torch.arange(2), blocks, None)
    assert a.window_len != b.window_len and signature(a)[0] != signature(b)[0]
    batch.total_len.copy_(torch.tensor([11, 12]))  # other values, the same width
    c = kv.start_round(batch, torch.arange(2), blocks, None)
    assert signature(a)[0] == signature(c)[0]
    one = kv.start_round(batch.select(torch.tensor([0])), torch.arange(1), blocks[:1], None)
    assert signature(one)[0] != signature(c)[0]
