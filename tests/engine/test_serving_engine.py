"""The serving engine (dinfer.engine): requests submitted from other threads while the model decodes,
joining and leaving at block boundaries, each decoded as it would be alone."""

import dataclasses
import threading
import time

import pytest
import torch
from helpers.block_diffusion import DECODERS, llada2_model
from helpers.engine_models import MOE, model_of

from dinfer.engine import Engine, QueueFull
from dinfer.generate import GenerationConfig, Generator, generate

PROMPTS = [[3, 1, 4], [1, 5, 9, 2, 6, 5], [3, 5, 8, 9, 7, 9, 3, 2, 3], [2, 7], [4] * 13, [6, 6]]


class Collector:
    """One request's events, and a way to wait for its end."""

    def __init__(self):
        self.blocks, self.tokens, self.error, self.forwards = [], None, None, None
        self.done = threading.Event()

    def __call__(self, kind, *args):
        if kind == "block":
            self.blocks.append(args[0].tolist())
        elif kind == "finish":
            self.tokens, self.forwards = args[0].tolist(), args[1]
            self.done.set()
        else:
            self.error = args[0]
            self.done.set()

    def wait(self, timeout=60):
        assert self.done.wait(timeout), "the request did not end"
        return self


@pytest.fixture
def engine_of():
    made = []

    def make(model, **kw):
        made.append(Engine(model, **kw))
        return made[-1]

    yield make
    for e in made:
        e.shutdown()


@pytest.mark.parametrize("kind", ["bidirectional", "block-causal"])
def test_requests_from_threads_decode_as_alone(engine_of, kind):
    if kind == "bidirectional":
        model = model_of(MOE, seed=3, scale=20)
        cfg = GenerationConfig(gen_length=12, block_length=4, early_stop=False)
    else:
        model = llada2_model()
        cfg = GenerationConfig(
            gen_length=12, block_length=4, cache="paged", decoder=DECODERS["joint"], early_stop=False
        )
    engine = engine_of(model, max_batch=3)
    got = [Collector() for _ in PROMPTS]
    threads = [
        threading.Thread(target=engine.submit, args=(p, cfg, c)) for p, c in zip(PROMPTS, got)
    ]  # six requests, three slots: half of them join as others leave
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p, c in zip(PROMPTS, got):
        c.wait()
        alone = generate(model, [p], cfg)[0][0].tolist()
        assert c.error is None and c.tokens == alone
        assert sum(c.blocks, []) == alone  # the streamed blocks are the answer, in order
        assert c.forwards >= len(c.blocks)


def test_cancel_frees_the_slot_for_the_next_request(engine_of):
    model = model_of(MOE, seed=3, scale=20)
    long = GenerationConfig(gen_length=64, block_length=4, early_stop=False, unroll=1)
    short = dataclasses.replace(long, gen_length=8)
    engine = engine_of(model, max_batch=1)
    first, second, queued = Collector(), Collector(), Collector()
    rid = engine.submit([1, 2, 3], long, first)
    engine.submit([4, 5], short, second)  # waits for the only slot
    qid = engine.submit([6], short, queued)
    engine.cancel(qid)  # still queued: gone at once
    while not first.blocks:  # the first request is running
        time.sleep(0.01)
    engine.cancel(rid)
    second.wait()
    assert second.tokens == generate(model, [[4, 5]], short)[0][0].tolist()
    assert first.done.is_set() and len(first.blocks) < 16  # left at a block boundary, early
    assert not queued.done.is_set() and engine.counters["cancelled"] == 2
    assert engine.waiting == 0 and engine.in_flight() == 0


def test_a_cancelled_request_decodes_no_further_block_and_its_slot_refills_at_once():
    model = model_of(MOE, seed=3, scale=20)
    cfg = GenerationConfig(gen_length=16, block_length=4, early_stop=False)
    gen = Generator(model, cfg)
    blocks, finished = {}, {}
    gen.open(
        1,
        gen._span(3, cfg.gen_length),
        3 + cfg.gen_length,
        lambda i, tokens, forwards: finished.setdefault(i, (tokens.tolist(), forwards)),
        lambda i, tokens: blocks.setdefault(i, []).append(tokens.tolist()),
    )
    first, second = gen.submit([1, 2, 3]), gen.submit([4, 5])
    assert gen.step() and len(blocks[first]) == 1 and second not in blocks
    forwards = int(gen.sched.forwards[0])
    assert gen.cancel(first) == "in flight"
    assert gen.step()  # the cancelled request leaves before this round: the next one runs in its slot
    assert len(blocks[first]) == 1 and len(blocks[second]) == 1
    tokens, ran = finished[first]
    assert ran == forwards and tokens[: len(blocks[first][0])] == blocks[first][0]
    assert model.config.mask_id in tokens  # what was never committed is still [MASK]
    while gen.step():
        pass
    assert finished[second][0] == generate(model, [[4, 5]], cfg)[0][0].tolist()
    assert gen.cancel(first) is None  # gone


