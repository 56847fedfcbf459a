"""Loop unrolling on CUDA: a chunk of iterations captured once per shape as a CUDA graph and replayed
from static buffers, across blocks and requests.

A chunk's graph is keyed on its kinds (the KV-cache manager's: "refresh", "window", ...) and on the
round state's *signature*: the shapes, dtypes and devices of its tensors and every host value it
holds (batch size, block length, the round's columns, the window widths, the decoder's settings...),
i.e. everything a captured iteration freezes. A signature has one *static* round state: the first
round state seen with it. A later round state of the same signature (the next block, other requests,
a compaction down to the same batch size) is loaded into it in place (`copy_`), and the static state
goes on as the live one: the chunk runs on its buffers and so does everything the host reads after
it (poll, compaction, the scheduler's store). Tensors both states already share (the KV cache's
views of its persistent storage) are not copied: only per-round ones. Two tensors of one state that
alias each other must hold the same values in every state of their signature (they are one
quantity: the decoder's offsets, the sequences' lengths).

A (signature, kinds) pair's first chunk runs eagerly: it is the warm-up (cuBLAS handles, Triton
compilation: never inside a capture). Its second is captured (which executes nothing) and replayed,
every later one replayed. All captures share one memory pool. A captured iteration also freezes
what it reads outside the round state (the model, the KV-cache manager and its page pool): `reset`
drops every graph when those change (Generator.open).

A long-lived engine (a server) meets new signatures as prompt lengths vary: at most `max_signatures`
are kept, the least recently used one (its static state and graphs) dropped for a new one, so the
number of graphs stays bounded (their memory is the shared pool's high-water mark); a dropped
signature that comes back is warmed up and captured again. A capture that fails (an op that cannot
be captured) is logged and its chunk shape runs eagerly from then on: a slower lane, not a dead one.

The graph mechanism is injectable (`graph_factory`: a callable's capture, with `replay()`), so the
CPU tests run the static-state plumbing with a stand-in that replays by calling the chunk again.
"""

import logging
import time
from collections import OrderedDict
from typing import Callable

import torch

log = logging.getLogger(__name__)

# Host values a round state may hold (they key its graphs); anything else is walked into.
_HOST = (bool, int, float, str, type(None), torch.dtype, torch.device)


def enabled_for(model, cfg) -> bool:
    """Whether a run of GenerationConfig `cfg` on `model` replays CUDA graphs: on a GPU, greedy
    decoding (sampling keys its noise per iteration on the host), no tensor parallelism (the
    vocabulary-parallel decode step reads values on the host), no phase timing (it synchronises)."""
    return (
        cfg.cuda_graphs
        and model.device.type == "cuda"
        and cfg.decoder.temperature == 0
        and getattr(model, "parallel", None) is None
        and not cfg.time_phases
    )


class CUDAGraphs:
    """The product's graph factory: `fn` captured as a CUDA graph, every capture in one memory
    pool (the graphs replay one at a time on one stream, so they may share it)."""

    def __init__(self):
        self._pool = None

    def __call__(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            fn()
        return graph


def signature(state) -> tuple:
    """(the key of `state`, its tensors in a fixed order): the state walked through its tuples
    (NamedTuples too), lists and objects' attributes down to tensors and host values."""
    key, tensors = [], []

    def walk(obj):
        if isinstance(obj, torch.Tensor):
            key.append((tuple(obj.shape), obj.dtype, obj.device))
            tensors.append(obj)
        elif isinstance(obj, _HOST):
            key.append((type(obj), obj))
        elif isinstance(obj, (tuple, list)):
            key.append((type(obj), len(obj)))
            for item in obj:
                walk(item)
        elif hasattr(obj, "__dict__"):
            fields = vars(obj)
            key.append((type(obj), tuple(fields)))
            for item in fields.values():
                walk(item)
        else:
            raise TypeError(f"internal error: a round state holds a {type(obj).__name__}, no graph key")

    walk(state)
    return tuple(key), tensors


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.device == b.device


class StepGraphs:
    """Chunks of iterations run through graphs (enabled), or eagerly. graph_factory: fn -> an
    object whose replay() runs what fn ran (default: CUDAGraphs)."""

    def __init__(self, enabled: bool, graph_factory: Callable = None, max_signatures: int = 32):
        self.enabled = enabled
        self.max_signatures = max_signatures
        self.graph_factory = CUDAGraphs() if graph_factory is None else graph_factory
        self.reset()

    def reset(self):
        """Drops every graph and static state (their model, cache or page pool is gone)."""
        self._static = OrderedDict()  # signature -> its static round state, least recently used first
        self._tensors = {}  # id(static state) -> (its signature, its tensors)
        self._graphs = {}  # (signature, kinds) -> graph
        self._warm = set()  # (signature, kinds) run eagerly once
        self._eager = set()  # (signature, kinds) whose capture failed: run eagerly

    def run(self, iteration, state, kinds: tuple, stats):
        """Runs iteration(state, kind) for each kind in `kinds` (the KV-cache manager's), counting
        captures and replays into `stats` (a dinfer.stats.Stats). Returns the state the chunk ran
        on, which the caller goes on with: `state` itself, or its signature's static state holding
        its values."""
        if not self.enabled:
            for kind in kinds:
                iteration(state, kind)
            return state
        if id(state) in self._tensors:  # a static state itself (statics are kept: ids are theirs)
            key = self._tensors[id(state)][0]
        else:
            key, tensors = signature(state)
            static = self._static.get(key)
            if static is None:  # the first of its signature: its buffers become the static ones
                if len(self._static) >= self.max_signatures:
                    self._drop(next(iter(self._static)))
                self._static[key], self._tensors[id(state)] = state, (key, tensors)
            else:
                for dst, src in zip(self._tensors[id(static)][1], tensors):
                    if not _same_memory(dst, src):
                        dst.copy_(src)
                state = static

        self._static.move_to_end(key)

        def chunk():
            for kind in kinds:
                iteration(state, kind)

        graph = self._graphs.get((key, kinds))
        if graph is None and (key, kinds) in self._warm and (key, kinds) not in self._eager:
            t = time.perf_counter()
            try:
                graph = self._graphs[(key, kinds)] = self.graph_factory(chunk)
            except RuntimeError as e:  # an op that cannot be captured: that chunk stays eager
                self._eager.add((key, kinds))
                log.warning("CUDA graph capture failed (%s: %s); this chunk shape runs eagerly", kinds, e)
            else:
                stats.graph_captures += 1
                stats.capture_seconds += time.perf_counter() - t
        if graph is None:
            self._warm.add((key, kinds))
            chunk()
        else:
            graph.replay()
            stats.graph_replays += 1
        return state

    def _drop(self, key):
        """Forgets signature `key`: its static state, graphs and warm-ups."""
        del self._tensors[id(self._static.pop(key))]
        self._graphs = {k: g for k, g in self._graphs.items() if k[0] != key}
        self._warm = {k for k in self._warm if k[0] != key}
        self._eager = {k for k in self._eager if k[0] != key}
