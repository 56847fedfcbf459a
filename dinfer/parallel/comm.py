"""The communicator the sharded model and the engine use: a torch.distributed process group (NCCL on
CUDA, gloo on the host) behind the few collectives they need, each with a bounded wait.

A rank that dies or stops answering turns every other rank's next collective into a ParallelError
naming the collective and this rank within the group's timeout (gloo: at once when the peer's socket
closes, else after the timeout; NCCL: its watchdog's timeout), never a hang. Collectives on a gloo
group run in fp32 (its bf16 / fp16 sums are not relied on); NCCL reduces in the tensor's dtype.
`sent` counts the bytes each collective put on the wire from this rank, as the algorithm the
bench assumes (ring all-reduce 2 (n-1)/n, all-gather and reduce-scatter (n-1)/n of the full tensor,
all-to-all the rows sent to other ranks), for bench_kernels/bench_parallel.py.
"""

from __future__ import annotations

import datetime
import os
from typing import List, Optional

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = float(os.environ.get("DINFER_DIST_TIMEOUT_S", "600"))


class ParallelError(RuntimeError):
    """A collective failed: another rank died, or did not reach it within the timeout."""


def backend_for(device: torch.device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def timeout(seconds: Optional[float] = None) -> datetime.timedelta:
    return datetime.timedelta(seconds=DEFAULT_TIMEOUT_S if seconds is None else seconds)


class Comm:
    def __init__(self, group=None, timeout_s: Optional[float] = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        self.sent = 0  # bytes sent by this rank (see the module docstring)

    def _run(self, what: str, fn):
        try:
            return fn()
        except (RuntimeError, ValueError) as e:  # dist.DistError is a RuntimeError
            raise ParallelError(
                f"rank {self.rank} of {self.world}: {what} failed: a rank died or did not reach it "
                f"within {self.timeout_s:g} s ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
            ) from e

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        return (
            t.float() if self.backend == "gloo" and t.dtype != torch.float32 and t.is_floating_point() else t
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks (x's dtype; may reuse x's storage)."""
        if self.world == 1:
            return x
        y = self._wire(x).contiguous()
        self.sent += 2 * (self.world - 1) * y.numel() * y.element_size() // self.world
        self._run("all_reduce", lambda: dist.all_reduce(y, group=self.group))
        return y.to(x.dtype)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[world * n, ...]: every rank's x [n, ...] (equal shapes), in rank order."""
        y = self._wire(x).contiguous()
        out = y.new_empty((self.world * y.shape[0], *y.shape[1:]))
        self.sent += (self.world - 1) * y.numel() * y.element_size()
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._run("all_gather", lambda: gather(out, y, group=self.group))
        return out.to(x.dtype)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's [n / world, ...] block of the sum over the ranks of x [n, ...]."""
        y = self._wire(x).contiguous()
        out = y.new_empty((y.shape[0] // self.world, *y.shape[1:]))
        self.sent += (self.world - 1) * out.numel() * out.element_size()
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self._run("reduce_scatter", lambda: scatter(out, y, group=self.group))
        return out.to(x.dtype)

    def all_to_all(self, x: torch.Tensor, send: List[int], recv: List[int]) -> torch.Tensor:
        """Rows x[sum(send[:r]) : sum(send[:r+1])] go to rank r; returns the rows received, sum(recv)."""
        y = self._wire(x).contiguous()
        out = y.new_empty((sum(recv), *y.shape[1:]))
        row = y[0].numel() * y.element_size() if y.shape[0] else 0
        self.sent += row * (sum(send) - send[self.rank])
        self._run(
            "all_to_all",
            lambda: dist.all_to_all_single(out, y, recv, send, group=self.group),
        )
        return out.to(x.dtype)

    def exchange_counts(self, send: torch.Tensor) -> List[int]:
        """recv[r] = the send[self.rank] of rank r (send: [world] int64 on the host or device)."""
        out = torch.empty_like(send)
        self.sent += send.element_size() * (self.world - 1)
        self._run("all_to_all", lambda: dist.all_to_all_single(out, send.contiguous(), group=self.group))
        return out.tolist()

    def broadcast_object(self, obj=None, src: int = 0, group=None):
        """obj of rank `src` on every rank (a pickled Python object; the group: a gloo one)."""
        box = [obj]
        self._run("broadcast", lambda: dist.broadcast_object_list(box, src=src, group=group))
        return box[0]

    def barrier(self, group=None) -> None:
        self._run("barrier", lambda: dist.barrier(group=group if group is not None else self.group))
