"""A long-running engine for a server: requests arrive and leave while the model decodes.

One thread owns the model and loops: it takes what other threads handed it (submissions,
cancellations), then runs one round of continuous batching (dinfer.generate.Generator.step: every
request in flight decodes its next block; newcomers join and finished or cancelled requests leave at
these block boundaries), and reports what each round committed through each request's `events`
callback, called from the engine thread:

    events("block", tokens)                      the request's next block is committed (its tokens)
    events("finish", tokens, forwards)           it is finished: all its generated tokens (EOS after
                                                 an early stop), the forwards it ran
    events("error", exception)                   it failed (NonFiniteLogitsError, ...); so did every
                                                 request in flight beside it

Requests that share a batch must share what the loop cannot vary per sequence: the block length,
cache mode, decoder rule and its scalars, sampling temperature and seed... Each such configuration
has its own *lane* (a Generator with its own rows and KV cache), created when a request first needs
it and dropped when it is idle and the lane limit needs room; lanes take turns round by round. What
varies per request inside a lane: the prompt, the generation length and the commit threshold.

Admission is bounded twice: at most `max_batch` requests in flight per lane (then they queue in the
lane) and at most `max_queue` requests waiting in all (then `submit` raises QueueFull, which a server
answers with 429 and Retry-After) -- never an unbounded queue.
"""

import dataclasses
import logging
import queue
import threading
from typing import Callable, Dict, List, Optional

import torch

