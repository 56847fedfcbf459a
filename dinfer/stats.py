"""Counters and timers of one generate() call, and profiler ranges around each phase (with
DINFER_NVTX=1: dinfer_kernels.profiling)."""

import contextlib
import time
from dataclasses import dataclass, field

import torch

from dinfer_kernels import profiling


@dataclass
class Stats:
    forwards: int = 0  # model forwards, refreshes and no-op unrolled steps included (dInfer's TPF)
    refreshes: int = 0  # full-sequence forwards that rebuilt the KV cache
    prefills: int = 0  # forwards that only wrote a prompt's K/V (block-causal models; not in forwards)
    sequence_forwards: int = 0  # forwards times the sequences they ran for: per-sequence TPF at any batch
    tokens: int = 0  # generated tokens that are not EOS
    seconds: float = 0.0
    # CUDA graphs (dinfer.graphs): chunks captured (once per shape and kinds), chunks replayed, and
    # the host time the captures took
    graph_captures: int = 0
    graph_replays: int = 0
    capture_seconds: float = 0.0
    phase_seconds: dict = field(default_factory=lambda: {"forward": 0.0, "decode": 0.0, "smoothing": 0.0})
    timed: bool = False  # phases are timed only when the device is synchronous (CPU) or asked

    def count_chunk(self, kinds: tuple, sequences: int):
        """A chunk of iterations (`kinds`: each one's kind, "refresh" for a full refresh) over
        `sequences` sequences."""
        self.forwards += len(kinds)
        self.sequence_forwards += len(kinds) * sequences
        self.refreshes += kinds.count("refresh")

    @contextlib.contextmanager
    def phase(self, name: str, device: torch.device):
        with profiling.region(name):
            if not self.timed:
                yield
                return
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            yield
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.phase_seconds[name] += time.perf_counter() - t

    def as_dict(self) -> dict:
        d = {
            "forwards": self.forwards,
            "refreshes": self.refreshes,
            "prefills": self.prefills,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 6),
            "tokens_per_forward": round(self.tokens / max(self.forwards, 1), 4),
            "sequence_forwards": self.sequence_forwards,
            "tokens_per_sequence_forward": round(self.tokens / max(self.sequence_forwards, 1), 4),
            "tokens_per_second": round(self.tokens / self.seconds, 3) if self.seconds else 0.0,
            "graph_captures": self.graph_captures,
            "graph_replays": self.graph_replays,
            "capture_seconds": round(self.capture_seconds, 6),
        }
        if self.timed:
            inside = sum(self.phase_seconds.values())
            d["phase_seconds"] = {k: round(v, 6) for k, v in self.phase_seconds.items()}
            d["loop_overhead_fraction"] = (
                round(max(self.seconds - inside, 0.0) / self.seconds, 4) if self.seconds else 0.0
            )
        return d