@pytest.mark.parametrize("paged", [False, True])
def test_the_generator_reports_its_queue_and_admissions(paged):
    """What a server's engine reads of a lane: requests queued and in flight, idle, and each
    admission as it happens (one slot: the second request waits for the first to finish; a paged
    cache with room for one sequence makes it wait the same way with two slots)."""
    if paged:
        model = llada2_model()
        cfg = GenerationConfig(gen_length=8, block_length=4, cache="paged", kv_pages=3, early_stop=False)
    else:
        model = model_of(MOE, seed=3, scale=20)
        cfg = GenerationConfig(gen_length=8, block_length=4, early_stop=False)
    gen = Generator(model, cfg)
    assert gen.idle and gen.in_flight == 0 and gen.queued == 0  # before open
    admitted, finished = [], []
    slots = 2 if paged else 1
    gen.open(
        slots,
        gen._span(3, cfg.gen_length),
        3 + cfg.gen_length,
        lambda i, *_: finished.append(i),
        None,
        admitted.append,
    )
    first, second = gen.submit([1, 2, 3]), gen.submit([4, 5])
    assert not gen.idle and gen.in_flight == 0 and gen.queued == 2 and admitted == []
    assert gen.step() and admitted == [first] and gen.in_flight == 1 and gen.queued == 1
    while not finished:
        assert gen.step()
    assert finished == [first] and admitted == [first] and gen.queued == 1
    assert gen.step() and admitted == [first, second] and gen.in_flight == 1 and gen.queued == 0
    while gen.step():
        pass
    assert finished == [first, second] and gen.idle and gen.in_flight == 0


def test_a_full_queue_is_refused_not_grown(engine_of):
    model = model_of(MOE, seed=3, scale=20)
    cfg = GenerationConfig(gen_length=64, block_length=4, early_stop=False)
    engine = engine_of(model, max_batch=1, max_queue=2)
    got = [Collector(), Collector()]
    for c in got:
        engine.submit([1, 2], cfg, c)
    with pytest.raises(QueueFull, match="max_queue 2"):
        engine.submit([3], cfg, Collector())
    for c in got:
        c.wait()
    assert engine.waiting == 0
    assert engine.submit([3], cfg, Collector()) == 2  # room again: the third request's id


def test_requests_with_other_settings_run_in_their_own_lanes(engine_of):
    model = model_of(MOE, seed=3, scale=20)
    base = GenerationConfig(gen_length=8, block_length=4, early_stop=False)
    configs = [
        base,
        dataclasses.replace(base, gen_length=12),  # same lane: the length is per request
        dataclasses.replace(base, decoder=dataclasses.replace(base.decoder, threshold=0.5)),  # and tau
        dataclasses.replace(base, cache="dual"),
        dataclasses.replace(base, decoder=dataclasses.replace(base.decoder, name="fixed", steps_per_block=2)),
    ]
    engine = engine_of(model, max_batch=2, max_lanes=3)
    got = [Collector() for _ in configs]
    for cfg, c in zip(configs, got):
        engine.submit([1, 2, 3], cfg, c)
    for cfg, c in zip(configs, got):
        assert c.wait().tokens == generate(model, [[1, 2, 3]], cfg)[0][0].tolist()
    assert len(engine.lanes) == 3  # three configurations, each its own lane


def test_a_failing_lane_fails_its_requests_and_the_engine_goes_on(engine_of):
    model = model_of(MOE, seed=3, scale=20)
    cfg = GenerationConfig(gen_length=8, block_length=4)
    engine = engine_of(model, max_batch=2)
    real = model.w["lm_head"]
    model.w["lm_head"] = torch.full_like(real, float("nan"))
    bad = [Collector(), Collector()]
    for c in bad:
        engine.submit([1, 2], cfg, c)
    for c in bad:
        assert "non-finite logits" in str(c.wait().error)
    model.w["lm_head"] = real
    good = Collector()
    engine.submit([1, 2], cfg, good)
    assert good.wait().tokens == generate(model, [[1, 2]], cfg)[0][0].tolist()
    assert engine.counters["failed"] == 2


def test_bad_requests(engine_of):
    model = model_of(MOE, seed=3, scale=20)
    engine = engine_of(model, max_len=32)
    with pytest.raises(
        ValueError, match="max_tokens: 3 prompt tokens \\+ 40 to generate exceed the 32 positions"
    ):
        engine.submit([1, 2, 3], GenerationConfig(gen_length=40, block_length=8), Collector())
    with pytest.raises(ValueError, match="prompt: empty"):
        engine.submit([], GenerationConfig(gen_length=8, block_length=8), Collector())
    with pytest.raises(ValueError, match="max_batch"):
        Engine(model, max_batch=0)
    with pytest.raises(ValueError, match="max_len"):
        Engine(model, max_len=10**6)