from .generate import GenerationConfig, Generator

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The engine holds max_queue waiting requests already: try again later."""


Events = Callable[..., None]


def lane_key(cfg: GenerationConfig) -> GenerationConfig:
    """The part of a request's configuration a batch must share: all of it but the generation
    length and the threshold (per sequence)."""
    return dataclasses.replace(
        cfg, gen_length=cfg.block_length, decoder=dataclasses.replace(cfg.decoder, threshold=0.0)
    )


class Engine:
    """Continuous batching on `model` (a DiffusionLM) for requests submitted from any thread.

    max_batch: requests in flight per lane; max_queue: waiting requests in all; max_len: positions
    of the longest sequence (prompt + generation) a request may have; max_lanes: configurations kept
    at once (each holds its own KV cache)."""

    def __init__(
        self,
        model,
        max_batch: int = 8,
        max_queue: int = 64,
        max_len: Optional[int] = None,
        max_lanes: int = 4,
    ):
        for name, v in (("max_batch", max_batch), ("max_queue", max_queue), ("max_lanes", max_lanes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")
        self.model = model
        self.max_len = model.config.max_positions if max_len is None else max_len
        if not 1 <= self.max_len <= model.config.max_positions:
            raise ValueError(
                f"max_len: must be in [1, {model.config.max_positions}] (the model's positions), got {max_len}"
            )
        self.max_batch, self.max_queue, self.max_lanes = max_batch, max_queue, max_lanes
        self.lanes: Dict[GenerationConfig, Generator] = {}
        self._events: Dict[tuple, Events] = {}  # (lane key, lane request id) -> its callback
        self._ids: Dict[int, tuple] = {}  # engine request id -> (lane key, lane request id)
        self._rids: Dict[tuple, int] = {}  # and back
        self._inbox: "queue.SimpleQueue" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiting = 0  # submitted, not yet started
        self._next = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._turn = 0
        self.counters = dict(rounds=0, forwards=0, finished=0, failed=0, cancelled=0)
        self._thread = threading.Thread(target=self._loop, name="dinfer-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------ any thread

    def submit(self, prompt: List[int], cfg: GenerationConfig, events: Events, key: int = 0) -> int:
        """Queues a request (token ids, its GenerationConfig, its callback; key: its sampling key)
        and returns its id. QueueFull when max_queue requests wait already; ValueError when it
        cannot fit max_len."""
        if len(prompt) == 0:
            raise ValueError("prompt: empty")
        if len(prompt) + cfg.gen_length > self.max_len:
            raise ValueError(
                f"max_tokens: {len(prompt)} prompt tokens + {cfg.gen_length} to generate exceed the "
                f"{self.max_len} positions this server takes"
            )
        with self._lock:
            if self._waiting >= self.max_queue:
                raise QueueFull(f"{self._waiting} requests are waiting (max_queue {self.max_queue})")
            self._waiting += 1
            rid, self._next = self._next, self._next + 1
        self._inbox.put(("submit", rid, prompt, cfg, events, key))
        self._wake.set()
        return rid

    def cancel(self, rid: int) -> None:
        """Request rid leaves: at once if it waits, at its next block boundary if it runs. A no-op
        for a request that is finished or unknown."""
        self._inbox.put(("cancel", rid))
        self._wake.set()

    @property
    def waiting(self) -> int:
        return self._waiting

    def in_flight(self) -> int:
        return sum(g.in_flight for g in list(self.lanes.values()))

    @property
    def alive(self) -> bool:
        """The engine thread runs (a server's health)."""
        return self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    # ------------------------------------------------------------------------------ the engine thread

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain()
            lane = self._next_lane()
            if lane is None:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            key, gen = lane
            try:
                gen.step()
                self.counters["rounds"] += 1
            except Exception as e:  # the lane's model failed: its requests fail, the engine goes on
                log.error(
                    "a lane failed its %d request(s) in flight and queued",
                    gen.in_flight + gen.queued,
                    exc_info=e,
                )
                self._fail_lane(key, e)

    def _drain(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "submit":
                self._start(*msg[1:])
            else:
                self._cancel(msg[1])

    def _start(self, rid: int, prompt: List[int], cfg: GenerationConfig, events: Events, key: int) -> None:
        k = lane_key(cfg)
        try:
            gen = self.lanes.get(k) or self._open_lane(k)
            lrid = gen.submit(prompt, cfg.gen_length, key, cfg.decoder.threshold)
        except Exception as e:  # no room for a lane (MemoryError, ...): this request fails
            self._left_queue(1)
            self.counters["failed"] += 1
            events("error", e)
            return
        self._events[(k, lrid)] = events
        self._ids[rid], self._rids[(k, lrid)] = (k, lrid), rid

    def _open_lane(self, k: GenerationConfig) -> Generator:
        if len(self.lanes) >= self.max_lanes:
            idle = [key for key, g in self.lanes.items() if g.idle]
            if not idle:
                raise MemoryError(
                    f"every one of the {self.max_lanes} lanes (configurations) is busy: retry later"
                )
            del self.lanes[idle[0]]
            if self.model.device.type == "cuda":
                torch.cuda.empty_cache()
        gen = Generator(self.model, k)
        lane = (k,)

        def on_block(lrid: int, tokens: torch.Tensor) -> None:
            self._events[lane + (lrid,)]("block", tokens)

        def on_finish(lrid: int, tokens: torch.Tensor, forwards: int) -> None:
            self.counters["finished"] += 1
            self.counters["forwards"] += forwards
            self._ids.pop(self._rids.pop(lane + (lrid,)), None)
            self._events.pop(lane + (lrid,))("finish", tokens, forwards)

        def on_admit(lrid: int) -> None:  # it left the lane's queue: no longer waiting
            self._left_queue(1)

        # any sequence of up to max_len positions: its blocks (the last may reach a block past it),
        # the after-look window and a padding row
        width = self.max_len + k.block_length + k.after_look + 1
        gen.open(self.max_batch, width, self.max_len, on_finish, on_block, on_admit)
        self.lanes[k] = gen
        return gen

    def _left_queue(self, n: int) -> None:
        with self._lock:
            self._waiting -= n

    def _cancel(self, rid: int) -> None:
        where = self._ids.pop(rid, None)
        if where is None or where[0] not in self.lanes:
            return
        k, lrid = where
        left = self.lanes[k].cancel(lrid)
        if left is not None:
            self.counters["cancelled"] += 1
            if left == "queued":  # it never started: nothing will report it
                self._left_queue(1)
                self._events.pop((k, lrid), None)
                self._rids.pop((k, lrid), None)

    def _next_lane(self):
        keys = [k for k, g in self.lanes.items() if not g.idle]
        if not keys:
            return None
        self._turn = (self._turn + 1) % len(keys)
        k = keys[self._turn]
        return k, self.lanes[k]

    def _fail_lane(self, k: GenerationConfig, error: Exception) -> None:
        gen = self.lanes.pop(k)
        for (lk, lrid), events in list(self._events.items()):
            if lk == k:
                self.counters["failed"] += 1
                events("error", error)
                del self._events[(lk, lrid)]
        self._left_queue(gen.queued)
        self._ids = {rid: w for rid, w in self._ids.items() if w[0] != k}
        self._rids = {w: rid for w, rid in self._rids.items() if w[0] != k}
